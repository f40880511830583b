"""The options every preset takes, as parts: one small factory per option, and `option_parts`.

A preset ends in `compose(..., options=option_parts(kl_beta=kl_beta, **extras))`; `option_parts`
returns one `LossPart` per option that is on (all are off by default), built by the factories below:

    kl_beta, kl_estimator            kl_penalty_part: beta * KL_t in the loss ("k1" | "k2" | "k3", k3 default)
    entropy_coef                     entropy_part: loss -= coef * H_t
    kl_reward_beta,                  kl_reward_part: r_i -= beta * sum_t KL_t, KL in the reward
      kl_reward_estimator                             (k1 default)
    overlong_buffer_frac             overlong_part: DAPO overlong shaping, L_c = frac * max_new_tokens
    mask_truncated                   truncation_part: drop truncated completions (truncated_B)
    top_entropy_frac                 top_entropy_part: train only on this top fraction of tokens by
                                     (old) entropy (1 = off)
    tis_cap, is_level                tis_part: truncated IS on pi_old / pi_rollout ("token" | "sequence")
    mis_low, mis_high, is_level      mis_part: masked IS, drop where pi_old / pi_rollout leaves [low, high]

`EXTRAS` lists the option names (what `jaxrl.config.LossConfig.options` may set for any preset).
"""

from __future__ import annotations

import functools

from jaxrl.losses import corrections, masks, regularizers
from jaxrl.losses import prepare as prep
from jaxrl.losses.parts import KLEstimator, LossPart, label, named

# The options every preset accepts (forwarded by each preset's **extras to `option_parts`); with their
# defaults they are all off. `jaxrl.config.LossConfig.options` sets them from a config file or --set.
EXTRAS = (
    "kl_estimator",
    "entropy_coef",
    "kl_reward_beta",
    "kl_reward_estimator",
    "overlong_buffer_frac",
    "mask_truncated",
    "top_entropy_frac",
    "tis_cap",
    "mis_low",
    "mis_high",
    "is_level",
)

KL_ESTIMATORS = {"k1": regularizers.kl_k1, "k2": regularizers.kl_k2, "k3": regularizers.kl_k3}


def kl_estimator_by_name(estimator: str | KLEstimator, field: str = "kl_estimator") -> KLEstimator:
    """The KL estimator called `estimator` ("k1" | "k2" | "k3"), or `estimator` itself if callable."""
    if callable(estimator):
        return estimator
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"{field}: got {estimator!r}, expected one of {tuple(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator]


def kl_penalty_part(beta: float, estimator: str | KLEstimator = "k3") -> LossPart:
    """beta * KL_t(pi_theta || pi_ref) added to each token's loss (the GRPO placement); reads ref_logp_BxT."""
    est = kl_estimator_by_name(estimator)
    reg = named(f"kl_penalty({beta}, {label(est)})", regularizers.kl_penalty(beta, est))
    return LossPart(regularizers=(reg,), needs_ref=True)


def entropy_part(coef: float) -> LossPart:
    """-coef * H_t added to each token's loss (H_t = batch['entropy_BxT'])."""
    return LossPart(regularizers=(named(f"entropy_bonus({coef})", regularizers.entropy_bonus(coef)),))


def kl_reward_part(beta: float, estimator: str | KLEstimator = "k1") -> LossPart:
    """KL in the reward: r_i -= beta * sum_t KL_t (`prepare.kl_reward`); reads ref_logp_BxT."""
    shaper = prep.kl_reward(beta, kl_estimator_by_name(estimator, "kl_reward_estimator"))
    return LossPart(shapers=(shaper,), needs_ref=True)


def overlong_part(buffer_frac: float) -> LossPart:
    """DAPO's overlong reward shaping with L_c = buffer_frac * max_new_tokens (`prepare.overlong_penalty`)."""
    return LossPart(shapers=(prep.overlong_penalty(buffer_frac),))


def truncation_part() -> LossPart:
    """Drop truncated completions (truncated_B) from the loss and every normaliser."""
    return LossPart(rows=(named("mask_truncated", prep.not_truncated_rows),))


def top_entropy_part(frac: float) -> LossPart:
    """Train only on the top `frac` of live tokens by old entropy (`masks.top_entropy_keep`)."""
    keep = named(f"top_entropy_keep({frac})", masks.top_entropy_keep(frac))
    return masks.token_mask(keep, "entropy_keep_BxT", "entropy_masked_BxT", needs_old_logp=True)


def tis_part(cap: float, level: str = "token") -> LossPart:
    """Truncated IS on the policy term: l_t *= sg(min(pi_old / pi_rollout, cap)) (`corrections.tis`)."""
    corrections.check_tis(cap, level)
    return LossPart(corrections=(functools.partial(corrections.tis, cap=cap, level=level),))


def mis_part(low: float, high: float, level: str = "token") -> LossPart:
    """Masked IS on the policy term: drop where pi_old / pi_rollout leaves [low, high] (`corrections.mis`)."""
    corrections.check_mis(low, high, level)
    return LossPart(corrections=(functools.partial(corrections.mis, low=low, high=high, level=level),))


def option_parts(
    kl_beta: float = 0.0,
    *,
    kl_estimator: str | KLEstimator = "k3",
    entropy_coef: float = 0.0,
    kl_reward_beta: float = 0.0,
    kl_reward_estimator: str | KLEstimator = "k1",
    overlong_buffer_frac: float = 0.0,
    mask_truncated: bool = False,
    top_entropy_frac: float = 1.0,
    tis_cap: float = 0.0,
    mis_low: float = 0.0,
    mis_high: float = 0.0,
    is_level: str = "token",
) -> tuple[LossPart, ...]:
    """The parts of the options that are on, in the order `compose` applies them: reward shaping
    (overlong, then KL in the reward), truncation, top-entropy mask, MIS then TIS on the policy term,
    KL penalty, entropy bonus. Every value is checked here; a bad one is a ValueError naming it."""
    corrections.check_level(is_level)
    kl_estimator_by_name(kl_estimator)  # a misspelt estimator is an error even while its beta is 0
    kl_estimator_by_name(kl_reward_estimator, "kl_reward_estimator")
    if mis_low and not mis_high:
        raise ValueError(f"mis_low: got {mis_low!r} with mis_high=0 (off); set mis_high to enable masked IS")
    if not 0 < top_entropy_frac <= 1:
        raise ValueError(f"top_entropy_frac: got {top_entropy_frac!r}, expected a number in (0, 1] (1 = off)")
    out = []
    if overlong_buffer_frac:
        out.append(overlong_part(overlong_buffer_frac))
    if kl_reward_beta:
        out.append(kl_reward_part(kl_reward_beta, kl_reward_estimator))
    if mask_truncated:
        out.append(truncation_part())
    if top_entropy_frac != 1.0:
        out.append(top_entropy_part(top_entropy_frac))
    if mis_high:
        out.append(mis_part(mis_low, mis_high, is_level))
    if tis_cap:
        out.append(tis_part(tis_cap, is_level))
    if kl_beta:
        out.append(kl_penalty_part(kl_beta, kl_estimator))
    else:
        regularizers.kl_penalty(kl_beta)  # validates the value
    if entropy_coef:
        out.append(entropy_part(entropy_coef))
    return tuple(out)
