"""Objectives: (log_ratio_BxT, adv_BxT, mask_BxT) -> (loss_BxT, stats).

The per-token loss before aggregation (a quantity to MINIMISE, i.e. the negated surrogate).
`stats` holds per-token float arrays named `<what>_BxT`, 0 on masked tokens; reduce them with
`jaxrl.losses.aggregation.reduce_stats`.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

Objective = Callable[[jax.Array, jax.Array, jax.Array], tuple]


def ppo_clip(eps_low: float = 0.2, eps_high: Optional[float] = None) -> Objective:
    """PPO clipped surrogate (Schulman et al. 2017), per token, with asymmetric bounds (DAPO clip-higher).

        l_t = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A),   rho_t = exp(log_ratio_t)

    `eps_high=None` means eps_high = eps_low.

    Clip indicators (float 0/1, 0 on masked tokens) mark exactly the tokens where the clip was
    ACTIVE, i.e. the min picks the clipped (constant) term and the gradient is zero:
      clipped_low_BxT:  A < 0 and rho < 1 - eps_low
      clipped_high_BxT: A > 0 and rho > 1 + eps_high
    Inequalities are strict; at a tie both terms are equal and we take the unclipped branch, so the
    gradient there is -A * rho rather than the half-gradient `jnp.minimum` would give. Everywhere
    else the gradient with respect to logp is d(-rho A)/dlogp = -A * rho.
    When A == 0 the loss and gradient are 0 and neither indicator is set.

    stats: ratio_BxT (rho, no gradient), clipped_low_BxT, clipped_high_BxT; all 0 on masked tokens.
    """
    eps_high = eps_low if eps_high is None else eps_high
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"ppo_clip: eps_low={eps_low!r}, eps_high={eps_high!r}; expected non-negative numbers")
    lo, hi = 1.0 - eps_low, 1.0 + eps_high

    def objective(log_ratio_BxT: jax.Array, adv_BxT: jax.Array, mask_BxT: jax.Array):
        live_BxT = mask_BxT > 0
        ratio_BxT = jnp.exp(log_ratio_BxT)
        clipped_low_BxT = live_BxT & (adv_BxT < 0) & (ratio_BxT < lo)
        clipped_high_BxT = live_BxT & (adv_BxT > 0) & (ratio_BxT > hi)
        active_BxT = clipped_low_BxT | clipped_high_BxT
        # When the clip is active the surrogate is the constant clip bound times A; writing it as a
        # select (rather than min) makes "indicator set" and "gradient zero" the same statement.
        bound_BxT = jnp.clip(jax.lax.stop_gradient(ratio_BxT), lo, hi)
        surrogate_BxT = jnp.where(active_BxT, bound_BxT * adv_BxT, ratio_BxT * adv_BxT)
        stats = {
            "ratio_BxT": jnp.where(live_BxT, jax.lax.stop_gradient(ratio_BxT), 0.0),
            "clipped_low_BxT": clipped_low_BxT.astype(jnp.float32),
            "clipped_high_BxT": clipped_high_BxT.astype(jnp.float32),
        }
        return -surrogate_BxT, stats

    return objective
