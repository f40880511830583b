"""The loss algebra: advantage estimator x ratio level x objective x aggregation + regularisers
+ corrections, with batch-level `prepare` parts.

See `compose.py` for the `Loss` contract used by the training step and `compose`, `parts.py` for the
parts' types and the shared labelled blocks (exported here: `reward_sum`, `group_mean_std`,
`ppo_clip` print their parameters in `Loss.parts`), `options.py` for the options every preset takes
(as parts, `option_parts`), `masks.py` for batch-level token masks, `evaluate.py` for a loss
evaluated on a batch exactly as the update step does (`evaluate_loss`), and `presets.py` for the
registry of named compositions (`register_preset`: train with a loss of your own). The stats
reduction the update and `evaluate_loss` share is in `aggregation.py`. This package never imports
`jaxrl.models`.
"""

from jaxrl.losses.advantages import estimator, group_mean
from jaxrl.losses.aggregation import (
    constant_norm,
    seq_mean_token_mean,
    seq_mean_token_sum,
    seq_mean_token_sum_norm,
    token_mean,
    weighted_sum,
)
from jaxrl.losses.compose import Loss, check_loss, compose, policy_token_loss, with_regularizers
from jaxrl.losses.corrections import mis, tis
from jaxrl.losses.evaluate import LossEvaluation, batch_advantages, evaluate_loss, prepare_batch, weighted_loss
from jaxrl.losses.masks import apply_keep_mask
from jaxrl.losses.options import EXTRAS, option_parts
from jaxrl.losses.parts import LossPart, group_mean_std, label, named, ppo_clip, reward_sum, row_filter
from jaxrl.losses.prepare import chain, no_prepare
from jaxrl.losses.presets import PRESETS, Preset, check_rollout, make_loss, register_preset
from jaxrl.losses.presets_grpo import dr_grpo, grpo
from jaxrl.losses.ratios import token_log_ratio
from jaxrl.losses.regularizers import entropy_bonus, kl_k1, kl_k2, kl_k3, kl_penalty

__all__ = [
    "Loss",
    "PRESETS",
    "Preset",
    "register_preset",
    "make_loss",
    "check_loss",
    "check_rollout",
    "grpo",
    "dr_grpo",
    "compose",
    "named",
    "label",
    "policy_token_loss",
    "with_regularizers",
    "EXTRAS",
    "option_parts",
    "LossPart",
    "row_filter",
    "apply_keep_mask",
    "evaluate_loss",
    "LossEvaluation",
    "prepare_batch",
    "batch_advantages",
    "weighted_loss",
    "estimator",
    "reward_sum",
    "group_mean",
    "group_mean_std",
    "token_log_ratio",
    "ppo_clip",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_penalty",
    "entropy_bonus",
    "tis",
    "mis",
    "chain",
    "no_prepare",
    "seq_mean_token_mean",
    "token_mean",
    "seq_mean_token_sum_norm",
    "seq_mean_token_sum",
    "constant_norm",
    "weighted_sum",
]
