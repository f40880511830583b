"""benchmarks/engine_training.py's per-run summary, by hand: RL seconds from the step-1 row, samples
drawn (the engine's rollout/samples, plus samples restarted by the staleness bound; static runs count
B per step) and both at the first evaluation at or above the target."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `benchmarks` is a folder at the root
from benchmarks.engine_training import ARMS, overrides, summarise


def _rows():
    return [
        {"step": 0, "eval/accuracy": 0.2, "wall_time": 100.0},
        {"step": 1, "reward/mean": 0.1, "response_len/mean": 10.0, "wall_time": 130.0, "rollout/samples": 64},
        {
            "step": 2,
            "reward/mean": 0.2,
            "response_len/mean": 20.0,
            "wall_time": 132.0,
            "rollout/samples": 96,
            "engine/restarted_samples": 8,
            "eval/accuracy": 0.3,
        },
        {
            "step": 3,
            "reward/mean": 0.3,
            "response_len/mean": 30.0,
            "wall_time": 135.0,
            "rollout/samples": 64,
            "eval/accuracy": 0.5,
        },
    ]


def test_summary_by_hand():
    s = summarise(_rows(), target=0.45, batch_rows=64)
    # the clock starts at step 1's row (130): steps 2 and 3 took 2 s and 3 s
    assert s["rl_seconds"] == pytest.approx(5.0) and s["steps_per_s"] == pytest.approx(2 / 5.0)
    # samples: 64, then 96 + 8 restarted, then 64 -> 232 in all; the target is first met at step 3
    assert s["samples"] == 232 and s["samples_to_target"] == 232 and s["seconds_to_target"] == pytest.approx(5.0)
    assert s["step_to_target"] == 3 and s["final_accuracy"] == 0.5 and s["base_accuracy"] == 0.2
    assert s["response_len"] == pytest.approx(20.0)


def test_static_runs_count_the_batch_and_an_unreached_target_is_none():
    rows = [{k: v for k, v in r.items() if not k.startswith(("rollout/", "engine/"))} for r in _rows()]
    s = summarise(rows, target=0.9, batch_rows=64)
    assert s["samples"] == 3 * 64 and s["samples_to_target"] is None and s["seconds_to_target"] is None


def test_every_arm_shares_one_warm_start_and_varies_the_seed():
    for arm in ARMS:
        sets = overrides(arm, 2, type("A", (), {"steps": 5, "eval_every": 5, "eval_prompts": 10, "set": []})())
        assert "train.seed=2" in sets and "warmstart.seed=0" in sets and all(a in sets for a in ARMS[arm])
