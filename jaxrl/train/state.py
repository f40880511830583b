"""Training state as one explicit pytree, and the optimizer that updates it."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxrl.config import OptimConfig


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: number of updates applied
    params: Any
    opt_state: Any
    rng: jax.Array  # carried key: every random draw of the run is split from it
    ref_params: Any | None = None  # frozen reference policy, only when `Loss.needs_ref` (a KL term);
    # None otherwise, so neither the state nor its checkpoints hold a second copy of the weights
    base: Any | None = None  # LoRA (model.lora.rank > 0): the frozen base weights in their storage dtype,
    # `params` then being the adapters (jaxrl.train.lora_state); None for full fine-tuning. Never saved.


class SavedState(NamedTuple):
    """What a checkpoint holds of a `TrainState`: all but the LoRA base, which a resume rebuilds from its
    source (jaxrl.train.lora_state)."""

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    ref_params: Any | None = None


def saved_part(state: TrainState) -> SavedState:
    return SavedState(state.step, state.params, state.opt_state, state.rng, state.ref_params)


def learning_rate_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warm-up to `learning_rate`, then cosine decay to `end_lr_ratio * learning_rate`."""
    decay = max(cfg.decay_steps or total_steps, cfg.warmup_steps + 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if cfg.warmup_steps else cfg.learning_rate,
        peak_value=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps,
        decay_steps=decay,
        end_value=cfg.learning_rate * cfg.end_lr_ratio,
    )


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """AdamW with gradient-norm clipping; the schedule counts optimizer updates, not RL steps."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(learning_rate_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay),
    )


def init_state(
    params: Any,
    optimizer: optax.GradientTransformation,
    rng: jax.Array,
    ref_params: Any | None = None,
    base: Any | None = None,
) -> TrainState:
    """`params` are what the optimizer trains: the model's params, or under LoRA the adapters (`base`
    then holds the frozen weights, which the optimizer never sees)."""
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=optimizer.init(params),
        rng=rng,
        ref_params=ref_params,
        base=base,
    )


def state_shardings(
    optimizer: optax.GradientTransformation,
    abstract_state: TrainState,
    param_shardings: Any,
    replicated: Any,
    base_shardings: Any = None,
) -> TrainState:
    """Shardings of the whole state: params and reference params (and the optimizer's per-parameter
    moments, via `optax.tree_map_params`) laid out like the params, scalars (step, RNG, counts)
    replicated, the LoRA base by `base_shardings`. `abstract_state` comes from `jax.eval_shape(init_state, ...)`."""
    opt_sh = optax.tree_map_params(
        optimizer,
        lambda _, sh: sh,
        abstract_state.opt_state,
        param_shardings,
        transform_non_params=lambda _: replicated,
    )
    return TrainState(
        step=replicated,
        params=param_shardings,
        opt_state=opt_sh,
        rng=replicated,
        ref_params=None if abstract_state.ref_params is None else param_shardings,
        base=None if abstract_state.base is None else base_shardings,
    )
