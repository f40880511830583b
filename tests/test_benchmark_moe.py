"""benchmarks/moe.py runs end to end at a tiny shape and prints one JSON line last."""

import json

import pytest
from harness import REPO, child_env, run_python


@pytest.mark.slow
def test_moe_benchmark_small_prints_json_last():
    proc = run_python([str(REPO / "benchmarks" / "moe.py"), "--small"], child_env(), timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) >= 5, proc.stdout  # one line per path, a summary and the EP line, then the JSON
    result = json.loads(lines[-1])
    assert result["benchmark"] == "moe" and result["config"] == "tiny"
    assert set(result["paths"]) == {"dropless", "dropless_ragged", "capacity", "naive"}
    for path in result["paths"].values():
        assert path["tokens_per_s"] > 0 and path["seconds"] > 0 and path["dropped_frac"] == 0.0
    assert result["speedup_dropless_vs_naive"] > 0
    assert result["shape"]["tokens"] == 256 and result["shape"]["experts"] == 4
    # Expert parallelism on 8 fake devices (a subprocess): same numbers as dropless, weights split 1/8.
    assert result["ep8_devices"] == 8 and result["ep8_tokens_per_s"] > 0
    assert result["ep8_single_device_dropless_tokens_per_s"] > 0
    assert result["ep8_outputs_match"] is True and result["ep8_max_abs_err_out"] < 1e-4
    assert result["ep8_weights_sharded"] is True
    assert result["ep8_shape"]["experts"] == 8  # --small's 4 experts rounded up to one per device
    assert sorted(map(tuple, result["ep8_weight_shard_shapes"])) == [(1, 32, 64), (1, 64, 32)]
    assert result["ep8_all_to_all_in_hlo"] is True
