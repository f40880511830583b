"""The int8 drafter kept in int8 until the matmul (`models/int8.py`, `drafters.draft_view("int8")`).

`int8.matmul` on a plain array is the layers' einsum of `w.astype(dtype)`; on an `Int8Weight` it is
(x @ values) * scale, equal to the dequantised weight's product to float32 rounding. The drafter's
compiled forward takes the int8 tree as its arguments: its weight bytes are a quarter of float32 (plus
one float32 scale per output column), and the program's parameters are s8; the speculative
sampler's decode loop carries the drafter's matrices as s8. Exactness of speculative
rollouts with this drafter (greedy identity, the sampled distribution) is in test_speculative.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import ModelConfig
from jaxrl.models import int8
from jaxrl.models import transformer as tf
from jaxrl.models.cache_kinds import LayerKV
from jaxrl.models.decode import LayerCache, empty_window, layer_params, window_layers
from jaxrl.rollout.speculative.drafters import dequantize, draft_view, quantize_int8

CFG = ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)
MOE = dataclasses.replace(CFG, n_experts=4, experts_per_token=2, expert_mlp_dim=32, tie_embeddings=False)

# (einsum, weight shape, the weight's input dims): every weight matmul of layers.py and the head.
SPECS = [
    ("btd,dhk->bthk", (32, 4, 8), (0,)),
    ("bthk,hkd->btd", (4, 8, 32), (0, 1)),
    ("btd,df->btf", (32, 64), (0,)),
    ("btf,fd->btd", (64, 32), (0,)),
]


@pytest.mark.parametrize("spec,shape,reduce", SPECS, ids=[s[0] for s in SPECS])
def test_matmul_plain_is_the_einsum_and_int8_matches_the_dequantised(spec, shape, reduce):
    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (2, 3, *([4, 8] if spec.startswith("bthk") else [shape[0]])), jnp.float32)
    w = jax.random.normal(kw, shape, jnp.float32)
    for dtype in (jnp.float32, jnp.bfloat16):
        xd = x.astype(dtype)
        plain = int8.matmul(spec, xd, w, dtype)
        np.testing.assert_array_equal(np.asarray(plain), np.asarray(jnp.einsum(spec, xd, w.astype(dtype))))
    q = int8.quantize(w, reduce)
    assert q.values.dtype == jnp.int8 and q.scale.shape == tuple(1 if i in reduce else n for i, n in enumerate(shape))
    assert float(jnp.max(jnp.abs(int8.dequantize(q) - w) / q.scale)) <= 0.5 + 1e-6
    got = int8.matmul(spec, x, q, jnp.float32)
    want = jnp.einsum(spec, x, int8.dequantize(q), precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    head = int8.matmul(spec, x.astype(jnp.bfloat16), q, jnp.bfloat16, preferred_element_type=jnp.float32)
    assert head.dtype == jnp.float32
    # The compiled product reads the int8 values: an s8 parameter, no float32 one of the weight's shape.
    hlo = jax.jit(lambda x, q: int8.matmul(spec, x, q, jnp.float32)).lower(x, q).compile().as_text()
    assert hlo is not None
    entry = hlo[hlo.index("ENTRY") :]
    assert f"s8[{','.join(map(str, shape))}]" in entry
    assert f"f32[{','.join(map(str, shape))}]{{" not in entry.split("\n")[0]


def test_matmul_refuses_a_scale_along_the_contracted_dim():
    w = int8.quantize(jnp.ones((32, 64)), (1,))  # one scale per input row: not an output-column scale
    with pytest.raises(ValueError, match=r"contracted dim 'd'"):
        int8.matmul("btd,df->btf", jnp.ones((1, 1, 32)), w, jnp.float32)


def test_quantize_int8_names_an_unknown_leaf():
    with pytest.raises(ValueError, match=r"\['extra'\]"):
        quantize_int8({"extra": jnp.ones((2, 2))})


def test_embedding_rows_gathered_in_int8():
    table = jax.random.normal(jax.random.PRNGKey(1), (96, 32)) * 3.0
    q = quantize_int8({"embedding": table})["embedding"]
    assert q.scale.shape == (96, 1)  # one scale per row: the tied head's output column
    toks = jnp.array([[0, 5, 95]])
    np.testing.assert_array_equal(
        np.asarray(int8.embed(q, toks, jnp.float32)), np.asarray(jnp.take(int8.dequantize(q), toks, axis=0))
    )
    np.testing.assert_array_equal(np.asarray(int8.embed(table, toks, jnp.float32)), np.asarray(table[toks]))


def _draft_forward_bytes(lparams, cfg):
    """The drafter's one-token forward over a layer cache (what the speculative loop and
    `calibrate.measure_step_costs` run), compiled with `lparams` as its arguments -> (argument bytes,
    entry computation text)."""
    n, S = 2, 16
    dtype = jnp.dtype(cfg.dtype)
    kv = tuple(LayerKV(*(jnp.zeros((n, cfg.n_kv_heads, S, cfg.head_dim), dtype),) * 2) for _ in range(cfg.n_layers))
    cache = LayerCache(kv, jnp.ones((n, S), bool), jnp.zeros((n,), jnp.int32))

    def step(p, cache, tokens_Nx1):
        window = empty_window(cache, 1, cfg.n_layers)
        return window_layers(p, cfg, tokens_Nx1, cache, jnp.full((n,), S // 2, jnp.int32), window, 0)[0]

    compiled = jax.jit(step).lower(lparams, cache, jnp.zeros((n, 1), jnp.int32)).compile()
    mem = compiled.memory_analysis()
    text = compiled.as_text()
    assert mem is not None and text is not None
    return mem.argument_size_in_bytes, text[text.index("ENTRY") :].split("\n")[0]


@pytest.mark.parametrize("cfg", [CFG, MOE, dataclasses.replace(CFG, dtype="bfloat16")], ids=["dense", "moe", "bf16"])
def test_drafter_program_takes_a_quarter_of_the_float32_weight_bytes(cfg):
    """Compile-only: the draft forward's argument bytes drop by exactly what the int8 tree saves (each
    quantised leaf: 1 byte per weight plus its scales, in place of 4), so the quantised weights' share
    is ~1/4 of float32 (1/2 of a bfloat16 rollout's cast weights); its entry parameters are s8."""
    params = tf.init_params(cfg, jax.random.PRNGKey(0))
    lparams = tf.rollout_params(layer_params(params, cfg), cfg)
    dparams, n_layers = draft_view(lparams, "int8", 1, cfg.n_layers)
    assert n_layers == cfg.n_layers

    leaves = jax.tree.leaves(dparams, is_leaf=int8.is_int8)
    quantised = [x for x in leaves if int8.is_int8(x)]
    q_bytes = sum(x.values.nbytes + x.scale.nbytes for x in quantised)
    float_bytes = sum(x.values.size * jnp.dtype(cfg.dtype).itemsize for x in quantised)
    assert 0.25 <= q_bytes / (4 * sum(x.values.size for x in quantised)) < 0.3
    assert q_bytes / float_bytes < (0.3 if cfg.dtype == "float32" else 0.6)
    kept = [x for x in leaves if not int8.is_int8(x)]
    assert kept and all(x.dtype == jnp.float32 for x in kept)  # norm scales and routers
    assert not cfg.n_experts or any(x.values.ndim == 3 for x in quantised)  # the experts are int8 too

    int8_args, int8_entry = _draft_forward_bytes(dparams, cfg)
    float_args, float_entry = _draft_forward_bytes(lparams, cfg)
    assert float_args - int8_args == float_bytes - q_bytes
    assert "s8[" in int8_entry and "s8[" not in float_entry


def test_int8_tree_dequantises_to_within_half_a_step():
    """quantize_int8 on stacked params: per layer (and expert) scales, |w - q * s| <= s / 2."""
    params = tf.init_params(MOE, jax.random.PRNGKey(0))
    q = jax.jit(quantize_int8)(params)
    up = q["blocks"]["moe"]["moe"]["up"]  # (layers, experts, D, F): one scale per layer, expert and column
    assert isinstance(up, int8.Int8Weight) and up.scale.shape == (*up.values.shape[:2], 1, up.values.shape[3])
    assert not int8.is_int8(q["blocks"]["moe"]["moe"]["router"])
    flat_q = jax.tree.leaves(q, is_leaf=int8.is_int8)
    for a, w, b in zip(flat_q, jax.tree.leaves(params), jax.tree.leaves(jax.jit(dequantize)(q))):
        if int8.is_int8(a):
            assert float(jnp.max(jnp.abs(b - w) / a.scale)) <= 0.5 + 1e-6
        else:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(w))


