"""`jaxrl train`: rollout -> rewards -> update (advantages, loss, gradient) -> log -> checkpoint.

The host loop only moves data, scores completions, logs and checkpoints; everything numeric runs in
jitted pure functions. A run resumes from its newest checkpoint and continues exactly as an
uninterrupted run would (same state, RNG and data position); SIGTERM saves and exits cleanly.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxrl.config import Config
from jaxrl.data.rewards import score
from jaxrl.data.stream import StreamState, from_arrays
from jaxrl.data.tasks import load_task
from jaxrl.data.tokenizer import CharTokenizer
from jaxrl.losses import check_rollout, make_loss
from jaxrl.rollout.calibrate import cached_step_costs, constant_costs, costs_from_json, costs_to_json, widest_draft
from jaxrl.rollout.reuse import DraftStore, spec_metrics
from jaxrl.rollout.sampler import sample
from jaxrl.rollout.speculative import sample_speculative, worth_speculating
from jaxrl.models.transformer import init_params, param_logical_axes
from jaxrl.sharding import (any_process, all_processes_sum, batch_devices, batch_sharding, check_batch_divides,
                            gather_rows, is_primary, local_rows, make_mesh, named_sharding, named_shardings,
                            param_shardings, process_rows, put_global, put_rows, replicated)
from jaxrl.train import checkpoint as ckpt
from jaxrl.train.batching import decode_completions, next_prompts, prompt_width
from jaxrl.train.evaluate import eval_records, make_evaluator
from jaxrl.train.metrics import MetricsLog, plot
from jaxrl.train.pretrained import load_pretrained
from jaxrl.train.state import TrainState, init_state, make_optimizer, state_shardings
from jaxrl.train.steps import make_logp_fn, make_update_step
from jaxrl.train.warmstart import cache_root, load_or_train_base
from jaxrl.train.workdir import RunRecord, open_run


class _StopFlag:
    """Set by SIGTERM; the loop saves a checkpoint at the end of the current step and returns."""

    def __init__(self):
        self.requested = False

    def __call__(self, signum, frame):
        self.requested = True


def _build(cfg: Config, progress: bool, mesh, preset):
    """Tokenizer, model config, task, the base params laid out by the preset, their shardings."""
    tokenizer = CharTokenizer()
    model_cfg = cfg.model if cfg.model.vocab_size else dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size)
    if jax.process_count() > 1:  # process 0 builds the dataset cache (if missing) before the others read it
        from jax.experimental import multihost_utils

        task = load_task(cfg.data) if is_primary() else None
        multihost_utils.sync_global_devices("jaxrl: dataset ready")
        task = task or load_task(cfg.data)
    else:
        task = load_task(cfg.data)
    if cfg.model.hf_path:  # a pretrained checkpoint brings its tokenizer, architecture and weights
        tokenizer, model_cfg, base_params, base_path, param_sh = load_pretrained(cfg.model, mesh, preset)
        return tokenizer, model_cfg, task, base_params, base_path, param_sh
    # eval_shape -> shardings: the cached base policy is restored straight into its sharded layout.
    abstract_params = jax.eval_shape(lambda: init_params(model_cfg, jax.random.key(0)))
    param_sh = param_shardings(mesh, preset, param_logical_axes(model_cfg), abstract_params)
    base_params, base_path = load_or_train_base(cfg, model_cfg, tokenizer, task.train, tokenizer.alphabet,
                                                progress=progress, shardings=param_sh)
    base_params = jax.tree.map(_placed, base_params, param_sh)
    return tokenizer, model_cfg, task, base_params, base_path, param_sh


def _placed(x, sharding):
    """A host (or differently placed) array -> a global array laid out by `sharding`."""
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
        return x
    return put_global(sharding, np.asarray(x))


def train(cfg: Config, workdir: pathlib.Path, allow_config_change: bool = False) -> list[dict]:
    """Run (or resume) the job in `workdir`; returns the metric rows written. The workdir is checked
    and locked first, and a config that differs from the run's is refused (jaxrl.train.workdir)."""
    with open_run(cfg, pathlib.Path(workdir), allow_config_change) as run:
        return _train(cfg, pathlib.Path(workdir), run)


