"""`jaxrl eval`: score a policy on its task's test split.

    greedy accuracy   one temperature-0 completion per prompt (the trainer's held-out evaluator)
    pass@k            K sampled completions per prompt (rollout.temperature, top_k, top_p, or
                      --temperature), unbiased estimator over the K (jaxrl.eval.metrics)
    maj@k             majority vote over the final answers of the first k of those samples

for k = 1, 2, 4, ... up to K (and K). The samples are drawn as the rollout draws them: all K completions
of a chunk of prompts in one sampler call (jaxrl.train.evaluate.sample_in_chunks), chunk c with
fold_in(key(--seed), c), so a given --seed gives the same numbers. An environment's test records are
scored by greedy episodes only (the trainer's evaluator, jaxrl.sources.agents: greedy/accuracy,
return, turns, tool calls). The report goes to the terminal (a table) and to a JSON file: --out, else
the run's eval/step_<N>.json, else runs/eval/ (`report_path`).
"""

from __future__ import annotations

import json
import pathlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxrl.config import Config
from jaxrl.data.registry import get_task
from jaxrl.data.rewards import score
from jaxrl.data.tokenizer import decode_completions
from jaxrl.eval.metrics import ks_up_to, sample_metrics
from jaxrl.eval.sources import EvalError, Located, Policy, load_policy, locate, run_model
from jaxrl.models.transformer import rollout_params
from jaxrl.multihost import from_primary
from jaxrl.sources.agents import make_agent_evaluator
from jaxrl.train.evaluate import EVAL_CHUNK, encode_records, make_chunk_sampler, make_evaluator, sample_in_chunks


class EvalRequest(NamedTuple):
    config_path: str
    samples: int = 1  # K completions per prompt
    prompts: int | None = None  # the first N test prompts (None: the whole test split)
    temperature: float | None = None  # None: rollout.temperature
    seed: int = 0
    out: str | None = None  # the JSON report's path
    overrides: tuple[str, ...] = ()  # the --set flags (a run's own model.* wins over the config's)


def check_request(req: EvalRequest) -> None:
    if req.samples < 1:
        raise EvalError(f"--samples {req.samples}: expected at least 1 completion per prompt")
    if req.prompts is not None and req.prompts < 1:
        raise EvalError(f"--prompts {req.prompts}: expected at least 1 test prompt")
    if req.temperature is not None and not req.temperature >= 0:
        raise EvalError(f"--temperature {req.temperature}: expected >= 0 (0 is greedy)")


def split_records(cfg: Config, task, prompts: int | None) -> list[dict]:
    """The first `prompts` records of the test split (all of it by default)."""
    n = len(task.test)
    if prompts is not None and prompts > n:
        raise EvalError(f"--prompts {prompts}: the test split has {n} records (data.num_test={cfg.data.num_test})")
    return [task.test[i] for i in range(prompts or n)]


def greedy_metrics(cfg: Config, policy: Policy, records: list[dict], verifier, ep=None) -> dict:
    """The trainer's held-out evaluator over these records: greedy accuracy, format, response length.
    ep: the run's `sharding.parallel_for(mesh, preset)` (rows split over its batch axes; MoE experts)."""
    evaluate = make_evaluator(cfg, policy.model_cfg, policy.tokenizer, records, verifier, parallel=ep)
    with tqdm(total=len(records), desc="greedy", unit="prompt", disable=not cfg.train.progress) as bar:
        found = evaluate(policy.params, on_chunk=bar.update)
    return {f"greedy/{k.split('/', 1)[1]}": v for k, v in found.items()}


