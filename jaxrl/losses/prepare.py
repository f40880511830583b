"""Batch-level parts: `prepare(batch, group_size, max_new_tokens) -> batch`, run ONCE on the whole update batch.

The update step calls `loss.prepare` inside the jitted step, after the old / reference log-probs are
recorded and BEFORE the weights are computed and the batch is split into microbatches, so a part that
depends on more than one row sees the whole batch and microbatching stays exact. A part may drop rows
(`drop_rows(keep_fn)`: the row gets no gradient and leaves every normaliser; `mc_pivot_rows`,
`gd2po_rows`, `not_truncated_rows`, `informative_rows`) or add token masks for `masks.apply_keep_mask`.
Reward shaping is part of the advantage step, not of prepare. It reads the rollout batch's keys plus
`advantages_B`, `old_logp_BxT` / `old_entropy_BxT` (with `needs_old_logp`), `ref_logp_BxT` (with
`needs_ref`); groups come from `segments.batch_groups(batch, group_size)`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import jax
import jax.numpy as jnp

from jaxrl.losses import advantages as adv_lib
from jaxrl.losses import multi_reward
from jaxrl.losses import segments as seg
from jaxrl.losses.regularizers import KLEstimator, kl_k1


class Prepare(Protocol):
    """(batch, group_size, max_new_tokens) -> batch: a batch-level part, run once on the whole batch."""

    def __call__(self, batch: dict, group_size: int, max_new_tokens: int, /) -> dict: ...


class RowKeep(Protocol):
    """(batch, group_size) -> keep_B (float 0/1): a row filter; groups from `segments.batch_groups`."""

    def __call__(self, batch: dict, group_size: int, /) -> jax.Array: ...


class Shaper(Protocol):
    """(batch, max_new_tokens) -> bonus_B: reward shaping, added to the combined reward."""

    def __call__(self, batch: dict, max_new_tokens: int, /) -> jax.Array: ...


def no_prepare(batch: dict, group_size: int | None = None, max_new_tokens: int | None = None) -> dict:
    """The identity: the default `Loss.prepare`."""
    return batch


def chain(*parts: Prepare) -> Prepare:
    """Run prepare parts left to right."""
    parts = tuple(p for p in parts if p is not no_prepare)
    if not parts:
        return no_prepare

    def prepare(batch: dict, group_size: int, max_new_tokens: int) -> dict:
        for part in parts:
            batch = part(batch, group_size, max_new_tokens)
        return batch

    return prepare


def on_batch(fn: Callable[[dict], dict]) -> Prepare:
    """Lift a `batch -> batch` function (e.g. `m2po.m2po_prepare(tau)`) to the prepare signature."""

    def prepare(batch, group_size=None, max_new_tokens=None):
        return fn(dict(batch))

    return prepare


# ---------------------------------------------------------------------------------------------
# Row filters


def drop_rows(keep_fn: RowKeep) -> Prepare:
    """completion_mask_BxT *= keep_B[:, None]: the dropped rows get no gradient and leave every
    normaliser (aggregation counts live rows and tokens from the mask)."""

    def prepare(batch: dict, group_size: int, max_new_tokens: int) -> dict:
        keep_B = jax.lax.stop_gradient(keep_fn(batch, group_size)).astype(jnp.float32)
        mask_BxT = batch["completion_mask_BxT"]
        return dict(batch, completion_mask_BxT=(mask_BxT * keep_B[:, None]).astype(mask_BxT.dtype))

    return prepare


def mc_pivot_rows(batch: dict, group_size: int) -> jax.Array:
    """MC-GRPO: keep_B = 1 - pivot_B, the pivot being the median row of each group of G+1 (odd).

    Read from advantages_B, not the rewards: A = r - median (or / (MAD + eps)) is a monotone map of r
    within a group, so the stable sort -- hence `adv_lib.median_pivot` -- picks the same row, and the
    pivot follows any reward shaping applied before it. Padding rows are kept (their mask is 0 anyway).
    """
    return 1.0 - adv_lib.median_pivot(batch["advantages_B"], seg.batch_groups(batch, group_size))


def informative_rows(batch: dict, group_size: int) -> jax.Array:
    """keep_B = 0 for every row of a group whose advantages are all exactly 0 (a group with equal
    rewards: the group estimators return exact zeros there). Our reading of DAPO's dynamic sampling
    for a fixed-shape batch: such groups carry no policy gradient, so they leave the normaliser too
    (DAPO drops them and samples more; refilling the batch is rollout control, not a loss part)."""
    adv_B = batch["advantages_B"]
    return seg.any_B(adv_B != 0, seg.as_groups(seg.batch_groups(batch, group_size), adv_B)).astype(jnp.float32)


def not_truncated_rows(batch: dict, group_size: int = 1) -> jax.Array:
    """keep_B = 1 - truncated_B: completions cut at max_new_tokens are masked out (DAPO's
    "overlong filtering" option)."""
    return 1.0 - (batch["truncated_B"] > 0).astype(jnp.float32)


def gd2po_rows(weights: Sequence[float] | None = None, eps: float = 1e-6, conflict_threshold: float = 0.5) -> RowKeep:
    """GD2PO's conflict mask as a row filter (see `multi_reward.gd2po_parts`)."""
    keep = multi_reward.gd2po_keep(weights=weights, eps=eps, conflict_threshold=conflict_threshold)

    def keep_fn(batch: dict, group_size: int) -> jax.Array:
        return keep(batch["rewards_BxK"], seg.batch_groups(batch, group_size))

    return keep_fn


