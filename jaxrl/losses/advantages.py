"""Advantage estimators: rewards_BxK -> adv_B.

An estimator is two parts, composed by `estimator`:

    reward_combine: rewards_BxK -> r_B                    e.g. `reward_sum(weights)`
    normaliser:     (r_B, group_size) -> adv_B            e.g. `group_mean_std(eps)`, `group_mean`

Rows of one group are adjacent: row i belongs to group i // group_size. `group_size` must be a
static Python int (pass it with `static_argnums` under `jax.jit`), because it fixes a reshape.

Convention used across `jaxrl.losses`: a part with hyperparameters is a factory that returns the
function (`group_mean_std(eps)`); a part without any is the function itself (`group_mean`).

Standard-deviation convention (every estimator here and in `multi_reward.py` that divides by a group
or batch std): the std is the UNBIASED sample std, ddof = 1 (Bessel's correction), as TRL, verl and
OpenRLHF compute it (`torch.std`), with eps added to the std, not inside the sqrt:

    std_n(x) = sqrt( sum_i (x_i - mean x)^2 / (n - ddof) ),        A = (r - mean) / (std + eps)

so rewards [1,0,0,0] give A = [1.5, -0.5, -0.5, -0.5]. `ddof=0` (the population std, A = [1.732..,
-0.577..]) is an option: `std_ddof` of the normaliser factories and of the presets (loss.options
"std_ddof=0"). For n equal-size groups the two differ only by the constant factor sqrt(n / (n - 1)).
A group (or batch) of one sample has no spread: its divisor is clamped to 1, so std = 0 and its
advantage is exactly 0 (never NaN), whatever ddof.
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


def _check_ddof(ddof) -> int:
    if ddof not in (0, 1) or isinstance(ddof, bool):
        raise ValueError(f"std_ddof: got {ddof!r}, expected 1 (unbiased std, the default) or 0 (population std)")
    return int(ddof)


def _std(x: jax.Array, ddof: int, axis=None) -> jax.Array:
    """std with `ddof` (see the module docstring), keepdims along `axis`; the divisor n - ddof is
    clamped to >= 1, so a single sample has std 0 (its centred value is 0) instead of 0/0 = NaN."""
    n = x.size if axis is None else x.shape[axis]
    centred = x - jnp.mean(x, axis=axis, keepdims=True)
    return jnp.sqrt(jnp.sum(jnp.square(centred), axis=axis, keepdims=True) / max(n - ddof, 1))


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


def group_mean_std(eps: float = 1e-6, ddof: int = 1) -> Normaliser:
    """GRPO normaliser (Shao et al. 2024): A_i = (r_i - mean_G r) / (std_G r + eps).

    std is the UNBIASED std by default (ddof=1, as TRL / verl): sqrt(sum_G (r - mean_G r)^2 / (G - 1));
    ddof=0 gives the population std. eps is added to the std (not inside the sqrt). A group whose
    rewards are all equal, or a group of one, gets exactly zero advantage (no NaN, no float residue).
    """
    if not eps > 0:
        raise ValueError(f"eps: got {eps!r}, expected a positive number")
    ddof = _check_ddof(ddof)

    def normalise(r_B: jax.Array, group_size: int) -> jax.Array:
        r_NxG = _by_group(r_B, group_size)
        mean_Nx1 = jnp.mean(r_NxG, axis=1, keepdims=True)
        std_Nx1 = _std(r_NxG, ddof, axis=1)
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


def group_mean_batch_std(eps: float = 1e-6, ddof: int = 1) -> Normaliser:
    """Batch-std scaling ("group mean, batch std", Liu et al. 2025, "Tricks or Traps? A Deep Dive
    into RL for LLM Reasoning"):

        A_i = (r_i - mean_G r) / (std_B r + eps)

    std_B is the std of the raw rewards over all B rows of the batch (not of the centred values),
    unbiased (ddof=1) by default; eps is added to the std. A constant group gets exactly 0; a
    constant batch too.
    """
    if not eps > 0:
        raise ValueError(f"eps: got {eps!r}, expected a positive number")
    ddof = _check_ddof(ddof)

    def normalise(r_B: jax.Array, group_size: int) -> jax.Array:
        centred_B = group_mean(r_B, group_size)
        return centred_B / (_std(r_B, ddof)[0] + eps)

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


def _batch_whiten_NxG(adv_NxG: jax.Array, eps: float, ddof: int = 1) -> jax.Array:
    """(A - mean_B A) / (std_B A + eps), std over all rows with `ddof`; a group whose advantages are
    all exactly 0 stays exactly 0. For a group-centred input the batch mean is 0 in exact arithmetic,
    so that guard only removes float residue (constant groups carry no signal and must not get a
    spurious ~1e-8 advantage)."""
    whitened_NxG = (adv_NxG - jnp.mean(adv_NxG)) / (_std(adv_NxG, ddof) + eps)
    all_zero_Nx1 = jnp.all(adv_NxG == 0, axis=1, keepdims=True)
    return jnp.where(all_zero_Nx1, 0.0, whitened_NxG)


def group_mean_batch_whiten(eps: float = 1e-6, ddof: int = 1) -> Normaliser:
    """REINFORCE++ with baseline (Hu et al. 2025, arXiv:2501.03262): A_i = r_i - mean_G r, then
    whitened over the batch: A_i <- (A_i - mean_B A) / (std_B A + eps), unbiased std by default
    (ddof=1, as verl's `masked_whiten`).

    Whitening is over SEQUENCES (each row counts once). OpenRLHF whitens the per-token advantages
    over all completion tokens, which weighs long rows more; that needs the mask, which the
    estimator contract does not see. Constant groups get exactly 0 (see `_batch_whiten_NxG`).
    """
    if not eps > 0:
        raise ValueError(f"eps: got {eps!r}, expected a positive number")
    ddof = _check_ddof(ddof)

    def normalise(r_B: jax.Array, group_size: int) -> jax.Array:
        centred_NxG = group_mean(r_B, group_size).reshape(-1, group_size)
        return _batch_whiten_NxG(centred_NxG, eps, ddof).reshape(-1)

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


def group_median(mad_scale: bool = True, mad_eps: float = 1e-3, nonzero_rescale: bool = True) -> Normaliser:
    """MC-GRPO advantage ("Median-Centered Group Relative Policy Optimization", papers.txt; the
    paper's code, github.com/lotusroot-kim/MC-GRPO, `grpo_trainer_*.py`). With M = median_{G+1} r:

        A_i = (r_i - M) / (MAD + mad_eps)                  MAD = median_{G+1} |r_i - M|   (mad_scale)
        A_i <- A_i * (G+1) / #{j : |A_j| > 1e-6}           on the rows with |A_i| > 1e-6 (nonzero_rescale)

    Both steps are on by default, as in the paper's code (which divides by MAD + 1e-3 always and
    rescales the non-zero advantages of each group of G+1 by (G+1) / #nonzero, with the same 1e-6
    zero tolerance); `mad_scale=False, nonzero_rescale=False` is the plain form A_i = r_i - M.
    group_size is G+1 and must be ODD, so the median is one group member's reward (no averaging).
    Every row tied at the median, the pivot included, gets exactly A = 0 (r - r is exact) and is not
    rescaled; a group with no non-zero advantage stays all 0. Note for 0/1 rewards: the MAD is 0
    whenever more than half the group ties at the median (always, for an odd group of 0/1 rewards),
    so A = +-1/mad_eps = +-1000 before the rescale: that is the paper's code, a global scale that
    global-norm clipping and Adam largely remove; the rescale then gives every informative group the
    same total |A| = (G+1)/mad_eps.
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
        if nonzero_rescale:
            nonzero_NxG = jnp.abs(adv_NxG) > _MC_ZERO_TOL
            n_nonzero_Nx1 = jnp.sum(nonzero_NxG, axis=1, keepdims=True)
            scale_Nx1 = group_size / jnp.maximum(n_nonzero_Nx1, 1).astype(adv_NxG.dtype)
            adv_NxG = jnp.where(nonzero_NxG, adv_NxG * scale_Nx1, adv_NxG)
        return adv_NxG.reshape(-1)

    return normalise


_MC_ZERO_TOL = 1e-6  # the paper's code: torch.isclose(A, 0, atol=1e-6) counts as a zero advantage


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
