"""benchmarks/agents.py runs end to end in --quick mode and prints its JSON line last."""

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_quick_run_prints_the_speedup_json_last():
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "agents.py"), "--quick"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "agents" and result["config"] == "quick" and result["same_episodes"] is True
    assert (
        result["speedup_async_env"]
        == round(result["overlap"]["episodes_per_s"] / result["turn_sync"]["episodes_per_s"], 2)
        > 0
    )
    for mode in ("overlap", "turn_sync"):
        r = result[mode]
        assert r["episodes_per_s"] > 0 and r["tokens_per_s"] > 0 and r["env_steps"] > 0
        # Every step sleeps 20 ms: the measured step seconds are at least that; hidden + exposed = all.
        assert r["env_seconds"] >= 0.02 * r["env_steps"]
        assert abs(r["env_hidden_seconds"] + r["env_exposed_seconds"] - r["env_seconds"]) < 2e-3
    assert result["overlap"]["model_tokens"] == result["turn_sync"]["model_tokens"]  # the same episodes