# ---------------------------------------------------------------------------------------------
# Reward shaping: an additive bonus_B on the combined reward, normalised by the advantage step.


def _lengths_B(batch: dict) -> jax.Array:
    return jnp.sum((batch["completion_mask_BxT"] > 0).astype(jnp.float32), axis=1)


def overlong_penalty(buffer_frac: float = 0.2, max_len: int | None = None) -> Shaper:
    """DAPO overlong reward shaping (Yu et al. 2025, arXiv:2503.14476), with L_max the generation
    limit and L_c = buffer_frac * L_max the soft buffer (DAPO: 4096 of 20480, i.e. 0.2):

        bonus = 0                              if |y| <= L_max - L_c
                ((L_max - L_c) - |y|) / L_c    if L_max - L_c < |y| <= L_max
                -1                             beyond

    |y| = the row's completion-mask length (EOS included). `max_len=None` takes L_max =
    max_new_tokens. Our sampler never exceeds L_max, so -1 is reached exactly at |y| = L_max.
    """
    if not 0 < buffer_frac <= 1:
        raise ValueError(f"overlong_buffer_frac: got {buffer_frac!r}, expected a number in (0, 1]")
    if max_len is not None and not max_len > 0:
        raise ValueError(f"overlong max_len: got {max_len!r}, expected a positive int or None")

    def bonus(batch: dict, max_new_tokens: int) -> jax.Array:
        l_max = float(max_len if max_len is not None else max_new_tokens)
        if not l_max > 0:
            raise ValueError(f"overlong_penalty needs max_new_tokens > 0, got {max_new_tokens!r}")
        l_c = buffer_frac * l_max
        return jnp.clip(((l_max - l_c) - _lengths_B(batch)) / l_c, -1.0, 0.0)

    bonus.part = f"overlong_penalty(L_c={buffer_frac}*L_max)"
    return bonus


def kl_reward(beta: float, estimator: KLEstimator = kl_k1, logp_key: str = "rollout_logp_BxT") -> Shaper:
    """KL in the reward: bonus_i = -beta * sum_t m_t KL_t(pi_sample || pi_ref), per SEQUENCE.

    KL_t is the chosen estimator (k1 / k2 / k3 of `regularizers`) of the sampling policy's log-prob
    (`logp_key`, default the sampler's rollout_logp_BxT) against ref_logp_BxT; no gradient (a reward is
    data). The whole-sequence sum is subtracted from the outcome reward, a sequence-level reading of
    the token-level penalty (no returns-to-go). Needs ref_logp_BxT in the batch.
    """
    if not beta >= 0:
        raise ValueError(f"kl_reward_beta: got {beta!r}, expected a non-negative number")

    def bonus(batch: dict, max_new_tokens: int) -> jax.Array:
        if "ref_logp_BxT" not in batch:
            raise KeyError("kl_reward needs batch['ref_logp_BxT'] (the reference policy's log-probs)")
        live_BxT = batch["completion_mask_BxT"] > 0
        logp_BxT = jnp.where(live_BxT, batch[logp_key], 0.0)
        ref_BxT = jnp.where(live_BxT, batch["ref_logp_BxT"], logp_BxT)
        kl_BxT = jnp.where(live_BxT, estimator(logp_BxT, ref_BxT), 0.0)
        return jax.lax.stop_gradient(-beta * jnp.sum(kl_BxT, axis=1))

    bonus.part = f"kl_reward(beta={beta}, {getattr(estimator, '__name__', 'kl')})"
    return bonus


def shaped_estimator(reward_combine: adv_lib.RewardCombine, normaliser: adv_lib.Normaliser) -> Callable:
    """The estimator of a loss with reward shaping: (rewards_BxK, groups, bonus_B=None) -> adv_B
    = normaliser(reward_combine(rewards_BxK) + bonus_B, groups), without gradient.

    bonus_B is the sum of the loss's `reward_shaping` functions on the batch; the advantage step
    (`jaxrl.losses.evaluate.batch_advantages`, run inside the update) passes it. Without it this is the
    unshaped estimator."""

    def advantages(rewards_BxK: jax.Array, groups: seg.GroupsLike, bonus_B: jax.Array | None = None) -> jax.Array:
        r_B = reward_combine(rewards_BxK)
        if bonus_B is not None:
            r_B = r_B + bonus_B
        return jax.lax.stop_gradient(normaliser(r_B, groups))

    return advantages
