"""Reward-model figures read back from finished workdirs: held-out pair accuracy by step (and, for an
`arithmetic` reward model, by the kind of wrong answer), and the held-out accuracy of RL runs against
it beside a verifier-rewarded run.

    PYTHONPATH=. .venv/bin/python benchmarks/reward_model.py \\
        --rm arith=runs/rm_arith --rm even_last=runs/rm_even_last \\
        --rl grpo=runs/grpo_arithmetic --rl grpo_rm=runs/grpo_rm_arith \\
        --out benchmarks/results/reward_model.json

Nothing is trained here: the commands that make the workdirs are in benchmarks/README.md ("Reward
models"). Prints the JSON it writes.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

from jaxrl.config import Config, apply_overrides
from jaxrl.rewards.pairs import carry_dropped, synthetic_pairs


def rows(workdir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def mistake(prompt: str, chosen: str, rejected: str) -> str:
    """Which kind of wrong answer `rejected` is (jaxrl.rewards.pairs.wrong_sum)."""
    a, b = map(int, prompt[:-1].split("+"))
    right, wrong = int(chosen), int(rejected)
    if wrong == carry_dropped(a, b):
        return "carry_dropped"
    if len(rejected) > len(chosen) and wrong // 10 == right:
        return "digit_added"
    if wrong - right in (10, 100):
        return "spurious_carry"
    if abs(wrong - right) <= 10:
        return "off_by_1_to_10"
    return "leading_digit_dropped"


def by_mistake(workdir: pathlib.Path) -> dict:
    """Held-out pair accuracy of an `arithmetic` reward model per kind of wrong answer."""
    from jaxrl.rewards.scorer import load_scorer

    scorer = load_scorer(apply_overrides(Config(), [f"reward_model.workdir={workdir}"]).reward_model)
    config = json.loads((workdir / "reward_model.json").read_text())["config"]  # what trained it
    rm, data = config["reward_model"], config["data"]
    _, test = synthetic_pairs("arithmetic", data["digits"], rm["num_train"], rm["num_test"], data["seed"])
    margin = scorer([p.prompt for p in test], [p.chosen for p in test]) - scorer(
        [p.prompt for p in test], [p.rejected for p in test]
    )
    kinds = np.array([mistake(p.prompt, p.chosen, p.rejected) for p in test])
    return {
        str(k): {"pairs": int((kinds == k).sum()), "accuracy": float((margin[kinds == k] > 0).mean())}
        for k in sorted(set(kinds))
    }


def _tenth(row: dict) -> bool:
    return row["step"] % 10 == 0


def main() -> None:
    ap = argparse.ArgumentParser(description="reward-model figures read back from finished workdirs")
    ap.add_argument("--rm", action="append", default=[], metavar="NAME=DIR", help="a reward model's workdir")
    ap.add_argument("--arithmetic", action="append", default=[], metavar="NAME", help="--rm names to split by mistake")
    ap.add_argument("--rl", action="append", default=[], metavar="NAME=DIR", help="a `jaxrl train` run's workdir")
    ap.add_argument("--out", default="benchmarks/results/reward_model.json")
    args = ap.parse_args()
    out: dict = {"reward_models": {}, "rl": {}}
    for item in args.rm:
        name, workdir = item.split("=", 1)
        evals = [r for r in rows(pathlib.Path(workdir)) if "rm/test_accuracy" in r]
        entry = {
            "workdir": workdir,
            "test_accuracy_by_step": {r["step"]: round(r["rm/test_accuracy"], 4) for r in evals},
            "final_test_accuracy": evals[-1]["rm/test_accuracy"],
        }
        if name in args.arithmetic:
            entry["test_accuracy_by_mistake"] = by_mistake(pathlib.Path(workdir))
        out["reward_models"][name] = entry
    for item in args.rl:
        name, workdir = item.split("=", 1)
        rl = rows(pathlib.Path(workdir))
        out["rl"][name] = {
            "workdir": workdir,
            "eval_accuracy_by_step": {r["step"]: round(r["eval/accuracy"], 4) for r in rl if "eval/accuracy" in r},
            "reward_model_by_step": {
                r["step"]: round(r["reward/reward_model"], 3)
                for r in rl
                if "reward/reward_model" in r and r["step"] % 10 == 0
            },
            "eval_response_len_by_step": {
                r["step"]: round(r["eval/response_len"], 3) for r in rl if "eval/response_len" in r
            },
        }
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
