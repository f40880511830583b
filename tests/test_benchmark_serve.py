"""benchmarks/serve.py: the latency figures by hand, and a `--small` run end to end (a real `jaxrl serve`
process, the openai client, the in-process engine, the stress phase with disconnects)."""

import sys

import pytest
from harness import REPO, child_env, run_benchmark

sys.path.insert(0, str(REPO))  # `benchmarks` is a plain folder at the repository root

from benchmarks.serve import Trace, latency  # noqa: E402


def test_latency_figures_by_hand():
    """Two requests sent at t=0: tokens at 1, 1, 3 and at 2; 4 tokens in a 4 s round."""
    traces = [Trace(sent=0.0, times=[1.0, 1.0, 3.0], tokens=[5, 6, 7]), Trace(sent=0.0, times=[2.0], tokens=[8])]
    out = latency([*traces, Trace(error="TimeoutError: ")], 4.0)
    assert out["tokens"] == 4 and out["tokens_per_s"] == 1.0 and out["errors"] == 1
    assert out["ttft_p50_s"] == pytest.approx(1.5) and out["ttft_p99_s"] == pytest.approx(1.99)
    # gaps: 0 (two tokens of one chunk) and 2
    assert out["itl_p50_s"] == pytest.approx(1.0) and out["itl_p99_s"] == pytest.approx(1.98)


@pytest.mark.slow
def test_serve_benchmark_small(cache_env):
    """--small in a child Python (it starts `jaxrl serve` as its own child): both sides drew the same
    tokens, every stress request completed correctly or was left by its client, the slots are free."""
    result = run_benchmark("serve.py", "--small", env=child_env(cache_env), timeout=300)
    assert result["config"] == "tiny" and result["same_tokens"] is True
    server, local = result["rounds"]["server"][0], result["rounds"]["in_process"][0]
    assert server["tokens"] == local["tokens"] > 0 and server["errors"] == local["errors"] == 0
    assert result["serve_overhead"] == pytest.approx(local["tokens_per_s"] / server["tokens_per_s"])
    assert 0 < server["ttft_p50_s"] <= server["ttft_p99_s"] and 0 <= server["itl_p50_s"] <= server["itl_p99_s"]
    stress = result["stress"]
    (only,) = stress["stress_rounds"]
    assert stress["lost_requests"] == only["lost_requests"] == 0 and stress["all_slots_free"] is True
    assert only["correct"] == only["completed"] and only["cancelled_by_client"] > 0
    assert only["completed"] + only["cancelled_by_client"] == stress["stress_clients"] == 24
    assert len(stress["server_rss_mib"]) == 2 and min(stress["server_rss_mib"]) > 0
    stats = only["stats"]
    assert stats["active"] == stats["queued"] == stats["failed"] == 0 and stats["free_slots"] == 4
