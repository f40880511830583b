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
    critic: Any | None = None  # the value model's params and optimizer state (jaxrl.train.critic.CriticState)
    # when critic.enabled; None otherwise, so a run without one keeps the same state and checkpoints


class SavedState(NamedTuple):
    """What a checkpoint holds of a `TrainState`: all but the LoRA base, which a resume rebuilds from its
    source (jaxrl.train.lora_state), and the critic, which only `SavedCriticState` has."""

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    ref_params: Any | None = None


class SavedCriticState(NamedTuple):
    """A `SavedState` with the critic's params and optimizer state (critic.enabled): a run without a
    critic saves the five-field tree it always did, so its checkpoints and older ones stay the same."""

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    ref_params: Any | None
    critic: Any


def saved_part(state: TrainState) -> SavedState | SavedCriticState:
    fields = (state.step, state.params, state.opt_state, state.rng, state.ref_params)
    return SavedState(*fields) if state.critic is None else SavedCriticState(*fields, state.critic)


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
    """AdamW with gradient-norm clipping; the schedule counts optimizer updates, not RL steps. With
    `optim.state_dtype=bfloat16` both moments are stored in bfloat16 (`moments_stored_as`); the state's
    tree is the same as float32's, only its moment leaves' dtype differs."""
    schedule = learning_rate_schedule(cfg, total_steps)
    if cfg.state_dtype == "float32":
        adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay)
    else:  # optax.adamw's own chain, its scale_by_adam storing the moments in state_dtype
        adamw = optax.chain(
            moments_stored_as(jnp.dtype(cfg.state_dtype), optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2)),
            optax.add_decayed_weights(cfg.weight_decay),
            optax.scale_by_learning_rate(schedule),
        )
    optimizer = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)
    return optimizer if cfg.state_memory == "device" else state_on_host(optimizer)


def state_on_host(optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
    """`optimizer` for a state kept in host memory (`opt_state_in`): each update brings the state
    into device memory, updates it there and returns the new state to host memory. Inside a jitted
    update these are XLA transfers (host -> device -> host); the numbers are the same."""

    def update(updates, state, params=None):
        updates, state = optimizer.update(updates, jax.device_put(state, jax.memory.Space.Device), params)
        return updates, jax.device_put(state, jax.memory.Space.Host)

    return optax.GradientTransformation(optimizer.init, update)


def opt_state_in(shardings: TrainState, memory: str) -> TrainState:
    """`shardings` (a state's) with every optimizer-state leaf in memory kind `memory` (optim.state_memory:
    "device" changes nothing, "pinned_host" is host RAM). The update's jit takes and returns the state by
    these shardings (its optimizer then being `state_on_host`'s), and checkpoints restore into them."""
    if memory == "device":
        return shardings
    return shardings._replace(opt_state=jax.tree.map(lambda sh: sh.with_memory_kind(memory), shardings.opt_state))


def moments_stored_as(dtype: Any, adam: optax.GradientTransformation) -> optax.GradientTransformation:
    """`adam` (optax.scale_by_adam) keeping `mu` and `nu` in `dtype` between updates. Each update widens
    them to float32, runs Adam there (the update it returns uses the unrounded moments) and rounds the
    new moments to `dtype` once, to nearest. Both moments, not only mu (optax's `mu_dtype`): that halves
    the state. A bfloat16 nu keeps float32's exponent range, so tiny squared gradients do not underflow;
    what it loses is increments under its half-step, which OptimConfig.validate bounds through b2."""

    def narrow(state):
        return state._replace(mu=optax.tree.cast(state.mu, dtype), nu=optax.tree.cast(state.nu, dtype))

    def widen(state):
        return state._replace(mu=optax.tree.cast(state.mu, jnp.float32), nu=optax.tree.cast(state.nu, jnp.float32))

    def update(updates, state, params=None):
        updates, new_state = adam.update(updates, widen(state), params)
        return updates, narrow(new_state)

    return optax.GradientTransformation(lambda params: narrow(adam.init(params)), update)


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
