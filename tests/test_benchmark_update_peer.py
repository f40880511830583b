"""update.py --run-peer (the PyTorch forward+backward peer, same run) and update_variants.py, --small,
each `main` in this process (the torch peer is still update.py's child). The one update.py run checks
its own figures as well as the peer's."""

import math

import pytest
from harness import run_benchmark_here


def _run(script: str, *args: str, capsys) -> dict:
    return run_benchmark_here(script, *args, "--small", capsys=capsys)


@pytest.mark.slow
def test_update_run_peer_reports_same_run_speedup(capsys):
    result = _run("update.py", "--run-peer", capsys=capsys)
    assert result["tokens_per_s"] > 0 and 0 < result["mfu"], result
    assert result["matmul_peak_gflops"] > 0 and result["seconds"] > 0, result
    assert result["config"] == "tiny"
    assert result["trained_tokens"] == result["shape"]["batch"] * result["shape"]["seq"]
    assert result["share_prefix"] is True  # the default, as in the training loop
    torch = result["torch"]
    assert torch["tokens_per_s"] > 0 and torch["torch_threads"] >= 1 and torch["cpu_seconds"] > 0
    assert math.isclose(result["speedup_vs_torch"], result["tokens_per_s"] / torch["tokens_per_s"])
    assert math.isclose(
        result["speedup_vs_torch_cpu"], result["tokens_per_cpu_s_x_cores"] / torch["tokens_per_cpu_s_x_cores"]
    )
    # The peer trains on the same 8 x 24 tokens (every token counts); its loss is the next-token NLL,
    # ~ln V at random init (V = 256: 5.545).
    assert torch["trained_tokens"] == result["trained_tokens"] == 8 * 24
    assert abs(torch["loss"] - math.log(256)) < 0.1, torch["loss"]


@pytest.mark.slow
def test_update_variants_small(capsys):
    result = _run("update_variants.py", "--variants", "mb1,mb0-chunk1024-rematfull", "--rounds", "1", capsys=capsys)
    plain, auto = result["variants"]["mb1"], result["variants"]["mb0-chunk1024-rematfull"]
    assert auto["chosen_microbatches"] == 1 and auto["logits_chunk"] == 32 and auto["remat"] == "full"
    assert plain["tokens_per_s"] > 0 and auto["tokens_per_s"] > 0
    assert auto["xla_temp_mib"] < plain["xla_temp_mib"]
