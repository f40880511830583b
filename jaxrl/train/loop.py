"""`jaxrl train`: rollout -> rewards -> update (advantages, loss, gradient) -> log -> checkpoint.

The host loop only moves data, scores completions, logs and checkpoints; everything numeric runs in
jitted pure functions. A run resumes from its newest checkpoint and continues exactly as an
uninterrupted run would (same state, RNG and data position). SIGTERM and Ctrl-C finish the step, save
it and stop: `train` returns (SIGTERM) or raises `Interrupted` (Ctrl-C, whose message is the one line to
print); a second Ctrl-C raises KeyboardInterrupt at once.

Each step: `produce_scored_groups` (the rollout source, jaxrl.sources.groups: `produce` and
`checkpoint_state` are all the loop calls), `assemble_batch` (host batch -> global arrays), `run.update`
(the jitted update), `log_and_checkpoint` (eval cadence, the row on disk one step late, checkpoint,
signals); `build_run` sets up the mesh, loss, base policy, state, restore and source once.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from jaxrl.config import Config, ConfigError, LossConfig, to_dict
from jaxrl.data.registry import get_task
from jaxrl.data.stream import StreamState, from_arrays
from jaxrl.losses import Loss, check_loss, check_rollout, make_loss
from jaxrl.models.transformer import param_logical_axes
from jaxrl.multihost import any_process, is_primary, process_rows
from jaxrl.policy.base import build_base
from jaxrl.policy.warmstart import cache_root
from jaxrl.rewards.scorer import model_rewards
from jaxrl.runlog.metrics import MetricsLog, plot
from jaxrl.runlog.report import emit
from jaxrl.runlog.summary import start_line, stopped_line, summary
from jaxrl.runlog.trackers import check_backends, open_trackers
from jaxrl.sharding import (
    batch_sharding,
    check_batch_divides,
    layout_line,
    make_mesh,
    parallel_for,
    replicated,
)
from jaxrl.sources.agents import AgentSource, check_agent_config, make_agent_evaluator
from jaxrl.sources.blackbox import AgentServer, BlackBoxSource, check_blackbox_config, make_blackbox_evaluator
from jaxrl.sources.groups import EngineSource, StaticSource
from jaxrl.sources.sampler import SamplerSource
from jaxrl.sources.scoring import RowLayout, assemble_batch
from jaxrl.train import checkpoint as ckpt
from jaxrl.train import lora_state
from jaxrl.train import teacher as distill_teacher
from jaxrl.train.critic import check_critic
from jaxrl.train.evaluate import eval_records, make_evaluator
from jaxrl.train.memory_budget import auto_jit
from jaxrl.train.programs import (
    full_state_shardings,
    jit_update,
    policy_for,
    rollout_layout,
    run_optimizer,
    state_maker,
    update_builder,
    update_memory,
    with_critic,
)
from jaxrl.train.state import (
    TrainState,
    opt_state_in,
    saved_part,
)
from jaxrl.train.workdir import RunRecord, open_run

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
OTHER_PROCESS = "a signal to another process"  # what stopped a process of a multi-process run that got none


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped the run after its step was saved; str(): the one line to print."""


class _StopFlag:
    """The handler of SIGTERM and SIGINT: the first sets `signal` (its name); the loop saves a checkpoint
    at the end of the current step and stops. A second Ctrl-C aborts at once (KeyboardInterrupt)."""

    def __init__(self):
        self.signal: str | None = None

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def __call__(self, signum, frame):
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = self.signal or signal.Signals(signum).name


class Run(NamedTuple):
    """What the step loop needs, built once by `build_run`; the loop carries state and stream."""

    cfg: Config
    workdir: pathlib.Path
    mesh: Any
    preset: Any
    tokenizer: Any
    task: Any
    rows: RowLayout  # the step's completion rows: their sharding and this process's share
    source: Any  # StaticSource | EngineSource (jaxrl.sources.groups): produce(params, stream, rng, step)
    update: Callable  # (state, batch) -> (state, device metrics), the jitted update
    evaluate: Callable  # params -> the eval/* metrics
    saver: ckpt.BackgroundSaver  # the orbax checkpoint manager, saving off the loop's thread
    log: MetricsLog
    base_path: pathlib.Path  # where the base policy came from
    policy: Callable  # state -> the params the rollout and the evaluation use (under LoRA: merged)
    lora: lora_state.LoraRun | None  # None for full fine-tuning
    teacher: Callable | None = None  # batch -> batch + teacher_logp_BxT (jaxrl.train.teacher); None: no teacher


