"""Presets of the GRPO family that differ in the advantage estimator, the normaliser (aggregation) or
batch-level row selection; all use the token ratio and the PPO clip.

Every preset is a short `compose(...)` call; each takes `kl_beta` (beta * KL_t in the loss, k3 by
default), `reward_weights` (one weight per reward function; None = all 1), and, exactly when it divides
by a group or batch std, `adv_eps` (added to every std it divides by) and `std_ddof` (1 = the unbiased
std, the default, as TRL / verl; 0 = the population std; see `advantages.py`), and the options in
`options.EXTRAS` via **extras (TIS / MIS corrections, entropy bonus, KL in the reward, overlong
shaping, truncation masking, top-entropy masking), all off unless the paper uses them.
Notation: G completions y_i per prompt with rewards r_i (r_ik for reward function k), A_i the advantage,
rho_t = pi_theta(y_t) / pi_old(y_t), m_t the mask, |y_i| = sum_t m_t, sg = stop-gradient, B the number of
live rows of the update batch, L_max = max_new_tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxrl.losses import advantages as adv_lib
from jaxrl.losses import aggregation, multi_reward, parts, ratios
from jaxrl.losses import prepare as prep
from jaxrl.losses.compose import Loss, compose
from jaxrl.losses.options import option_parts
from jaxrl.losses.parts import named


def grpo(
    eps_low: float = 0.2,
    eps_high: float | None = None,
    kl_beta: float = 0.0,
    adv_eps: float = 1e-6,
    std_ddof: int = 1,
    reward_weights: Sequence[float] | None = None,
    **extras,
) -> Loss:
    """GRPO, Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
    Language Models" (arXiv:2402.03300).

        r_i   = sum_k w_k r_ik                                           (reward_sum)
        A_i   = (r_i - mean_G r) / (std_G r + adv_eps)                   (group_mean_std)
                std_G r = sqrt(sum_G (r - mean_G r)^2 / (G - std_ddof)): unbiased by default (std_ddof=1,
                as TRL / verl), so rewards [1,0,0,0] give A = [1.5, -0.5, -0.5, -0.5]; std_ddof=0 gives
                the population std (A = [1.732, -0.577, ...]); a group of one gets A = 0
        J     = 1/B sum_i 1/|y_i| sum_t [ min(rho_t A_i, clip(rho_t, 1-eps_low, 1+eps_high) A_i)
                                          - kl_beta * KL_t ]             (ppo_clip, kl_penalty,
                                                                          seq_mean_token_mean)
    KL_t defaults to the k3 estimator exp(ref - logp) - (ref - logp) - 1 the paper uses. The
    paper's clip is symmetric (eps_high = eps_low, the default); B counts live rows.
    """
    return compose(
        "grpo",
        reward_combine=parts.reward_sum(reward_weights),
        normaliser=parts.group_mean_std(adv_eps, std_ddof),
        ratio=ratios.token_log_ratio,
        objective=parts.ppo_clip(eps_low, eps_high),
        weights=aggregation.seq_mean_token_mean,
        options=option_parts(kl_beta=kl_beta, **extras),
    )


def dr_grpo(
    eps_low: float = 0.2,
    eps_high: float | None = None,
    kl_beta: float = 0.0,
    reward_weights: Sequence[float] | None = None,
    **extras,
) -> Loss:
    """Dr.GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
    (arXiv:2503.20783): GRPO with its two biases removed.

        A_i = r_i - mean_G r                     (no std: no per-question difficulty weighting)
        J   = 1/(B * L_max) sum_i sum_t min(rho_t A_i, clip(rho_t, 1-eps_low, 1+eps_high) A_i)
                                                 (no 1/|y_i|: no length bias; seq_mean_token_sum_norm)
    minus kl_beta * KL_t inside the sum as in GRPO (the paper trains with kl_beta = 0).
    """
    return compose(
        "dr_grpo",
        reward_combine=parts.reward_sum(reward_weights),
        normaliser=adv_lib.group_mean,
        ratio=ratios.token_log_ratio,
        objective=parts.ppo_clip(eps_low, eps_high),
        weights=aggregation.seq_mean_token_sum_norm,
        options=option_parts(kl_beta=kl_beta, **extras),
    )


def bnpo(
    eps_low: float = 0.2,
    eps_high: float | None = None,
    kl_beta: float = 0.0,
    adv_eps: float = 1e-6,
    std_ddof: int = 1,
    reward_weights: Sequence[float] | None = None,
    **extras,
) -> Loss:
    """BNPO in the sense of the trainers' "bnpo" loss type: GRPO with the batch-normalised token mean.

        A_i = (r_i - mean_G r) / (std_G r + adv_eps)
        J   = sum_{i,t} m_it min(rho_t A_i, clip(rho_t, 1-eps_low, 1+eps_high) A_i) / sum_{i,t} m_it
    (token_mean over the WHOLE update batch, the "bnpo" loss type of common trainers). Not the
    Beta-distribution advantage normalisation of Xiao et al. 2025 ("BNPO: Beta Normalization Policy
    Optimization", arXiv:2506.02864), which this preset does not implement.
    """
    return compose(
        "bnpo",
        reward_combine=parts.reward_sum(reward_weights),
        normaliser=parts.group_mean_std(adv_eps, std_ddof),
        ratio=ratios.token_log_ratio,
        objective=parts.ppo_clip(eps_low, eps_high),
        weights=aggregation.token_mean,
        options=option_parts(kl_beta=kl_beta, **extras),
    )


def dapo(
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    kl_beta: float = 0.0,
    adv_eps: float = 1e-6,
    std_ddof: int = 1,
    reward_weights: Sequence[float] | None = None,
    overlong_buffer_frac: float = 0.2,
    drop_constant_groups: bool = True,
    **extras,
) -> Loss:
    """DAPO, Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"
    (arXiv:2503.14476).

        r_i   = sum_k w_k r_ik + R_len(|y_i|)     overlong shaping, L_c = overlong_buffer_frac * L_max:
                R_len = 0 if |y| <= L_max - L_c; ((L_max - L_c) - |y|) / L_c inside the buffer; -1 beyond
        A_i   = (r_i - mean_G r) / (std_G r + adv_eps)
        J     = sum_{i,t} m_it min(rho_t A_i, clip(rho_t, 1 - 0.2, 1 + 0.28) A_i) / sum_{i,t} m_it
                (clip-higher, token-level mean over the whole batch, no KL)
    Dynamic sampling, our reading for a fixed-shape batch (`drop_constant_groups`): groups whose
    advantages are all 0 (equal rewards) are dropped from the loss and the token count; refilling the
    batch with new samples is rollout control, outside the loss. `overlong_buffer_frac=0` turns the
    shaping off; the paper's alternative, masking truncated samples, is the `mask_truncated` option.
    Shaping runs in `prepare` (inside the update step): it needs the completion lengths.
    """
    reward_combine, normaliser = parts.reward_sum(reward_weights), parts.group_mean_std(adv_eps, std_ddof)
    rows = (parts.row_filter(named("informative_groups", prep.informative_rows)),) if drop_constant_groups else ()
    return compose(
        "dapo",
        reward_combine=reward_combine,
        normaliser=normaliser,
        ratio=ratios.token_log_ratio,
        objective=parts.ppo_clip(eps_low, eps_high),
        weights=aggregation.token_mean,
        parts=rows,
        options=option_parts(kl_beta=kl_beta, overlong_buffer_frac=overlong_buffer_frac, **extras),
    )


def async_const_norm(
    eps_low: float = 0.2,
    eps_high: float | None = None,
    kl_beta: float = 0.0,
    adv_eps: float = 1e-6,
    std_ddof: int = 1,
    reward_weights: Sequence[float] | None = None,
    k: float | None = None,
    **extras,
) -> Loss:
    """AsyncWebRL's constant normaliser (Bai et al. 2026, "AsyncWebRL: Efficient Multi-Step RL for Visual
    Web Agents", arXiv:2606.05597: asynchronous multi-step GRPO for web agents on WebGym): GRPO with
    the per-trajectory 1/|y_i| replaced by 1/k.

        A_i = (r_i - mean_G r) / (std_G r + adv_eps)
        J   = 1/B sum_i 1/k sum_t min(rho_t A_i, clip(rho_t, 1-eps_low, 1+eps_high) A_i)
    Because failures are longer than successes, 1/|y_i| down-weights the negative gradient on failed
    tokens; a constant keeps it. The abstract gives no value of k: `k=None` uses k = L_max
    (max_new_tokens). Differs from Dr.GRPO only by keeping GRPO's std normalisation.
    """
    return compose(
        "async_const_norm",
        reward_combine=parts.reward_sum(reward_weights),
        normaliser=parts.group_mean_std(adv_eps, std_ddof),
        ratio=ratios.token_log_ratio,
        objective=parts.ppo_clip(eps_low, eps_high),
        weights=aggregation.constant_norm(k),
        options=option_parts(kl_beta=kl_beta, **extras),
    )


def rloo(
    eps_low: float = 0.2,
    eps_high: float | None = None,
    kl_beta: float = 0.0,
    reward_weights: Sequence[float] | None = None,
    **extras,
) -> Loss:
    """RLOO, Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
    Learning from Human Feedback in LLMs" (arXiv:2402.14740).

        A_i = r_i - 1/(G-1) sum_{j != i} r_j           (leave-one-out baseline; needs G >= 2)
        J   = 1/B sum_i sum_t min(rho_t A_i, clip(rho_t, 1-eps_low, 1+eps_high) A_i)
    REINFORCE on the whole sequence: the row's loss is the SUM of its token terms (seq_mean_token_sum),
    i.e. A_i * log pi(y_i) at rho = 1. The clip only matters with several PPO epochs (RLOO itself is
    on-policy: with one epoch rho = 1 and it is exactly the REINFORCE-leave-one-out gradient).
    """
    return compose(
        "rloo",
        reward_combine=parts.reward_sum(reward_weights),
        normaliser=adv_lib.rloo,
        ratio=ratios.token_log_ratio,
        objective=parts.ppo_clip(eps_low, eps_high),
        weights=aggregation.seq_mean_token_sum,
        options=option_parts(kl_beta=kl_beta, **extras),
    )


def reinforce_pp(
    eps_low: float = 0.2,
    eps_high: float | None = None,
    kl_beta: float = 0.0,
    adv_eps: float = 1e-6,
    std_ddof: int = 1,
    reward_weights: Sequence[float] | None = None,
    kl_reward_beta: float = 0.0,
    **extras,
) -> Loss:
    """REINFORCE++ with baseline, Hu et al. 2025, "REINFORCE++: A Simple and Efficient Approach for
    Aligning Large Language Models" (arXiv:2501.03262).

        r_i <- r_i - kl_reward_beta * sum_t KL_t        (KL in the reward, k1 by default; 0 = off)
        A_i  = r_i - mean_G r, then whitened over the batch: (A - mean_B A) / (std_B A + adv_eps)
               (std_B with std_ddof, unbiased by default)
        J    = sum_{i,t} m_it min(rho_t A_i, clip(rho_t, 1-eps_low, 1+eps_high) A_i) / sum_{i,t} m_it
    (token_mean). The paper puts a token-level KL penalty in the reward; ours subtracts the whole
    sequence's KL from the outcome reward (`prepare.kl_reward`), and whitens per sequence, not per
    token (see `advantages.group_mean_batch_whiten`). With kl_reward_beta > 0 the advantages are
    recomputed inside the update step, where ref_logp_BxT is known.
    """
    normaliser = named(
        f"group_mean_batch_whiten(eps={adv_eps:g}, ddof={std_ddof})", adv_lib.group_mean_batch_whiten(adv_eps, std_ddof)
    )
    return compose(
        "reinforce_pp",
        reward_combine=parts.reward_sum(reward_weights),
        normaliser=normaliser,
        ratio=ratios.token_log_ratio,
        objective=parts.ppo_clip(eps_low, eps_high),
        weights=aggregation.token_mean,
        options=option_parts(kl_beta=kl_beta, kl_reward_beta=kl_reward_beta, **extras),
    )


def mc_grpo(
    eps_low: float = 0.2,
    eps_high: float | None = None,
    kl_beta: float = 0.0,
    reward_weights: Sequence[float] | None = None,
    mad_scale: bool = True,
    mad_eps: float = 1e-3,
    nonzero_rescale: bool = True,
    **extras,
) -> Loss:
    """MC-GRPO, Kim 2026, "MC-GRPO: Median-Centered Group Relative Policy Optimization for Small-Rollout
    Reinforcement Learning" (arXiv:2601.22582; code github.com/lotusroot-kim/MC-GRPO). Sample G+1
    completions: rollout.group_size = G+1, ODD.
    As the paper's code (`advantages.group_median`), with M = median_{G+1} r:

        A_i = (r_i - M) / (MAD + mad_eps),  MAD = median_{G+1} |r - M|         (mad_scale, default on)
        A_i <- A_i * (G+1) / #{nonzero A in the group}  on the nonzero A_i      (nonzero_rescale, default on)
        J   = 1/G sum_{i != pivot} 1/|y_i| sum_t min(rho_t A_i, clip(rho_t, 1-eps_low, 1+eps_high) A_i)
    `mad_scale=false, nonzero_rescale=false` (loss.options) is the plain form A_i = r_i - M. The MAD
    is not a std: this preset takes no adv_eps / std_ddof (its eps is `mad_eps`, the code's 1e-3).
    The pivot (the median row; A = 0) is removed in `prepare`: its completion mask is zeroed, so it
    gets no gradient (KL and entropy terms included) and does not count in B: G rows per group carry
    gradient, the cost of plain G-rollout training.
    """
    normaliser = named(
        f"group_median(mad_scale={mad_scale}, mad_eps={mad_eps:g}, nonzero_rescale={nonzero_rescale})",
        adv_lib.group_median(mad_scale=mad_scale, mad_eps=mad_eps, nonzero_rescale=nonzero_rescale),
    )
    return compose(
        "mc_grpo",
        reward_combine=parts.reward_sum(reward_weights),
        normaliser=normaliser,
        ratio=ratios.token_log_ratio,
        objective=parts.ppo_clip(eps_low, eps_high),
        weights=aggregation.seq_mean_token_mean,
        parts=(parts.row_filter(named("mc_pivot", prep.mc_pivot_rows)),),
        options=option_parts(kl_beta=kl_beta, **extras),
    )


def gdpo(
    eps_low: float = 0.2,
    eps_high: float | None = None,
    kl_beta: float = 0.0,
    adv_eps: float = 1e-6,
    std_ddof: int = 1,
    reward_weights: Sequence[float] | None = None,
    **extras,
) -> Loss:
    """GDPO, Liu et al. 2026, "GDPO: Group reward-Decoupled Normalization Policy Optimization for
    Multi-reward RL Optimization" (arXiv:2601.05242):
    normalise each reward function within the group first, then combine, then batch-normalise.

        z_ik = (r_ik - mean_G r_k) / (std_G r_k + adv_eps);  a_i = sum_k w_k z_ik
        A_i  = (a_i - mean_B a) / (std_B a + adv_eps)
    Both stds take std_ddof (1 = unbiased, the default; 0 = population std).
        J    = 1/B sum_i 1/|y_i| sum_t min(rho_t A_i, clip(rho_t, 1-eps_low, 1+eps_high) A_i)
    Reward shaping options are not available (they add to a combined reward; GDPO combines z-scores).
    """
    est = named(
        "gdpo" if reward_weights is None else f"gdpo{tuple(reward_weights)}",
        multi_reward.gdpo(reward_weights, eps=adv_eps, batch_eps=adv_eps, ddof=std_ddof),
    )
    return compose(
        "gdpo",
        estimator=est,
        ratio=ratios.token_log_ratio,
        objective=parts.ppo_clip(eps_low, eps_high),
        weights=aggregation.seq_mean_token_mean,
        options=option_parts(kl_beta=kl_beta, **extras),
    )


def gd2po(
    eps_low: float = 0.2,
    eps_high: float | None = None,
    kl_beta: float = 0.0,
    adv_eps: float = 1e-6,
    std_ddof: int = 1,
    reward_weights: Sequence[float] | None = None,
    conflict_threshold: float = 0.5,
    consensus_power: float = 1.0,
    **extras,
) -> Loss:
    """GD^2PO, Liu et al. 2026, "GD^2PO: Mitigating Multi-Reward Conflicts via Group-Dynamic
    reward-Decoupled Policy Optimization" (arXiv:2606.16771; code github.com/Qwen-Applications/GD2PO),
    OUR READING (formulas in `multi_reward.gd2po_parts`):

        A_i^GDPO as in `gdpo`; conflict_i = weighted share of reward functions whose z_ik opposes A_i
        keep_i = conflict_i <= conflict_threshold;  consensus_g = 1 - mean_{i in g} conflict_i
        A_i  = keep_i * consensus_g ** consensus_power * A_i^GDPO
        J    = 1/B' sum_{i kept} 1/|y_i| sum_t min(rho_t A_i, clip(rho_t, 1-eps_low, 1+eps_high) A_i)
    Masked rollouts are removed in `prepare` (mask zeroed), so B' counts only kept rows. adv_eps and
    std_ddof apply to both stds as in `gdpo` (the conflict mask reads signs only: ddof-invariant).
    """
    est = named(
        f"gd2po(threshold={conflict_threshold}, power={consensus_power})",
        multi_reward.gd2po(
            conflict_threshold=conflict_threshold,
            consensus_power=consensus_power,
            batch_eps=adv_eps,
            ddof=std_ddof,
            weights=reward_weights,
            eps=adv_eps,
        ),
    )
    conflict_rows = prep.gd2po_rows(conflict_threshold=conflict_threshold, weights=reward_weights, eps=adv_eps)
    rows = (parts.row_filter(named(f"gd2po_conflict(>{conflict_threshold})", conflict_rows)),)
    return compose(
        "gd2po",
        estimator=est,
        ratio=ratios.token_log_ratio,
        objective=parts.ppo_clip(eps_low, eps_high),
        weights=aggregation.seq_mean_token_mean,
        parts=rows,
        options=option_parts(kl_beta=kl_beta, **extras),
    )
