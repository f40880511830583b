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
