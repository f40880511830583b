"""The loss algebra: advantage estimator x ratio level x objective x aggregation + regularisers.

See `presets.py` for the `Loss` contract used by the training step. This package never imports
`jaxrl.models`.
"""

from jaxrl.losses.advantages import estimator, group_mean, group_mean_std, reward_sum
from jaxrl.losses.aggregation import (
    finalize_stats,
    merge_stat_partials,
    reduce_stats,
    seq_mean_token_mean,
    seq_mean_token_sum_norm,
    stat_partials,
    token_mean,
    weighted_sum,
)
from jaxrl.losses.objectives import ppo_clip
from jaxrl.losses.presets import PRESETS, Loss, dr_grpo, grpo, make_loss, policy_token_loss
from jaxrl.losses.ratios import token_log_ratio
from jaxrl.losses.regularizers import entropy_bonus, kl_k1, kl_k2, kl_k3, kl_penalty

__all__ = [
    "Loss", "PRESETS", "make_loss", "grpo", "dr_grpo", "policy_token_loss",
    "estimator", "reward_sum", "group_mean", "group_mean_std",
    "token_log_ratio",
    "ppo_clip",
    "kl_k1", "kl_k2", "kl_k3", "kl_penalty", "entropy_bonus",
    "seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm", "weighted_sum",
    "stat_partials", "merge_stat_partials", "finalize_stats", "reduce_stats",
]
