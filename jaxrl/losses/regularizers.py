"""Regularisers: per-token KL estimators and parts that add to the per-token loss.

A regulariser part is `(logp_BxT, batch) -> (extra_loss_BxT, stats)`; `compose` (compose.py)
adds `extra_loss_BxT` to the objective's loss, so it is aggregated with the same
weights (the GRPO placement: beta * KL inside the per-token sum, not in the reward).
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp


class KLEstimator(Protocol):
    """(logp_BxT, ref_logp_BxT) -> kl_BxT: a per-token KL estimate (gradient through logp only)."""

    def __call__(self, logp_BxT: jax.Array, ref_logp_BxT: jax.Array, /) -> jax.Array: ...


class Regularizer(Protocol):
    """(logp_BxT, batch) -> (extra_loss_BxT, stats): a term added to the per-token loss."""

    def __call__(self, logp_BxT: jax.Array, batch: dict, /) -> tuple[jax.Array, dict]: ...


# The three estimators of KL(pi_theta || pi_ref) from samples y ~ pi (Schulman's k1/k2/k3 naming).
# Gradients are with respect to logp; ref is data.


def kl_k1(logp_BxT: jax.Array, ref_logp_BxT: jax.Array) -> jax.Array:
    """k1 = logp - ref. Unbiased but signed (can be negative per token); d/dlogp = 1."""
    return logp_BxT - jax.lax.stop_gradient(ref_logp_BxT)


def kl_k2(logp_BxT: jax.Array, ref_logp_BxT: jax.Array) -> jax.Array:
    """k2 = (logp - ref)^2 / 2. Non-negative; d/dlogp = logp - ref."""
    return 0.5 * jnp.square(logp_BxT - jax.lax.stop_gradient(ref_logp_BxT))


def kl_k3(logp_BxT: jax.Array, ref_logp_BxT: jax.Array) -> jax.Array:
    """k3 = exp(ref - logp) - (ref - logp) - 1, as in GRPO. Non-negative, 0 iff logp == ref.

    d/dlogp = 1 - exp(ref - logp). Computed as expm1(d) - d, which keeps precision near d = 0
    where the naive form cancels to the float epsilon.
    """
    d_BxT = jax.lax.stop_gradient(ref_logp_BxT) - logp_BxT
    return jnp.expm1(d_BxT) - d_BxT


def kl_penalty(beta: float, estimator: KLEstimator = kl_k3) -> Regularizer:
    """Add beta * KL_t (per token, with `estimator`) to the loss; stats: kl_BxT (0 on masked tokens).

    With beta == 0 the part is inert: it never reads `ref_logp_BxT`, so callers may omit the
    reference forward entirely. `beta` is static here (a Python float chosen at build time).
    """
    if beta < 0:
        raise ValueError(f"kl_penalty: beta={beta!r}; expected a non-negative number")

    def regularizer(logp_BxT: jax.Array, batch: dict):
        if beta == 0:
            return jnp.zeros_like(logp_BxT), {}
        if "ref_logp_BxT" not in batch:
            raise KeyError("kl_penalty with beta > 0 needs batch['ref_logp_BxT'] (the reference policy's log-probs)")
        live_BxT = batch["completion_mask_BxT"] > 0
        # Padding may hold garbage reference log-probs; using logp itself there makes KL exactly 0
        # with exactly zero gradient, instead of exp(garbage) -> inf -> NaN.
        ref_BxT = jnp.where(live_BxT, batch["ref_logp_BxT"], jax.lax.stop_gradient(logp_BxT))
        kl_BxT = jnp.where(live_BxT, estimator(logp_BxT, ref_BxT), 0.0)
        return beta * kl_BxT, {"kl_BxT": jax.lax.stop_gradient(kl_BxT)}

    return regularizer


def entropy_bonus(coef: float) -> Regularizer:
    """Subtract coef * H_t (maximise entropy), with H_t = batch['entropy_BxT'].

    The bonus only has a gradient if the caller computed `entropy_BxT` inside the differentiated
    function (from the same logits as logp); a precomputed array makes it a constant shift.
    stats: none (the caller already owns entropy_BxT and can add it to the stats itself).
    """

    def regularizer(logp_BxT: jax.Array, batch: dict):
        if coef == 0:
            return jnp.zeros_like(logp_BxT), {}
        live_BxT = batch["completion_mask_BxT"] > 0
        return jnp.where(live_BxT, -coef * batch["entropy_BxT"], 0.0), {}

    return regularizer
