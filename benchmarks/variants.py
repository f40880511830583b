"""Train every loss preset on the embedded task with several seeds; write a results table and a plot.

    PYTHONPATH=. .venv/bin/python benchmarks/variants.py                    # every preset, 3 seeds
    PYTHONPATH=. .venv/bin/python benchmarks/variants.py --presets grpo,dapo --seeds 5 --steps 100

Each run is `jaxrl train configs/<preset>_arithmetic.py` (the preset's own config: same model, warm
start, task, learning rate and rollout budget as the default run; MC-GRPO draws G+1 = 9, SAO draws one
rollout for each of 128 prompts) in its own subprocess, with `train.seed` = the seed. The seed sets
the warm start (initial weights and which demonstrations the fallible teacher gets wrong, so each
seed has its own base policy, shared by every preset) and the RL sampling; prompt order and the test
set stay fixed.
Every run takes `train.ppo_epochs=2` (--ppo-epochs): two optimizer steps per rollout batch, so the
second is off-policy. With one epoch the ratio is exactly 1 at the only update, and presets whose
gradients then differ by a global factor (token-mean vs 1/k normalisers, CISPO vs PPO-clip) train
bit-identically under global-norm clipping at 1 with Adam; the clip/trust-region parts never act.
The MC-GRPO study adds GRPO at G = 2 and MC-GRPO at G = 2 (it draws G + 1 = 3) next to the G = 8
runs of the main table.

Nothing is lost: each run has its own workdir under --root (checkpointed, so a killed run resumes)
and a finished run is read back instead of retrained, so the script can be stopped and rerun.
Writes `<out>.md` (tables), `<out>.json` (every run) and `<out>.png` (mean held-out accuracy by step),
then prints one JSON line last.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jaxrl.losses import PRESETS  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Arm:
    """One line of a table: a preset at a group size (None = its config's)."""

    label: str
    preset: str
    group_size: int | None = None


@dataclasses.dataclass(frozen=True)
class Budget:
    steps: int
    eval_every: int
    eval_prompts: int
    target: float  # held-out accuracy for "steps to target"
    ppo_epochs: int = 2
    extra: tuple = ()  # more --set overrides, applied to every run

    def overrides(self, arm: Arm, seed: int) -> list[str]:
        sets = [
            f"train.steps={self.steps}",
            f"train.seed={seed}",
            f"train.eval_every={self.eval_every}",
            f"train.eval_prompts={self.eval_prompts}",
            f"train.ppo_epochs={self.ppo_epochs}",
            "train.progress=false",
            f"checkpoint.every={max(self.eval_every, 1)}",
        ]
        if arm.group_size is not None:
            sets.append(f"rollout.group_size={arm.group_size}")
        return sets + list(self.extra)


MC_STUDY = (Arm("grpo G=2", "grpo", 2), Arm("mc_grpo G=2 (draws 3)", "mc_grpo", 3))


def run_dir(root: pathlib.Path, arm: Arm, seed: int, budget: Budget) -> pathlib.Path:
    g = "cfg" if arm.group_size is None else f"G{arm.group_size}"
    # Everything that changes the run is in the name, so a finished run is only reused for the same job.
    key = hashlib.sha1(json.dumps(budget.overrides(arm, seed)).encode()).hexdigest()[:8]
    return root / f"{arm.preset}_{g}_seed{seed}_steps{budget.steps}_{key}"


def read_rows(workdir: pathlib.Path) -> list[dict]:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def finished(rows: list[dict], steps: int) -> bool:
    return any(r.get("step") == steps and "eval/accuracy" in r for r in rows)


def summarise_run(rows: list[dict], target: float) -> dict:
    """Final held-out accuracy, the first evaluated step at or above `target` (None if never), the
    accuracy curve, and the mean sampled response length over training."""
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    train = [r for r in rows if "reward/mean" in r]
    reached = [s for s, a in evals if s > 0 and a >= target]
    return {
        "final_accuracy": evals[-1][1],
        "base_accuracy": evals[0][1],
        "curve": evals,
        "steps_to_target": reached[0] if reached else None,
        "response_len": statistics.fmean(r["response_len/mean"] for r in train) if train else math.nan,
        "final_reward": statistics.fmean(r["reward/mean"] for r in train[-10:]) if train else math.nan,
        "clip_frac": statistics.fmean(r.get("clip_frac", 0.0) for r in train) if train else math.nan,
    }


def train_one(arm: Arm, seed: int, budget: Budget, root: pathlib.Path, env: dict) -> dict:
    workdir = run_dir(root, arm, seed, budget)
    rows = read_rows(workdir)
    t0 = time.perf_counter()
    reused = finished(rows, budget.steps)
    if not reused:
        cmd = [
            sys.executable,
            "-m",
            "jaxrl.cli",
            "train",
            str(REPO / "configs" / f"{arm.preset}_arithmetic.py"),
            "--workdir",
            str(workdir),
        ]
        for s in budget.overrides(arm, seed):
            cmd += ["--set", s]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"label": arm.label, "preset": arm.preset, "seed": seed, "error": " | ".join(tail)}
        rows = read_rows(workdir)
    out = {
        "label": arm.label,
        "preset": arm.preset,
        "seed": seed,
        "workdir": str(workdir),
        "reused": reused,
        "seconds": None if reused else time.perf_counter() - t0,
    }
    return dict(out, **summarise_run(rows, budget.target))


