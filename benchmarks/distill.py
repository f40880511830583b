"""On-policy distillation vs GRPO on the default task: held-out accuracy and compute for the same steps.

    jaxrl train configs/distill_teacher.py --workdir runs/distill_teacher_arithmetic   # the teacher, once
    PYTHONPATH=. .venv/bin/python benchmarks/distill.py                                # 3 seeds x 60 steps

Arms: `grpo` (configs/grpo_arithmetic.py, the default run), `distill` (configs/distill_arithmetic.py:
the same student, warm start, rollout budget and learning rate; the correctness reward replaced by the
teacher's per-token reverse KL) and `distill_reward` (the same with `reward_weight=1`: the KL advantage
plus GRPO's advantage of the correctness reward); `grpo_lr3e-4` and `distill_lr3e-4` are the first two
at three times the learning rate. Each run is `jaxrl train <config>` in its own subprocess with
`train.seed` = the seed (the seed sets the student's warm start and the sampling; the teacher and the
test set are the same for every run), `train.steps` = --steps, held-out greedy accuracy every
--eval-every steps. A finished run under --root is read back instead of retrained.

Compute per step: `step_s`, the median wall seconds between consecutive training rows (steps after
the first, eval steps and the steps after them left out; CPU timings on a shared machine, so compare
arms run under the same load), and model FLOPs (`step_flops`: benchmarks/common.py's convention) of the
rollout, the update and, for distillation, the teacher's one forward per step. Not XLA's cost analysis
(`jaxrl plan`): the layers run as one `lax.scan` and the decode as one while loop, whose bodies it
counts once.

Writes <out>.json (every run, the means) and prints the markdown table, then one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import emit, sequence_flops  # noqa: E402

# arm -> (config file, --set overrides)
ARMS = {
    "grpo": ("configs/grpo_arithmetic.py", ()),
    "distill": ("configs/distill_arithmetic.py", ()),
    "distill_reward": ("configs/distill_arithmetic.py", ("loss.options=reward_weight=1.0",)),
    # Both at 3x the learning rate: is the step size what holds either back at this budget?
    "grpo_lr3e-4": ("configs/grpo_arithmetic.py", ("optim.learning_rate=3e-4",)),
    "distill_lr3e-4": ("configs/distill_arithmetic.py", ("optim.learning_rate=3e-4",)),
}


def _rows(workdir: pathlib.Path) -> list[dict]:
    path = workdir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _finished(rows: list[dict], steps: int) -> bool:
    return any(r["step"] == steps and "eval/accuracy" in r for r in rows)


def train(arm: str, seed: int, args) -> list[dict]:
    workdir = args.root / f"{arm}_s{seed}"
    rows = _rows(workdir)
    if not _finished(rows, args.steps):
        config, extra = ARMS[arm]
        command = [sys.executable, "-m", "jaxrl.cli", "train", config, "--workdir", str(workdir)]
        for override in (
            f"train.seed={seed}",
            f"train.steps={args.steps}",
            f"train.eval_every={args.eval_every}",
            f"checkpoint.every={args.eval_every}",
            *extra,
        ):
            command += ["--set", override]
        log = workdir.with_suffix(".log")
        with log.open("w") as out:
            subprocess.run(command, cwd=REPO, check=True, stdout=out, stderr=subprocess.STDOUT)
        rows = _rows(workdir)
    return rows


def step_seconds(rows: list[dict]) -> float:
    """Median wall s between consecutive training rows, without step 1 (compiles), eval rows and the
    rows right after them."""
    by_step = {r["step"]: r for r in rows}
    gaps = [
        by_step[s]["wall_time"] - by_step[s - 1]["wall_time"]
        for s in sorted(by_step)
        if s >= 3 and s - 1 in by_step and "eval/accuracy" not in by_step[s] and "eval/accuracy" not in by_step[s - 1]
    ]
    return statistics.median(gaps)


def run_record(arm: str, seed: int, rows: list[dict]) -> dict:
    evals = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    train_rows = [r for r in rows if r["step"] > 0]
    record = {
        "arm": arm,
        "seed": seed,
        "accuracy": {str(k): round(v, 4) for k, v in sorted(evals.items())},
        "step_s": round(step_seconds(rows), 4),
        "rollout_s": round(statistics.median(r["rollout/seconds"] for r in train_rows), 4),
        "reward_mean": round(statistics.mean(r["reward/mean"] for r in train_rows), 4),
    }
    if "distill/reverse_kl" in train_rows[0]:  # every tenth step's
        record["reverse_kl"] = {str(r["step"]): round(r["distill/reverse_kl"], 4) for r in train_rows[::10]}
    return record


def _forward_flops(cfg, rows: int, group_size: int, prompt_len: int, new_tokens: int, shared: bool) -> float:
    """Model FLOPs of one forward over `rows` prompt + completion rows (benchmarks/common.py convention);
    `shared`: each group's prompt forwarded once (train.share_prefix on the static sampler's batches)."""
    prompts = rows // group_size if shared else rows
    return prompts * sequence_flops(cfg, 0, prompt_len) + rows * sequence_flops(cfg, prompt_len, new_tokens)


def step_flops(arm: str) -> dict:
    """Model FLOPs of one step (2 per multiply-add, matmuls and attention, every slot of the B x (P + T)
    batch counted, padding included): the rollout (one forward of every slot), the update (forward +
    backward = 3 forwards, per PPO epoch), the teacher's forward (distillation only)."""
    from jaxrl.config import load_config
    from jaxrl.policy.resolve import resolve_policy
    from jaxrl.train.programs import prompt_groups
    from jaxrl.train.teacher import teacher_model_config

    config, extra = ARMS[arm]
    cfg = load_config(REPO / config, list(extra))
    rc, student = cfg.rollout, resolve_policy(cfg).model_cfg
    B, P, T, G = rc.prompts_per_step * rc.group_size, cfg.data.max_prompt_len, rc.max_new_tokens, rc.group_size
    shared = prompt_groups(cfg) > 1
    out = {
        "rollout": B * sequence_flops(student, 0, P + T),
        "update": 3 * cfg.train.ppo_epochs * _forward_flops(student, B, G, P, T, shared),
        "teacher": 0.0,
    }
    if cfg.distill.teacher:
        out["teacher"] = _forward_flops(teacher_model_config(cfg), B, G, P, T, shared)
    return out


