"""`jaxrl plan`: what each of a run's programs costs per device, from XLA, before anything runs.

    records = plan(cfg)                       # one dict per program, on the devices JAX sees
    records = plan(cfg, ("update", "engine_chunk"))

Every program is lowered and compiled on abstract inputs (`jax.ShapeDtypeStruct`s placed with the
run's shardings): no weights are loaded, no dataset is read, nothing is executed. The model comes from
the config (`model.hf_path`: its config.json only). The programs are the ones `jaxrl train` builds:

    update        the jitted update (`programs.update_builder`, `programs.jit_update`), on the batch the rollout
                  hands it (the static sampler's fields, or the engine's with group_id_B and stale_BxT)
    rollout       the static sampler (`rollout.sampler.sample`, as `sources.sampler.SamplerSource`
                  jits it; the speculative sampler is not planned)
    engine_chunk  one `decode_chunk` of the slot engine on its split params, the slots' rows split
                  over the batch axes when they divide
    eval          the evaluator's greedy chunk sampler (`train.evaluate.make_chunk_sampler`)
    teacher       with `distill.teacher`: the teacher's forward on the update's batch, once per step
                  (`train.teacher.teacher_scorer`; the architecture from the teacher's config files)

With `rollout.mesh` set, the rollout programs (rollout, engine_chunk, eval) compile under the
rollout's own layout (their record's `mesh` is it) and carry `rollout_copy_mib_per_device`: the
policy copy resharded into that layout once per policy version, held besides training's params.

Each record: per-device FLOPs and bytes accessed (XLA's cost analysis of the partitioned program),
per-device memory in MiB (arguments, temporaries, outputs, aliased), the collectives of the compiled
HLO by kind (static counts in the program text: one inside a loop body counts once), and the layout
(which parameters are split, which replicated and why; how the other inputs are laid out). A
parameter dimension that does not divide over its mesh axis is a ConfigError (`sharding.spec_for`)
before anything compiles, unless `mesh.allow_replicated` names the parameter.
"""

from __future__ import annotations

import functools
import math
import pathlib
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.config import Config, ConfigError
from jaxrl.data.registry import get_task
from jaxrl.data.rewards import REWARD_NAMES
from jaxrl.losses import check_rollout, make_loss
from jaxrl.models.transformer import abstract_params, param_logical_axes, rollout_params
from jaxrl.policy.resolve import checkpoint_config, resolve_policy, shardings_for
from jaxrl.rollout.engine.state import EngineSpec, decode_chunk, init_state, split_params, state_shardings
from jaxrl.rollout.sampler import SamplingParams
from jaxrl.sharding import (
    check_batch_divides,
    layout_of,
    make_mesh,
    named_sharding,
    parallel_for,
    replicated,
    rollout_mesh,
)
from jaxrl.sources.sampler import jit_plain_rollout, prompt_sharding
from jaxrl.train import lora_state
from jaxrl.train import teacher as teacher_lib
from jaxrl.train.critic import check_critic
from jaxrl.train.evaluate import EVAL_CHUNK, make_chunk_sampler, rows_sharding
from jaxrl.train.memory_budget import auto_jit
from jaxrl.train.programs import (
    critic_layout,
    full_state_shardings,
    jit_update,
    run_optimizer,
    state_maker,
    update_builder,
    update_memory,
)
from jaxrl.train.state import opt_state_in