def train(
    cfg: Config, workdir: pathlib.Path, allow_config_change: bool = False, *, loss: Loss | None = None
) -> list[dict]:
    """Run (or resume) the job in `workdir`; returns the metric rows written. The workdir is checked
    and locked first, and a config that differs from the run's is refused (jaxrl.train.workdir).

    `loss`: a `Loss` (e.g. `jaxrl.losses.compose(...)`) to train with instead of `make_loss(cfg.loss)`,
    checked against the contract first. It carries its own parameters, so `cfg.loss` must be left at
    `LossConfig()`; the run records `loss.preset` as "<name>" (the loss's name), which a resume must
    repeat. To train a loss from the command line or `jaxrl eval` a run by name, register it
    (`jaxrl.losses.register_preset`) instead."""
    if loss is not None:
        loss = check_loss(loss, "train(loss=...)")
        cfg = _given_loss(cfg, loss)
    check_backends(cfg.log)  # a tracker's missing library is an error before the workdir is touched
    with open_run(cfg, pathlib.Path(workdir), allow_config_change) as record:
        return _train(cfg, pathlib.Path(workdir), record, loss)


def _given_loss(cfg: Config, loss: Loss) -> Config:
    """`cfg` with loss.preset recording the given loss's name; ConfigError naming a loss field the config
    sets, which the given loss would silently ignore."""
    for field in dataclasses.fields(LossConfig):
        if field.name != "preset" and getattr(cfg.loss, field.name) != field.default:
            raise ConfigError(
                f"loss.{field.name}: set to {getattr(cfg.loss, field.name)!r}, but train() was given a Loss, "
                "which carries its own parameters; leave cfg.loss at LossConfig()"
            )
    return dataclasses.replace(cfg, loss=LossConfig(preset=f"<{loss.name}>"))


def _train(cfg: Config, workdir: pathlib.Path, record: RunRecord, loss: Loss | None = None) -> list[dict]:
    run, state, stream, start = build_run(cfg, workdir, record, loss)
    tc = cfg.train
    stop = _StopFlag()
    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    bar = tqdm(
        total=tc.steps,
        initial=start,
        desc=cfg.loss.preset,
        disable=not tc.progress or not is_primary(),
        dynamic_ncols=True,
    )
    done, stopping = start, False
    if is_primary() and (line := start_line(workdir, start, tc.steps)):
        print(line, file=sys.stderr)
    try:
        policy = run.policy(state)  # once per state: under LoRA, the merged params
        if start == 0 and tc.steps >= 0:
            run.log.write({"step": 0, **run.evaluate(policy), "wall_time": time.time()})
            if is_primary():
                plot(run.log.rows, workdir / "progress.png", title=str(workdir.name))
        pending = None  # (row, device metrics, t0) of the step dispatched last: pulled after the next dispatch
        for step in range(start + 1, tc.steps + 1):
            t0 = time.perf_counter()
            state, produced = produce_scored_groups(run, state, policy, stream, step)
            stream, row = produced.stream, {"step": step, **produced.metrics}
            batch = update_batch(run, produced)
            state, metrics = run.update(state, batch)
            policy = run.policy(state)
            if pending is not None:
                emit(run.log, bar, *pending)
            pending, stopping = log_and_checkpoint(run, (state, policy), stream, step, (row, metrics, t0), stop, bar)
            done = step
            if stopping:
                break
        if pending is not None:
            emit(run.log, bar, *pending)
    finally:
        run.saver.close()
        if (close := getattr(run.source, "close", None)) is not None:  # a black-box run's server and engine
            close()
        run.log.close()
        bar.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
    stopped_by = (stop.signal or OTHER_PROCESS) if stopping else None
    if tc.progress and is_primary():
        print(json.dumps(summary(workdir, run.base_path, done, tc.steps, stopped_by, run.log.rows)))
    if stopped_by == "SIGINT" and done < tc.steps:  # a Ctrl-C with the last step: the run is complete
        raise Interrupted(stopped_line(workdir, done, stopped_by))
    return run.log.rows


