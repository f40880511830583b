"""Advantage estimators: rewards_BxK -> adv_B.

An estimator is two parts, composed by `estimator`:

    reward_combine: rewards_BxK -> r_B                    e.g. `reward_sum(weights)`
    normaliser:     (r_B, group_size) -> adv_B            e.g. `group_mean_std(eps)`, `group_mean`

Rows of one group are adjacent: row i belongs to group i // group_size. `group_size` must be a
static Python int (pass it with `static_argnums` under `jax.jit`), because it fixes a reshape.

Convention used across `jaxrl.losses`: a part with hyperparameters is a factory that returns the
function (`group_mean_std(eps)`); a part without any is the function itself (`group_mean`).
"""

from __future__ import annotations

import operator
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from jaxrl.config import ConfigError

RewardCombine = Callable[[jax.Array], jax.Array]  # rewards_BxK -> r_B
Normaliser = Callable[[jax.Array, int], jax.Array]  # (r_B, group_size) -> adv_B
Estimator = Callable[[jax.Array, int], jax.Array]  # (rewards_BxK, group_size) -> adv_B


def _by_group(x_B: jax.Array, group_size: int) -> jax.Array:
    """Reshape rows into (num_groups, group_size); shapes are static, so this check runs at trace time."""
    if x_B.ndim != 1:
        raise ValueError(f"expected a rank-1 r_B, got shape {x_B.shape}")
    try:
        group_size = operator.index(group_size)  # a Python/NumPy int; a tracer is not allowed
    except TypeError:
        raise ValueError(f"group_size: got {group_size!r}, expected a static int") from None
    if group_size <= 0:
        raise ValueError(f"group_size: got {group_size!r}, expected a positive int")
    if x_B.shape[0] % group_size:
        raise ValueError(f"batch of {x_B.shape[0]} rows is not a whole number of groups of {group_size}")
    return x_B.reshape(x_B.shape[0] // group_size, group_size)


def _is_constant_NxG(r_NxG: jax.Array) -> jax.Array:
    # The float mean of equal values need not equal them (e.g. four 0.3s), so a constant group
    # would leave r - mean ~ 1e-8 and std ~ 1e-8; divided by (std + eps) that is a spurious
    # advantage of order 0.01. Exact zero is the mathematically right answer, so force it.
    return jnp.max(r_NxG, axis=1, keepdims=True) == jnp.min(r_NxG, axis=1, keepdims=True)


def group_mean(r_B: jax.Array, group_size: int) -> jax.Array:
    """Dr.GRPO centring (Liu et al. 2025): A_i = r_i - mean_G r, no division by the std."""
    r_NxG = _by_group(r_B, group_size)
    centred_NxG = r_NxG - jnp.mean(r_NxG, axis=1, keepdims=True)
    centred_NxG = jnp.where(_is_constant_NxG(r_NxG), 0.0, centred_NxG)
    return centred_NxG.reshape(-1)


def group_mean_std(eps: float = 1e-6) -> Normaliser:
    """GRPO normaliser (Shao et al. 2024): A_i = (r_i - mean_G r) / (std_G r + eps).

    std is the POPULATION std (ddof=0, no Bessel correction): sqrt(mean_G (r - mean_G r)^2).
    eps is added to the std (not inside the sqrt). A group whose rewards are all equal gets exactly
    zero advantage (no NaN, no float-rounding residue).
    """
    if not eps > 0:
        raise ValueError(f"eps: got {eps!r}, expected a positive number")

    def normalise(r_B: jax.Array, group_size: int) -> jax.Array:
        r_NxG = _by_group(r_B, group_size)
        mean_Nx1 = jnp.mean(r_NxG, axis=1, keepdims=True)
        std_Nx1 = jnp.std(r_NxG, axis=1, keepdims=True)  # ddof=0
        adv_NxG = (r_NxG - mean_Nx1) / (std_Nx1 + eps)
        adv_NxG = jnp.where(_is_constant_NxG(r_NxG), 0.0, adv_NxG)
        return adv_NxG.reshape(-1)

    return normalise


def reward_sum(weights: Optional[Sequence[float]] = None) -> RewardCombine:
    """Collapse K reward functions into one reward: r_i = sum_k w_k r_ik (GRPO sums rewards first).

    `weights=None` means every column has weight 1, for any K. Otherwise one weight per column;
    a count mismatch is a user config mistake and raises `ConfigError` at trace time.
    """
    if weights is not None:
        weights = tuple(float(w) for w in weights)
        if not weights:
            raise ConfigError("loss.reward_weights: got (), expected one weight per reward function")

    def combine(rewards_BxK: jax.Array) -> jax.Array:
        if rewards_BxK.ndim != 2:
            raise ValueError(f"expected rewards_BxK of rank 2, got shape {rewards_BxK.shape}")
        rewards_BxK = rewards_BxK.astype(jnp.float32)
        if weights is None:
            return jnp.sum(rewards_BxK, axis=1)
        k = rewards_BxK.shape[1]
        if len(weights) != k:
            raise ConfigError(f"loss.reward_weights: got {weights!r} ({len(weights)} weights), "
                              f"expected one weight per reward function (rewards_BxK has K={k})")
        return rewards_BxK @ jnp.asarray(weights, jnp.float32)

    return combine


def estimator(reward_combine: RewardCombine, normaliser: Normaliser) -> Estimator:
    """Compose `(rewards_BxK, group_size) -> adv_B` = normaliser(reward_combine(rewards), group_size).

    The result carries no gradient: advantages are targets, never differentiated.
    """

    def advantages(rewards_BxK: jax.Array, group_size: int) -> jax.Array:
        r_B = reward_combine(rewards_BxK)
        return jax.lax.stop_gradient(normaliser(r_B, group_size))

    return advantages


# ---------------------------------------------------------------------------------------------
# More single-reward normalisers: (r_B, group_size) -> adv_B, for `estimator(reward_combine, .)`.
# Batch-level statistics (batch std, whitening) are over EVERY row of r_B: call the estimator on
# the whole update batch (the advantage step does), never per microbatch.


def group_mean_batch_std(eps: float = 1e-6) -> Normaliser:
    """Batch-std scaling ("group mean, batch std", Liu et al. 2025, "Tricks or Traps? A Deep Dive
    into RL for LLM Reasoning"):

        A_i = (r_i - mean_G r) / (std_B r + eps)

    std_B is the POPULATION std (ddof=0) of the raw rewards over all B rows of the batch (not of the
    centred values); eps is added to the std. A constant group gets exactly 0; a constant batch too.
    """
    if not eps > 0:
        raise ValueError(f"eps: got {eps!r}, expected a positive number")

    def normalise(r_B: jax.Array, group_size: int) -> jax.Array:
        centred_B = group_mean(r_B, group_size)
        return centred_B / (jnp.std(r_B) + eps)

    return normalise


def rloo(r_B: jax.Array, group_size: int) -> jax.Array:
    """RLOO (Ahmadian et al. 2024): A_i = r_i - mean_{j != i} r_j = G/(G-1) * (r_i - mean_G r).

    Needs group_size >= 2 (the leave-one-out baseline of a lone completion is undefined).
    A constant group gets exactly 0.
    """
    r_NxG = _by_group(r_B, group_size)
    if group_size < 2:
        raise ValueError(f"rloo needs group_size >= 2, got {group_size}")
    loo_mean_NxG = (jnp.sum(r_NxG, axis=1, keepdims=True) - r_NxG) / (group_size - 1)
    adv_NxG = jnp.where(_is_constant_NxG(r_NxG), 0.0, r_NxG - loo_mean_NxG)
    return adv_NxG.reshape(-1)


def _batch_whiten_NxG(adv_NxG: jax.Array, eps: float) -> jax.Array:
    """(A - mean_B A) / (std_B A + eps), population std over all rows; a group whose advantages are
    all exactly 0 stays exactly 0. For a group-centred input the batch mean is 0 in exact arithmetic,
    so that guard only removes float residue (constant groups carry no signal and must not get a
    spurious ~1e-8 advantage)."""
    whitened_NxG = (adv_NxG - jnp.mean(adv_NxG)) / (jnp.std(adv_NxG) + eps)
    all_zero_Nx1 = jnp.all(adv_NxG == 0, axis=1, keepdims=True)
    return jnp.where(all_zero_Nx1, 0.0, whitened_NxG)


def group_mean_batch_whiten(eps: float = 1e-6) -> Normaliser:
    """REINFORCE++ with baseline (Hu et al. 2025, arXiv:2501.03262): A_i = r_i - mean_G r, then
    whitened over the batch: A_i <- (A_i - mean_B A) / (std_B A + eps), population std.

    Whitening is over SEQUENCES (each row counts once). OpenRLHF whitens the per-token advantages
    over all completion tokens, which weighs long rows more; that needs the mask, which the
    estimator contract does not see. Constant groups get exactly 0 (see `_batch_whiten_NxG`).
    """
    if not eps > 0:
        raise ValueError(f"eps: got {eps!r}, expected a positive number")

    def normalise(r_B: jax.Array, group_size: int) -> jax.Array:
        centred_NxG = group_mean(r_B, group_size).reshape(-1, group_size)
        return _batch_whiten_NxG(centred_NxG, eps).reshape(-1)

    return normalise


# ---------------------------------------------------------------------------------------------
# MC-GRPO: median baseline over G+1 completions; one pivot per group carries no gradient.


def _median_order_NxG(r_B: jax.Array, group_size: int) -> tuple:
    r_NxG = _by_group(r_B, group_size)
    if group_size % 2 == 0:
        raise ValueError(f"MC-GRPO samples G+1 completions so that the median is one of them: group_size "
                         f"(= G+1) must be odd, got {group_size}")
    order_NxG = jnp.argsort(r_NxG, axis=1, stable=True)  # ties keep row order
    return r_NxG, order_NxG


def group_median(mad_scale: bool = False, mad_eps: float = 1e-3) -> Normaliser:
    """MC-GRPO advantage: A_i = r_i - median_{G+1} r, optionally / (MAD + mad_eps).

    group_size is G+1 and must be ODD, so the median is one group member's reward (no averaging).
    Every row tied at the median, the pivot included, gets exactly A = 0 (r - r is exact).
    MAD = median_{G+1} |r_i - median| (the pivot's 0 included). Warning for 0/1 rewards: the MAD is 0
    whenever more than half the group ties at the median, and then A = +-1/mad_eps = +-1000 — this is
    the variant's definition, not a bug; keep mad_scale=False for binary rewards unless intended.
    Pair with `median_pivot` to remove the pivot's row from the loss (see there).
    """
    if mad_scale and not mad_eps > 0:
        raise ValueError(f"mad_eps: got {mad_eps!r}, expected a positive number")

    def normalise(r_B: jax.Array, group_size: int) -> jax.Array:
        r_NxG, order_NxG = _median_order_NxG(r_B, group_size)
        mid = group_size // 2
        median_Nx1 = jnp.take_along_axis(r_NxG, order_NxG[:, mid:mid + 1], axis=1)
        adv_NxG = r_NxG - median_Nx1
        if mad_scale:
            mad_Nx1 = jnp.sort(jnp.abs(adv_NxG), axis=1)[:, mid:mid + 1]
            adv_NxG = adv_NxG / (mad_Nx1 + mad_eps)
        return adv_NxG.reshape(-1)

    return normalise


def median_pivot(r_B: jax.Array, group_size: int) -> jax.Array:
    """pivot_B: float 1.0 on exactly one row per group (the MC-GRPO pivot), 0.0 elsewhere.

    The pivot is the row at position (G+1)//2 of a STABLE ascending sort of the group's rewards; so
    among rows tied at the median it is the k-th tied row in row order, k = (G+1)//2 - #{r < median} + 1.
    It has A = 0 by construction. MC-GRPO gives it NO gradient and counts only the other G rows, so
    the preset must drop the row from the loss, not just rely on A = 0 (A = 0 still leaves the KL /
    entropy terms and the row's count in the aggregation normalisers): before computing the
    aggregation weights, set completion_mask_BxT *= (1 - pivot_B)[:, None].
    Same signature as a normaliser, so `estimator(reward_combine, median_pivot)` gives it from rewards.
    """
    _, order_NxG = _median_order_NxG(r_B, group_size)
    pivot_idx_N = order_NxG[:, group_size // 2]
    pivot_NxG = jnp.arange(group_size)[None, :] == pivot_idx_N[:, None]
    return pivot_NxG.astype(jnp.float32).reshape(-1)


# ---------------------------------------------------------------------------------------------
# Single-rollout baseline (no group).


def batch_mean(r_B: jax.Array, group_size: int = 1) -> jax.Array:
    """A_i = r_i - mean_B r over every row of the batch; groups are ignored (any group_size).

    OUR READING for single-rollout methods (SAO, G = 1): the paper's baseline is a learned value of
    the prompt (a value head regressed on rewards); until the model has a value head, the batch mean
    reward stands in for it (a constant baseline: unbiased, higher variance than a prompt value).
    A constant batch gets exactly 0.
    """
    if r_B.ndim != 1:
        raise ValueError(f"expected a rank-1 r_B, got shape {r_B.shape}")
    constant = jnp.max(r_B) == jnp.min(r_B)
    return jnp.where(constant, 0.0, r_B - jnp.mean(r_B))
