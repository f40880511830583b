"""The benchmark scripts run end to end (tiny shapes) and print one JSON line last; FLOP counting."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `benchmarks` is a plain folder at the repository root

from benchmarks import common  # noqa: E402
from jaxrl.config import ModelConfig  # noqa: E402


def _run(script: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--small"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) >= 2, proc.stdout  # human-readable lines, then the JSON
    result = json.loads(lines[-1])
    assert result["tokens_per_s"] > 0 and 0 < result["mfu"], result
    assert result["matmul_peak_gflops"] > 0 and result["seconds"] > 0, result
    return result


@pytest.mark.parametrize("script", ["rollout.py", "update.py"])
def test_script_small_prints_json_last(script):
    result = _run(script)
    assert result["config"] == "tiny"
    if script == "rollout.py":
        shape = result["shape"]
        assert result["generated_tokens"] == shape["prompts"] * shape["samples"] * shape["new_tokens"]
    else:
        assert result["trained_tokens"] == result["shape"]["batch"] * result["shape"]["seq"]


def test_model_flops_per_token_matches_hand_count():
    cfg = ModelConfig(vocab_size=10, d_model=4, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=3, mlp_dim=5,
                      tie_embeddings=False)
    # Per layer: q 4*2*3=24, k 4*1*3=12, v 12, o 2*3*4=24, gate/up/down 3*4*5=60 -> 132 params in
    # matmuls; 2 layers = 264, plus the LM head 4*10=40 -> 304. Forward: 2 FLOPs per matmul param.
    assert common.matmul_params(cfg) == 304
    # Attention at context 7: scores + values = 4 * L * context * H * Hd = 4*2*7*2*3 = 336.
    assert common.model_flops_per_token(cfg, 7) == 2 * 304 + 336
    assert common.model_flops_per_token(cfg, 0) == 608
    # Causal sequence: tokens at slots 2, 3, 4 attend 3 + 4 + 5 = 12 keys.
    assert common.attention_flops(cfg, 2, 3) == 4 * 2 * 2 * 3 * 12
    assert common.sequence_flops(cfg, 2, 3) == 3 * 608 + 4 * 2 * 2 * 3 * 12
    # Embedding (unless tied) and norm scales count as parameters but not as matmul FLOPs.
    assert common.total_params(cfg) == 304 + 40 + 2 * 2 * 4 + 4
    tied = ModelConfig(**{**cfg.__dict__, "tie_embeddings": True})
    assert common.total_params(tied) == 304 + 2 * 2 * 4 + 4


def test_bench_small_shape():
    cfg = common.bench_small()
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim, cfg.vocab_size) == (
        512, 8, 8, 2, 64, 1408, 8192)
    assert cfg.dtype == "float32" and not cfg.tie_embeddings
    cfg.validate()