def build_run(
    cfg: Config, workdir: pathlib.Path, record: RunRecord, loss: Loss | None = None
) -> tuple[Run, TrainState, StreamState, int]:
    """-> (the Run, the initial or restored state, the data stream's position, the last finished step).
    `loss`: a checked `Loss` given to `train`, else `make_loss(cfg.loss)`."""
    tc, rc = cfg.train, cfg.rollout
    G, B = rc.group_size, rc.prompts_per_step * rc.group_size
    mesh, preset = make_mesh(cfg.mesh)
    check_batch_divides(mesh, preset, B, "rollout.prompts_per_step*rollout.group_size")

    # The loss first: a bad preset / option / group size is a one-line error before any work is done.
    # rollout.group_size is taken as given (MC-GRPO's config samples G+1; its prepare drops the pivot).
    if loss is None:
        loss = make_loss(cfg.loss)
        check_rollout(cfg.loss.preset, G)
    check_critic(cfg, loss)  # a preset that reads values needs critic.enabled (the model: `with_critic`)
    distill_teacher.check_teacher(cfg, loss)
    if get_task(cfg.data.task).black_box:
        check_blackbox_config(cfg, cfg.data.task)
    elif get_task(cfg.data.task).episodic:
        check_agent_config(cfg)
    tokenizer, model_cfg, task, base_params, base_path, param_sh = build_base(cfg, tc.progress, mesh, preset)
    if cfg.reward_model.workdir or cfg.reward_model.judge_path:  # rewards from a model (jaxrl.rewards)
        task = dataclasses.replace(task, verifier=model_rewards(task.verifier, cfg.reward_model, tc.seed))
    optimizer = run_optimizer(cfg)
    rep, rows_sharding = replicated(mesh), batch_sharding(mesh, preset)
    layout = (mesh, preset, param_sh, rep)
    own = rollout_layout(cfg, model_cfg, mesh)  # rollout.mesh: a layout of the rollout's own, else None
    if mesh.size > 1 and is_primary():
        print(layout_line(mesh, cfg.mesh.preset, param_sh, base_params), file=sys.stderr)
        if own is not None:
            line = layout_line(own[0], cfg.rollout.mesh.preset, own[2], base_params, "rollout.mesh.preset")
            print(line, file=sys.stderr)
    if cfg.model.lora.enabled:  # adapters trained, the base frozen; the reference is the base (no copy)
        lora = lora_state.LoraRun(cfg.model.lora, param_logical_axes(model_cfg), base_path, [])
        state, state_sh, lora = lora_state.initial_state(base_params, optimizer, tc.seed, lora, layout)
    else:
        state, state_sh = _initial_state(base_params, optimizer, tc.seed, param_sh, rep, with_ref=loss.needs_ref)
        lora = None
    if cfg.optim.state_memory != "device":  # the optimizer state to host memory between updates
        state_sh = opt_state_in(state_sh, cfg.optim.state_memory)
        state = state._replace(opt_state=jax.device_put(state.opt_state, state_sh.opt_state))
    # critic.enabled: the value model, a copy of the base policy's trunk with a zero head (else unchanged)
    state, state_sh = with_critic(cfg, model_cfg, (state, state_sh), base_params, param_sh, rep)
    del base_params
    teacher = None
    if cfg.distill.teacher:  # frozen, outside the TrainState: no checkpoint holds it
        teacher_model = distill_teacher.load_teacher(cfg, tokenizer, mesh, preset)
        teacher = distill_teacher.teacher_scorer(cfg, teacher_model, mesh, preset, parallel_for(mesh, preset))

    manager = ckpt.make_manager(workdir, cfg.checkpoint)
    resumed_step, state, stream, host = _restore(manager, state, loss, record, lora)
    policy = policy_for(lora, state_sh, param_sh, own, model_cfg)
    trackers = open_trackers(cfg.log, workdir, json.loads(json.dumps(to_dict(cfg)))) if is_primary() else []
    log = MetricsLog(
        workdir,
        resume_step=resumed_step,
        write=is_primary(),
        tensorboard="tensorboard" in cfg.log.backends,
        trackers=trackers,
    )

    update_fn = update_builder(cfg, model_cfg, loss, optimizer, parallel_for(mesh, preset), lora)
    rows = RowLayout(rows_sharding, process_rows(rows_sharding, B), B)
    # host: the restored checkpoint's JSON item, whose rollout state the source takes back.
    source, evaluate = _rollout_side(
        cfg, model_cfg, tokenizer, task, own or layout, (policy(state), state.rng), rows, host
    )
    run = Run(
        cfg,
        workdir,
        mesh,
        preset,
        tokenizer,
        task,
        rows,
        source,
        _lazily_jitted_update(update_fn, tc, state_sh, rep),
        evaluate,
        ckpt.BackgroundSaver(manager),
        log,
        base_path,
        policy,
        lora,
        teacher,
    )
    return run, state, stream, resumed_step or 0


