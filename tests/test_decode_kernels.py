"""model.decode_attention: the fill-bounded decode kernels (jaxrl/models/decode_attention.py) against
the dense kv-head-major kernels of attention.py on caches with mixed fills, the blocked kernel's
run-time trip count in the compiled program, the Pallas kernel lowered for GPU (Triton) and TPU
(Mosaic) on this CPU machine, the config errors, and the engine's greedy rollouts through each kernel
equal to the sampler's (plain and speculative)."""

import dataclasses
import functools
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_engine as te
import test_engine_speculative as ts
from harness import run_benchmark_here, worker_result

from jaxrl.config import ConfigError, ModelConfig
from jaxrl.models import decode_attention as da
from jaxrl.models.attention import attend_kv_head_major, attend_window
from jaxrl.models.cache_kinds import LayerKV
from jaxrl.models.decode import LayerCache, decode_rows, layer_params
from jaxrl.rollout.engine.groups import batch_of_groups

B, H, K, S, HD, W = 4, 6, 2, 40, 8, 4  # R = 3 (GQA, Q = T*R not a power of 2); S not a multiple of BLOCK
BLOCK = 16
TOL = {jnp.float32: 2e-6, jnp.bfloat16: 3e-2}


def _caches(T: int, dtype, seed=0):
    """q, k, v, key_valid and index_B: rows at slot 0 (nothing before), 1, the last slot that fits T
    queries (a full row) and 17 (inside the second block); ~20% of earlier keys invalid (padding)."""
    rng = np.random.default_rng(seed)
    index_B = jnp.asarray([0, 1, S - T, 17], jnp.int32)
    q_BxTxHxHd, k_BxKxSxHd, v_BxKxSxHd = (
        jnp.asarray(rng.normal(size=shape), dtype) for shape in ((B, T, H, HD), (B, K, S, HD), (B, K, S, HD))
    )
    slot_S = np.arange(S)
    own_BxS = (slot_S >= np.asarray(index_B)[:, None]) & (slot_S < np.asarray(index_B)[:, None] + T)
    valid_BxS = jnp.asarray((rng.random((B, S)) > 0.2) | own_BxS)
    return q_BxTxHxHd, k_BxKxSxHd, v_BxKxSxHd, valid_BxS, index_B


KERNELS = {
    "blocked": functools.partial(da.attend_blocked, block=BLOCK),
    # The GPU and TPU programs of the Pallas kernel, run by the interpreter.
    "pallas-gpu-form": functools.partial(da.attend_pallas, block=BLOCK, platform="gpu", interpret=True),
    "pallas-tpu-form": functools.partial(da.attend_pallas, block=BLOCK, platform="tpu", interpret=True),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("T", [1, 3], ids=["decode", "verify"])
@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_equals_dense_with_mixed_fills(name, T, dtype):
    q, k, v, valid, index_B = _caches(T, dtype)
    want = attend_kv_head_major(q, k, v, valid, index_B, dtype)
    got = KERNELS[name](q, k, v, valid, index_B, dtype)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=TOL[dtype], rtol=0)
    if name == "blocked":  # the sampler's step: one scalar index for every row
        np.testing.assert_allclose(
            np.asarray(da.attend_blocked(q, k, v, valid, 5, dtype, BLOCK), np.float32),
            np.asarray(attend_kv_head_major(q, k, v, valid, 5, dtype), np.float32),
            atol=TOL[dtype],
            rtol=0,
        )