PROGRAMS = ("update", "rollout", "engine_chunk", "eval", "teacher")
COLLECTIVES: tuple[str, ...] = ("all-gather", "all-reduce", "all-to-all", "reduce-scatter", "collective-permute")
_COLLECTIVE_OP = re.compile(r"\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
MIB = 2**20


class _Ids(NamedTuple):
    """The token ids a program's graph depends on (SamplingParams' eos/pad), without a tokenizer file."""

    eos_id: int
    pad_id: int


class _Run(NamedTuple):
    """What every program's plan needs, built once."""

    cfg: Config
    model_cfg: Any
    ids: _Ids
    mesh: Any
    preset: Any
    params: Any  # abstract params placed with their shardings
    param_sh: Any
    rep: Any
    parallel: Any
    layout: dict  # `sharding.layout_of` the params
    preset_name: str  # the mesh.preset (or rollout.mesh.preset) the mesh is of
    rollout: Any = None  # the rollout programs' _Run when rollout.mesh sets a layout of their own, else None
    copy_mib: float = 0.0  # (rollout's own) the resharded policy copy's MiB per device


def default_programs(cfg: Config) -> tuple[str, ...]:
    """The programs a run with `cfg` compiles: its update, its rollout (the static sampler, or the slot
    engine's chunk for the engine and for episodes), its evaluation."""
    engine = cfg.rollout.engine.enabled or get_task(cfg.data.task).episodic
    teacher = ("teacher",) if cfg.distill.teacher else ()
    return ("update", "engine_chunk" if engine else "rollout", "eval", *teacher)


def parse_programs(text: str) -> tuple[str, ...]:
    """`update,rollout` -> ("update", "rollout"); a ConfigError naming --programs otherwise."""
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [n for n in names if n not in PROGRAMS]
    if not names or bad:
        raise ConfigError(f"--programs: got {text!r}, expected a comma-separated subset of {', '.join(PROGRAMS)}")
    return names


def plan(cfg: Config, programs: tuple[str, ...] | None = None) -> list[dict]:
    """One record per program (module docstring), compiled for the devices JAX sees. Config mistakes
    (a batch or parameter dimension that does not divide, a bad loss) are ConfigErrors before any compile."""
    run = _setup(cfg)
    builders: dict[str, Callable[[_Run], tuple[Any, dict]]] = {
        "update": _update,
        "rollout": _rollout,
        "engine_chunk": _engine_chunk,
        "eval": _eval,
        "teacher": _teacher,
    }
    records = []
    for name in programs or default_programs(cfg):
        on = run if name in ("update", "teacher") or run.rollout is None else run.rollout
        compiled, extra = builders[name](on)
        if on is not run:  # the policy resharded into rollout.mesh once per version, besides training's params
            extra = {**extra, "rollout_copy_mib_per_device": on.copy_mib}
        records.append(describe(name, compiled, on, extra))
    return records


def _setup(cfg: Config) -> _Run:
    rc = cfg.rollout
    mesh, preset = make_mesh(cfg.mesh)
    B = rc.prompts_per_step * rc.group_size
    check_batch_divides(mesh, preset, B, "rollout.prompts_per_step*rollout.group_size")
    if cfg.model.hf_path:  # the architecture from config.json; token ids only fix two constants of the graph
        model_cfg, ids = checkpoint_config(cfg.model), _Ids(0, 0)
    else:
        tokenizer, model_cfg = resolve_policy(cfg)
        ids = _Ids(tokenizer.eos_id, tokenizer.pad_id)
    run = _on(cfg, model_cfg, ids, mesh, preset, cfg.mesh.preset)
    own = rollout_mesh(cfg, mesh)  # rollout.mesh: the rollout programs compile under a layout of their own
    if own is None:
        return run
    rollout = _on(cfg, model_cfg, ids, *own, cfg.rollout.mesh.preset)
    return run._replace(rollout=rollout._replace(copy_mib=round(_bytes_per_device(rollout.params) / MIB, 3)))


def _on(cfg: Config, model_cfg, ids: _Ids, mesh, preset, preset_name: str) -> _Run:
    """The plan's _Run on `mesh` under `preset`: the params' shardings (a dimension that does not divide
    is a ConfigError, before any compile), the abstract params placed with them, the layout report."""
    param_sh = shardings_for(model_cfg, mesh, preset)
    layout = layout_of(mesh, preset, param_logical_axes(model_cfg), abstract_params(model_cfg))
    return _Run(
        cfg,
        model_cfg,
        ids,
        mesh,
        preset,
        abstract_params(model_cfg, param_sh),
        param_sh,
        replicated(mesh),
        parallel_for(mesh, preset),
        layout,
        preset_name,
    )


def _bytes_per_device(placed) -> int:
    """The bytes one device holds of a pytree of placed ShapeDtypeStructs (even shards)."""
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(placed)
    )


