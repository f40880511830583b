"""PPO with a value model, the loss side: token-level GAE, advantage whitening and the clipped value loss.

Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation"
(arXiv:1506.02438), on the completion tokens of each row, with the outcome reward R_i (the combined
reward plus any shaping bonus: `advantages_B` as the `raw_reward` estimator leaves it) given at the
row's last live token and V_t = old_values_BxT (the critic's value of the state before token t,
recorded once on the whole batch before the epochs):

    r_t     = R_i if t is the last live token, else 0
    delta_t = r_t + gamma * m_{t+1} V_{t+1} - V_t                 (after the last live token: V = 0)
    A_t     = delta_t + gamma * lam * m_{t+1} A_{t+1}
    R_t     = A_t + V_t                                           (returns_BxT: the value target)

Both are 0 on masked tokens. `gae_part` writes advantages_BxT (what `compose._advantages_BxT` prefers
over advantages_B) and returns_BxT; `whiten_part` rescales advantages_BxT to mean 0, std 1 over the
batch's live tokens. `value_loss_terms` is the clipped value loss of PPO implementations (OpenAI
baselines' ppo2; Ouyang et al. 2022's InstructGPT PPO):

    l_t = 0.5 * max((V_t - R_t)^2, (clip(V_t, V_old_t - eps, V_old_t + eps) - R_t)^2)     (eps = 0: unclipped)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.losses import segments as seg
from jaxrl.losses.parts import LossPart, named


def raw_reward(r_B: jax.Array, groups: seg.GroupsLike = 1) -> jax.Array:
    """A normaliser that leaves the combined reward as it is (0 on padding rows): PPO's baseline is the
    critic's value, applied per token by `gae_part`, not a group statistic."""
    if r_B.ndim != 1:
        raise ValueError(f"expected a rank-1 r_B, got shape {r_B.shape}")
    live_B = groups.live_B if isinstance(groups, seg.Groups) else jnp.ones(r_B.shape, bool)
    return jnp.where(live_B, r_B, 0.0)


def gae_BxT(
    reward_B: jax.Array, values_BxT: jax.Array, mask_BxT: jax.Array, gamma: float, lam: float
) -> tuple[jax.Array, jax.Array]:
    """(advantages_BxT, returns_BxT) by the recursion in the module docstring, a reverse scan over T.
    Live tokens are where mask_BxT > 0; the reward lands on each row's last live token (a row with
    none gets nothing)."""
    live_BxT = mask_BxT > 0
    B, T = live_BxT.shape
    values_BxT = jnp.where(live_BxT, values_BxT.astype(jnp.float32), 0.0)
    t_T = jnp.arange(T)
    last_B = jnp.max(jnp.where(live_BxT, t_T[None, :], -1), axis=1)
    rewards_BxT = jnp.where(t_T[None, :] == last_B[:, None], reward_B.astype(jnp.float32)[:, None], 0.0)
    live_f_BxT = live_BxT.astype(jnp.float32)
    # The next token's value and liveness (0 past the end).
    next_values_BxT = jnp.concatenate([values_BxT[:, 1:], jnp.zeros((B, 1), jnp.float32)], axis=1)
    next_live_BxT = jnp.concatenate([live_f_BxT[:, 1:], jnp.zeros((B, 1), jnp.float32)], axis=1)
    deltas_BxT = rewards_BxT + gamma * next_live_BxT * next_values_BxT - values_BxT

    def back(adv_next_B, xs):
        delta_B, next_live_B, live_B = xs
        adv_B = jnp.where(live_B > 0, delta_B + gamma * lam * next_live_B * adv_next_B, 0.0)
        return adv_B, adv_B

    xs = (deltas_BxT.T, next_live_BxT.T, live_f_BxT.T)
    _, adv_TxB = jax.lax.scan(back, jnp.zeros((B,), jnp.float32), xs, reverse=True)
    adv_BxT = adv_TxB.T
    returns_BxT = jnp.where(live_BxT, adv_BxT + values_BxT, 0.0)
    return jax.lax.stop_gradient(adv_BxT), jax.lax.stop_gradient(returns_BxT)


