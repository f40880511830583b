"""Evaluation split over the data axis, on 8 fake CPU devices in a child Python (the device count is
fixed before jax is imported: harness.child_env): the evaluator's sampler decodes 1/8 of a chunk's rows
on each device (the compiled program's per-device shapes and FLOPs), chunks whose rows do not divide
over the devices are padded and the padding dropped, and the completions and eval metrics equal one
device's. Multi-process evaluation (each process feeding and reading its own rows, process 0 scoring)
runs in tests/test_multihost.py, whose runs evaluate at steps 0 and 2."""

import pytest
from harness import child_env, run_python

SCRIPT = r"""
import re
import jax, numpy as np
from jaxrl.config import Config, DataConfig, MeshConfig, ModelConfig, RolloutConfig
from jaxrl.data.tokenizer import CharTokenizer, decode_completions
from jaxrl.models.transformer import init_params, param_logical_axes
from jaxrl.sharding import make_mesh, parallel_for, param_shardings
from jaxrl.multihost import put_rows
from jaxrl.train import evaluate as ev

assert jax.device_count() == 8
T = 6
tok = CharTokenizer()
cfg = Config(data=DataConfig(max_prompt_len=8), rollout=RolloutConfig(max_new_tokens=T))
model = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                    mlp_dim=64, max_seq_len=16)
params = jax.tree.map(np.asarray, init_params(model, jax.random.key(0)))
records = [{"id": f"t/{i}", "prompt": f"{i}+{2 * i}=", "answer": "?"} for i in range(21)]  # 21: not a multiple of 8
_, tok_BxP, mask_BxP = ev.encode_records(cfg, tok, records)
key = jax.random.key(0)

def draw(parallel, p, chunk):
    sampler = ev.make_chunk_sampler(cfg, model, tok, group_size=1, greedy=True, parallel=parallel)
    return sampler, ev.sample_in_chunks(sampler, p, tok_BxP, mask_BxP, chunk, key, 1, None, parallel)

one_sampler, want = draw(None, params, 10)  # 3 calls of 10 prompts, the last padded
assert want[0].shape == (21, T)
# Records the one-device completions answer for even i: accuracy 11/21, so equal metrics mean equal texts.
texts, _ = decode_completions(tok, want[0])
scored = [dict(r, answer=texts[i] if i % 2 == 0 else "never") for i, r in enumerate(records)]

def verifier(completion, finished, record):
    return float(completion == record["answer"]), float(finished)

want_metrics = ev.make_evaluator(cfg, model, tok, scored, verifier)(params)
assert abs(want_metrics["eval/accuracy"] - 11 / 21) < 1e-6, want_metrics  # (a float32 mean)
n_rows = 16  # a call's rows on 8 devices: the chunk of 10 padded to a multiple of 8
c1 = one_sampler.lower(params, prompt_BxP=tok_BxP[:n_rows], prompt_mask_BxP=mask_BxP[:n_rows], rng=key).compile()
for preset, most in (("data", 1.15), ("fsdp", 1.3)):
    mesh, layout = make_mesh(MeshConfig(preset=preset))
    par = parallel_for(mesh, layout)
    p8 = jax.device_put(params, param_shardings(mesh, layout, param_logical_axes(model), params))
    sampler, got = draw(par, p8, 10)
    for name, a, b in zip(("tokens", "finished", "length"), got, want):
        np.testing.assert_array_equal(a, b, err_msg=f"{preset} {name}")
    got_metrics = ev.make_evaluator(cfg, model, tok, scored, verifier, parallel=par)(p8)
    assert got_metrics == want_metrics, (preset, got_metrics, want_metrics)
    # The compiled program of one call: its outputs are 2 of the 16 rows per device, and every device does
    # about 1/8 of one device's work (before: data 8.0x, every device decoding every row; fsdp 1.66x).
    rows_sh = ev.rows_sharding(par)
    x, m = (put_rows(rows_sh, a[:n_rows], n_rows) for a in (tok_BxP, mask_BxP))
    c8 = sampler.lower(p8, prompt_BxP=x, prompt_mask_BxP=m, rng=key).compile()
    hlo = c8.as_text()
    assert f"s32[{n_rows // 8},{T}]" in hlo and f"s32[{n_rows},{T}]" not in hlo, preset
    share = c8.cost_analysis()["flops"] / (c1.cost_analysis()["flops"] / 8)
    print(preset, "flops per device / (one device's / 8):", round(share, 3), flush=True)
    assert 0.85 < share < most, (preset, share)
print("eval OK", flush=True)
"""


@pytest.mark.slow
def test_eval_rows_split_over_8_fake_devices_equal_one_device():
    """Under `data` (params replicated) and `fsdp` (params split), `make_chunk_sampler` + `sample_in_chunks`
    (21 prompts, chunks of 10 padded to 16 rows) return one device's completions, `make_evaluator` its
    metrics (accuracy 11/21 by construction), and the compiled call holds 2 of 16 rows per device with
    FLOPs per device within 15% (data; fsdp 30%: measured 1.15) of one device's / 8."""
    proc = run_python(["-c", SCRIPT], child_env(devices=8), check=False)
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "eval OK", proc.stdout[-2000:] + proc.stderr[-3000:]