def _train(cfg: Config, workdir: pathlib.Path, run: RunRecord) -> list[dict]:
    tc, rc = cfg.train, cfg.rollout
    G, B = rc.group_size, rc.prompts_per_step * rc.group_size
    mesh, preset = make_mesh(cfg.mesh)
    check_batch_divides(mesh, preset, B, "rollout.prompts_per_step*rollout.group_size")

    # The loss first: a bad preset / option / group size is a one-line error before any work is done.
    # rollout.group_size is taken as given (MC-GRPO's config samples G+1; its prepare drops the pivot).
    loss = make_loss(cfg.loss)
    check_rollout(cfg.loss.preset, G)
    tokenizer, model_cfg, task, base_params, base_path, param_sh = _build(cfg, tc.progress, mesh, preset)
    optimizer = make_optimizer(cfg.optim, tc.steps * tc.ppo_epochs)
    rep, rows_sharding = replicated(mesh), batch_sharding(mesh, preset)

    state, state_sh = _initial_state(base_params, optimizer, tc.seed, param_sh, rep, with_ref=loss.needs_ref)
    del base_params

    manager = ckpt.make_manager(workdir, cfg.checkpoint)
    restored = ckpt.restore_latest(manager, ckpt.match_reference(manager, ckpt.abstract_like(state)))
    stream = StreamState(0, 0)
    start, host = 0, {}  # host: the JSON item of the restored checkpoint (data position, speculation state)
    if restored is not None:
        start, state, host = restored
        if not loss.needs_ref:  # a reference copy from a checkpoint written before it was optional
            state = state._replace(ref_params=None)
        stream = from_arrays(host["stream"])
        run.commit(start)  # an allowed config change is recorded only once the checkpoint restored
    log = MetricsLog(workdir, resume_step=start if restored is not None else None, write=is_primary())

    logp_fn = make_logp_fn(model_cfg, rc.temperature, routing_replay=tc.routing_replay)
    # The advantages (and a reference forward, when the loss needs one) are computed inside the update.
    update_fn = make_update_step(logp_fn, loss, optimizer, ppo_epochs=tc.ppo_epochs, microbatches=tc.microbatches,
                                 max_new_tokens=rc.max_new_tokens, group_size=G, use_ref=loss.needs_ref)
    update_step = None  # jitted at the first batch, with the batch's shardings (chosen by field name)

    spec = rc.speculative
    sample_kw = dict(group_size=G, max_new_tokens=rc.max_new_tokens, temperature=rc.temperature, top_k=rc.top_k,
                     top_p=rc.top_p, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)

    def rollout_fn(params, prompt_BxP, prompt_mask_BxP, rng, spec_in):
        """spec_in (speculative only): the acceptance prior and the reuse drafts; -> (SampleOutput, SpecStats)."""
        if not spec.enabled:
            return sample(params, model_cfg, prompt_BxP, prompt_mask_BxP, rng, **sample_kw), None
        return sample_speculative(params, model_cfg, prompt_BxP, prompt_mask_BxP, rng, spec=spec, **sample_kw,
                                  **spec_in)

    # The rollout runs on the state's (sharded) params; prompts are split over the batch axes when
    # they divide (else replicated), completion rows always are.
    n_prompts = rc.prompts_per_step
    prompt_sh = rows_sharding if n_prompts % batch_devices(mesh, preset) == 0 else rep
    prompts_spec = jax.ShapeDtypeStruct((n_prompts, prompt_width(cfg.data)), jnp.int32)
    # Host state: the acceptance estimate carried between rollouts (checkpointed with the stream).
    spec_prior = float(host.get("spec_prior", spec.initial_acceptance))
    reuse_prior = float(host.get("spec_reuse_prior", spec.initial_acceptance))
    drafts = None
    if spec.enabled and spec.drafter == "reuse":  # the store is checkpointed: a resume drafts alike
        drafts = DraftStore.from_state(host["spec_drafts"]) if "spec_drafts" in host else DraftStore()
    costs = _speculative_costs(cfg, model_cfg, state.params, host, B)

    def spec_inputs(prompt_BxP, pmask_BxP):
        if not spec.enabled:
            return {}
        out = {"acceptance_prior": np.float32(spec_prior), "reuse_acceptance_prior": np.float32(reuse_prior)}
        if costs is not None:
            out["costs"] = costs
        if drafts is not None:
            d, n, lp = drafts.lookup(prompt_BxP, pmask_BxP, G, rc.max_new_tokens, tokenizer.pad_id)
            out.update(draft_NxT=d, draft_len_N=n, draft_logp_NxT=lp)
        return out

    def speculate_now(step: int, spec_host: dict) -> bool:
        """Every probe_every-th rollout speculates (fresh acceptance counts); the others only when
        speculation can gain. Every process decides alike (drafts are per process)."""
        if (step - 1) % spec.probe_every == 0:
            return True
        lengths = None
        if drafts is not None:  # the rows' draft lengths, gathered from the process that holds each
            lengths = gather_rows(rows_sharding, spec_host["draft_len_N"][rows], B)
        return worth_speculating(costs if costs is not None else constant_costs(spec), spec, spec_prior, reuse_prior,
                                 lengths)

    spec_abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                                 spec_inputs(np.zeros((n_prompts, 1), np.int32), np.zeros((n_prompts, 1), bool)))
    spec_sh = {k: rows_sharding if k.startswith("draft") else rep for k in spec_abstract}
    out_abstract, _ = jax.eval_shape(rollout_fn, state.params, prompts_spec, prompts_spec, state.rng, spec_abstract)
    rollout = jax.jit(rollout_fn, in_shardings=(param_sh, prompt_sh, prompt_sh, rep, spec_sh),
                      out_shardings=(named_shardings(mesh, preset, out_abstract), rep if spec.enabled else None))
    # With speculation on, a rollout that cannot gain (worth_speculating) runs the plain sampler.
    rollout_plain = jax.jit(lambda p, t, m, r: sample(p, model_cfg, t, m, r, **sample_kw),
                            in_shardings=(param_sh, prompt_sh, prompt_sh, rep),
                            out_shardings=named_shardings(mesh, preset, out_abstract))
    prompt_rows, rows = process_rows(prompt_sh, n_prompts), process_rows(rows_sharding, B)  # this process's
    evaluate = make_evaluator(cfg, model_cfg, tokenizer, eval_records(cfg, task.test), task.verifier,
                              out_sharding=rep)

    stop = _StopFlag()
    previous = signal.signal(signal.SIGTERM, stop)
    bar = tqdm(total=tc.steps, initial=start, desc=cfg.loss.preset, disable=not tc.progress or not is_primary(),
               dynamic_ncols=True)
    last_eval = {}
    try:
        if start == 0 and tc.steps >= 0:
            last_eval = evaluate(state.params)
            log.write({"step": 0, **last_eval})
            if is_primary():
                plot(log.rows, workdir / "progress.png", title=str(workdir.name))
        pending = None  # (row, device metrics) of the step dispatched last: pulled after the next dispatch
        for step in range(start + 1, tc.steps + 1):
            t0 = time.perf_counter()
            records, prompt_BxP, pmask_BxP, stream, n_skipped = next_prompts(
                task.train, stream, rc.prompts_per_step, tokenizer, cfg.data, cfg.data.seed)
            rng, k_sample = jax.random.split(state.rng)
            state = state._replace(rng=rng)
            # Every process walks the same stream; each feeds the devices only its own prompt rows
            # and scores only its own completion rows (`rows`); host metrics see all rows.
            spec_host = spec_inputs(prompt_BxP, pmask_BxP)
            prompts_in = (put_rows(prompt_sh, prompt_BxP[prompt_rows], n_prompts),
                          put_rows(prompt_sh, pmask_BxP[prompt_rows], n_prompts))
            if spec.enabled and not speculate_now(step, spec_host):
                out, spec_stats = rollout_plain(state.params, *prompts_in, k_sample), None
            else:
                spec_in = {k: put_rows(spec_sh[k], v[rows], B) if k.startswith("draft") else v
                           for k, v in spec_host.items()}
                out, spec_stats = rollout(state.params, *prompts_in, k_sample, spec_in)
            my_tokens_BxT = local_rows(out.tokens_BxT)
            t_rollout = time.perf_counter() - t0
            my_mask_BxT = local_rows(out.completion_mask_BxT)
            my_finished_B = local_rows(out.finished_B)
            texts = decode_completions(tokenizer, my_tokens_BxT)
            my_rewards_BxK, n_failed = score(task.verifier, texts, list(my_finished_B),
                                             [r for r in records for _ in range(G)][rows])
            rewards_BxK = gather_rows(rows_sharding, my_rewards_BxK, B)
            mask_BxT = gather_rows(rows_sharding, my_mask_BxT, B)
            finished_B = gather_rows(rows_sharding, my_finished_B, B)
            n_failed = all_processes_sum(n_failed)
            my_batch = {
                "prompt_tokens_BxP": np.repeat(prompt_BxP, G, 0)[rows],
                "prompt_mask_BxP": np.repeat(pmask_BxP, G, 0)[rows],
                "tokens_BxT": my_tokens_BxT, "completion_mask_BxT": my_mask_BxT,
                "rollout_logp_BxT": local_rows(out.logp_BxT), "rewards_BxK": my_rewards_BxK,
                "truncated_B": (~my_finished_B).astype(np.float32),
            }
            batch = {k: put_rows(named_sharding(mesh, preset, k), v, B) for k, v in my_batch.items()}
            if out.routing_BxSxLxK is not None:  # MoE: replayed in the update, and the mismatch metric
                batch["routing_BxSxLxK"] = out.routing_BxSxLxK  # already laid out by its name
            if update_step is None:
                update_step = jax.jit(update_fn, in_shardings=(state_sh, {k: v.sharding for k, v in batch.items()}),
                                      out_shardings=(state_sh, rep), donate_argnums=0)
            with jax.set_mesh(mesh):  # MoE dropless dispatch goes expert-parallel on a mesh `expert` axis > 1
                state, metrics = update_step(state, batch)
            if pending is not None:
                _emit(log, bar, *pending)
            n_tokens = float(mask_BxT.sum())
            r_B = _combined_reward(rewards_BxK, cfg.loss.reward_weights)
            row = {"step": step, "reward/mean": float(r_B.mean()), "reward/std": float(r_B.std()),
                   "reward/correctness": float(rewards_BxK[:, 0].mean()),
                   "reward/format": float(rewards_BxK[:, 1].mean()) if rewards_BxK.shape[1] > 1 else None,
                   "reward/failed": int(n_failed), "data/skipped_prompts": int(n_skipped),
                   "response_len/mean": float(mask_BxT.sum(1).mean()), "response/truncated": float((~finished_B).mean()),
                   "rollout/tokens_per_s": n_tokens / max(t_rollout, 1e-9), "rollout/seconds": t_rollout,
                   "rollout/decode_steps": int(out.num_steps)}
            if spec_stats is not None:
                row.update(spec_metrics(spec_stats))
                spec_prior, reuse_prior = float(spec_stats.acceptance), float(spec_stats.reuse_acceptance)
            elif spec.enabled:
                row["spec/speculated_frac"] = 0.0
            if drafts is not None:  # every process stores all rows, so process 0's checkpoint holds them
                drafts.update(prompt_BxP, pmask_BxP, gather_rows(rows_sharding, my_tokens_BxT, B),
                              mask_BxT.sum(1).astype(np.int32),
                              gather_rows(rows_sharding, local_rows(out.logp_BxT), B), G)
            pending = (row, metrics, t0)
            if tc.eval_every and step % tc.eval_every == 0 or step == tc.steps:
                last_eval = evaluate(state.params)
                row.update(last_eval)
            # Read once: a signal landing later in this step is seen next step. All processes agree.
            stopping = any_process(stop.requested)
            save_now = (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == tc.steps or stopping
            if save_now or "eval/accuracy" in row:
                _emit(log, bar, *pending)  # the row must be on disk before the checkpoint that covers it
                pending = None
            if "eval/accuracy" in row and is_primary():
                plot(log.rows, workdir / "progress.png", title=str(workdir.name))
            if save_now:
                saved = {"stream": stream._asdict(), "spec_prior": spec_prior, "spec_reuse_prior": reuse_prior}
                if costs is not None:
                    saved["spec_costs"] = costs_to_json(costs)
                if drafts is not None:
                    saved["spec_drafts"] = drafts.to_state()
                ckpt.save(manager, step, state, saved, force=True)
            if stopping:
                print(f"jaxrl: SIGTERM received; saved step {step} to {workdir / 'checkpoints'}", file=sys.stderr)
                break
        if pending is not None:
            _emit(log, bar, *pending)
    finally:
        manager.wait_until_finished()
        manager.close()
        log.close()
        bar.close()
        signal.signal(signal.SIGTERM, previous)
    summary = {"workdir": str(workdir), "base_policy": str(base_path), "steps": tc.steps,
               "final_eval": last_eval}
    if tc.progress and is_primary():
        print(json.dumps(summary))
    return log.rows


def _speculative_costs(cfg: Config, model_cfg, params, host: dict, n_rows: int):
    """The step costs the speculation control uses (None: the configured constants): a resumed run's
    checkpointed ones, else this machine's cached measurement for the rollout shape (measured now if
    missing). Never re-timed within a run, so the wall clock does not pick the sampled tokens."""
    spec = cfg.rollout.speculative
    if not (spec.enabled and spec.calibrate):
        return None
    if "spec_costs" in host:
        costs, where = costs_from_json(host["spec_costs"]), "from the checkpoint"
    else:
        cache_len = prompt_width(cfg.data) + cfg.rollout.max_new_tokens + widest_draft(spec) + 1
        costs, where = constant_costs(spec), ""
        if is_primary():  # the other processes take process 0's costs
            costs, path, measured = cached_step_costs(params, model_cfg, spec, n_rows, cache_len,
                                                      cache_root(cfg) / "speculative_costs")
            where = f"{'measured now, saved to' if measured else 'cached in'} {path}"
        if jax.process_count() > 1:  # every process must feed the rollout the same (replicated) costs
            from jax.experimental import multihost_utils

            costs = jax.tree.map(jnp.asarray, multihost_utils.broadcast_one_to_all(jax.tree.map(np.asarray, costs)))
    if is_primary():
        print(f"jaxrl: speculative costs on this machine ({where}), in plain decode steps: "
              f"verify k=1..{widest_draft(spec)} drafts {[round(float(c), 2) for c in np.asarray(costs.verify_K)]}, "
              f"one drafted token {float(costs.draft):.2f}", file=sys.stderr)
    return costs


def _initial_state(base_params, optimizer, seed: int, param_sh, rep, *, with_ref: bool):
    """(state, its shardings), laid out by the preset: eval_shape -> shardings -> jit(init, out_shardings).
    `with_ref` (the loss's needs_ref) adds a reference copy of the base params; without it
    state.ref_params is None and no checkpoint holds one."""

    def make_state(params, *ref_params):
        return init_state(params, optimizer, jax.random.key(seed), ref_params=ref_params[0] if ref_params else None)

    # The reference is a copy: donating a state whose two fields share buffers is an error.
    args = (base_params, jax.tree.map(jnp.copy, base_params)) if with_ref else (base_params,)
    state_sh = state_shardings(optimizer, jax.eval_shape(make_state, *args), param_sh, rep)
    state = jax.jit(make_state, in_shardings=(param_sh,) * len(args), out_shardings=state_sh)(*args)
    return state, state_sh


def _combined_reward(rewards_BxK: np.ndarray, reward_weights) -> np.ndarray:
    """r_B = sum_k w_k r_ik for the reward/mean metric, as the loss combines them (None: all weights 1)."""
    if reward_weights is None:
        return rewards_BxK.sum(axis=1)
    return rewards_BxK @ np.asarray(reward_weights, np.float32)


def _emit(log: MetricsLog, bar, row: dict, metrics, t0: float) -> None:
    """Pull the device metrics of a dispatched step, write its row and update the progress bar."""
    row = dict(row)
    row.update({k: float(v) for k, v in jax.device_get(metrics).items()})
    row["clip_frac"] = row.get("clipped_low", 0.0) + row.get("clipped_high", 0.0)
    row["step_seconds"] = time.perf_counter() - t0
    log.write(row)
    _stop_if_not_finite(row)
    bar.update(row["step"] - bar.n)
    post = {"reward": f"{row['reward/mean']:.3f}", "tok/s": f"{row['rollout/tokens_per_s']:.0f}"}
    if row.get("eval/accuracy") is not None:
        post["acc"] = f"{row['eval/accuracy']:.3f}"
    bar.set_postfix(post)


def _stop_if_not_finite(row: dict) -> None:
    """A NaN/inf loss or gradient norm stops the run before anything after it is saved (every save
    first pulls its step's row): the newest checkpoint stays the last finite one."""
    bad = {k: row.get(k) for k in ("loss", "grad_norm") if not np.isfinite(row.get(k, 0.0))}
    if bad:
        raise ckpt.NonFiniteError(f"step {row['step']}: " + ", ".join(f"{k} is {v}" for k, v in bad.items()) +
                                  "; stopped without saving this or any later step (the newest checkpoint is the "
                                  "last finite one). Lower optim.learning_rate, or check the rewards")
