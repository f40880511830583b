"""Advantage estimators: rewards_BxK -> adv_B.

An estimator is two parts, composed by `estimator`:

    reward_combine: rewards_BxK -> r_B                    e.g. `reward_sum(weights)`
    normaliser:     (r_B, groups) -> adv_B                e.g. `group_mean_std(eps)`, `group_mean`

`groups` is a static int `group_size` (contiguous equal groups; `static_argnums` under `jax.jit`) or a
`segments.Groups` (any sizes, padding rows: advantage exactly 0, in no statistic). A part with
hyperparameters is a factory returning the function (`group_mean_std(eps)`), one without is the function.

Every std (here and in `multi_reward.py`) is the unbiased sample std (ddof=1, as TRL / verl / OpenRLHF),
eps added to the std: A = (r - mean) / (std + eps), so rewards [1,0,0,0] give A = [1.5, -0.5, -0.5,
-0.5]; `std_ddof=0` gives the population std. A group of one has advantage exactly 0 (never NaN).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import jax
import jax.numpy as jnp

from jaxrl.config import ConfigError
from jaxrl.losses import segments as seg
from jaxrl.losses.segments import Groups, GroupsLike


class RewardCombine(Protocol):
    """rewards_BxK -> r_B: one reward per row from the K reward functions' columns."""

    def __call__(self, rewards_BxK: jax.Array, /) -> jax.Array: ...


class Normaliser(Protocol):
    """(r_B, groups) -> adv_B: the baseline / scale step of an estimator (groups: a static size or ids)."""

    def __call__(self, r_B: jax.Array, groups: GroupsLike, /) -> jax.Array: ...


class Estimator(Protocol):
    """(rewards_BxK, groups) -> adv_B: the whole advantage step."""

    def __call__(self, rewards_BxK: jax.Array, groups: GroupsLike, /) -> jax.Array: ...


def _groups(r_B: jax.Array, groups: GroupsLike) -> Groups:
    if r_B.ndim != 1:
        raise ValueError(f"expected a rank-1 r_B, got shape {r_B.shape}")
    return seg.as_groups(groups, r_B)


def _check_ddof(ddof) -> int:
    if ddof not in (0, 1) or isinstance(ddof, bool):
        raise ValueError(f"std_ddof: got {ddof!r}, expected 1 (unbiased std, the default) or 0 (population std)")
    return int(ddof)


def _zero_where_no_signal(adv_B: jax.Array, r_B: jax.Array, g: Groups) -> jax.Array:
    # The float mean of equal values need not equal them (e.g. four 0.3s), so a constant group
    # would leave r - mean ~ 1e-8 and std ~ 1e-8; divided by (std + eps) that is a spurious
    # advantage of order 0.01. Exact zero is the mathematically right answer, so force it; padding too.
    return jnp.where(seg.constant_B(r_B, g) | ~g.live_B, 0.0, adv_B)


def group_mean(r_B: jax.Array, groups: GroupsLike) -> jax.Array:
    """Dr.GRPO centring (Liu et al. 2025): A_i = r_i - mean_G r, no division by the std."""
    g = _groups(r_B, groups)
    return _zero_where_no_signal(r_B - seg.mean_B(r_B, g), r_B, g)


def group_mean_std(eps: float = 1e-6, ddof: int = 1) -> Normaliser:
    """GRPO normaliser (Shao et al. 2024): A_i = (r_i - mean_G r) / (std_G r + eps).

    std is the UNBIASED std by default (ddof=1, as TRL / verl): sqrt(sum_G (r - mean_G r)^2 / (G - 1))
    with G the row's own group size; ddof=0 gives the population std. eps is added to the std (not
    inside the sqrt). A group whose rewards are all equal, or a group of one, gets exactly zero
    advantage (no NaN, no float residue).
    """
    if not eps > 0:
        raise ValueError(f"eps: got {eps!r}, expected a positive number")
    ddof = _check_ddof(ddof)

    def normalise(r_B: jax.Array, groups: GroupsLike) -> jax.Array:
        g = _groups(r_B, groups)
        adv_B = (r_B - seg.mean_B(r_B, g)) / (seg.std_B(r_B, g, ddof) + eps)
        return _zero_where_no_signal(adv_B, r_B, g)

    return normalise


def reward_sum(weights: Sequence[float] | None = None) -> RewardCombine:
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
            raise ConfigError(
                f"loss.reward_weights: got {weights!r} ({len(weights)} weights), "
                f"expected one weight per reward function (rewards_BxK has K={k})"
            )
        return rewards_BxK @ jnp.asarray(weights, jnp.float32)

    return combine


