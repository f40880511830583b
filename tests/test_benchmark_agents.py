"""benchmarks/agents.py runs end to end in --quick mode and prints its JSON line last (in this
process: the benchmark needs no fresh interpreter, and its environment steps run on threads)."""

import pytest
from harness import run_benchmark_here


@pytest.mark.slow
def test_quick_run_prints_the_speedup_json_last(capsys):
    result = run_benchmark_here("agents.py", "--quick", capsys=capsys, min_lines=4)  # header, two modes, JSON
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
