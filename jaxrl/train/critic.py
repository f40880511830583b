"""The value model of a PPO run: its state, its optimizer, its layout and what the update step does with it.

    state.critic = init_critic(policy_params, model_cfg, cfg.critic, optimizer)    # CriticState
    critic = make_critic_update(model_cfg, cfg.critic, optimizer, microbatches=..)  # given to make_update_step

The critic is a copy of the (warm-started) policy's decoder (`params["trunk"]`) with a zero scalar head
(`params["head"]`, jaxrl.models.value), so its first values are 0. `critic.share_trunk`: no copy; the
head reads the policy's hidden states and the value loss's gradient with respect to the policy's
weights, times `critic.trunk_grad_scale`, is added to the policy's gradient. Without it no gradient of
the value loss reaches the policy: the critic's gradient is taken with respect to its own params only.
It has its own AdamW state (`critic_optimizer`), saved in every checkpoint with the policy's.

In the update (`steps.make_update_step(..., critic=...)`): `old_values` on the whole batch before the
loss's prepare (old_values_BxT, like old_logp_BxT); `targets` after it (returns_BxT: the GAE returns
the loss wrote, else the row's summed reward at every live token; and the once-per-batch metrics);
`step` once per optimizer step, beside the policy's, on the same mini-batch and microbatches.
docs/ppo.md describes the design; docs/metrics.md the critic/* and advantages/* metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxrl.config import ConfigError, ModelConfig, OptimConfig
from jaxrl.config.critic import CriticConfig
from jaxrl.losses.aggregation import empty_stat_partials, merge_stat_partials, stat_partials
from jaxrl.losses.gae import explained_variance, value_loss_terms
from jaxrl.models.parallel import Parallel
from jaxrl.models.value import init_value_head, token_values
from jaxrl.train.state import make_optimizer
from jaxrl.train.steps import merge_microbatches, split_microbatches

# The batch keys the critic reads (a microbatch of only these is what its scans carry).
_READS = ("prompt_tokens_BxP", "prompt_mask_BxP", "tokens_BxT", "completion_mask_BxT")
_TARGETS = ("old_values_BxT", "returns_BxT")


class CriticState(NamedTuple):
    params: Any  # {"head": {"w_D", "b"}, "trunk": decoder params}; no "trunk" with critic.share_trunk
    opt_state: Any


class CriticUpdate(NamedTuple):
    """What `make_update_step` calls; see the module docstring."""

    old_values: Callable  # (critic params, policy params, batch) -> old_values_BxT
    targets: Callable  # prepared batch -> (batch with returns_BxT, metrics)
    step: Callable  # (CriticState, policy params, minibatch) -> (CriticState, policy grads or None, partials)


def critic_optimizer(cc: CriticConfig, total_updates: int) -> optax.GradientTransformation:
    """AdamW with the critic's own learning rate (constant after `warmup_steps`) and gradient clip."""
    optim = OptimConfig(
        learning_rate=cc.learning_rate,
        warmup_steps=cc.warmup_steps,
        end_lr_ratio=1.0,
        weight_decay=cc.weight_decay,
        b1=cc.b1,
        b2=cc.b2,
        grad_clip=cc.grad_clip,
    )
    return make_optimizer(optim, total_updates)


def init_critic(policy_params: Any, model_cfg: ModelConfig, cc: CriticConfig, optimizer) -> CriticState:
    """The critic at the start: a copy of `policy_params` as its trunk (none with share_trunk) and a zero head."""
    params: dict = {"head": init_value_head(model_cfg)}
    if not cc.share_trunk:
        params["trunk"] = jax.tree.map(jnp.copy, policy_params)
    return CriticState(params, optimizer.init(params))


def critic_shardings(optimizer, abstract: CriticState, param_sh: Any, rep: Any) -> CriticState:
    """The trunk (and its moments) laid out like the policy's params, the head and scalars replicated."""
    params_sh: dict = {"head": jax.tree.map(lambda _: rep, abstract.params["head"])}
    if "trunk" in abstract.params:
        params_sh["trunk"] = param_sh
    opt_sh = optax.tree_map_params(
        optimizer, lambda _, sh: sh, abstract.opt_state, params_sh, transform_non_params=lambda _: rep
    )
    return CriticState(params_sh, opt_sh)


def check_critic(cfg, loss, model_cfg: ModelConfig | None = None) -> None:
    """ConfigError naming the field when the run's critic and loss do not fit: a loss that reads values
    (`Loss.needs_critic`, the `ppo` preset) without critic.enabled, or a critic on a LoRA or MoE model."""
    cc = cfg.critic
    if getattr(loss, "needs_critic", False) and not cc.enabled:
        raise ConfigError(
            f"critic.enabled: got False, but loss.preset={cfg.loss.preset!r} needs a value model "
            "(GAE reads the critic's values); set critic.enabled=true"
        )
    if not cc.enabled:
        return
    if cfg.model.lora.enabled:
        raise ConfigError(
            f"model.lora.rank: got {cfg.model.lora.rank}, but a critic (critic.enabled) needs full fine-tuning (rank 0)"
        )
    if model_cfg is not None and model_cfg.n_experts:
        raise ConfigError(
            f"model.n_experts: got {model_cfg.n_experts}, but the value head supports dense models only "
            "(critic.enabled=true)"
        )


def _select(batch: dict, keys: tuple) -> dict:
    return {k: batch[k] for k in keys}