def estimator(reward_combine: RewardCombine, normaliser: Normaliser) -> Estimator:
    """Compose `(rewards_BxK, groups) -> adv_B` = normaliser(reward_combine(rewards), groups).

    The result carries no gradient: advantages are targets, never differentiated.
    """

    def advantages(rewards_BxK: jax.Array, groups: GroupsLike) -> jax.Array:
        r_B = reward_combine(rewards_BxK)
        return jax.lax.stop_gradient(normaliser(r_B, groups))

    return advantages


# ---------------------------------------------------------------------------------------------
# More single-reward normalisers: (r_B, groups) -> adv_B, for `estimator(reward_combine, .)`.
# Batch-level statistics (batch std, whitening) are over EVERY live row of r_B: call the estimator
# on the whole update batch (the advantage step does), never per microbatch.


def group_mean_batch_std(eps: float = 1e-6, ddof: int = 1) -> Normaliser:
    """Batch-std scaling ("group mean, batch std", Liu et al. 2025, "Tricks or Traps? A Deep Dive
    into RL for LLM Reasoning"):

        A_i = (r_i - mean_G r) / (std_B r + eps)

    std_B is the std of the raw rewards over all live rows of the batch (not of the centred values),
    unbiased (ddof=1) by default; eps is added to the std. A constant group gets exactly 0; a
    constant batch too.
    """
    if not eps > 0:
        raise ValueError(f"eps: got {eps!r}, expected a positive number")
    ddof = _check_ddof(ddof)

    def normalise(r_B: jax.Array, groups: GroupsLike) -> jax.Array:
        g = _groups(r_B, groups)
        return group_mean(r_B, g) / (seg.live_std(r_B, g.live_B, ddof) + eps)

    return normalise


def rloo(r_B: jax.Array, groups: GroupsLike) -> jax.Array:
    """RLOO (Ahmadian et al. 2024): A_i = r_i - mean_{j != i} r_j = n/(n-1) * (r_i - mean_n r), with n
    the row's own group size.

    A lone completion has no leave-one-out baseline: a static group_size < 2 is an error; a group of
    one among groups of ids gets A = 0 (no signal, like a constant group, which also gets exactly 0).
    """
    g = _groups(r_B, groups)
    if not isinstance(groups, Groups) and groups < 2:
        raise ValueError(f"rloo needs group_size >= 2, got {groups}")
    n_B = seg.size_B(g)
    loo_mean_B = (seg.sum_N(r_B, g)[g.id_B] - r_B) / jnp.maximum(n_B - 1.0, 1.0)
    return _zero_where_no_signal(jnp.where(n_B >= 2, r_B - loo_mean_B, 0.0), r_B, g)


def batch_whiten(adv_B: jax.Array, g: Groups, eps: float, ddof: int = 1) -> jax.Array:
    """(A - mean_B A) / (std_B A + eps), mean and std over the live rows with `ddof`; a group whose
    advantages are all exactly 0 stays exactly 0, padding too. For a group-centred input the batch
    mean is 0 in exact arithmetic, so that guard only removes float residue (constant groups carry no
    signal and must not get a spurious ~1e-8 advantage)."""
    whitened_B = (adv_B - seg.live_mean(adv_B, g.live_B)) / (seg.live_std(adv_B, g.live_B, ddof) + eps)
    return jnp.where(seg.any_B(adv_B != 0, g), whitened_B, 0.0)


def group_mean_batch_whiten(eps: float = 1e-6, ddof: int = 1) -> Normaliser:
    """REINFORCE++ with baseline (Hu et al. 2025, arXiv:2501.03262): A_i = r_i - mean_G r, then
    whitened over the batch: A_i <- (A_i - mean_B A) / (std_B A + eps), unbiased std by default
    (ddof=1, as verl's `masked_whiten`).

    Whitening is over SEQUENCES (each live row counts once). OpenRLHF whitens the per-token advantages
    over all completion tokens, which weighs long rows more; that needs the mask, which the
    estimator contract does not see. Constant groups get exactly 0 (see `batch_whiten`).
    """
    if not eps > 0:
        raise ValueError(f"eps: got {eps!r}, expected a positive number")
    ddof = _check_ddof(ddof)

    def normalise(r_B: jax.Array, groups: GroupsLike) -> jax.Array:
        g = _groups(r_B, groups)
        return batch_whiten(group_mean(r_B, g), g, eps, ddof)

    return normalise


# ---------------------------------------------------------------------------------------------
# MC-GRPO: median baseline over G+1 completions; one pivot per group carries no gradient.


def _median_groups(r_B: jax.Array, groups: GroupsLike) -> Groups:
    if not isinstance(groups, Groups) and seg.check_group_size(groups, r_B.shape[0]) % 2 == 0:
        raise ValueError(
            f"MC-GRPO samples G+1 completions so that the median is one of them: group_size "
            f"(= G+1) must be odd, got {groups}"
        )
    return _groups(r_B, groups)


