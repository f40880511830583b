"""Loss presets: named compositions of the parts in this package.

A `Loss` is three functions the training step calls:

    advantages(rewards_BxK, group_size) -> adv_B                (group_size static)
    weights(completion_mask_BxT, max_new_tokens) -> weights_BxT (on the WHOLE update batch)
    token_loss(logp_BxT, batch) -> (loss_BxT, stats)            (per microbatch)

and the update minimises sum over microbatches of `weighted_sum(weights_BxT, loss_BxT)`.

`batch` keys read by token_loss: completion_mask_BxT, old_logp_BxT, advantages_B (or
advantages_BxT), ref_logp_BxT (only when a KL term is active), entropy_BxT (only for an entropy
bonus). `loss_BxT` is exactly 0 on masked tokens. `stats` holds per-token arrays (0 on masked
tokens) for `reduce_stats` / `stat_partials`: ratio_BxT, clipped_low_BxT, clipped_high_BxT and,
when kl_beta > 0, kl_BxT.

Hyperparameters are static Python numbers closed over at build time; a change recompiles.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

from jaxrl.config import ConfigError
from jaxrl.losses import advantages as adv_lib
from jaxrl.losses import aggregation, objectives, ratios, regularizers


class Loss(NamedTuple):
    name: str
    advantages: Callable  # (rewards_BxK, group_size: int) -> adv_B
    weights: Callable  # (completion_mask_BxT, max_new_tokens: int) -> weights_BxT
    token_loss: Callable  # (logp_BxT, batch: dict) -> (loss_BxT, stats)


def _advantages_BxT(batch: dict, shape: tuple) -> jax.Array:
    if "advantages_BxT" in batch:
        return jax.lax.stop_gradient(batch["advantages_BxT"])
    return jnp.broadcast_to(jax.lax.stop_gradient(batch["advantages_B"])[:, None], shape)


def policy_token_loss(ratio: ratios.RatioFn, objective: objectives.Objective,
                      regularizer_parts: Sequence[regularizers.Regularizer] = ()) -> Callable:
    """Compose ratio level -> objective (+ regularisers) into `token_loss(logp_BxT, batch)`."""
    regularizer_parts = tuple(regularizer_parts)

    def token_loss(logp_BxT: jax.Array, batch: dict):
        mask_BxT = batch["completion_mask_BxT"]
        log_ratio_BxT = ratio(logp_BxT, batch["old_logp_BxT"], mask_BxT)
        loss_BxT, stats = objective(log_ratio_BxT, _advantages_BxT(batch, logp_BxT.shape), mask_BxT)
        stats = dict(stats)
        for part in regularizer_parts:
            extra_BxT, part_stats = part(logp_BxT, batch)
            loss_BxT = loss_BxT + extra_BxT
            stats.update(part_stats)
        # Every part already masks; this final select is the contract guarantee for callers.
        return jnp.where(mask_BxT > 0, loss_BxT, 0.0), stats

    return token_loss


def grpo(eps_low: float = 0.2, eps_high: Optional[float] = None, kl_beta: float = 0.0,
         adv_eps: float = 1e-6, reward_weights: Optional[Sequence[float]] = None,
         kl_estimator: regularizers.KLEstimator = regularizers.kl_k3) -> Loss:
    """GRPO, Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
    Language Models" (arXiv:2402.03300).

        r_i   = sum_k w_k r_ik                                           (reward_sum)
        A_i   = (r_i - mean_G r) / (std_G r + adv_eps),  population std  (group_mean_std)
        rho_t = exp(logp_theta(y_t) - logp_old(y_t))                     (token_log_ratio)
        J     = 1/B sum_i 1/|y_i| sum_t [ min(rho_t A_i, clip(rho_t, 1-eps_low, 1+eps_high) A_i)
                                          - kl_beta * KL_t ]             (ppo_clip, kl_penalty,
                                                                          seq_mean_token_mean)
    KL_t defaults to the k3 estimator exp(ref - logp) - (ref - logp) - 1 the paper uses. The
    paper's clip is symmetric (eps_high = eps_low, the default); B counts live rows.
    """
    return Loss(
        name="grpo",
        advantages=adv_lib.estimator(adv_lib.reward_sum(reward_weights), adv_lib.group_mean_std(adv_eps)),
        weights=aggregation.seq_mean_token_mean,
        token_loss=policy_token_loss(ratios.token_log_ratio, objectives.ppo_clip(eps_low, eps_high),
                                     [regularizers.kl_penalty(kl_beta, kl_estimator)]),
    )


def dr_grpo(eps_low: float = 0.2, eps_high: Optional[float] = None, kl_beta: float = 0.0,
            reward_weights: Optional[Sequence[float]] = None,
            kl_estimator: regularizers.KLEstimator = regularizers.kl_k3) -> Loss:
    """Dr.GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
    (arXiv:2503.20783): GRPO with its two biases removed.

        A_i = r_i - mean_G r                     (no std: no per-question difficulty weighting)
        J   = 1/(B * L_max) sum_i sum_t min(rho_t A_i, clip(rho_t, 1-eps_low, 1+eps_high) A_i)
                                                 (no 1/|y_i|: no length bias; L_max = max_new_tokens)
    minus kl_beta * KL_t inside the sum as in GRPO (the paper trains with kl_beta = 0).
    """
    return Loss(
        name="dr_grpo",
        advantages=adv_lib.estimator(adv_lib.reward_sum(reward_weights), adv_lib.group_mean),
        weights=aggregation.seq_mean_token_sum_norm,
        token_loss=policy_token_loss(ratios.token_log_ratio, objectives.ppo_clip(eps_low, eps_high),
                                     [regularizers.kl_penalty(kl_beta, kl_estimator)]),
    )


PRESETS: dict[str, Callable[..., Loss]] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
}


def make_loss(loss_cfg) -> Loss:
    """Build the preset named by `loss_cfg.preset` (a `jaxrl.config.LossConfig`).

    Each LossConfig field that names a parameter of the preset's factory is passed to it; fields a
    preset has no use for (e.g. adv_eps for dr_grpo) are ignored.
    """
    if loss_cfg.preset not in PRESETS:
        allowed = ", ".join(repr(n) for n in sorted(PRESETS))
        raise ConfigError(f"loss.preset: got {loss_cfg.preset!r}, expected one of {allowed}")
    factory = PRESETS[loss_cfg.preset]
    params = inspect.signature(factory).parameters
    kwargs = {f.name: getattr(loss_cfg, f.name) for f in dataclasses.fields(loss_cfg)
              if f.name != "preset" and f.name in params}
    return factory(**kwargs)
