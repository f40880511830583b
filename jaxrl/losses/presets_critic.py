"""Presets that learn a value model (`Loss.needs_critic`): the run trains a critic beside the policy
(critic.enabled, jaxrl.train.critic) and records its values on the whole batch before `prepare`.
Same conventions as `presets_grpo.py` (kl_beta, reward_weights, `options.EXTRAS` via **extras).
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxrl.losses import aggregation, parts, ratios
from jaxrl.losses import gae as gae_lib
from jaxrl.losses.compose import Loss, compose
from jaxrl.losses.options import option_parts
from jaxrl.losses.parts import named


def ppo(
    eps_low: float = 0.2,
    eps_high: float | None = None,
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten: bool = True,
    kl_beta: float = 0.0,
    reward_weights: Sequence[float] | None = None,
    **extras,
) -> Loss:
    """PPO with a value model: Schulman et al. 2017, "Proximal Policy Optimization Algorithms"
    (arXiv:1707.06347), with GAE advantages (Schulman et al. 2016, arXiv:1506.02438) per completion
    token, as RLHF's PPO uses it (Ouyang et al. 2022, InstructGPT, arXiv:2203.02155).

        R_i   = sum_k w_k r_ik (+ shaping), at the row's last live token          (reward_sum -> raw_reward)
        A_t   = GAE(gamma, lam) of R_i and the critic's old values V_t            (gae: jaxrl.losses.gae)
        A_t  <- (A_t - mean) / std over the batch's live tokens                  (whiten_advantages, `whiten`)
        J     = sum_{i,t} m_it min(rho_t A_t, clip(rho_t, 1-eps_low, 1+eps_high) A_t) / sum_{i,t} m_it
                                                                                  (ppo_clip, token_mean)
    The value loss (clipped by critic.value_clip) is the critic's, minimised by its own optimizer
    (jaxrl.train.critic); gamma = 1 and lam = 0.95 are the usual LLM defaults (a reward only at the
    end, so discounting only shortens credit). Any group_size works: the baseline is V, not a group.
    """
    return compose(
        "ppo",
        reward_combine=parts.reward_sum(reward_weights),
        normaliser=named("raw_reward", gae_lib.raw_reward),
        ratio=ratios.token_log_ratio,
        objective=parts.ppo_clip(eps_low, eps_high),
        weights=aggregation.token_mean,
        parts=(gae_lib.gae_part(gamma, lam, whiten),),
        options=option_parts(kl_beta=kl_beta, **extras),
    )
