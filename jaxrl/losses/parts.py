"""The parts a loss is built from: their types, `LossPart` (the pieces that act at batch level or wrap
the token loss) and the labelled building blocks the presets share.

Roles (each a `typing.Protocol`, defined next to its family and collected here):

    RewardCombine   rewards_BxK -> r_B                                  advantages.py
    Normaliser      (r_B, groups) -> adv_B                              advantages.py
    Estimator       (rewards_BxK, groups) -> adv_B                      advantages.py
    RatioFn         (logp_BxT, old_logp_BxT, mask_BxT) -> log_ratio_BxT ratios.py
    Objective       (log_ratio_BxT, adv_BxT, mask_BxT) -> (loss_BxT, stats)   objectives.py
    Prepare         (batch, group_size, max_new_tokens) -> batch        prepare.py
    RowKeep         (batch, group_size) -> keep_B                       prepare.py
    Shaper          (batch, max_new_tokens) -> bonus_B                  prepare.py
    KLEstimator     (logp_BxT, ref_logp_BxT) -> kl_BxT                  regularizers.py
    Regularizer     (logp_BxT, batch) -> (extra_loss_BxT, stats)        regularizers.py
    TokenLoss       (logp_BxT, batch) -> (loss_BxT, stats)              here
    TokenWrapper    TokenLoss -> TokenLoss                              here (TIS / MIS, keep masks)

`compose.compose(...)` puts them together; its `parts` and `options` are `LossPart`s, whose fields say
where each piece acts; `options.option_parts(...)` builds the options every preset takes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import jax

from jaxrl.losses import advantages as adv_lib
from jaxrl.losses import objectives
from jaxrl.losses.advantages import Estimator, Normaliser, RewardCombine
from jaxrl.losses.objectives import Objective
from jaxrl.losses.prepare import Prepare, RowKeep, Shaper
from jaxrl.losses.ratios import RatioFn
from jaxrl.losses.regularizers import KLEstimator, Regularizer

__all__ = [
    "Estimator",
    "KLEstimator",
    "LossPart",
    "Normaliser",
    "Objective",
    "Prepare",
    "RatioFn",
    "Regularizer",
    "RewardCombine",
    "RowKeep",
    "Shaper",
    "TokenLoss",
    "TokenWrapper",
    "grpo_advantages",
    "group_mean_std",
    "label",
    "named",
    "ppo_clip",
    "reward_sum",
    "row_filter",
]


class TokenLoss(Protocol):
    """(logp_BxT, batch) -> (loss_BxT, stats): the per-token loss of one (micro)batch."""

    def __call__(self, logp_BxT: jax.Array, batch: dict, /) -> tuple[jax.Array, dict]: ...


class TokenWrapper(Protocol):
    """TokenLoss -> TokenLoss: a correction (TIS / MIS) or a mask around a token loss."""

    def __call__(self, token_loss: TokenLoss, /) -> TokenLoss: ...


class LossPart(NamedTuple):
    """A piece of a composition; each field is where it acts (empty: nowhere). In `compose`, in order:

    rows          RowKeep: rows dropped in prepare (`prepare.drop_rows`), before any other prepare part
    prepare       Prepare: batch-level parts after the row filters (e.g. a batch token mask)
    shapers       Shaper: reward bonuses added to the combined reward before it is normalised
    corrections   TokenWrapper around the policy term (ratio -> objective), before the regularisers
    regularizers  Regularizer: per-token terms added to the loss (KL penalty, entropy bonus)
    masks         TokenWrapper around the whole token loss, regularisers included (keep masks)
    needs_old_logp / needs_ref: what the part reads (old log-probs and entropies / ref_logp_BxT)
    needs_critic: the part reads the critic's old_values_BxT (GAE): the run needs a value model
    """

    rows: tuple = ()
    prepare: tuple = ()
    shapers: tuple = ()
    corrections: tuple = ()
    regularizers: tuple = ()
    masks: tuple = ()
    needs_old_logp: bool = False
    needs_ref: bool = False
    needs_critic: bool = False


class _Labelled(functools.partial):
    """A `functools.partial` that carries a readable part label."""

    part: str


def named(label: str, fn: Callable) -> Callable:
    """`fn` with a readable part label (for `Loss.parts`), without mutating `fn` itself."""
    wrapped = _Labelled(fn)
    wrapped.part = label
    return wrapped


def label(fn: Callable) -> str:
    """The readable label of a part: its `part` attribute, else its name."""
    return getattr(fn, "part", None) or getattr(fn, "__name__", None) or type(fn).__name__


def row_filter(keep_fn: RowKeep) -> LossPart:
    """A part that drops the rows where keep_fn(batch, group_size) is 0 (label it with `named`)."""
    return LossPart(rows=(keep_fn,))


# ---------------------------------------------------------------------------------------------
# The labelled blocks most presets share (GRPO's reward sum, group std and clip).


def reward_sum(reward_weights: Sequence[float] | None = None) -> RewardCombine:
    """r_i = sum_k w_k r_ik (`advantages.reward_sum`), labelled with its weights."""
    tag = "reward_sum" if reward_weights is None else f"reward_sum{tuple(reward_weights)}"
    return named(tag, adv_lib.reward_sum(reward_weights))


def group_mean_std(adv_eps: float = 1e-6, std_ddof: int = 1) -> Normaliser:
    """A_i = (r_i - mean_G r) / (std_G r + adv_eps) (`advantages.group_mean_std`), labelled."""
    return named(f"group_mean_std(eps={adv_eps:g}, ddof={std_ddof})", adv_lib.group_mean_std(adv_eps, std_ddof))


def ppo_clip(eps_low: float = 0.2, eps_high: float | None = None) -> Objective:
    """The PPO clip (`objectives.ppo_clip`), eps_high = eps_low when None, labelled with both bounds."""
    eps_high = eps_low if eps_high is None else eps_high
    return named(f"ppo_clip({eps_low:g}, {eps_high:g})", objectives.ppo_clip(eps_low, eps_high))


def grpo_advantages(reward_weights: Sequence[float] | None, adv_eps: float, std_ddof: int) -> dict:
    """GRPO's advantage step as `compose` keywords: reward_sum -> group_mean_std."""
    return dict(reward_combine=reward_sum(reward_weights), normaliser=group_mean_std(adv_eps, std_ddof))
