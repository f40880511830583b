"""Rollout-vs-trainer corrections: importance weights between the sampler and the trainer's old policy.

The discrepancy old / rollout (`old_logp_BxT` vs the sampler's `rollout_logp_BxT`) is kept apart from
the staleness ratio current / old (`ratios.py`), as wrappers around a token loss:

    tis(token_loss, cap, level)         truncated IS: loss_t *= sg(min(pi_old / pi_rollout, cap))
    mis(token_loss, low, high, level)   masked IS: tokens (or whole rows) whose pi_old / pi_rollout
                                        leaves [low, high] get loss 0 and gradient 0

level="token" uses the per-token ratio, level="sequence" the product of the row's token ratios. Both
ratios are data (no gradient). Wrap the POLICY part only (`compose` does), so a KL penalty is neither
reweighted nor dropped. Stats: is_ratio_BxT (log clipped to +-80), is_weight_BxT + is_truncated_BxT
(TIS) or mis_masked_BxT (MIS).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

LEVELS = ("token", "sequence")


def check_level(level: str) -> None:
    if level not in LEVELS:
        raise ValueError(f"is_level: got {level!r}, expected one of {LEVELS}")


def check_tis(cap: float, level: str = "token") -> None:
    """ValueError naming is_level / tis_cap when `tis` would refuse them."""
    check_level(level)
    if not cap > 0:
        raise ValueError(f"tis_cap: got {cap!r}, expected a positive number")


def check_mis(low: float, high: float, level: str = "token") -> None:
    """ValueError naming is_level / the mis bounds when `mis` would refuse them."""
    check_level(level)
    if not (low >= 0 and high > 0 and low <= high):
        raise ValueError(f"mis bounds: got low={low!r}, high={high!r}; expected 0 <= low <= high, high > 0")


def rollout_log_ratio(batch: dict, level: str = "token") -> jax.Array:
    """log(pi_old / pi_rollout) per token (level="token") or the row's sum broadcast along T
    (level="sequence"); 0 on masked tokens; no gradient."""
    check_level(level)
    if "rollout_logp_BxT" not in batch:
        raise KeyError(
            "rollout-mismatch corrections (TIS / MIS) need batch['rollout_logp_BxT'] (the sampler's log-probs)"
        )
    live_BxT = batch["completion_mask_BxT"] > 0
    lr_BxT = jnp.where(live_BxT, batch["old_logp_BxT"] - batch["rollout_logp_BxT"], 0.0).astype(jnp.float32)
    if level == "sequence":
        lr_BxT = jnp.where(live_BxT, jnp.sum(lr_BxT, axis=1, keepdims=True), 0.0)
    return jax.lax.stop_gradient(lr_BxT)


def _ratio_stat(lr_BxT: jax.Array, live_BxT: jax.Array) -> jax.Array:
    return jnp.where(live_BxT, jnp.exp(jnp.clip(lr_BxT, -80.0, 80.0)), 0.0)


def tis(token_loss: Callable, cap: float, level: str = "token") -> Callable:
    """Truncated importance sampling: l_t <- sg(min(pi_old / pi_rollout, cap)) * l_t.

    Sequence level: the weight is min(prod_t pi_old / pi_rollout, cap), computed in log space
    (min(sum_t log ratio, log cap)) so a long row cannot overflow.
    """
    check_tis(cap, level)
    log_cap = math.log(cap)

    def wrapped(logp_BxT: jax.Array, batch: dict):
        loss_BxT, stats = token_loss(logp_BxT, batch)
        live_BxT = batch["completion_mask_BxT"] > 0
        lr_BxT = rollout_log_ratio(batch, level)
        weight_BxT = jnp.where(live_BxT, jnp.exp(jnp.minimum(lr_BxT, log_cap)), 0.0)
        stats = dict(
            stats,
            is_ratio_BxT=_ratio_stat(lr_BxT, live_BxT),
            is_weight_BxT=weight_BxT,
            is_truncated_BxT=(live_BxT & (lr_BxT > log_cap)).astype(jnp.float32),
        )
        return jnp.where(live_BxT, weight_BxT * loss_BxT, 0.0), stats

    wrapped.part = f"tis(cap={cap}, {level})"
    return wrapped


def mis(token_loss: Callable, low: float, high: float, level: str = "token") -> Callable:
    """Masked importance sampling: drop tokens (level="token") or whole rows (level="sequence") whose
    pi_old / pi_rollout lies outside [low, high] (inclusive bounds; low=0 means no lower bound).

    Dropped tokens get loss 0 and NO gradient even through a ratio level that mixes a row's tokens
    (GSPO): their log-prob enters the inner loss through stop_gradient.
    """
    check_mis(low, high, level)
    log_low = math.log(low) if low > 0 else -math.inf
    log_high = math.log(high)

    def wrapped(logp_BxT: jax.Array, batch: dict):
        live_BxT = batch["completion_mask_BxT"] > 0
        lr_BxT = rollout_log_ratio(batch, level)
        keep_BxT = live_BxT & (lr_BxT >= log_low) & (lr_BxT <= log_high)
        logp_in = jnp.where(keep_BxT, logp_BxT, jax.lax.stop_gradient(logp_BxT))
        loss_BxT, stats = token_loss(logp_in, batch)
        stats = dict(
            stats, is_ratio_BxT=_ratio_stat(lr_BxT, live_BxT), mis_masked_BxT=(live_BxT & ~keep_BxT).astype(jnp.float32)
        )
        return jnp.where(keep_BxT, loss_BxT, 0.0), stats

    wrapped.part = f"mis([{low}, {high}], {level})"
    return wrapped