def sampled_metrics(cfg: Config, policy: Policy, records: list[dict], verifier, req: EvalRequest, ep=None) -> dict:
    """pass@k and maj@k from K samples per prompt, and the samples' format and length (ep: as greedy_metrics;
    every process samples its rows, process 0 scores)."""
    K, B = req.samples, len(records)
    temperature = cfg.rollout.temperature if req.temperature is None else req.temperature
    _, tok_BxP, mask_BxP = encode_records(cfg, policy.tokenizer, records, "test prompts")
    # As many rows per call as a training rollout (or the greedy evaluator) uses.
    chunk = min(B, max(1, max(EVAL_CHUNK, cfg.rollout.prompts_per_step * cfg.rollout.group_size) // K))
    sampler = make_chunk_sampler(
        cfg, policy.model_cfg, policy.tokenizer, group_size=K, greedy=False, temperature=temperature,
        parallel=ep,
    )  # fmt: skip
    rng = jax.random.key(req.seed)
    with tqdm(total=B, desc=f"sampling {K} per prompt", unit="prompt", disable=not cfg.train.progress) as bar:
        tokens_NxT, finished_N, length_N = sample_in_chunks(
            sampler, policy.params, tok_BxP, mask_BxP, chunk, rng, K, bar.update, ep
        )
    return from_primary(lambda: _score_samples(cfg, policy, records, verifier, (tokens_NxT, finished_N, length_N), K))


def _score_samples(cfg: Config, policy: Policy, records: list[dict], verifier, drawn: tuple, K: int) -> dict:
    tokens_NxT, finished_N, length_N = drawn
    B = len(records)
    texts, _ = decode_completions(policy.tokenizer, tokens_NxT)
    rewards_NxR, _ = score(verifier, texts, list(finished_N), [r for r in records for _ in range(K)])
    correct_BxK = (rewards_NxR[:, 0] >= 1.0).reshape(B, K)
    task = get_task(cfg.data.task)
    answers_BxK = [[task.answer_of(t) for t in texts[b * K : (b + 1) * K]] for b in range(B)]
    found = sample_metrics(correct_BxK, answers_BxK, ks_up_to(K))
    metrics = {f"pass@{k}": v for k, v in found["pass@k"].items()}
    metrics.update({f"maj@{k}": v for k, v in found["maj@k"].items()})
    metrics["sampled/format"] = float(rewards_NxR[:, 1].mean())
    metrics["sampled/response_len"] = float(length_N.mean())
    return metrics


def report_path(req: EvalRequest, located: Located) -> pathlib.Path:
    """--out; else the run's eval/step_<N>.json (--workdir, or a --checkpoint inside a run); else
    runs/eval/<config stem>_<source>.json under the current directory (runs/ is where `jaxrl train`
    puts runs by default, and git ignores it): never a file in the checkout itself."""
    if req.out:
        return pathlib.Path(req.out)
    if located.kind == "workdir" and located.path is not None:
        return located.path / "eval" / f"step_{located.step}.json"
    if located.run_dir is not None and located.step is not None:
        return located.run_dir / "eval" / f"step_{located.step}.json"
    name = "_".join(
        [pathlib.Path(req.config_path).stem, located.kind]
        + ([located.path.resolve().name] if located.path is not None else [])
        + ([f"step_{located.step}"] if located.step is not None else [])
    )
    return pathlib.Path("runs") / "eval" / f"{name}.json"


def run_eval(cfg: Config, req: EvalRequest, located: Located) -> tuple[dict, pathlib.Path]:
    """Score the located policy on the config's test split; write the JSON report. -> (report, its path)."""
    from jaxrl.data.tasks import load_task
    from jaxrl.multihost import is_primary
    from jaxrl.sharding import make_mesh, parallel_for

    check_request(req)
    if (get_task(cfg.data.task).episodic or get_task(cfg.data.task).black_box) and req.samples > 1:
        raise EvalError(
            f"--samples {req.samples}: data.task={cfg.data.task!r} plays episodes, scored by greedy "
            "episodes only; drop --samples"
        )
    cfg = run_model(cfg, located, req.overrides)
    task = load_task(cfg.data)
    records = split_records(cfg, task, req.prompts)
    mesh, preset = make_mesh(cfg.mesh)
    policy = load_policy(cfg, located, mesh, preset, task, cfg.train.progress)
    if jnp.dtype(policy.model_cfg.dtype) != jnp.float32:  # every forward below is a rollout's: cast once
        policy = policy._replace(params=jax.jit(rollout_params, static_argnames="cfg")(policy.params, policy.model_cfg))
    ep = parallel_for(mesh, preset)  # rows split over the batch axes, MoE experts as training splits them
    if task.spec.black_box:  # the trainer's greedy episodes of the agent, through an in-process server
        from jaxrl.sources.blackbox import AgentServer, make_blackbox_evaluator

        kept, server = records, AgentServer(cfg, policy.model_cfg, policy.tokenizer, ep)
        try:
            evaluate = make_blackbox_evaluator(cfg, task, records, server)
            metrics = {f"greedy/{k.split('/', 1)[1]}": v for k, v in evaluate(policy.params).items()}
        finally:
            server.close()
    elif task.spec.episodic:  # the trainer's held-out episodes (jaxrl.sources.agents)
        kept = records
        evaluate = make_agent_evaluator(cfg, policy.model_cfg, policy.tokenizer, task.spec.suite, records, ep)
        metrics = {f"greedy/{k.split('/', 1)[1]}": v for k, v in evaluate(policy.params).items()}
    else:
        kept, _, _ = encode_records(cfg, policy.tokenizer, records, "test prompts")
        metrics = greedy_metrics(cfg, policy, kept, task.verifier, ep)
        metrics.update(sampled_metrics(cfg, policy, kept, task.verifier, req, ep))
    report = {
        "config": req.config_path,
        "source": {"kind": located.kind, "path": None if located.path is None else str(located.path)},
        "params": policy.origin,
        "step": located.step,
        "task": cfg.data.task,
        "test_split": task.test.name,
        "prompts": len(kept),
        "skipped_prompts": len(records) - len(kept),
        "samples": req.samples,
        "temperature": cfg.rollout.temperature if req.temperature is None else req.temperature,
        "top_k": cfg.rollout.top_k,
        "top_p": cfg.rollout.top_p,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "seed": req.seed,
        "metrics": metrics,
    }
    path = report_path(req, located)
    if is_primary():  # every process holds the same report
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
    return report, path


def format_table(report: dict) -> str:
    """metric | k | value, as a Markdown table, under a line saying what was scored."""
    m = report["metrics"]
    rows = [("greedy accuracy", 1, m["greedy/accuracy"])]
    for name in ("pass", "maj"):
        rows += [(f"{name}@k", int(key.split("@")[1]), v) for key, v in m.items() if key.startswith(f"{name}@")]
    step = "" if report["step"] is None else f" step {report['step']}"
    head = (
        f"{report['source']['kind']}{step}: {report['prompts']} test prompts of {report['task']}, "
        f"{report['samples']} samples each at temperature {report['temperature']:g}, seed {report['seed']}"
    )
    lines = [head, "| metric | k | value |", "|---|---|---|"]
    lines += [f"| {name} | {k} | {float(np.round(v, 4)):.4f} |" for name, k, v in rows]
    return "\n".join(lines)


__all__ = ["EvalError", "EvalRequest", "format_table", "locate", "run_eval"]