def test_kernels_skip_blocks_past_the_fill():
    """The blocks after the one holding a row's last query slot are never read: NaN there changes
    nothing (the dense kernel's masked products turn it into NaN). Pallas skips them per row; the
    blocked kernel per batch, so there every row is put inside block 0."""
    q, k, v, valid, index_B = _caches(1, jnp.float32)

    def poisoned(index_B):
        past_Bx1xSx1 = (jnp.arange(S) >= (index_B[:, None] // BLOCK + 1) * BLOCK)[:, None, :, None]
        return tuple(jnp.where(past_Bx1xSx1, jnp.nan, x) for x in (k, v))

    k_nan, v_nan = poisoned(index_B)
    assert np.isnan(np.asarray(attend_kv_head_major(q, k_nan, v_nan, valid, index_B, jnp.float32))).any()
    want = attend_kv_head_major(q, k, v, valid, index_B, jnp.float32)
    got = KERNELS["pallas-gpu-form"](q, k_nan, v_nan, valid, index_B, jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=0)
    short_B = jnp.asarray([0, 1, 15, 2], jnp.int32)
    k_far, v_far = poisoned(short_B)
    got = da.attend_blocked(q, k_far, v_far, valid, short_B, jnp.float32, BLOCK)
    want = attend_kv_head_major(q, k, v, valid, short_B, jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_window_kernel_equals_dense(dtype):
    """The speculative read: cache slots below each row's fill (0, 1, S and 17), then a window of W."""
    T = 3
    q, k, v, valid, _ = _caches(T, dtype, seed=1)
    rng = np.random.default_rng(2)
    wk, wv = (jnp.asarray(rng.normal(size=(B, K, W, HD)), dtype) for _ in range(2))
    fill_B = jnp.asarray([0, 1, S, 17])
    seen_BxS = valid & (jnp.arange(S) < fill_B[:, None])
    want = attend_window(q, k, v, seen_BxS, wk, wv, 1, dtype)
    got = da.attend_window_blocked(q, k, v, seen_BxS, wk, wv, 1, dtype, BLOCK)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=TOL[dtype], rtol=0)


def _shapes(T=1, S=256, dtype=jnp.float32, H=H, K=K, HD=HD):
    return (
        jax.ShapeDtypeStruct((B, T, H, HD), dtype),
        jax.ShapeDtypeStruct((B, K, S, HD), dtype),
        jax.ShapeDtypeStruct((B, K, S, HD), dtype),
        jax.ShapeDtypeStruct((B, S), jnp.bool_),
        jax.ShapeDtypeStruct((B,), jnp.int32),
    )


def test_blocked_trip_count_is_dynamic_in_the_compiled_program():
    """The compiled blocked kernel is one while loop with no trip count known at compile time (XLA
    marks a static one `known_trip_count`); the cost model sees one block's work per loop body,
    the dense kernel the whole cache's."""
    blocked = jax.jit(functools.partial(da.attend_blocked, dtype=jnp.float32, block=32)).lower(*_shapes()).compile()
    dense = jax.jit(functools.partial(attend_kv_head_major, dtype=jnp.float32)).lower(*_shapes()).compile()
    text, dense_text = blocked.as_text() or "", dense.as_text() or ""
    assert text.count(" while(") == 1 and "known_trip_count" not in text
    assert " while(" not in dense_text
    costs = [c.cost_analysis() or {} for c in (blocked, dense)]
    exps_blocked, exps_dense = (c["transcendentals"] for c in costs)
    assert exps_dense == B * K * H // K * 256  # every (row, query head, slot)
    assert exps_blocked < exps_dense / 4  # the body: one block of 32 of 256 slots (+ the rescales)


def test_pallas_lowers_for_gpu_triton():
    """Lowered for CUDA on this CPU machine: one Triton custom call, grid (B, K). Compiling needs a GPU."""
    f = functools.partial(da.attend_pallas, dtype=jnp.bfloat16, block=64, platform="gpu")
    text = jax.jit(f).trace(*_shapes(dtype=jnp.bfloat16, S=200, HD=64)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 1
    assert f"grid_x = {B} : i32, grid_y = {K} : i32" in text
    with pytest.raises(ValueError, match="model.decode_block: got 48"):
        jax.jit(functools.partial(f, block=48)).trace(*_shapes(dtype=jnp.bfloat16, HD=64))


def test_pallas_lowers_for_tpu_mosaic():
    """Mosaic reads the TPU generation from the device it lowers for: on a CPU machine lowering fails
    ("Unsupported TPU device kind: cpu") unless an abstract mesh names a TPU device (v5e here). The
    Mosaic module is compiled only on a TPU."""
    from jax._src.mesh import AbstractDevice, AbstractMesh

    f = jax.jit(functools.partial(da.attend_pallas, dtype=jnp.bfloat16, block=128, platform="tpu"))
    traced = f.trace(*_shapes(dtype=jnp.bfloat16, HD=128))
    with pytest.raises(ValueError, match="Unsupported TPU device kind: cpu"):
        traced.lower(lowering_platforms=("tpu",))
    v5e = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("TPU v5 lite", 1, "tpu"))
    with jax.sharding.use_abstract_mesh(v5e):
        text = f.trace(*_shapes(dtype=jnp.bfloat16, HD=128)).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 1


def test_resolve_and_config_errors():
    assert da.resolve_decode_kernel("auto", 128, "cpu").name == "dense"
    assert da.resolve_decode_kernel("auto", 128, "gpu") == da.DecodeKernel("blocked", 128, "gpu")
    assert da.resolve_decode_kernel("auto", 64, "tpu").name == "blocked"
    assert da.resolve_decode_kernel("pallas", 64, "gpu") == da.DecodeKernel("pallas", 64, "gpu")
    with pytest.raises(ValueError, match="model.decode_attention: got 'paged'"):
        da.resolve_decode_kernel("paged", 128, "cpu")
    ModelConfig(decode_attention="pallas", decode_block=32).validate()
    with pytest.raises(ConfigError, match=r"model\.decode_attention: got 'flash'"):
        ModelConfig(decode_attention="flash").validate()
    with pytest.raises(ConfigError, match=r"model\.decode_block: got 0"):
        ModelConfig(decode_block=0).validate()


@pytest.mark.parametrize("kernel", ["dense", "blocked", "pallas"])
def test_decode_rows_reaches_the_configured_kernel(kernel):
    """`model.decode_attention` reaches the engine's step (`decode.decode_rows`) through the config
    alone: a cache whose blocks past every row's fill hold NaN gives finite logits through the
    fill-bounded kernels and NaN through the dense one; the fill-bounded logits equal the dense
    logits on the clean cache."""
    cfg = dataclasses.replace(te.CFG, decode_attention=kernel, decode_block=4)
    lparams = layer_params(te._params(te.CFG), te.CFG)
    rng = np.random.default_rng(0)
    n, S, fill_B = 3, 16, jnp.asarray([0, 2, 6], jnp.int32)
    shape = (n, te.CFG.n_kv_heads, S, te.CFG.head_dim)
    clean = [LayerKV(*(jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(2))) for _ in range(2)]
    past_Bx1xSx1 = (jnp.arange(S) >= 8)[None, None, :, None]
    dirty = [LayerKV(*(jnp.where(past_Bx1xSx1, jnp.nan, x) for x in kv)) for kv in clean]
    valid_BxS = jnp.arange(S)[None, :] < fill_B[:, None]
    token_B = jnp.asarray([3, 4, 5], jnp.int32)

    def logits(cfg, kv):
        cache = LayerCache(tuple(kv), valid_BxS, fill_B)
        return np.asarray(decode_rows(lparams, cfg, token_B, cache, fill_B, jnp.ones(n, jnp.int32))[0])

    if kernel == "dense":
        assert np.isnan(logits(cfg, dirty)).all()
    else:
        np.testing.assert_allclose(logits(cfg, dirty), logits(te.CFG, clean), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kernel,speculative", [("blocked", False), ("blocked", True), ("pallas", False)])
def test_engine_greedy_through_each_kernel_equals_sampler(kernel, speculative):
    """The slot engine's greedy rollouts (slots reused, groups admitted at different times) with the
    cache read by `kernel` in blocks of 4 slots: tokens, masks and truncation identical to the dense
    sampler's, recorded log-probs to float32 noise. Speculative: the verify window's cache read
    (`attend_window_blocked`) and the engine's T = K+1 verify step."""
    cfg = dataclasses.replace(te.CFG, decode_attention=kernel, decode_block=4)
    eos = te._eos(te.CFG)
    ref = te._plain(te.CFG, eos)
    if speculative:
        engine = ts._engine(cfg, eos, slots=4, chunk=3, admit_groups=2)
    else:
        engine = te._engine(cfg, eos, slots=4, chunk=3, admit_groups=2)
    assert engine.spec.cache_len > 2 * 4  # the cache spans several blocks
    groups = engine.collect(te._params(te.CFG), 0, te._items()[::-1], n_groups=len(te.LENGTHS))
    te._check_same_rollout(batch_of_groups(te._by_tag(groups)).fields(), ref, te.CFG)
    if speculative:
        ts._check_drafts_tested(engine.counts)


def test_benchmark_small_prints_json_last(capsys):
    """benchmarks/decode_attention.py --small: every (program, kernel, fill) timed, ratios from them."""
    result = run_benchmark_here("decode_attention.py", "--small", capsys=capsys)
    assert result["benchmark"] == "decode_attention" and result["config"] == "tiny"
    assert result["fills"] == {"eighth": 7, "full": 63}
    for program in ("step", "attention"):
        ms = result["ms"][program]
        assert all(ms[k][f] > 0 for k in ("dense", "blocked") for f in ("eighth", "full")), ms
        ratio = result["ratios"][program]["blocked_over_dense_full"]
        assert ratio == round(ms["blocked"]["full"] / ms["dense"]["full"], 3)


def _worker():
    """8 fake devices, rows split over them (the data-parallel rollout's layout): one decode_rows
    step through each kernel, compiled; the collectives in the program and the logits."""
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    n, S = 8, 64
    lparams = layer_params(te._params(te.CFG), te.CFG)
    rng = np.random.default_rng(0)
    shape = (n, te.CFG.n_kv_heads, S, te.CFG.head_dim)
    kv = tuple(LayerKV(*(jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(2))) for _ in range(2))
    rows = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))
    kv, fill_B = jax.device_put((kv, jnp.asarray([0, 1, 5, 63, 20, 33, 7, 2], jnp.int32)), rows)
    out = {}
    for kernel in ("dense", "blocked", "pallas"):
        cfg = dataclasses.replace(te.CFG, decode_attention=kernel, decode_block=16)

        def step(kv, fill_B, cfg=cfg):
            cache = LayerCache(kv, jnp.arange(S)[None, :] <= fill_B[:, None], fill_B)
            return decode_rows(lparams, cfg, jnp.ones(n, jnp.int32), cache, fill_B, jnp.ones(n, jnp.int32))[0]

        compiled = jax.jit(step).lower(kv, fill_B).compile()
        text = compiled.as_text() or ""
        counts = {c: len(re.findall(rf"\b{c}(-start)?\(", text)) for c in ("all-gather", "all-reduce", "all-to-all")}
        out[kernel] = {"collectives": counts, "logits": np.asarray(compiled(kv, fill_B)).tolist()}
    print("RESULT " + json.dumps(out))


@pytest.mark.slow
def test_row_sharded_decode_by_kernel(cache_env):
    """Rows split over 8 devices: `blocked` equals dense and adds one all-reduce (the batch's largest
    fill, a scalar) and no gather of the cache. `pallas` equals dense too, but XLA cannot partition
    its custom call: the compiled program gathers every device's cache (a known limit, in
    docs/accelerators.md; a shard_map around the kernel would remove it)."""
    result, _ = worker_result(__file__, cache_env, timeout=300)
    dense, blocked, pallas = (result[k] for k in ("dense", "blocked", "pallas"))
    for other in (blocked, pallas):
        np.testing.assert_allclose(np.asarray(other["logits"]), np.asarray(dense["logits"]), atol=1e-5, rtol=0)
    assert blocked["collectives"]["all-reduce"] == dense["collectives"]["all-reduce"] + 1
    assert blocked["collectives"]["all-gather"] == dense["collectives"]["all-gather"]
    assert pallas["collectives"]["all-gather"] > dense["collectives"]["all-gather"]


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    _worker()
