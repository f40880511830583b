"""The `Loss` contract the training step calls, and `compose`, the one builder every preset uses.

A `Loss` is

    advantages(rewards_BxK, groups) -> adv_B                      the advantage estimator; groups = a static
                                                                  group_size or a `segments.Groups` (group
                                                                  ids); with `reward_shaping`, also bonus_B
    prepare(batch, group_size, max_new_tokens) -> batch           ONCE on the whole update batch, inside
                                                                  the jitted update, after the advantages
                                                                  and old / ref log-probs, before weights
                                                                  and microbatching (`prepare.py`)
    weights(completion_mask_BxT, max_new_tokens) -> weights_BxT   on the whole (prepared) batch
    token_loss(logp_BxT, batch) -> (loss_BxT, stats)              per microbatch

plus `needs_old_logp` (the update step must record the whole batch's old log-probs and entropies,
`old_logp_BxT` / `old_entropy_BxT`, before `prepare`, even for a single PPO epoch), `needs_ref` (the
loss reads the reference policy's `ref_logp_BxT`: a KL penalty or KL in the reward; only then does a
run keep reference weights and run their forward), `reward_shaping` (bonus_B functions
`(batch, max_new_tokens) -> bonus_B` added to the combined reward before it is normalised) and `parts`
(a human-readable list of the composition, for `jaxrl variants`).

`jaxrl.losses.evaluate` runs these in order -- advantages (from rewards_BxK, with the shaping), prepare,
weights, token loss, `weighted_sum` -- and the update step calls the same functions, so
`evaluate_loss(loss, logp_BxT, batch, group_size=G, max_new_tokens=T)` is the update's loss on a batch.
The update minimises the sum over microbatches of `weighted_sum(weights_BxT, loss_BxT)`; since the
advantages, prepare and weights see the whole batch, that is exactly the full-batch loss and gradient.

Groups: a batch may carry `group_id_B` (int32 [B]; equal ids = one group of any size, rows anywhere,
id < 0 or an all-0 completion mask = padding, advantage 0 and in no statistic). Without it the groups
are group_size adjacent rows. The advantage step passes the estimator `segments.Groups` built from it;
prepare parts read it with `segments.batch_groups(batch, group_size)` (see `evaluate.py`).

`batch` keys read by token_loss: completion_mask_BxT, old_logp_BxT, advantages_B (or advantages_BxT),
ref_logp_BxT (KL term), entropy_BxT (entropy bonus), rollout_logp_BxT (TIS / MIS), and whatever keys
prepare added (m2po_keep_BxT, entropy_keep_BxT). `loss_BxT` is exactly 0 on masked tokens; `stats`
holds per-token float arrays `<name>_BxT`, 0 on masked tokens.

Hyperparameters are static Python values closed over at build time; a change recompiles.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.losses import advantages as adv_lib
from jaxrl.losses import corrections, m2po, objectives, ratios, regularizers
from jaxrl.losses import prepare as prep
from jaxrl.losses.prepare import no_prepare


class Loss(NamedTuple):
    name: str
    advantages: Callable  # (rewards_BxK, groups: group_size int | segments.Groups[, bonus_B]) -> adv_B
    weights: Callable  # (completion_mask_BxT, max_new_tokens: int) -> weights_BxT
    token_loss: Callable  # (logp_BxT, batch: dict) -> (loss_BxT, stats)
    prepare: Callable = no_prepare  # (batch, group_size: int, max_new_tokens: int) -> batch
    needs_old_logp: bool = False  # record old_logp_BxT / old_entropy_BxT for the whole batch first
    parts: tuple = ()  # readable composition, e.g. ("reward_sum -> group_mean_std(1e-06)", ...)
    needs_ref: bool = False  # reads ref_logp_BxT: the run keeps reference params and runs their forward
    reward_shaping: tuple = ()  # (batch, max_new_tokens) -> bonus_B, added to the combined reward


class _Labelled(functools.partial):
    """A `functools.partial` that carries a readable part label."""

    part: str


def named(label: str, fn: Callable) -> Callable:
    """`fn` with a readable part label (for `Loss.parts`), without mutating `fn` itself."""
    wrapped = _Labelled(fn)
    wrapped.part = label
    return wrapped


def label(fn: Callable) -> str:
    return getattr(fn, "part", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _advantages_BxT(batch: dict, shape: tuple) -> jax.Array:
    if "advantages_BxT" in batch:
        return jax.lax.stop_gradient(batch["advantages_BxT"])
    return jnp.broadcast_to(jax.lax.stop_gradient(batch["advantages_B"])[:, None], shape)


def with_regularizers(token_loss: Callable, regularizer_parts: Sequence[regularizers.Regularizer]) -> Callable:
    """Add each regulariser's per-token term to `token_loss` (same weights, the GRPO placement)."""
    regularizer_parts = tuple(regularizer_parts)

    def wrapped(logp_BxT: jax.Array, batch: dict):
        loss_BxT, stats = token_loss(logp_BxT, batch)
        stats = dict(stats)
        for part in regularizer_parts:
            extra_BxT, part_stats = part(logp_BxT, batch)
            loss_BxT = loss_BxT + extra_BxT
            stats.update(part_stats)
        # Every part already masks; this final select is the contract guarantee for callers.
        return jnp.where(batch["completion_mask_BxT"] > 0, loss_BxT, 0.0), stats

    return wrapped


