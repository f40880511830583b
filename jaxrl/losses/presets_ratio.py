"""Presets that change the ratio level, the objective or the trust region (GRPO advantages unless said).

Same conventions as `presets_grpo.py`: each is a short `compose(...)`, takes kl_beta, reward_weights
and the `options.EXTRAS` options, and adv_eps / std_ddof exactly when it divides by a std (GRPO
advantages: unbiased group std by default); rho_t = pi_theta(y_t) / pi_old(y_t), B live rows, |y_i| = sum_t m_t.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxrl.losses import advantages as adv_lib
from jaxrl.losses import aggregation, objectives, parts, ratios
from jaxrl.losses import m2po as m2po_lib
from jaxrl.losses.compose import Loss, compose
from jaxrl.losses.options import option_parts
from jaxrl.losses.parts import named


def gspo(
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    kl_beta: float = 0.0,
    adv_eps: float = 1e-6,
    std_ddof: int = 1,
    reward_weights: Sequence[float] | None = None,
    **extras,
) -> Loss:
    """GSPO, Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071).

        s_i = exp(1/|y_i| sum_t log rho_t)            (sequence_log_ratio: length-normalised)
        J   = 1/B sum_i min(s_i A_i, clip(s_i, 1 - 3e-4, 1 + 4e-4) A_i)
    The ratio is one number per row, clipped as one number with GSPO's tiny ranges; GRPO advantages.
    seq_mean_token_mean of a row-constant loss is the row's value, so J is exactly the paper's.
    """
    return compose(
        "gspo",
        **parts.grpo_advantages(reward_weights, adv_eps, std_ddof),
        ratio=ratios.sequence_log_ratio,
        objective=parts.ppo_clip(eps_low, eps_high),
        weights=aggregation.seq_mean_token_mean,
        options=option_parts(kl_beta=kl_beta, **extras),
    )


def gspo_token(
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    kl_beta: float = 0.0,
    adv_eps: float = 1e-6,
    std_ddof: int = 1,
    reward_weights: Sequence[float] | None = None,
    **extras,
) -> Loss:
    """GSPO-token (Zheng et al. 2025, arXiv:2507.18071, the token-level variant):

        s_it = sg(s_i) * rho_t / sg(rho_t)              (sequence_token_log_ratio)
        J    = 1/B sum_i 1/|y_i| sum_t min(s_it A_it, clip(s_it, 1 - 3e-4, 1 + 4e-4) A_it)
    Same value and clipping as GSPO, per-token gradient (so per-token advantages can differ); with a
    per-row advantage its gradient equals GSPO's.
    """
    return compose(
        "gspo_token",
        **parts.grpo_advantages(reward_weights, adv_eps, std_ddof),
        ratio=ratios.sequence_token_log_ratio,
        objective=parts.ppo_clip(eps_low, eps_high),
        weights=aggregation.seq_mean_token_mean,
        options=option_parts(kl_beta=kl_beta, **extras),
    )


def tbpo(
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    c: float = 3.0,
    kl_beta: float = 0.0,
    adv_eps: float = 1e-6,
    std_ddof: int = 1,
    reward_weights: Sequence[float] | None = None,
    **extras,
) -> Loss:
    """TBPO, Trust-Band Policy Optimization from QaRL (Gu et al. 2026, "QaRL: Rollout-Aligned
    Quantization-Aware RL for Fast and Stable Training under Training--Inference Mismatch",
    arXiv:2604.07853), in its abstract's words a sequence-level objective with dual clipping for
    negative samples.

        s_i = exp(1/|y_i| sum_t log rho_t)                               (sequence_log_ratio, as GSPO)
        l_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)    and, if A_i < 0 and s_i > c,
        l_i = -c A_i                                                      (dual clip: constant, no gradient)
        J   = -1/B sum_i l_i
    OUR READING: the abstract gives neither the ratio's normalisation nor the band, so the sequence
    ratio and the band are GSPO's (3e-4 / 4e-4) and c = 3 is dual-clip PPO's usual cap. The cap keeps
    a negative sample whose sequence ratio exploded (garbled tokens from a mismatched sampler) from
    dominating the update. GRPO advantages.
    """
    obj = named(f"dual_clip({eps_low:g}, {eps_high:g}, c={c:g})", objectives.dual_clip(eps_low, eps_high, c))
    return compose(
        "tbpo",
        **parts.grpo_advantages(reward_weights, adv_eps, std_ddof),
        ratio=ratios.sequence_log_ratio,
        objective=obj,
        weights=aggregation.seq_mean_token_mean,
        options=option_parts(kl_beta=kl_beta, **extras),
    )


def pnpo(
    eps_low: float = 0.2,
    eps_high: float | None = None,
    kl_beta: float = 0.0,
    adv_eps: float = 1e-6,
    std_ddof: int = 1,
    reward_weights: Sequence[float] | None = None,
    **extras,
) -> Loss:
    """PNPO, "Reusing Rollouts under Policy Lag: Prefix-Normalized Policy Optimization for LLM
    Reinforcement Learning" (2026, arXiv:2608.01418):

        w_t = exp(1/t sum_{j <= t} log rho_j)           (prefix_log_ratio: causal geometric mean)
        J   = 1/B sum_i 1/|y_i| sum_t min(w_t A_i, clip(w_t, 1-eps_low, 1+eps_high) A_i)
    OUR READING for the clip: the abstract gives no range; the prefix weight starts as a token ratio
    (t = 1) and tends to GSPO's sequence value, so we keep the token-level 0.2 by default.
    """
    return compose(
        "pnpo",
        **parts.grpo_advantages(reward_weights, adv_eps, std_ddof),
        ratio=ratios.prefix_log_ratio,
        objective=parts.ppo_clip(eps_low, eps_high),
        weights=aggregation.seq_mean_token_mean,
        options=option_parts(kl_beta=kl_beta, **extras),
    )


def gmpo(
    eps_low: float = 0.4,
    eps_high: float | None = None,
    kl_beta: float = 0.0,
    adv_eps: float = 1e-6,
    std_ddof: int = 1,
    reward_weights: Sequence[float] | None = None,
    **extras,
) -> Loss:
    """GMPO, Zhao et al. 2025, "Geometric-Mean Policy Optimization" (arXiv:2507.20673).

        c_t = min(log rho_t, eps_high) if A_i > 0, max(log rho_t, -eps_low) if A_i < 0   (log space!)
        J   = 1/B sum_i A_i exp(1/|y_i| sum_t c_t)     (gmpo objective, seq_mean_token_mean)
    i.e. the geometric mean of the token ratios clipped to (e^-0.4, e^0.4) by default. eps_low /
    eps_high here are LOG-space bounds (unlike ppo_clip's). GRPO advantages.
    """
    eps_high = eps_low if eps_high is None else eps_high
    return compose(
        "gmpo",
        **parts.grpo_advantages(reward_weights, adv_eps, std_ddof),
        ratio=ratios.token_log_ratio,
        objective=named(f"gmpo(log-clip {eps_low:g}, {eps_high:g})", objectives.gmpo(eps_low, eps_high)),
        weights=aggregation.seq_mean_token_mean,
        options=option_parts(kl_beta=kl_beta, **extras),
    )


def cispo(
    eps_high: float = 0.28,
    eps_low: float | None = None,
    kl_beta: float = 0.0,
    adv_eps: float = 1e-6,
    std_ddof: int = 1,
    reward_weights: Sequence[float] | None = None,
    **extras,
) -> Loss:
    """CISPO, MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
    Attention" (arXiv:2506.13585).

        l_t = -sg(clip(rho_t, 1 - eps_low, 1 + eps_high)) A_i log pi_theta(y_t)     (the reported per-token loss)
        J   = -sum_{i,t} m_it l_t / sum_{i,t} m_it
    The IS weight is clipped and DETACHED: every token keeps a gradient (token_mean, GRPO advantages).
    The per-token loss is reported as TRL and verl report it, -sg(w) A log pi_theta (not the
    log-ratio form, which has the same gradient). The paper leaves the lower bound off (eps_low=None)
    and tunes only the upper one; no value we can cite, so the default cap 1 + 0.28 reuses DAPO's
    clip-higher bound (our choice).
    Mapping to TRL: our eps_high is RELATIVE (cap = 1 + eps_high), TRL's `epsilon_high` for
    loss_type="cispo" is the ABSOLUTE cap (`clamp(ratio, max=epsilon_high)`, no floor). So TRL's
    epsilon_high = X is our eps_high = X - 1 (e.g. epsilon_high=5.0 is eps_high=4.0) with eps_low=None;
    our default eps_high=0.28 is TRL's epsilon_high=1.28.
    """
    floor = None if eps_low is None else 1.0 - eps_low
    obj = named(
        f"cispo(cap={1 + eps_high:g}{'' if floor is None else f', floor={floor:g}'})",
        objectives.cispo(cap=1.0 + eps_high, floor=floor),
    )
    return compose(
        "cispo",
        **parts.grpo_advantages(reward_weights, adv_eps, std_ddof),
        ratio=ratios.token_log_ratio,
        objective=obj,
        weights=aggregation.token_mean,
        options=option_parts(kl_beta=kl_beta, **extras),
    )


def sapo(
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    kl_beta: float = 0.0,
    adv_eps: float = 1e-6,
    std_ddof: int = 1,
    reward_weights: Sequence[float] | None = None,
    **extras,
) -> Loss:
    """SAPO, Gao et al. (Qwen) 2025, "Soft Adaptive Policy Optimization" (arXiv:2511.20347), the soft
    gate; not the unrelated "Swarm sAmpling Policy Optimization" that shares the acronym:

        J = 1/B sum_i 1/|y_i| sum_t (4 / tau) sigmoid(tau (rho_t - 1)) A_i,  tau = tau_pos if A > 0 else tau_neg
    A smooth trust region instead of a hard clip (gradient -A at rho = 1, decaying away from it);
    tau_neg > tau_pos damps negative updates more. GRPO advantages.
    """
    obj = named(f"sapo(tau_pos={tau_pos:g}, tau_neg={tau_neg:g})", objectives.sapo(tau_pos, tau_neg))
    return compose(
        "sapo",
        **parts.grpo_advantages(reward_weights, adv_eps, std_ddof),
        ratio=ratios.token_log_ratio,
        objective=obj,
        weights=aggregation.seq_mean_token_mean,
        options=option_parts(kl_beta=kl_beta, **extras),
    )


def sao(
    eps_low: float = 0.2,
    eps_high: float | None = None,
    kl_beta: float = 0.0,
    reward_weights: Sequence[float] | None = None,
    **extras,
) -> Loss:
    """SAO, Hou et al. 2026, "Single-Rollout Asynchronous Optimization for Agentic Reinforcement
    Learning" (arXiv:2607.07508). One rollout per prompt (rollout.group_size = 1):

        A_i = r_i - mean_B r                            (OUR READING: batch-mean baseline, see below)
        l_t = -rho_t A_i  if 1 - eps_low <= rho_t <= 1 + eps_high, else dropped (no gradient, either sign)
        J   = sum_{i,t} m_it (-l_t) / sum_{i,t} m_it     (strict double-side clip, token_mean)
    SAO's baseline is a learned value of the prompt (a value model); jaxrl has no value head yet, so
    the batch mean reward stands in (`advantages.batch_mean`). Clip range and token-mean are our
    choices (the abstract gives neither).
    """
    eps_high = eps_low if eps_high is None else eps_high
    obj = named(f"strict_double_side({eps_low:g}, {eps_high:g})", objectives.strict_double_side(eps_low, eps_high))
    return compose(
        "sao",
        reward_combine=parts.reward_sum(reward_weights),
        normaliser=adv_lib.batch_mean,
        ratio=ratios.token_log_ratio,
        objective=obj,
        weights=aggregation.token_mean,
        options=option_parts(kl_beta=kl_beta, **extras),
    )


def mu_grpo(
    eps_low: float = 0.4,
    eps_high: float | None = None,
    delta: float = 0.5,
    kl_beta: float = 0.0,
    adv_eps: float = 1e-6,
    std_ddof: int = 1,
    reward_weights: Sequence[float] | None = None,
    **extras,
) -> Loss:
    """Mu-GRPO (Tian et al. 2026, "How Off-Policy Can GRPO Be? Mu-GRPO for Efficient LLM Reinforcement
    Learning", arXiv:2605.17570): relaxed clipping plus a negative-advantage veto, OUR READING
    (`objectives.mu_grpo`):

        l_t = -min(rho_t A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) A_i), except for A_i < 0 every
              token from the first with |log rho_t| > delta to the end of the row is vetoed (loss 0)
        J   = 1/B sum_i 1/|y_i| sum_t (-l_t)
    The abstract gives no numbers: "relaxed" is eps = 0.4 (twice GRPO's 0.2) and delta = 0.5 (rho
    outside [0.61, 1.65]) by default, our choices.
    """
    eps_high = eps_low if eps_high is None else eps_high
    obj = named(
        f"mu_grpo(eps {eps_low:g}/{eps_high:g}, veto |log rho| > {delta:g})",
        objectives.mu_grpo(eps_low, eps_high, delta),
    )
    return compose(
        "mu_grpo",
        **parts.grpo_advantages(reward_weights, adv_eps, std_ddof),
        ratio=ratios.token_log_ratio,
        objective=obj,
        weights=aggregation.seq_mean_token_mean,
        options=option_parts(kl_beta=kl_beta, **extras),
    )


def m2po(
    tau: float = 0.04,
    token_set: str = "trust_region",
    kl_beta: float = 0.0,
    adv_eps: float = 1e-6,
    std_ddof: int = 1,
    reward_weights: Sequence[float] | None = None,
    **extras,
) -> Loss:
    """M2PO, Second-Moment Trust Policy Optimization (Zheng, Zhao, Chen 2025, "Prosperity before
    Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?", arXiv:2510.01161),
    Algorithm 1:

        r_t = pi_theta(y_t) / pi_rollout(y_t)            behaviour = the rollout policy (the sampler)
        S   = trust-region tokens {A > 0, r > 1} u {A < 0, r < 1}   (token_set="trust_region", default)
              or every live token                                     (token_set="all")
        M   = batch mask dropping the tokens of S with the largest (log r_t)^2 until
              mean_{kept in S} (log r_t)^2 <= tau (0.04); tokens outside S are never dropped
        J   = sum_{i,t} m_it M_it r_t A_i / sum_{i,t} m_it        (no clip; token_mean; GRPO advantages)
    The mask depends on every token of the batch, so it is computed in `prepare` on the whole batch
    (`m2po.m2po_prepare`, with r at the start of the update: pi_old / pi_rollout; the update step
    records old log-probs first: needs_old_logp) and applied per microbatch (`masks.apply_keep_mask`).
    The objective's ratio is pi_theta / pi_rollout (`m2po.rollout_behaviour`); without rollout
    log-probs in the batch, pi_rollout = pi_old. Masked tokens keep their place in the token count
    (our reading). Metric: m2po_masked (fraction of live tokens masked).
    """
    return compose(
        "m2po",
        **parts.grpo_advantages(reward_weights, adv_eps, std_ddof),
        ratio=ratios.token_log_ratio,
        objective=named("unclipped", objectives.unclipped()),
        weights=aggregation.token_mean,
        parts=(m2po_lib.m2po_part(tau, token_set),),
        options=option_parts(kl_beta=kl_beta, **extras),
    )