def _sds(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def _placed(tree, shardings):
    return jax.tree.map(lambda a, s: _sds(a.shape, a.dtype, s), tree, shardings)


def _key(rep) -> jax.ShapeDtypeStruct:
    k = jax.eval_shape(lambda: jax.random.key(0))
    return _sds(k.shape, k.dtype, rep)


def abstract_batch(cfg: Config, model_cfg, routing=None) -> dict:
    """The update's batch as ShapeDtypeStructs, by field name: the static sampler's fields, plus the
    engine's group_id_B and stale_BxT when it draws the rows; `routing` (MoE replay): its struct."""
    rc = cfg.rollout
    B, P, T = rc.prompts_per_step * rc.group_size, cfg.data.max_prompt_len, rc.max_new_tokens
    f32, i32 = jnp.float32, jnp.int32
    batch = {
        "prompt_tokens_BxP": ((B, P), i32),
        "prompt_mask_BxP": ((B, P), jnp.bool_),
        "tokens_BxT": ((B, T), i32),
        "completion_mask_BxT": ((B, T), f32),
        "rollout_logp_BxT": ((B, T), f32),
        "truncated_B": ((B,), f32),
        "rewards_BxK": ((B, len(REWARD_NAMES)), f32),
    }
    if cfg.rollout.engine.enabled or get_task(cfg.data.task).episodic:
        batch.update({"group_id_B": ((B,), i32), "stale_BxT": ((B, T), f32)})
    if cfg.distill.teacher:  # the teacher's scores, made before the update (jaxrl.train.teacher)
        batch["teacher_logp_BxT"] = ((B, T), f32)
    out = {k: jax.ShapeDtypeStruct(*v) for k, v in batch.items()}
    if routing is not None:
        out["routing_BxSxLxK"] = routing
    return out


def engine_routing(cfg: Config, model_cfg) -> jax.ShapeDtypeStruct:
    """The routing the slot engine and the episode engine hand the update (MoE): int32 experts of
    every slot S = P + T (left-padded prompt, then completion), MoE layer and k, one row per sample."""
    rc = cfg.rollout
    B, S = rc.prompts_per_step * rc.group_size, cfg.data.max_prompt_len + rc.max_new_tokens
    return jax.ShapeDtypeStruct((B, S, model_cfg.n_moe_layers, model_cfg.experts_per_token), jnp.int32)


def _rollout_params(run: _Run):
    """The params the rollout reads: cast to the compute dtype once per policy version, as the loop
    casts them (`transformer.rollout_params`; float32 models: the params themselves)."""
    return _placed(jax.eval_shape(lambda p: rollout_params(p, run.model_cfg), run.params), run.param_sh)


def _rollout_jit(run: _Run):
    """(the static sampler jitted as the loop's SamplerSource jits it, its abstract arguments)."""
    cfg, rc = run.cfg, run.cfg.rollout
    sampling = SamplingParams.of_rollout(rc, eos_id=run.ids.eos_id, pad_id=run.ids.pad_id)
    prompt_sh = prompt_sharding(run.mesh, run.preset, rc.prompts_per_step)
    prompts = _sds((rc.prompts_per_step, cfg.data.max_prompt_len), jnp.int32, prompt_sh)
    args = (_rollout_params(run), prompts, prompts, _key(run.rep))
    kw = dict(sampling=sampling, group_size=rc.group_size)
    return jit_plain_rollout(run.model_cfg, kw, run.mesh, run.preset, run.param_sh, prompt_sh, args), args


def _rollout(run: _Run) -> tuple[Any, dict]:
    jitted, args = _rollout_jit(run)
    note = "the plain sampler (rollout.speculative is not planned)" if run.cfg.rollout.speculative.enabled else None
    inputs = {"prompt_tokens_BxP": str(args[1].sharding.spec), "rng": "P()"}
    return jitted.lower(*args).compile(), {"inputs": inputs, **({"note": note} if note else {})}


def _update(run: _Run) -> tuple[Any, dict]:
    cfg, tc = run.cfg, run.cfg.train
    loss = make_loss(cfg.loss)
    check_rollout(cfg.loss.preset, cfg.rollout.group_size)
    optimizer = run_optimizer(cfg)
    base = abstract_params(run.model_cfg)
    lora = None
    if cfg.model.lora.enabled:
        lora = lora_state.LoraRun(cfg.model.lora, param_logical_axes(run.model_cfg), pathlib.Path(""), [])
        make_state, state_sh = lora_state.state_layout(
            base, optimizer, tc.seed, lora, (run.mesh, run.preset, run.param_sh, run.rep)
        )
        state = jax.eval_shape(make_state, base)
    else:
        args = (base,) * (2 if loss.needs_ref else 1)
        state_sh = full_state_shardings(base, optimizer, tc.seed, run.param_sh, run.rep, with_ref=loss.needs_ref)
        state = jax.eval_shape(state_maker(optimizer, tc.seed), *args)
    state_sh = opt_state_in(state_sh, cfg.optim.state_memory)
    if cfg.critic.enabled:  # the value model's state beside the policy's (jaxrl.train.critic)
        check_critic(cfg, loss, run.model_cfg)
        make_critic, critic_sh = critic_layout(cfg, run.model_cfg, base, run.param_sh, run.rep)
        state, state_sh = state._replace(critic=jax.eval_shape(make_critic, base)), state_sh._replace(critic=critic_sh)
    routing = None
    # MoE: the batch carries the rollout's routing, replayed or not (moe/routing_mismatch), as the loop's
    # does; black-box rows carry none
    task = get_task(cfg.data.task)
    if run.model_cfg.n_experts and not task.black_box:
        if cfg.rollout.engine.enabled or task.episodic:  # recorded per slot, gathered on the host
            routing = engine_routing(cfg, run.model_cfg)
        else:
            jitted, args = _rollout_jit(run)
            routing = jax.eval_shape(jitted, *args).routing_BxSxLxK
    batch = abstract_batch(cfg, run.model_cfg, routing)
    batch_sh = {k: named_sharding(run.mesh, run.preset, k) for k in batch}
    shardings = (state_sh, batch_sh)
    state, batch = _placed(state, state_sh), _placed(batch, batch_sh)
    update_for = update_builder(cfg, run.model_cfg, loss, optimizer, run.parallel, lora)
    extra: dict[str, Any] = {"inputs": {k: str(s.spec) for k, s in batch_sh.items()}}
    fit, auto = update_memory(tc, jax.local_devices()[0])
    jit_for = functools.partial(jit_update, update_for, shardings=shardings, rep=run.rep)
    if fit is None:  # as the loop chooses (`memory_budget.choose_fit`), logged there, reported here
        rows = next(iter(batch.values())).shape[0] // tc.minibatches
        jitted, fit, tried = auto_jit(jit_for, (state, batch), rows, log=lambda line: None, **auto)
        extra["tried_gib"] = {"/".join(map(str, k)): round(v, 4) for k, v in tried.items()}
        extra["memory_budget_gib"] = {"gib": round(auto["budget_gib"], 4), "from": auto["source"]}
    else:
        jitted = jit_for(fit)
    step = jitted.lower(state, batch).compile()  # auto_jit's compile, cached
    return step, {"microbatches": fit.microbatches, "remat": fit.remat, "logits_chunk": fit.logits_chunk, **extra}


def _engine_chunk(run: _Run) -> tuple[Any, dict]:
    cfg, rc = run.cfg, run.cfg.rollout
    if rc.speculative.enabled:
        raise ConfigError("--programs engine_chunk: rollout.speculative on the engine is not planned; leave it off")
    sampling = SamplingParams.of_rollout(rc, eos_id=run.ids.eos_id, pad_id=run.ids.pad_id)
    spec = EngineSpec.of_sampling(
        run.model_cfg,
        sampling,
        slots=rc.engine.slots,
        prompt_len=cfg.data.max_prompt_len,
        group_size=rc.group_size,
        parallel=run.parallel,
    )
    # The engine runs its chunks on split_params(params) (split once per collect): their layout is XLA's choice.
    split = split_params.lower(run.params, cfg=run.model_cfg).compile()
    lparams = _placed(jax.eval_shape(lambda p: split_params(p, cfg=run.model_cfg), run.params), split.output_shardings)
    state = jax.eval_shape(lambda: init_state(spec, jax.random.key(0)))
    state_sh = state_shardings(spec, state) or jax.tree.map(lambda _: run.rep, state)  # the engine's own layout
    i32 = _sds((), jnp.int32, run.rep)
    temperature = _sds((), jnp.float32, run.rep)
    lowered = decode_chunk.lower(lparams, spec, _placed(state, state_sh), i32, i32, temperature)
    slot_rows: Any = state_sh.last_S  # a NamedSharding in an EngineState-shaped tree
    inputs = {"state (slot rows)": str(slot_rows.spec), "slots": rc.engine.slots}
    return lowered.compile(), {"inputs": inputs}


def _eval(run: _Run) -> tuple[Any, dict]:
    cfg = run.cfg
    n_dev = 1 if run.parallel is None else run.parallel.n_rows_devices
    chunk = -(-min(EVAL_CHUNK, cfg.train.eval_prompts) // n_dev) * n_dev  # padded as `sample_in_chunks` pads
    sampler = make_chunk_sampler(cfg, run.model_cfg, run.ids, group_size=1, greedy=True, parallel=run.parallel)
    rows = run.rep if run.parallel is None else rows_sharding(run.parallel)
    prompts = _sds((chunk, cfg.data.max_prompt_len), jnp.int32, rows)
    mask = _sds((chunk, cfg.data.max_prompt_len), jnp.bool_, rows)
    params = _rollout_params(run)
    compiled = sampler.lower(params, prompt_BxP=prompts, prompt_mask_BxP=mask, rng=_key(run.rep)).compile()
    return compiled, {"inputs": {"prompt_tokens_BxP": str(rows.spec), "prompts_per_call": chunk}}


def _teacher(run: _Run) -> tuple[Any, dict]:
    cfg = run.cfg
    if not cfg.distill.teacher:
        raise ConfigError("--programs teacher: the config has no distill.teacher")
    teacher_cfg = teacher_lib.teacher_model_config(cfg)
    params = abstract_params(teacher_cfg, shardings_for(teacher_cfg, run.mesh, run.preset))
    fields = {k: v for k, v in abstract_batch(cfg, run.model_cfg).items() if k in teacher_lib.FORWARD_KEYS}
    batch = {k: _sds(v.shape, v.dtype, named_sharding(run.mesh, run.preset, k)) for k, v in fields.items()}
    out = named_sharding(run.mesh, run.preset, teacher_lib.TEACHER_KEY)
    jitted = jax.jit(teacher_lib.teacher_logp_fn(cfg, teacher_cfg, run.parallel), out_shardings=out)
    extra = {"teacher": {"n_layers": teacher_cfg.n_layers, "d_model": teacher_cfg.d_model}}
    return jitted.lower(params, batch).compile(), extra


def count_collectives(hlo_text: str) -> dict[str, int]:
    """{kind: number of such ops in the compiled HLO text} (async `-start` forms counted once)."""
    counts: dict[str, int] = dict.fromkeys(COLLECTIVES, 0)
    for m in _COLLECTIVE_OP.finditer(hlo_text):
        counts[m.group(1)] += 1
    return counts


def _cost(compiled) -> dict:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older JAX: one dict per module
        cost = cost[0] if cost else {}
    return dict(cost or {})


def memory_mib(compiled) -> dict[str, float]:
    m = compiled.memory_analysis()

    def mib(field: str) -> float:
        return round(float(getattr(m, field, 0) or 0) / MIB, 3) if m is not None else 0.0

    return {
        "argument": mib("argument_size_in_bytes"),
        "temp": mib("temp_size_in_bytes"),
        "output": mib("output_size_in_bytes"),
        "alias": mib("alias_size_in_bytes"),
    }


def describe(program: str, compiled, run: _Run, extra: dict) -> dict:
    """The JSON record of one compiled program (module docstring)."""
    cost = _cost(compiled)
    return {
        "program": program,
        "devices": run.mesh.size,
        "mesh": {"preset": run.preset_name, **{k: int(v) for k, v in run.mesh.shape.items()}},
        "flops_per_device": float(cost.get("flops", 0.0)),
        "bytes_accessed_per_device": float(cost.get("bytes accessed", 0.0)),
        "memory_mib": memory_mib(compiled),
        "collectives": count_collectives(compiled.as_text()),
        **extra,
        "layout": run.layout,
    }


def summary_line(record: dict) -> str:
    """One human line of a record (stderr)."""
    mem = record["memory_mib"]
    coll = ", ".join(f"{k} {v}" for k, v in record["collectives"].items() if v) or "none"
    axes = ", ".join(f"{k}={v}" for k, v in record["mesh"].items() if k != "preset")
    n_split, n_rep = len(record["layout"]["split"]), len(record["layout"]["replicated"])
    own = "rollout_copy_mib_per_device" in record
    copy = f"; the rollout's params copy {record['rollout_copy_mib_per_device']:.4g} MiB per device" if own else ""
    field = "rollout.mesh.preset" if own else "mesh.preset"
    return (
        f"jaxrl plan: {record['program']} on {record['devices']} devices ({field}={record['mesh']['preset']}: "
        f"{axes}): {record['flops_per_device'] / 1e9:.4g} GFLOP and {record['bytes_accessed_per_device'] / MIB:.4g} "
        f"MiB accessed per device; memory per device: arguments {mem['argument']:.4g}, temporaries {mem['temp']:.4g}, "
        f"outputs {mem['output']:.4g} MiB; collectives: {coll}; params {n_split} split, {n_rep} replicated{copy}"
    )
