"""What a run compiles, shared by the loop (`loop.build_run`) and `jaxrl plan`: the update step and
its optimizer, the train state and its layout, and the params the rollout reads once per policy version.

    update_for = update_builder(cfg, model_cfg, loss, optimizer, parallel, lora)
    step = jit_update(update_for, Fit(microbatches, remat, logits_chunk), (state_sh, batch_sh), rep)
    policy = policy_for(lora, state_sh, param_sh, rollout_layout(cfg, model_cfg, mesh), model_cfg)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.config import Config
from jaxrl.data.registry import get_task
from jaxrl.losses import Loss
from jaxrl.models.packing import PackSpec
from jaxrl.models.transformer import rollout_params
from jaxrl.policy.resolve import shardings_for
from jaxrl.sharding import replicated, resharder, rollout_mesh
from jaxrl.train import lora_state
from jaxrl.train.critic import check_critic, critic_optimizer, critic_shardings, init_critic, make_critic_update
from jaxrl.train.memory_budget import Fit, is_stand_in, memory_rungs, resolve_budget_gib
from jaxrl.train.state import TrainState, init_state, make_optimizer, state_shardings
from jaxrl.train.steps import make_logp_fn, make_update_step


def rollout_layout(cfg: Config, model_cfg, mesh) -> tuple | None:
    """(mesh, preset, param_sh, rep) of the rollout's own layout over training's `mesh`'s devices when
    rollout.mesh sets one (`sharding.rollout_mesh`), else None: the rollout decodes under training's."""
    own = rollout_mesh(cfg, mesh)
    if own is None:
        return None
    r_mesh, r_preset = own
    return r_mesh, r_preset, shardings_for(model_cfg, r_mesh, r_preset), replicated(r_mesh)


def policy_for(lora, state_sh: TrainState, param_sh, own: tuple | None, model_cfg=None) -> Callable:
    """state -> the params every rollout and evaluation forward takes, once per policy version: under
    training's layout `state.params` (LoRA: merged, laid out by `param_sh`); with a rollout layout of
    its own (`own`, from `rollout_layout`) resharded into it (LoRA: merged into it). A `model_cfg`
    whose dtype is not float32 gets its matrices cast to that dtype in the same program
    (`transformer.rollout_params`); float32 (or no model_cfg): the params as they are."""
    cast = None
    if model_cfg is not None and jnp.dtype(model_cfg.dtype) != jnp.float32:
        cast = functools.partial(rollout_params, cfg=model_cfg)
    if own is None or lora is not None:
        return lora_state.policy_fn(lora, state_sh, param_sh if own is None else own[2], cast)
    reshard = resharder(own[2]) if cast is None else jax.jit(cast, out_shardings=own[2])
    return lambda state: reshard(state.params)


def run_optimizer(cfg: Config):
    """The run's optimizer; its schedule counts optimizer updates: steps x PPO epochs x mini-batches."""
    tc = cfg.train
    return make_optimizer(cfg.optim, tc.steps * tc.ppo_epochs * tc.minibatches)


def update_builder(cfg: Config, model_cfg, loss: Loss, optimizer, parallel, lora) -> Callable:
    """update_for(fit) -> the pure update step (`make_update_step`) a run with `cfg` jits at `fit`
    (`memory_budget.Fit`: microbatches, remat, logits_chunk, as configured or chosen from the memory
    budget): the logp function of the resolved `model_cfg` with the run's one `parallel`
    (`sharding.parallel_for`, the rollout's too, not an ambient mesh); the advantages (and a reference
    forward when the loss needs one) are computed inside the update. `jaxrl plan` compiles the same step."""
    tc, rc = cfg.train, cfg.rollout

    def update_for(fit: Fit):
        logp_fn = make_logp_fn(
            model_cfg,
            rc.temperature,
            routing_replay=tc.routing_replay,
            prompt_groups=prompt_groups(cfg),
            logits_chunk=fit.logits_chunk,
            remat=fit.remat,
            parallel=parallel,
            packing=None if tc.packing == "off" else PackSpec(tc.packing, tc.pack_len, tc.pack_budget, tc.pack_sizes),
        )
        return make_update_step(
            logp_fn,
            loss,
            optimizer,
            ppo_epochs=tc.ppo_epochs,
            minibatches=tc.minibatches,
            microbatches=fit.microbatches,
            max_new_tokens=rc.max_new_tokens,
            group_size=rc.group_size,
            use_ref=loss.needs_ref,
            merge=lora_state.merge_fn(lora),
            parallel=parallel,
            critic=critic_for(cfg, model_cfg, fit, parallel),
        )

    return update_for