def policy_token_loss(
    ratio: ratios.RatioFn, objective: objectives.Objective, regularizer_parts: Sequence[regularizers.Regularizer] = ()
) -> Callable:
    """Compose ratio level -> objective (+ regularisers) into `token_loss(logp_BxT, batch)`."""

    takes_logp = "logp_BxT" in inspect.signature(objective).parameters  # CISPO reports -sg(w) A logp

    def token_loss(logp_BxT: jax.Array, batch: dict):
        mask_BxT = batch["completion_mask_BxT"]
        log_ratio_BxT = ratio(logp_BxT, batch["old_logp_BxT"], mask_BxT)
        loss_BxT, stats = objective(
            log_ratio_BxT,
            _advantages_BxT(batch, logp_BxT.shape),
            mask_BxT,
            **({"logp_BxT": logp_BxT} if takes_logp else {}),
        )
        return jnp.where(mask_BxT > 0, loss_BxT, 0.0), dict(stats)

    return with_regularizers(token_loss, regularizer_parts)


KL_ESTIMATORS = {"k1": regularizers.kl_k1, "k2": regularizers.kl_k2, "k3": regularizers.kl_k3}


def kl_estimator_by_name(estimator: str | regularizers.KLEstimator, field: str = "kl_estimator"):
    if callable(estimator):
        return estimator
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"{field}: got {estimator!r}, expected one of {tuple(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator]


# The options every preset accepts (forwarded by each preset's **extras to `compose`); with their
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