def _rollout_side(cfg: Config, model_cfg, tokenizer, task, layout, policy_rng: tuple, rows: RowLayout, host: dict):
    """(the rollout source, the evaluator): multi-turn episodes for an environment task, else the slot
    engine or the static sampler, each with its held-out evaluation. layout: the rollout's (mesh,
    preset, param_sh, rep), training's or rollout.mesh's own. policy_rng: the params the rollout uses
    (laid out by `layout`; for shapes and step costs) and the state's RNG."""
    mesh, preset, param_sh, rep = layout
    ep = parallel_for(mesh, preset)  # every rollout and evaluation forward (MoE: the update's expert axis)
    if task.spec.black_box:  # a black-box agent through the run's own server (jaxrl.sources.blackbox)
        server = AgentServer(cfg, model_cfg, tokenizer, ep)
        return (
            BlackBoxSource(cfg, model_cfg, tokenizer, task, host, server),
            make_blackbox_evaluator(cfg, task, eval_records(cfg, task.test), server),
        )
    if task.spec.episodic:  # multi-turn episodes (jaxrl.sources.agents)
        suite = task.spec.suite
        return (
            AgentSource(cfg, model_cfg, tokenizer, task, suite, host, ep, param_sh=param_sh),
            make_agent_evaluator(cfg, model_cfg, tokenizer, suite, eval_records(cfg, task.test), ep, param_sh=param_sh),
        )
    if cfg.rollout.engine.enabled:
        source = EngineSource(cfg, model_cfg, tokenizer, task, host, ep, param_sh=param_sh)
    else:
        source = StaticSource(
            cfg,
            SamplerSource(
                cfg,
                model_cfg,
                tokenizer,
                mesh,
                preset,
                param_sh,
                policy_rng[0],
                policy_rng[1],
                host,
                cache_root(cfg) / "speculative_costs",
            ),
            task,
            tokenizer,
            rows,
        )
    records = eval_records(cfg, task.test)
    evaluate = make_evaluator(
        cfg, model_cfg, tokenizer, records, task.verifier, parallel=ep
    )  # rows split as the rollout's
    return source, evaluate


def _restore(manager, state: TrainState, loss, record: RunRecord, lora):
    """-> (the restored step or None, state, stream position, the checkpoint's JSON item ({} when fresh)).
    A checkpoint holds no LoRA base: `state`'s own (rebuilt as at the start) stays, if it is the same."""
    lora_state.check_latest(manager, lora)  # before the restore: a LoRA/full mismatch fails it unclearly
    saved = ckpt.abstract_like(saved_part(state))
    restored = ckpt.restore_latest(manager, ckpt.match_reference(manager, saved))
    if restored is None:
        return None, state, StreamState(0, 0), {}
    start, restored_state, host = restored
    lora_state.check_resume(lora, host, start, manager.directory)
    state = TrainState(**restored_state._asdict(), base=state.base)  # SavedState or SavedCriticState
    if not loss.needs_ref:  # the checkpoint held a reference copy this loss does not need
        state = state._replace(ref_params=None)
    record.commit(start)  # an allowed config change is recorded only once the checkpoint restored
    return start, state, from_arrays(host["stream"]), host


