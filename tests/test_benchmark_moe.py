"""benchmarks/moe.py runs end to end at a tiny shape and prints one JSON line last."""

import pytest
from harness import run_benchmark_here


@pytest.mark.slow
def test_moe_benchmark_small_prints_json_last(capsys):
    """moe.py's main in this process; the expert-parallel part is its own 8-device child."""
    # one line per path, a summary and the EP line, then the JSON
    result = run_benchmark_here("moe.py", "--small", capsys=capsys, min_lines=5)
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