def _mean_std(xs: list[float]) -> str:
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{100 * xs[0]:.1f}"
    return f"{100 * statistics.fmean(xs):.1f} ± {100 * statistics.stdev(xs):.1f}"


def aggregate(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    accs = [r["final_accuracy"] for r in ok]
    hit = [r["steps_to_target"] for r in ok if r["steps_to_target"] is not None]
    return {
        "n": len(ok),
        "errors": [r["error"] for r in runs if "error" in r],
        "accuracy": accs,
        "accuracy_mean": statistics.fmean(accs) if accs else None,
        "accuracy_std": statistics.stdev(accs) if len(accs) > 1 else None,
        "gain": statistics.fmean(r["final_accuracy"] - r["base_accuracy"] for r in ok) if ok else None,
        "steps_to_target": hit,
        "reached": f"{len(hit)}/{len(ok)}",
        "response_len": statistics.fmean(r["response_len"] for r in ok) if ok else None,
        "final_reward": statistics.fmean(r["final_reward"] for r in ok) if ok else None,
        "clip_frac": statistics.fmean(r["clip_frac"] for r in ok) if ok else None,
    }


def table(arms: list[Arm], by_label: dict, target: float, suffix: dict | None = None) -> list[str]:
    lines = [
        f"| preset | held-out accuracy % (mean ± std) | gain (points) | steps to {100 * target:.0f}% (mean; "
        "reached) | response length | train reward (last 10 steps) | clip fraction |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in arms:
        a = by_label[arm.label]
        if not a["n"]:
            lines.append(
                f"| {arm.label}{(suffix or {}).get(arm.label, '')} | failed: {'; '.join(a['errors'])[:200]} | | | | | |"
            )
            continue
        steps = f"{statistics.fmean(a['steps_to_target']):.0f}" if a["steps_to_target"] else "never"
        lines.append(
            f"| {arm.label}{(suffix or {}).get(arm.label, '')} | {_mean_std(a['accuracy'])} | "
            f"{100 * a['gain']:+.1f} | {steps} ({a['reached']}) | "
            f"{a['response_len']:.2f} | {a['final_reward']:.3f} | {a['clip_frac']:.4f} |"
        )
    return lines


def plot(arms: list[Arm], runs: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [([a for a in arms if a not in MC_STUDY], "every preset (mean over seeds)")]
    if any(a in MC_STUDY for a in arms):
        study = [a for a in arms if a in MC_STUDY or a.preset in ("grpo", "mc_grpo")]
        panels.append((study, "MC-GRPO vs GRPO at G = 2 and G = 8"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5), squeeze=False)
    cmap = plt.get_cmap("tab20")
    for ax, (group, title) in zip(axes[0], panels):
        for i, arm in enumerate(group):
            curves = [r["curve"] for r in runs if r["label"] == arm.label and "curve" in r]
            if not curves:
                continue
            steps = [s for s, _ in curves[0]]
            mean = [statistics.fmean(c[j][1] for c in curves if len(c) > j) for j in range(len(steps))]
            ax.plot(
                steps, [100 * m for m in mean], label=arm.label, color=cmap(i % 20), linestyle="-" if i < 10 else "--"
            )
        ax.set_xlabel("GRPO step")
        ax.set_ylabel("held-out greedy accuracy (%)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="all", help="comma-separated preset names, or 'all'")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-prompts", type=int, default=500)
    p.add_argument("--target", type=float, default=0.7, help="held-out accuracy for 'steps to target'")
    p.add_argument(
        "--ppo-epochs",
        type=int,
        default=2,
        help="optimizer steps per rollout batch (1 = on-policy: the ratio is exactly 1, see the docstring)",
    )
    p.add_argument("--no-mc-study", action="store_true", help="skip the MC-GRPO G=2 runs")
    p.add_argument(
        "--root",
        default=os.path.expanduser("~/.cache/jaxrl/bench_variants"),
        help="where the run workdirs live (kept: reruns reuse finished runs)",
    )
    p.add_argument(
        "--out",
        default=str(REPO / "benchmarks" / "results" / "variants"),
        help="output path without suffix: writes .md, .json and .png",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="extra config override for every run (repeatable)",
    )
    args = p.parse_args(argv)

    names = sorted(PRESETS) if args.presets == "all" else [n.strip() for n in args.presets.split(",") if n.strip()]
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        p.error(f"--presets: unknown {', '.join(unknown)}; known: {', '.join(sorted(PRESETS))}")
    if min(args.seeds, args.steps, args.eval_every, args.ppo_epochs) < 1:
        p.error("--seeds, --steps, --eval-every and --ppo-epochs must be >= 1")
    if not 0 < args.target <= 1:
        p.error(f"--target: got {args.target}, expected a fraction in (0, 1]")
    budget = Budget(args.steps, args.eval_every, args.eval_prompts, args.target, args.ppo_epochs, tuple(args.set))
    arms = [Arm(n, n) for n in names]
    if not args.no_mc_study:
        arms += list(MC_STUDY)
    root = pathlib.Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # Every run compiles the same rollout and evaluation programs: share them through XLA's disk cache.
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(root / "xla_cache"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

    from tqdm import tqdm

    jobs = [(arm, seed) for seed in range(args.seeds) for arm in arms]  # seed-major: partial runs cover all
    runs = []
    t_start = time.perf_counter()
    with tqdm(jobs, desc="variants", dynamic_ncols=True) as bar:
        for arm, seed in bar:
            bar.set_postfix_str(f"{arm.label} seed {seed}")
            r = train_one(arm, seed, budget, root, env)
            runs.append(r)
            acc = f"{100 * r['final_accuracy']:.1f}%" if "final_accuracy" in r else f"FAILED: {r['error']}"
            tqdm.write(f"{arm.label:28s} seed {seed}: {acc}")
            write_outputs(arms, runs, budget, args, out, time.perf_counter() - t_start, partial=True)
    summary = write_outputs(arms, runs, budget, args, out, time.perf_counter() - t_start, partial=False)
    print(json.dumps(summary))
    return summary


def write_outputs(arms, runs, budget, args, out: pathlib.Path, seconds: float, partial: bool) -> dict:
    by_label = {a.label: aggregate([r for r in runs if r["label"] == a.label]) for a in arms}
    done = [a for a in arms if any(r["label"] == a.label for r in runs)]
    main_arms = [a for a in done if a not in MC_STUDY]
    base_by_seed = sorted({(r["seed"], r["base_accuracy"]) for r in runs if "base_accuracy" in r})
    base_text = (
        (
            "; base policy (the seed's warm start, shared by all presets) "
            + ", ".join(f"seed {s}: {100 * a:.1f}%" for s, a in base_by_seed)
        )
        if base_by_seed
        else ""
    )
    lines = [
        "# Loss presets on the embedded task",
        "",
        "Written by `benchmarks/variants.py`" + (" (PARTIAL: still running)" if partial else "") + ". "
        f"{args.seeds} seed(s) x {budget.steps} GRPO steps per preset, held-out greedy accuracy on "
        f"{budget.eval_prompts} test prompts every {budget.eval_every} steps{base_text}. "
        f"train.ppo_epochs={budget.ppo_epochs} (optimizer steps per rollout batch).",
        "",
        "Each preset runs its own `configs/<preset>_arithmetic.py`; `train.seed` varies the warm start and "
        "the sampling, the prompt order and test set do not. Accuracy is the final evaluation; gain is "
        "final minus the seed's base accuracy (mean over seeds); steps to target is the "
        "first evaluated step at or above the target, averaged over the seeds that reached it; "
        "response length is the mean sampled completion length (tokens, EOS included) over training.",
        "",
    ]
    lines += table(main_arms, by_label, budget.target)
    study = [a for a in done if a in MC_STUDY]
    if study:
        lines += [
            "",
            "## MC-GRPO at G = 2 vs G = 8",
            "",
            "MC-GRPO's claim: with a median baseline over G + 1 samples, G = 2 closes most of the gap to "
            "G = 8. G counts the completions that carry gradient; MC-GRPO draws one more (the pivot).",
            "",
        ]
        g8 = [a for a in main_arms if a.preset in ("grpo", "mc_grpo")]
        lines += table(study + g8, by_label, budget.target, suffix={"grpo": " G=8", "mc_grpo": " G=8 (draws 9)"})
        gap = _gap_closed(by_label)
        if gap is not None:
            lines += [
                "",
                f"Gap closed by MC-GRPO at G = 2: (mc_grpo G=2 - grpo G=2) / (grpo G=8 - grpo G=2) "
                f"= {gap:.2f} (mean final accuracies).",
            ]
    lines += ["", f"Wall time of this invocation: {seconds / 60:.1f} min (runs read back from --root cost ~0)."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(
        json.dumps({"budget": dataclasses.asdict(budget), "target": budget.target, "runs": runs}, indent=1)
    )
    plot(done, runs, out.with_suffix(".png"))
    return {
        "presets": len(main_arms),
        "runs": len(runs),
        "failed": sum("error" in r for r in runs),
        "seconds": round(seconds, 1),
        "gap_closed_mc_grpo_g2": _gap_closed(by_label),
        "accuracy_mean": {a.label: by_label[a.label]["accuracy_mean"] for a in done},
        "table": str(out.with_suffix(".md")),
    }


def _gap_closed(by_label: dict) -> float | None:
    try:
        lo, hi = by_label["grpo G=2"]["accuracy_mean"], by_label["grpo"]["accuracy_mean"]
        mc = by_label["mc_grpo G=2 (draws 3)"]["accuracy_mean"]
    except KeyError:
        return None
    if None in (lo, hi, mc) or abs(hi - lo) < 1e-9:
        return None
    return (mc - lo) / (hi - lo)


if __name__ == "__main__":
    main()
