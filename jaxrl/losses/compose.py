"""The `Loss` contract the training step calls, and `compose`, the one builder every preset uses.

    advantages(rewards_BxK, groups) -> adv_B                      groups: a static group_size or a
                                                                  `segments.Groups`
    prepare(batch, group_size, max_new_tokens) -> batch           ONCE on the whole update batch
    weights(completion_mask_BxT, max_new_tokens) -> weights_BxT   on the whole (prepared) batch
    token_loss(logp_BxT, batch) -> (loss_BxT, stats)              per microbatch

plus `needs_old_logp`, `needs_ref` (only then does a run keep reference weights), `needs_critic`
(the run trains a value model and records its old_values_BxT before prepare), `reward_shaping`
(bonus_B functions added to the combined reward) and `parts` (the composition, for `jaxrl variants`).
`loss_BxT` and every `<name>_BxT` stat are exactly 0 on masked tokens. Hyperparameters are static
values closed over at build time. `evaluate_loss` runs the same functions as the update, so it is the
update's loss; `check_loss` checks any object against this contract before a run, in one line.
docs/losses.md describes the order the parts run in and the batch keys they read.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.config.errors import ConfigError
from jaxrl.losses import advantages as adv_lib
from jaxrl.losses import objectives, ratios, regularizers
from jaxrl.losses import prepare as prep
from jaxrl.losses.options import EXTRAS
from jaxrl.losses.parts import LossPart, label
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
    needs_critic: bool = False  # reads old_values_BxT: the run trains a value model (critic.enabled)


# How the update calls each function of the contract: the positional arguments it passes.
_CALLS = {
    "advantages": ("rewards_BxK", "groups"),
    "weights": ("completion_mask_BxT", "max_new_tokens"),
    "token_loss": ("logp_BxT", "batch"),
    "prepare": ("batch", "group_size", "max_new_tokens"),
}
_FLAGS = ("needs_old_logp", "needs_ref", "needs_critic")


def _check_call(fn, field: str, args: tuple, where: str) -> None:
    if not callable(fn):
        raise ConfigError(f"{where}: Loss.{field} is {type(fn).__name__}, not callable as {field}({', '.join(args)})")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check before the call
        return
    try:
        sig.bind(*args)
    except TypeError as e:
        raise ConfigError(f"{where}: Loss.{field} cannot be called as {field}({', '.join(args)}): {e}") from None


def check_loss(obj, where: str = "loss") -> Loss:
    """`obj` as a `Loss`, checked against the contract as the update calls it: a `Loss` is returned as
    is; any other object with the fields (a NamedTuple or class of the user's) becomes one, its
    missing optional fields at their defaults. A missing field, a function that cannot be called with
    the update's arguments or a non-bool flag is a ConfigError naming it and `where`."""
    if not isinstance(obj, Loss):
        missing = [f for f in Loss._fields if f not in Loss._field_defaults and not hasattr(obj, f)]
        if missing:
            raise ConfigError(
                f"{where}: {type(obj).__name__} has no {missing[0]!r}, a field of the Loss contract "
                f"(jaxrl.losses.Loss: {', '.join(Loss._fields)})"
            )
        obj = Loss(**{f: getattr(obj, f) for f in Loss._fields if hasattr(obj, f)})
    if not isinstance(obj.name, str):
        raise ConfigError(f"{where}: Loss.name is {type(obj.name).__name__}, expected a string")
    for field, args in _CALLS.items():
        shaped = field == "advantages" and obj.reward_shaping
        _check_call(getattr(obj, field), field, (*args, "bonus_B") if shaped else args, where)
    for fn in obj.reward_shaping:
        _check_call(fn, "reward_shaping", ("batch", "max_new_tokens"), where)
    for flag in _FLAGS:
        if not isinstance(getattr(obj, flag), bool):
            raise ConfigError(f"{where}: Loss.{flag} is {getattr(obj, flag)!r}, expected True or False")
    return obj


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


_OLD_FLAGS = (*EXTRAS, "kl_beta", "row_filters", "batch_parts", "keep_masks", "needs_old_logp")


def _advantage_step(name: str, estimator, reward_combine, normaliser, shapers: tuple) -> tuple[Callable, list]:
    """The estimator (shaped when there are shapers) and its labels."""
    if estimator is None:
        if reward_combine is None or normaliser is None:
            raise ValueError(f"{name}: give `estimator`, or both `reward_combine` and `normaliser`")
        estimator = adv_lib.estimator(reward_combine, normaliser)
        labels = [f"{label(reward_combine)} -> {label(normaliser)}"]
    else:
        labels = [label(estimator)]
    if shapers:
        if reward_combine is None or normaliser is None:
            raise ValueError(
                f"{name}: reward shaping (overlong_buffer_frac, kl_reward_beta) needs an estimator that "
                "combines the rewards first (reward_combine -> normaliser); this preset normalises each "
                "reward function separately"
            )
        estimator = prep.shaped_estimator(reward_combine, normaliser)
        labels += [f"reward += {label(s)}" for s in shapers]
    return estimator, labels


def _wrap(token_loss: Callable, wrappers: tuple, labels: list) -> Callable:
    """Apply each TokenWrapper in order; a wrapped loss that carries a label is listed."""
    for wrapper in wrappers:
        token_loss = wrapper(token_loss)
        if getattr(token_loss, "part", None):
            labels.append(label(token_loss))
    return token_loss


def compose(
    name: str,
    *,
    ratio: ratios.RatioFn,
    objective: objectives.Objective,
    weights: Callable,
    estimator: adv_lib.Estimator | None = None,
    reward_combine: adv_lib.RewardCombine | None = None,
    normaliser: adv_lib.Normaliser | None = None,
    parts: Sequence[LossPart] = (),
    options: Sequence[LossPart] = (),
    **unknown,
) -> Loss:
    """Build a Loss from parts: the advantage step (`estimator`, or `reward_combine` then `normaliser`,
    the only form reward shaping can use: shaping adds to the combined reward), the ratio level, the
    objective, the aggregation `weights`, and `LossPart`s: the preset's own `parts` (e.g. DAPO's row
    filter, M2PO's batch mask) and `options` (`options.option_parts(...)`, the options every preset
    takes). Options wrap the preset: their row filters run before the preset's (truncation first),
    every other stage after the preset's. Order:

        advantages  combined reward + shaping bonuses, normalised
        prepare     row filters (`prepare.drop_rows`) -> prepare parts (batch parts, token masks)
        token loss  ratio -> objective -> corrections (MIS, TIS) -> + regularisers (KL, entropy) -> masks
    `needs_old_logp` / `needs_ref` / `needs_critic` are those of any part.
    """
    if unknown:
        key = next(iter(unknown))
        hint = "options=option_parts(...) (jaxrl.losses.options)" if key in _OLD_FLAGS else "the parts of a loss"
        raise TypeError(f"compose() got an unexpected keyword argument {key!r}: it takes {hint}")
    merged = [*options, *parts]
    staged = [*parts, *options]
    rows = [f for p in merged for f in p.rows]
    shapers = tuple(s for p in staged for s in p.shapers)
    estimator, labels = _advantage_step(name, estimator, reward_combine, normaliser, shapers)
    prepare_parts = [prep.drop_rows(f) for f in rows] + [q for p in staged for q in p.prepare]
    labels += [f"drop rows: {label(f)}" for f in rows] + [label(q) for p in staged for q in p.prepare]
    labels += [label(ratio), label(objective)]
    token_loss = policy_token_loss(ratio, objective)
    token_loss = _wrap(token_loss, tuple(w for p in staged for w in p.corrections), labels)
    regs = tuple(r for p in staged for r in p.regularizers)
    labels += [label(r) for r in regs]
    tail: list = []
    token_loss = _wrap(with_regularizers(token_loss, regs), tuple(w for p in staged for w in p.masks), tail)
    return Loss(
        name=name,
        advantages=estimator,
        weights=weights,
        token_loss=token_loss,
        prepare=prep.chain(*prepare_parts),
        needs_old_logp=any(p.needs_old_logp for p in staged),
        parts=(*labels, label(weights), *tail),
        needs_ref=any(p.needs_ref for p in staged),
        reward_shaping=shapers,
        needs_critic=any(p.needs_critic for p in staged),
    )