def compose(
    name: str,
    *,
    ratio: ratios.RatioFn,
    objective: objectives.Objective,
    weights: Callable,
    estimator: adv_lib.Estimator | None = None,
    reward_combine: adv_lib.RewardCombine | None = None,
    normaliser: adv_lib.Normaliser | None = None,
    kl_beta: float = 0.0,
    row_filters: Sequence[prep.RowKeep] = (),
    batch_parts: Sequence[prep.Prepare] = (),
    keep_masks: Sequence[tuple] = (),
    needs_old_logp: bool = False,
    # --- EXTRAS: options every preset takes (all off by default) ---
    kl_estimator: str | regularizers.KLEstimator = "k3",
    entropy_coef: float = 0.0,
    kl_reward_beta: float = 0.0,
    kl_reward_estimator: str | regularizers.KLEstimator = "k1",
    overlong_buffer_frac: float = 0.0,
    mask_truncated: bool = False,
    top_entropy_frac: float = 1.0,
    tis_cap: float = 0.0,
    mis_low: float = 0.0,
    mis_high: float = 0.0,
    is_level: str = "token",
) -> Loss:
    """Build a Loss from parts. The advantage estimator is `estimator`, or `reward_combine` then
    `normaliser` (the only form reward shaping can use: shaping adds to the combined reward).

    Preset-specific batch parts: `row_filters` (keep_B functions, applied with `prepare.drop_rows`),
    `batch_parts` (prepare parts run after them, e.g. M2PO's mask) and `keep_masks` ((key, stat) pairs:
    token masks added by a batch part, applied with `m2po.apply_keep_mask` around the whole token loss).

    EXTRAS (options for any preset):
      kl_estimator         "k1" | "k2" | "k3" for the kl_beta penalty in the loss (default k3)
      entropy_coef         entropy bonus: loss -= coef * H_t
      kl_reward_beta       KL in the reward: r_i -= beta * sum_t KL_t (kl_reward_estimator, default k1)
      overlong_buffer_frac DAPO overlong shaping with L_c = frac * max_new_tokens (0 = off)
      mask_truncated       drop truncated completions (truncated_B) from the loss and normalisers
      top_entropy_frac     train only on this top fraction of tokens by (old) entropy (1 = off)
      tis_cap              truncated IS on pi_old / pi_rollout at this cap (0 = off)
      mis_low, mis_high    masked IS: drop where pi_old / pi_rollout leaves [low, high] (high 0 = off)
      is_level             "token" | "sequence" for TIS / MIS
    `needs_ref` is set when kl_beta or kl_reward_beta is non-zero (both read ref_logp_BxT).
    Order: advantages (combined reward + shaping bonuses, normalised) -> prepare = row filters
    (truncation first) -> batch parts -> top-entropy mask;
    token loss = ratio -> objective -> MIS -> TIS -> + KL / entropy -> keep masks.
    """
    corrections._check_level(is_level)
    if mis_low and not mis_high:
        raise ValueError(f"mis_low: got {mis_low!r} with mis_high=0 (off); set mis_high to enable masked IS")
    if not 0 < top_entropy_frac <= 1:
        raise ValueError(f"top_entropy_frac: got {top_entropy_frac!r}, expected a number in (0, 1] (1 = off)")
    parts = []
    if estimator is None:
        if reward_combine is None or normaliser is None:
            raise ValueError(f"{name}: give `estimator`, or both `reward_combine` and `normaliser`")
        estimator = adv_lib.estimator(reward_combine, normaliser)
        parts.append(f"{label(reward_combine)} -> {label(normaliser)}")
    else:
        parts.append(label(estimator))

    prepare_parts = []
    shapers = []
    if overlong_buffer_frac:
        shapers.append(prep.overlong_penalty(overlong_buffer_frac))
    if kl_reward_beta:
        shapers.append(prep.kl_reward(kl_reward_beta, kl_estimator_by_name(kl_reward_estimator, "kl_reward_estimator")))
    if shapers:
        if reward_combine is None or normaliser is None:
            raise ValueError(
                f"{name}: reward shaping (overlong_buffer_frac, kl_reward_beta) needs an estimator that "
                "combines the rewards first (reward_combine -> normaliser); this preset normalises each "
                "reward function separately"
            )
        estimator = prep.shaped_estimator(reward_combine, normaliser)
        parts += [f"reward += {label(s)}" for s in shapers]
    row_filters = ((named("mask_truncated", prep.not_truncated_rows),) if mask_truncated else ()) + tuple(row_filters)
    for keep_fn in row_filters:
        prepare_parts.append(prep.drop_rows(keep_fn))
        parts.append(f"drop rows: {label(keep_fn)}")
    prepare_parts += list(batch_parts)
    parts += [label(p) for p in batch_parts]
    keep_masks = list(keep_masks)
    if top_entropy_frac != 1.0:
        prepare_parts.append(prep.top_entropy_keep(top_entropy_frac))
        keep_masks.append(("entropy_keep_BxT", "entropy_masked_BxT"))
        needs_old_logp = True
        parts.append(f"top_entropy_keep({top_entropy_frac})")

    parts += [label(ratio), label(objective)]
    token_loss = policy_token_loss(ratio, objective)
    if mis_high:
        token_loss = corrections.mis(token_loss, mis_low, mis_high, is_level)
        parts.append(label(token_loss))
    if tis_cap:
        token_loss = corrections.tis(token_loss, tis_cap, is_level)
        parts.append(label(token_loss))
    regs = []
    if kl_beta:
        est = kl_estimator_by_name(kl_estimator)
        regs.append(regularizers.kl_penalty(kl_beta, est))
        parts.append(f"kl_penalty({kl_beta}, {label(est)})")
    else:
        regularizers.kl_penalty(kl_beta)  # validates the value
    if entropy_coef:
        regs.append(regularizers.entropy_bonus(entropy_coef))
        parts.append(f"entropy_bonus({entropy_coef})")
    token_loss = with_regularizers(token_loss, regs)
    for key, stat in keep_masks:
        token_loss = m2po.apply_keep_mask(token_loss, key=key, stat=stat)
    parts.append(label(weights))
    return Loss(
        name=name,
        advantages=estimator,
        weights=weights,
        token_loss=token_loss,
        prepare=prep.chain(*prepare_parts),
        needs_old_logp=needs_old_logp,
        parts=tuple(parts),
        needs_ref=bool(kl_beta) or bool(kl_reward_beta),
        reward_shaping=tuple(shapers),
    )