def _mean_sd(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {sd:.3f}"


def table(records: list[dict], flops: dict, steps: int) -> str:
    lines = [
        f"| arm | acc. step 0 | acc. step {steps} (per seed) | acc. step {steps} mean ± sd | s / step | "
        "rollout GFLOP | update GFLOP | teacher GFLOP | GFLOP / step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in ARMS:
        runs = [r for r in records if r["arm"] == arm]
        if not runs:
            continue
        final = [r["accuracy"][str(steps)] for r in runs]
        first = [r["accuracy"]["0"] for r in runs]
        f = flops[arm]
        lines.append(
            f"| {arm} | {statistics.mean(first):.3f} | {', '.join(f'{a:.3f}' for a in final)} | {_mean_sd(final)} | "
            f"{statistics.median(r['step_s'] for r in runs):.3f} | {f['rollout'] / 1e9:.3f} | "
            f"{f['update'] / 1e9:.3f} | {f['teacher'] / 1e9:.3f} | {sum(f.values()) / 1e9:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description="on-policy distillation vs GRPO: accuracy and compute")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--root", type=pathlib.Path, default=REPO / "runs" / "distill_study")
    parser.add_argument("--out", type=pathlib.Path, default=REPO / "benchmarks" / "results" / "distill")
    parser.add_argument("--arms", default=",".join(ARMS))
    args = parser.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    args.root = args.root.resolve()
    args.root.mkdir(parents=True, exist_ok=True)
    # Seed-major: the arms of a seed train back to back, so their step times see the same machine load.
    records = [run_record(arm, seed, train(arm, seed, args)) for seed in range(args.seeds) for arm in arms]
    flops = {arm: step_flops(arm) for arm in arms}
    text = table(records, flops, args.steps)
    print(text)
    summary = {
        arm: {
            "accuracy_final_mean": statistics.mean(r["accuracy"][str(args.steps)] for r in records if r["arm"] == arm),
            "step_s_median": statistics.median(r["step_s"] for r in records if r["arm"] == arm),
            **{f"{k}_flops": v for k, v in flops[arm].items()},
        }
        for arm in arms
    }
    result = {"steps": args.steps, "seeds": args.seeds, "runs": records, "summary": summary, "table": text}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    emit({"benchmark": "distill", **{f"{a}_accuracy": round(s["accuracy_final_mean"], 4) for a, s in summary.items()}})


if __name__ == "__main__":
    main()