def _lazily_jitted_update(update_for, tc, state_sh, rep) -> Callable:
    """(state, batch) -> (state, metrics), jitted at the first batch with the batch's shardings
    (chosen by field name); the state is donated. update_for(fit) builds the step; where train.*
    leaves the microbatches (0) or remat ("auto") to the memory budget they are chosen then
    (`programs.update_memory`), and a chosen count is logged as `microbatches`."""
    jitted = []

    def update(state, batch):
        if not jitted:
            shardings = (state_sh, {k: v.sharding for k, v in batch.items()})

            def jit_for(fit):
                return jit_update(update_for, fit, shardings, rep)

            fixed, auto = update_memory(tc, jax.local_devices()[0])
            if fixed is None:
                rows = batch["completion_mask_BxT"].shape[0] // tc.minibatches  # per optimizer step
                step, fit, _ = auto_jit(jit_for, (state, batch), rows, **auto)
                jitted.append((step, fit.microbatches if tc.microbatches == 0 else None))
            else:
                jitted.append((jit_for(fixed), None))
        step, auto_count = jitted[0]
        state, metrics = step(state, batch)
        return state, metrics if auto_count is None else dict(metrics, microbatches=auto_count)

    return update


def produce_scored_groups(run: Run, state: TrainState, policy, stream: StreamState, step: int):
    """The step's scored groups from the rollout source (prompts from `stream`), sampled from `policy`
    (`run.policy(state)`). -> (state with its RNG advanced, `Produced`: this process's host batch, the
    metrics row so far, the stream after)."""
    rng, k_sample = jax.random.split(state.rng)
    state = state._replace(rng=rng)
    return state, run.source.produce(policy, stream, k_sample, step)


def update_batch(run: Run, produced) -> dict:
    """The update's batch on the devices (`assemble_batch`), with the teacher's scores of its sampled
    tokens (`teacher_logp_BxT`) when the run distils from a teacher (jaxrl.train.teacher)."""
    batch = assemble_batch(produced.host_batch, produced.routing_BxSxLxK, run.mesh, run.preset, run.rows.n)
    return batch if run.teacher is None else run.teacher(batch)


def log_and_checkpoint(run: Run, updated: tuple, stream: StreamState, step: int, pending: tuple, stop: _StopFlag, bar):
    """After the step's update is dispatched: evaluate on the cadence, write the row when a save or
    an eval needs it now (else it stays pending, pulled after the next dispatch), checkpoint, and
    see a SIGTERM / SIGINT. updated: (the state after the update, its policy). -> (what is still pending or
    None, stopping)."""
    cfg, tc = run.cfg, run.cfg.train
    state, policy = updated
    row = pending[0]
    still_pending: tuple | None = pending
    if tc.eval_every and step % tc.eval_every == 0 or step == tc.steps:
        row.update(run.evaluate(policy))
    # Read once: a signal landing later in this step is seen next step. All processes agree.
    stopping = any_process(stop.requested)
    save_now = (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == tc.steps or stopping
    if save_now or "eval/accuracy" in row:
        emit(run.log, bar, *pending)  # the row must be on disk before the checkpoint that covers it
        still_pending = None
    if "eval/accuracy" in row and is_primary():
        plot(run.log.rows, run.workdir / "progress.png", title=str(run.workdir.name))
    if save_now:  # the JSON item: the data position, the rollout source's host state, the LoRA base's identity
        host = {"stream": stream._asdict(), **run.source.checkpoint_state(), **lora_state.checkpoint_item(run.lora)}
        run.saver.save(step, saved_part(state), host, force=True)
    if stopping and stop.signal != "SIGINT":  # SIGINT's line is Interrupted's, printed by its catcher
        print(f"jaxrl: {stopped_line(run.workdir, step, stop.signal or OTHER_PROCESS)}", file=sys.stderr)
    return still_pending, stopping


def _initial_state(base_params, optimizer, seed: int, param_sh, rep, *, with_ref: bool):
    """(state, its shardings), laid out by the preset: eval_shape -> shardings -> jit(init, out_shardings).
    `with_ref` (the loss's needs_ref) adds a reference copy of the base params; without it
    state.ref_params is None and no checkpoint holds one."""
    # The reference is a copy: donating a state whose two fields share buffers is an error.
    args = (base_params, jax.tree.map(jnp.copy, base_params)) if with_ref else (base_params,)
    state_sh = full_state_shardings(base_params, optimizer, seed, param_sh, rep, with_ref=with_ref)
    state = jax.jit(state_maker(optimizer, seed), in_shardings=(param_sh,) * len(args), out_shardings=state_sh)(*args)
    return state, state_sh
