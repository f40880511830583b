"""Regenerate the README's headline figures from the runs that produce them.

    .venv/bin/python scripts/readme_figures.py                 # default, MoE and countdown configs
    .venv/bin/python scripts/readme_figures.py --configs grpo_arithmetic

Each config trains with `jaxrl train configs/<name>.py` in its own workdir under --root, with data and
warm-start caches of its own under --root (empty on the first run, so the wall time includes building
the dataset and the warm start, as on a fresh clone; the virtualenv set-up of `make train` is not
timed). A finished run is read back, not retrained. Writes --out (JSON: date, commit, machine, and per
config the held-out accuracy at step 0, step 10 and the last step, and the wall time), copies the
default run's progress plot to docs/progress.png, and prints one JSON line last. The README's numbers
are copied from that file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT = ("grpo_arithmetic", "grpo_arithmetic_moe", "grpo_countdown")


def _parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=",".join(DEFAULT), help="config stems under configs/, comma-separated")
    ap.add_argument("--root", default="runs/readme_figures", help="workdirs and caches of these runs")
    ap.add_argument("--out", default="docs/readme_figures.json")
    ap.add_argument("--plot", default="docs/progress.png", help="where the default run's progress.png goes")
    args = ap.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    missing = [c for c in args.configs if not (REPO / "configs" / f"{c}.py").is_file()]
    if missing:
        ap.error(f"--configs: no configs/{missing[0]}.py")
    return args


def _commit() -> str:
    def git(*a):
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def _rows(workdir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _train(name: str, root: pathlib.Path) -> dict:
    """Train configs/NAME.py to its end in root/NAME (a finished run is read back): its figures."""
    workdir, done = root / name, root / name / "figures_wall_seconds.json"
    env = dict(os.environ, JAXRL_DATA_DIR=str(root / "cache" / "tfds"), JAXRL_CACHE_DIR=str(root / "cache" / "warm"))
    if not done.exists():
        print(f"readme_figures: training configs/{name}.py in {workdir} ...", file=sys.stderr, flush=True)
        t0 = time.time()
        cmd = [sys.executable, "-m", "jaxrl.cli", "train", f"configs/{name}.py", "--workdir", str(workdir)]
        subprocess.run([*cmd, "--set", "train.progress=false"], cwd=REPO, env=env, check=True)
        done.write_text(json.dumps({"wall_seconds": time.time() - t0, "load_average": os.getloadavg()}))
    evals = {r["step"]: r["eval/accuracy"] for r in _rows(workdir) if "eval/accuracy" in r}
    last = max(evals)
    return {
        "config": f"configs/{name}.py",
        "accuracy_step0": evals[0],
        "accuracy_step10": evals.get(10),
        "accuracy_last": evals[last],
        "last_step": last,
        **json.loads(done.read_text()),
    }


def main(argv=None) -> dict:
    args = _parse(argv)
    root = (REPO / args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    commit = _commit()  # before the plot is copied into the working tree
    runs = {name: _train(name, root) for name in args.configs}
    if "grpo_arithmetic" in runs:
        shutil.copyfile(root / "grpo_arithmetic" / "progress.png", REPO / args.plot)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "cpus": os.cpu_count(),
        "runs": runs,
    }
    out = REPO / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    for name, r in runs.items():
        step10 = "-" if r["accuracy_step10"] is None else f"{100 * r['accuracy_step10']:.1f}%"
        print(
            f"{name}: {100 * r['accuracy_step0']:.1f}% -> {step10} (step 10) -> {100 * r['accuracy_last']:.1f}% "
            f"(step {r['last_step']}), {r['wall_seconds'] / 60:.1f} min at load {r['load_average'][0]:.1f}"
        )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