def critic_optimizer_of(cfg: Config):
    """The critic's optimizer, its schedule counting the same optimizer updates as the policy's."""
    tc = cfg.train
    return critic_optimizer(cfg.critic, tc.steps * tc.ppo_epochs * tc.minibatches)


def critic_for(cfg: Config, model_cfg, fit: Fit, parallel):
    """The update's critic stages (`critic.make_critic_update`) when critic.enabled, else None."""
    if not cfg.critic.enabled:
        return None
    return make_critic_update(
        model_cfg,
        cfg.critic,
        critic_optimizer_of(cfg),
        microbatches=fit.microbatches,
        remat=fit.remat,
        parallel=parallel,
    )


def critic_layout(cfg: Config, model_cfg, params, param_sh, rep) -> tuple[Callable, Any]:
    """(make(params) -> the initial critic state (`critic.init_critic`: a copy of `params` as its trunk
    unless critic.share_trunk, a zero head, its own optimizer state), its shardings: the trunk laid out
    like the params). `params` may be abstract."""
    optimizer = critic_optimizer_of(cfg)

    def make(params):
        return init_critic(params, model_cfg, cfg.critic, optimizer)

    return make, critic_shardings(optimizer, jax.eval_shape(make, params), param_sh, rep)


def with_critic(cfg: Config, model_cfg, state_and_sh: tuple, base_params, param_sh, rep) -> tuple:
    """(state, its shardings) with the critic's state (`critic_layout`) created from `base_params` when
    critic.enabled (a ConfigError naming the field for a model it does not support), else as given."""
    if not cfg.critic.enabled:
        return state_and_sh
    check_critic(cfg, None, model_cfg)
    state, state_sh = state_and_sh
    make, critic_sh = critic_layout(cfg, model_cfg, base_params, param_sh, rep)
    critic = jax.jit(make, in_shardings=(param_sh,), out_shardings=critic_sh)(base_params)
    return state._replace(critic=critic), state_sh._replace(critic=critic_sh)


def jit_update(update_for: Callable, fit: Fit, shardings: tuple, rep) -> Callable:
    """The jitted update at `fit`: shardings = (the state's, the batch's {name: sharding}); metrics
    replicated, the state donated."""
    return jax.jit(update_for(fit), in_shardings=shardings, out_shardings=(shardings[0], rep), donate_argnums=0)


def update_memory(tc, device) -> tuple[Fit | None, dict]:
    """How the run's update memory is settled: (the Fit when train.* fixes it, None) or (None, the
    keyword arguments of `memory_budget.auto_jit`: budget_gib, source, microbatches, rungs) when
    train.microbatches=0 or train.remat="auto" with a budget to measure against (`memory_budget`)."""
    budget, source = resolve_budget_gib(tc.memory_budget_gib, device)
    rungs = memory_rungs(tc.remat, tc.logits_chunk, is_stand_in(tc.memory_budget_gib, device))
    if tc.microbatches and len(rungs) == 1:
        return Fit(tc.microbatches, *rungs[0]), {}
    return None, {"budget_gib": budget, "source": source, "microbatches": tc.microbatches, "rungs": rungs}


def prompt_groups(cfg: Config) -> int:
    """G when every update batch is contiguous groups of G rows with one prompt each, so the update may
    forward each prompt once (train.share_prefix): the static sampler's batches (scoring.score_groups
    repeats each prompt G times). 0 for the slot engine (groups by group_id_B, of unequal sizes under
    VIGOR, picked by dynamic sampling) and agent episodes (each row its own transcript)."""
    static = not cfg.rollout.engine.enabled and not get_task(cfg.data.task).episodic
    return cfg.rollout.group_size if cfg.train.share_prefix and static else 0


def state_maker(optimizer, seed: int) -> Callable:
    """make_state(params[, ref_params]) -> the initial TrainState (a reference copy when given one)."""

    def make_state(params, *ref_params):
        return init_state(params, optimizer, jax.random.key(seed), ref_params=ref_params[0] if ref_params else None)

    return make_state


def full_state_shardings(base_params, optimizer, seed: int, param_sh, rep, *, with_ref: bool) -> TrainState:
    """The shardings of a full fine-tuning state over `base_params` (concrete or abstract): params, the
    optimizer's moments and the reference copy laid out like the params, scalars replicated."""
    args = (base_params,) * (2 if with_ref else 1)
    return state_shardings(optimizer, jax.eval_shape(state_maker(optimizer, seed), *args), param_sh, rep)