def test_speculative_decode_loop_holds_int8_weights():
    """Compile-only: in the speculative sampler with the int8 drafter, the decode loop's state carries
    every quantised matrix as s8 (the drafter reads int8 at each draft step), not a float32 copy."""
    from jaxrl.config import SpeculativeConfig
    from jaxrl.rollout.sampler import SamplingParams
    from jaxrl.rollout.speculative.sample import sample_speculative

    params = tf.init_params(CFG, jax.random.PRNGKey(0))
    spec = SpeculativeConfig(enabled=True, drafter="int8", max_draft=2, adaptive=False, max_active_rows=1 << 20)
    sp = SamplingParams(max_new_tokens=4, temperature=1.0, eos_id=1, pad_id=0, greedy=True)
    prompt = jnp.ones((2, 3), jnp.int32)

    def run(p, x, m, k):
        return sample_speculative(p, CFG, x, m, k, spec=spec, sampling=sp, group_size=2)

    text = jax.jit(run).lower(params, prompt, jnp.ones_like(prompt), jax.random.PRNGKey(0)).compile().as_text()
    assert text is not None
    dparams, _ = draft_view(layer_params(params, CFG), "int8", 1, CFG.n_layers)
    want = {
        f"s8[{','.join(map(str, x.values.shape))}]"
        for x in jax.tree.leaves(dparams, is_leaf=int8.is_int8)
        if int8.is_int8(x)
    }
    assert len(want) == 6  # q, k = v, o, gate = up, down, the (tied) embedding
    loop_states = [line.split(" while(")[0] for line in text.split("\n") if " while(" in line]
    assert any(all(s in state for s in want) for state in loop_states), (want, [s[:300] for s in loop_states])