def whiten_BxT(x_BxT: jax.Array, mask_BxT: jax.Array, eps: float = 1e-8) -> jax.Array:
    """(x - mean) / (std + eps) over the live tokens (std with ddof 0); 0 on masked tokens. A batch with
    no live token is returned as zeros."""
    live_BxT = mask_BxT > 0
    n = jnp.maximum(jnp.sum(live_BxT.astype(jnp.float32)), 1.0)
    mean = jnp.sum(jnp.where(live_BxT, x_BxT, 0.0)) / n
    var = jnp.sum(jnp.where(live_BxT, jnp.square(x_BxT - mean), 0.0)) / n
    return jnp.where(live_BxT, (x_BxT - mean) / (jnp.sqrt(var) + eps), 0.0)


def value_loss_terms(
    values_BxT: jax.Array, old_values_BxT: jax.Array, returns_BxT: jax.Array, mask_BxT: jax.Array, clip: float
) -> tuple[jax.Array, jax.Array]:
    """(loss_BxT, clipped_BxT): the clipped value loss per token (module docstring; `clip` = 0 gives
    0.5 (V - R)^2) and 1.0 where the clipped term is the larger one, so its gradient is 0
    (critic/value_clip_frac). Both 0 on masked tokens."""
    live_BxT = mask_BxT > 0
    values_BxT = values_BxT.astype(jnp.float32)
    unclipped_BxT = jnp.square(values_BxT - returns_BxT)
    if clip > 0:
        v_clip_BxT = old_values_BxT + jnp.clip(values_BxT - old_values_BxT, -clip, clip)
        clipped_sq_BxT = jnp.square(v_clip_BxT - returns_BxT)
        loss_BxT = 0.5 * jnp.maximum(unclipped_BxT, clipped_sq_BxT)
        clipped_BxT = (clipped_sq_BxT > unclipped_BxT).astype(jnp.float32)
    else:
        loss_BxT, clipped_BxT = 0.5 * unclipped_BxT, jnp.zeros_like(unclipped_BxT)
    return jnp.where(live_BxT, loss_BxT, 0.0), jnp.where(live_BxT, clipped_BxT, 0.0)


def explained_variance(values_BxT: jax.Array, returns_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    """1 - Var(R - V) / Var(R) over the live tokens (1: V predicts R exactly; 0: no better than R's
    mean; negative: worse). 0 when Var(R) is 0."""
    live_BxT = mask_BxT > 0
    n = jnp.maximum(jnp.sum(live_BxT.astype(jnp.float32)), 1.0)

    def var(x):
        mean = jnp.sum(jnp.where(live_BxT, x, 0.0)) / n
        return jnp.sum(jnp.where(live_BxT, jnp.square(x - mean), 0.0)) / n

    var_r = var(returns_BxT)
    return jnp.where(var_r > 0, 1.0 - var(returns_BxT - values_BxT) / jnp.where(var_r > 0, var_r, 1.0), 0.0)


def gae(gamma: float, lam: float):
    """The prepare stage: advantages_BxT and returns_BxT from advantages_B (the row's outcome reward)
    and old_values_BxT; a KeyError names the missing key (a run without a critic)."""
    if not 0 <= gamma <= 1:
        raise ValueError(f"gamma: got {gamma!r}, expected a number in [0, 1]")
    if not 0 <= lam <= 1:
        raise ValueError(f"lam: got {lam!r}, expected a number in [0, 1]")

    def prepare(batch: dict, group_size: int, max_new_tokens: int) -> dict:
        if "old_values_BxT" not in batch:
            raise KeyError(
                "GAE needs batch['old_values_BxT'], the critic's values at rollout time: the run needs a "
                "value model (critic.enabled=true)"
            )
        adv_BxT, returns_BxT = gae_BxT(
            batch["advantages_B"], batch["old_values_BxT"], batch["completion_mask_BxT"], gamma, lam
        )
        return dict(batch, advantages_BxT=adv_BxT, returns_BxT=returns_BxT)

    return named(f"gae(gamma={gamma:g}, lam={lam:g})", prepare)


def whiten_advantages(batch: dict, group_size: int, max_new_tokens: int) -> dict:
    """advantages_BxT whitened over the batch's live tokens (`whiten_BxT`)."""
    return dict(batch, advantages_BxT=whiten_BxT(batch["advantages_BxT"], batch["completion_mask_BxT"]))


def gae_part(gamma: float, lam: float, whiten: bool = True) -> LossPart:
    """GAE (then whitening, when `whiten`) as a prepare part that needs the critic's values."""
    stages = (gae(gamma, lam),) + ((named("whiten_advantages", whiten_advantages),) if whiten else ())
    return LossPart(prepare=stages, needs_critic=True)