def group_median(mad_scale: bool = True, mad_eps: float = 1e-3, nonzero_rescale: bool = True) -> Normaliser:
    """MC-GRPO advantage (Kim 2026, "MC-GRPO: Median-Centered Group Relative Policy Optimization",
    arXiv:2601.22582; the paper's code, github.com/lotusroot-kim/MC-GRPO, `grpo_trainer_*.py`).
    With M = median_{G+1} r:

        A_i = (r_i - M) / (MAD + mad_eps)                  MAD = median_{G+1} |r_i - M|   (mad_scale)
        A_i <- A_i * (G+1) / #{j : |A_j| > 1e-6}           on the rows with |A_i| > 1e-6 (nonzero_rescale)

    Both steps are on by default, as in the paper's code (which divides by MAD + 1e-3 always and
    rescales the non-zero advantages of each group of G+1 by (G+1) / #nonzero, with the same 1e-6
    zero tolerance); `mad_scale=False, nonzero_rescale=False` is the plain form A_i = r_i - M.
    A static group_size is G+1 and must be ODD, so the median is one group member's reward (no
    averaging). Groups of ids may have any size n (VIGOR allocation): G+1 is then the group's own n,
    and in an even group M (and the MAD) is the LOWER median, still a member (torch.median's rule;
    our reading, the paper samples odd groups only).
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

    def normalise(r_B: jax.Array, groups: GroupsLike) -> jax.Array:
        g = _median_groups(r_B, groups)
        adv_B = r_B - seg.lower_median_B(r_B, g)
        if mad_scale:
            adv_B = adv_B / (seg.lower_median_B(jnp.abs(adv_B), g) + mad_eps)
        if nonzero_rescale:
            nonzero_B = (jnp.abs(adv_B) > _MC_ZERO_TOL) & g.live_B
            n_nonzero_B = seg.sum_N(nonzero_B.astype(jnp.float32), g)[g.id_B]
            scale_B = seg.size_B(g) / jnp.maximum(n_nonzero_B, 1.0)
            adv_B = jnp.where(nonzero_B, adv_B * scale_B, adv_B)
        return jnp.where(g.live_B, adv_B, 0.0)

    return normalise


_MC_ZERO_TOL = 1e-6  # the paper's code: torch.isclose(A, 0, atol=1e-6) counts as a zero advantage


def median_pivot(r_B: jax.Array, groups: GroupsLike) -> jax.Array:
    """pivot_B: float 1.0 on exactly one row per group (the MC-GRPO pivot), 0.0 elsewhere (padding too).

    The pivot is the row at position (n-1)//2 of a STABLE ascending sort of the group's rewards (n the
    group's size; (G+1)//2 for an odd G+1); so among rows tied at the median it is the k-th tied row
    in row order, k = (n-1)//2 - #{r < median} + 1.
    It has A = 0 by construction. MC-GRPO gives it NO gradient and counts only the other G rows, so
    the preset must drop the row from the loss, not just rely on A = 0 (A = 0 still leaves the KL /
    entropy terms and the row's count in the aggregation normalisers): before computing the
    aggregation weights, set completion_mask_BxT *= (1 - pivot_B)[:, None].
    Same signature as a normaliser, so `estimator(reward_combine, median_pivot)` gives it from rewards.
    """
    g = _median_groups(r_B, groups)
    order_B, pos_N = seg.sorted_rows(r_B, g)
    pivot_row_N = order_B[jnp.clip(pos_N, 0, r_B.shape[0] - 1)]
    has_rows_N = seg.count_N(g) > 0
    pivot_B = jnp.zeros(r_B.shape, jnp.float32).at[pivot_row_N].max(has_rows_N.astype(jnp.float32))
    return jnp.where(g.live_B, pivot_B, 0.0)


# ---------------------------------------------------------------------------------------------
# Single-rollout baseline (no group).


def batch_mean(r_B: jax.Array, groups: GroupsLike = 1) -> jax.Array:
    """A_i = r_i - mean_B r over every live row of the batch; groups are ignored (any group_size),
    except that padding rows get 0 and count in no statistic.

    OUR READING for single-rollout methods (SAO, G = 1): the paper's baseline is a learned value of
    the prompt (a value head regressed on rewards); until the model has a value head, the batch mean
    reward stands in for it (a constant baseline: unbiased, higher variance than a prompt value).
    A constant batch gets exactly 0.
    """
    if r_B.ndim != 1:
        raise ValueError(f"expected a rank-1 r_B, got shape {r_B.shape}")
    live_B = groups.live_B if isinstance(groups, Groups) else jnp.ones(r_B.shape, bool)
    high = jnp.max(jnp.where(live_B, r_B, -jnp.inf))
    low = jnp.min(jnp.where(live_B, r_B, jnp.inf))
    return jnp.where((high == low) | ~live_B, 0.0, r_B - seg.live_mean(r_B, live_B))
