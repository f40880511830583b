"""On-policy distillation as a loss: a teacher's per-token log-probs on the student's own samples.

The run scores every rollout batch under a frozen teacher once per step (`teacher_logp_BxT`, made by
jaxrl.train.teacher before the update; never inside the epochs loop). Here that becomes a per-token
advantage, written to `batch["advantages_BxT"]` by a prepare part, which the ratio -> objective
chain reads in place of the row advantage (`compose._advantages_BxT`):

    A_t = -(log pi_student(y_t) - log pi_teacher(y_t)) + w * A_task,t      y_t ~ pi_student

log pi_student(y_t) is the log-prob the token was drawn with (`rollout_logp_BxT`), so the advantage is
data, fixed for every epoch. The first term is minus the one-sample (k1) estimate of the per-token
reverse KL, KL(pi_student || pi_teacher) at the token's context: with the policy-gradient objective
its expected gradient is the gradient of the sequence-level reverse KL sum_t KL_t when the per-token
terms are summed as returns; using the token's own term only (no sum over later tokens) is the
per-token, discount-0 reading that the on-policy distillation recipes use. A_task is the task
advantage the preset's estimator computes (GRPO's group-normalised reward; per token if an earlier
prepare part wrote `advantages_BxT`), weighted by `reward_weight` (0: pure distillation).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxrl.losses import aggregation, parts, ratios
from jaxrl.losses.compose import Loss, compose
from jaxrl.losses.options import option_parts
from jaxrl.losses.parts import LossPart
from jaxrl.losses.prepare import Prepare

TEACHER_KEY = "teacher_logp_BxT"
PART = "reverse_kl_advantages"  # the label prefix that marks a loss as reading the teacher (`reads_teacher`)


def _require_teacher(batch: dict, logp_key: str) -> None:
    for key, why in (
        (TEACHER_KEY, "set distill.teacher, the run then scores each batch under it"),
        (logp_key, "the rollout's log-probs of the sampled tokens"),
    ):
        if key not in batch:
            raise KeyError(f"{PART}: the batch has no {key!r} ({why})")


def reverse_kl_BxT(batch: dict, logp_key: str = "rollout_logp_BxT") -> jax.Array:
    """log pi_student(y_t) - log pi_teacher(y_t) on the sampled tokens, 0 on masked ones: the one-sample
    estimate of the per-token reverse KL (signed per token; its mean over samples is >= 0)."""
    _require_teacher(batch, logp_key)
    live_BxT = batch["completion_mask_BxT"] > 0
    return jnp.where(live_BxT, batch[logp_key] - batch[TEACHER_KEY], 0.0)


def reverse_kl_advantages(reward_weight: float = 0.0, logp_key: str = "rollout_logp_BxT") -> Prepare:
    """A prepare part: batch["advantages_BxT"] = -(logp - teacher_logp) + reward_weight * A_task on the
    live tokens, 0 elsewhere, without gradient. A_task is `advantages_BxT` when an earlier part wrote
    one, else the row advantage `advantages_B` on every token; reward_weight = 0 ignores it."""
    if not reward_weight >= 0:
        raise ValueError(f"reward_weight: got {reward_weight!r}, expected a non-negative number")

    def prepare(batch: dict, group_size: int, max_new_tokens: int) -> dict:
        mask_BxT = batch["completion_mask_BxT"]
        adv_BxT = -reverse_kl_BxT(batch, logp_key)
        if reward_weight:
            task_BxT = batch.get("advantages_BxT")
            if task_BxT is None:
                task_BxT = jnp.broadcast_to(batch["advantages_B"][:, None], mask_BxT.shape)
            adv_BxT = adv_BxT + reward_weight * task_BxT
        adv_BxT = jnp.where(mask_BxT > 0, adv_BxT, 0.0).astype(jnp.float32)
        return dict(batch, advantages_BxT=jax.lax.stop_gradient(adv_BxT))

    prepare.part = f"{PART}(A_t = -(logp - teacher_logp) + {reward_weight:g} * A_task)"
    return prepare


def distill_stats(logp_BxT: jax.Array, batch: dict) -> tuple[jax.Array, dict]:
    """A regulariser that adds nothing and reports the teacher's view of the batch, per live token:
    distill/reverse_kl (rollout logp - teacher logp), distill/teacher_logp, distill/advantage."""
    live_BxT = batch["completion_mask_BxT"] > 0
    stats = {
        "distill/reverse_kl_BxT": reverse_kl_BxT(batch),
        "distill/teacher_logp_BxT": jnp.where(live_BxT, batch[TEACHER_KEY], 0.0),
        "distill/advantage_BxT": jnp.where(live_BxT, batch["advantages_BxT"], 0.0),
    }
    return jnp.zeros_like(logp_BxT), stats


def teacher_part(reward_weight: float = 0.0) -> LossPart:
    """The distillation part of a composition: the KL advantage (prepare) and its metrics."""
    return LossPart(
        prepare=(reverse_kl_advantages(reward_weight),), regularizers=(parts.named("distill_stats", distill_stats),)
    )


def reads_teacher(loss: Loss) -> bool:
    """Whether `loss` reads `teacher_logp_BxT` (a composition with `teacher_part`)."""
    return any(str(p).startswith(PART) for p in loss.parts)


def distill(
    eps_low: float = 0.2,
    eps_high: float | None = None,
    reward_weight: float = 0.0,
    kl_beta: float = 0.0,
    adv_eps: float = 1e-6,
    std_ddof: int = 1,
    reward_weights: Sequence[float] | None = None,
    **extras,
) -> Loss:
    """On-policy distillation: the student samples, a frozen teacher scores the sampled tokens, and the
    per-token reverse KL is the advantage of a PPO-clip policy gradient.

        A_t = -(log pi(y_t) - log pi_T(y_t)) + reward_weight * A_i      (reverse_kl_advantages;
                                                                         A_i: GRPO's group_mean_std)
        J   = 1/N sum_{i,t} m_it min(rho_t A_t, clip(rho_t, 1-eps_low, 1+eps_high) A_t)
                                                                        (token ratio, ppo_clip, token_mean)
    N = the batch's live tokens (every token weighs the same: the objective is a per-token KL).

    Papers: GKD (Agarwal et al. 2023, "On-Policy Distillation of Language Models: Learning from
    Self-Generated Mistakes", arXiv:2306.13649) trains on the student's own samples against the
    teacher's token distribution, reverse KL being one of its divergences; MiniLLM (Gu et al. 2023,
    arXiv:2306.08543) minimises the reverse KL KL(student || teacher) by policy gradient on student
    samples; the Qwen3 technical report (2025, arXiv:2505.09388) distils its small models on-policy
    from teacher logits. What carries over here is the signal: the reverse KL on the student's own
    samples. We use its one-sample per-token estimate from the sampled token's log-probs (no full
    teacher distribution, so no forward-KL or JSD variants), without MiniLLM's return-to-go sum or
    its length normalisation and teacher-mixed sampling.
    """
    return compose(
        "distill",
        **parts.grpo_advantages(reward_weights, adv_eps, std_ddof),
        ratio=ratios.token_log_ratio,
        objective=parts.ppo_clip(eps_low, eps_high),
        weights=aggregation.token_mean,
        parts=(teacher_part(reward_weight),),
        options=option_parts(kl_beta=kl_beta, **extras),
    )