def make_critic_update(
    model_cfg: ModelConfig,
    cc: CriticConfig,
    optimizer: optax.GradientTransformation,
    *,
    microbatches: int,
    remat: str = "none",
    parallel: Parallel | None = None,
) -> CriticUpdate:
    """The critic's three stages for `make_update_step` (module docstring), each microbatched like the
    policy's forward (`microbatches` per optimizer step)."""
    share = cc.share_trunk

    def values_of(critic_params, policy_params, mb):
        trunk = policy_params if share else critic_params["trunk"]
        return token_values(
            trunk,
            critic_params["head"],
            model_cfg,
            mb["prompt_tokens_BxP"],
            mb["prompt_mask_BxP"],
            mb["tokens_BxT"],
            remat,
            parallel,
        )

    def old_values(critic_params, policy_params, batch):
        mbs = split_microbatches(_select(batch, _READS), microbatches, parallel)
        _, out = lax.scan(lambda c, mb: (c, values_of(critic_params, policy_params, mb)), None, mbs)
        values_BxT = merge_microbatches(out)
        return lax.stop_gradient(jnp.where(batch["completion_mask_BxT"] > 0, values_BxT, 0.0))

    def targets(batch):
        batch = dict(batch)
        mask_BxT = batch["completion_mask_BxT"]
        live_BxT = mask_BxT > 0
        if "returns_BxT" not in batch:  # a loss without GAE: the row's summed reward (gamma = 1, no baseline)
            reward_B = jnp.sum(batch["rewards_BxK"].astype(jnp.float32), axis=1)
            batch["returns_BxT"] = jnp.where(live_BxT, reward_B[:, None], 0.0)
        adv_BxT = batch.get("advantages_BxT")
        if adv_BxT is None:
            adv_BxT = jnp.broadcast_to(batch["advantages_B"][:, None], mask_BxT.shape)
        n = jnp.maximum(jnp.sum(live_BxT.astype(jnp.float32)), 1.0)
        adv_mean = jnp.sum(jnp.where(live_BxT, adv_BxT, 0.0)) / n
        some = jnp.any(live_BxT)
        metrics = {
            "critic/explained_variance": explained_variance(batch["old_values_BxT"], batch["returns_BxT"], mask_BxT),
            "critic/values_mean": jnp.sum(jnp.where(live_BxT, batch["old_values_BxT"], 0.0)) / n,
            "critic/returns_mean": jnp.sum(jnp.where(live_BxT, batch["returns_BxT"], 0.0)) / n,
            "advantages/mean": adv_mean,
            "advantages/std": jnp.sqrt(jnp.sum(jnp.where(live_BxT, jnp.square(adv_BxT - adv_mean), 0.0)) / n),
            "advantages/min": jnp.where(some, jnp.min(jnp.where(live_BxT, adv_BxT, jnp.inf)), 0.0),
            "advantages/max": jnp.where(some, jnp.max(jnp.where(live_BxT, adv_BxT, -jnp.inf)), 0.0),
        }
        return batch, metrics

    def microbatch_loss(critic_params, policy_params, mb, n_live):
        mask_BxT = mb["completion_mask_BxT"]
        values_BxT = values_of(critic_params, policy_params, mb)
        loss_BxT, clipped_BxT = value_loss_terms(
            values_BxT, mb["old_values_BxT"], mb["returns_BxT"], mask_BxT, cc.value_clip
        )
        stats = {"critic/value_loss": loss_BxT, "critic/value_clip_frac": clipped_BxT}  # per token (B x T)
        return jnp.sum(loss_BxT) / n_live, stat_partials(stats, mask_BxT)

    grad_one = jax.value_and_grad(microbatch_loss, argnums=(0, 1) if share else 0, has_aux=True)

    def gradients(critic_params, policy_params, minibatch):
        """(critic grads, policy grads or None, partials) of the minibatch's masked-mean value loss."""
        mb_all = _select(minibatch, _READS + _TARGETS)
        n_live = jnp.maximum(jnp.sum((mb_all["completion_mask_BxT"] > 0).astype(jnp.float32)), 1.0)
        mbs = split_microbatches(mb_all, microbatches, parallel)
        first = jax.tree.map(lambda x: x[0], mbs)
        like = jax.eval_shape(
            lambda c, p, mb: microbatch_loss(c, p, mb, n_live)[1], critic_params, policy_params, first
        )
        wrt = (critic_params, policy_params) if share else critic_params

        def accumulate(carry, mb):
            g_acc, p_acc = carry
            (_, partials), grads = grad_one(critic_params, policy_params, mb, n_live)
            return (jax.tree.map(jnp.add, g_acc, grads), merge_stat_partials(p_acc, partials)), None

        init = (jax.tree.map(jnp.zeros_like, wrt), empty_stat_partials(like))
        (grads, partials), _ = lax.scan(accumulate, init, mbs)
        return (grads[0], grads[1], partials) if share else (grads, None, partials)

    def step(state: CriticState, policy_params, minibatch):
        grads, policy_grads, partials = gradients(state.params, policy_params, minibatch)
        partials["critic/grad_norm"] = stat_partials({"g": optax.tree.norm(grads)}, minibatch["completion_mask_BxT"])[
            "g"
        ]
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        if policy_grads is not None:
            policy_grads = jax.tree.map(lambda g: cc.trunk_grad_scale * g, policy_grads)
        return CriticState(optax.apply_updates(state.params, updates), opt_state), policy_grads, partials

    return CriticUpdate(old_values, targets, step)
