"""benchmarks/speculative.py runs end to end on random tiny weights and prints its JSON line last."""

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_small_run_prints_speedups_json_last(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "speculative.py"), "--small",
                           "--root", str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "speculative" and result["config"] == "tiny"
    emb = result["embedded"]
    assert set(emb) == {"plain", "early_exit_k4", "reuse", "reuse_forced"}
    assert emb["plain"]["speedup"] == 1.0 and result["speedup_best_self_draft"] == emb["early_exit_k4"]["speedup"] > 0
    assert result["speedup_trajectory_reuse"] == emb["reuse"]["speedup"] > 0
    assert 0 < result["acceptance_rate"] <= 1 and emb["early_exit_k4"]["speculated_frac"] == 1.0
    # Same prompts, same number of rows: the generated token counts are real, positive numbers.
    assert all(r["tokens"] > 0 and r["tokens_per_s"] > 0 for r in emb.values())
