"""Model tests. Almost every forward uses one (2, 9) batch so the suite compiles few programs."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import ModelConfig
from jaxrl.models import kv_cache
from jaxrl.models import transformer as tf
from jaxrl.models.cache_kinds import StackedKV
from jaxrl.models.decoder import layer_module, run_decoder
from jaxrl.models.layers import apply_rope

CFG = ModelConfig(vocab_size=29, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)
S = 9


@functools.cache
def _params(cfg=CFG):
    return tf.init_params(cfg, jax.random.PRNGKey(0))


def _tokens(shape, seed=1):
    # numpy: a jax.random draw per shape would compile a generator per test
    return jnp.asarray(np.random.default_rng(seed).integers(0, CFG.vocab_size, shape, dtype=np.int32))


def _left_padded(lengths, width=S, seed=1, pad_tok=0):
    """Random tokens left-padded with `pad_tok` to `width`; returns (tokens, mask)."""
    toks = np.asarray(_tokens((len(lengths), width), seed))
    mask = np.zeros((len(lengths), width), np.int32)
    for i, n in enumerate(lengths):
        mask[i, width - n :] = 1
    return jnp.asarray(np.where(mask, toks, pad_tok)), jnp.asarray(mask)


def test_shapes_and_dtypes():
    params = _params()
    tokens, mask = _left_padded([5, 9])
    logits = tf.forward(params, CFG, tokens, mask)
    assert logits.shape == (2, S, CFG.vocab_size) and logits.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(logits)))  # fully padded query rows must not NaN
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    attn = params["blocks"]["attn"]  # scanned layers: leading L axis
    assert attn["q"].shape == (2, 32, 4, 8) and attn["k"].shape == (2, 32, 2, 8) and attn["o"].shape == (2, 4, 8, 32)
    cache = kv_cache.init_cache(CFG, 3, 11)
    assert cache.k_LxBxSxKxHd.shape == (2, 3, 11, 2, 8) and cache.valid_BxS.shape == (3, 11)
    assert cache.pos_B.dtype == jnp.int32 and not cache.valid_BxS.any()


def test_init_params_distribution():
    """init_params draws all noise at once; each param must still get its own std, layers differ."""
    params = _params()
    # The stacked blocks are the layer module's own params with a leading layers axis.
    carry = (jnp.zeros((1, 1, 32)), None, jnp.zeros((), jnp.int32))
    one_1x1 = jnp.ones((1, 1), jnp.int32)
    boxed = jax.eval_shape(layer_module(CFG, False).init, jax.random.PRNGKey(1), carry, one_1x1, one_1x1, 0)["params"]
    want = jax.tree.map(lambda x: (CFG.n_layers, *x.shape), tf.nn.meta.unbox(boxed))
    assert jax.tree.map(jnp.shape, params["blocks"]) == want
    assert set(params) == {"embedding", "blocks", "final_norm"} | (set() if CFG.tie_embeddings else {"lm_head"})
    np.testing.assert_array_equal(params["blocks"]["attn_norm"]["scale"], 1.0)
    for w, std in [
        (params["blocks"]["attn"]["q"], 32**-0.5),
        (params["blocks"]["attn"]["o"], 32**-0.5),
        (params["blocks"]["mlp"]["down"], 64**-0.5),
        (params["embedding"], 32**-0.5),
    ]:
        assert abs(float(jnp.std(w)) / std - 1) < 0.1
        assert float(jnp.max(jnp.abs(w))) <= 2 * std / 0.8796 + 1e-6  # truncated at 2 sigma
    q = params["blocks"]["attn"]["q"]
    assert not np.allclose(q[0], q[1])
    assert not np.allclose(tf.init_params(CFG, jax.random.PRNGKey(1))["embedding"], params["embedding"])


def test_left_padding_invariance_and_pad_keys_invisible():
    # Row 1 is row 0's first 6 tokens, left-padded by 3. By causality row 0's first 6 logits are the
    # unpadded computation of those 6 tokens, so they must equal row 1's last 6.
    params = _params()
    a = _tokens((1, S), seed=3)
    for pad_tok in (0, 7):  # the pad token id must not matter: padded keys are masked out
        b = jnp.concatenate([jnp.full((1, 3), pad_tok, jnp.int32), a[:, :6]], axis=1)
        mask = jnp.array([[1] * S, [0] * 3 + [1] * 6], jnp.int32)
        logits = tf.forward(params, CFG, jnp.concatenate([a, b]), mask)
        np.testing.assert_allclose(logits[1, 3:], logits[0, :6], atol=1e-5, rtol=0)
    # Teeth: treating the pads as real tokens (shifted positions, visible keys) changes the logits.
    shifted = tf.forward(params, CFG, jnp.concatenate([a, b]), jnp.ones((2, S), jnp.int32))
    assert np.max(np.abs(np.asarray(shifted[1, 3:] - logits[0, :6]))) > 1e-3


def test_rope_matches_rotate_half_convention():
    # HF Llama/Qwen: pairs (i, i + Hd/2) rotate by pos * theta^(-2i/Hd); converted checkpoints rely on it.
    x = jnp.arange(1.0, 9.0).reshape(1, 1, 1, 8)
    pos = jnp.array([[3]])
    got = np.asarray(apply_rope(x, pos, 100.0))[0, 0, 0]
    ang = 3 * 100.0 ** (-np.arange(0, 8, 2) / 8)
    x1, x2 = np.arange(1.0, 5.0), np.arange(5.0, 9.0)
    np.testing.assert_allclose(
        got, np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)]), rtol=1e-5
    )
    np.testing.assert_allclose(apply_rope(x, jnp.array([[0]]), 100.0), x)


def test_causal():
    params = _params()
    a = _tokens((2, S), seed=4)
    b = a.at[:, 5:].set((a[:, 5:] + 1) % CFG.vocab_size)
    ones = jnp.ones((2, S), jnp.int32)
    la, lb = tf.forward(params, CFG, a, ones), tf.forward(params, CFG, b, ones)
    np.testing.assert_allclose(la[:, :5], lb[:, :5], atol=1e-6, rtol=0)
    assert np.max(np.abs(np.asarray(la[:, 5:] - lb[:, 5:]))) > 1e-4


def _with_kv(params, fn):
    attn = params["blocks"]["attn"]
    attn = {**attn, "k": fn(attn["k"]), "v": fn(attn["v"])}
    return {**params, "blocks": {**params["blocks"], "attn": attn}}


@pytest.mark.parametrize("n_kv_heads", [1, 2])
def test_gqa_equals_mha_with_repeated_kv_heads(n_kv_heads):
    """GQA with K kv heads == MHA whose kv heads are copies: query head h must read kv head h // (H/K)."""
    gqa_cfg = dataclasses.replace(CFG, n_kv_heads=n_kv_heads)
    mha_cfg = dataclasses.replace(CFG, n_kv_heads=CFG.n_heads)
    gqa = _params(gqa_cfg)
    rep = CFG.n_heads // n_kv_heads
    mha = _with_kv(gqa, lambda w_LxDxKxHd: jnp.repeat(w_LxDxKxHd, rep, axis=2))
    want = jax.eval_shape(tf.init_params, mha_cfg, jax.random.PRNGKey(0))
    assert jax.tree.map(jnp.shape, mha) == jax.tree.map(lambda x: x.shape, want)
    tokens, mask = _left_padded([6, 9])
    ref = tf.forward(gqa, gqa_cfg, tokens, mask)
    np.testing.assert_allclose(ref[:, 3:], tf.forward(mha, mha_cfg, tokens, mask)[:, 3:], atol=1e-5, rtol=0)
    if 1 < n_kv_heads:  # tiling instead of repeating pairs query heads with the wrong kv heads
        bad = _with_kv(gqa, lambda w_LxDxKxHd: jnp.tile(w_LxDxKxHd, (1, 1, rep, 1)))
        assert np.max(np.abs(np.asarray(ref - tf.forward(bad, mha_cfg, tokens, mask)))) > 1e-4


def test_tied_vs_untied():
    untied_cfg = dataclasses.replace(CFG, tie_embeddings=False)
    tied, untied = _params(), _params(untied_cfg)
    assert "lm_head" not in tied and untied["lm_head"].shape == (32, CFG.vocab_size)
    assert set(untied) - set(tied) == {"lm_head"}
    tokens, mask = _left_padded([9, 9])
    tokens = jnp.where(tokens == 7, 8, tokens)  # token 7 unused, so its embedding row only feeds the head
    # Tied: logit v is the dot with embedding row v, so zeroing an unused row zeroes only that logit.
    base = tf.forward(tied, CFG, tokens, mask)
    zeroed = tf.forward({**tied, "embedding": tied["embedding"].at[7].set(0.0)}, CFG, tokens, mask)
    np.testing.assert_array_equal(zeroed[..., 7], 0.0)
    np.testing.assert_allclose(np.delete(np.asarray(zeroed), 7, -1), np.delete(np.asarray(base), 7, -1), atol=1e-6)
    # Untied: the head is its own parameter, and the embedding row no longer feeds logit 7.
    logits = tf.forward({**untied, "embedding": untied["embedding"].at[7].set(0.0)}, untied_cfg, tokens, mask)
    assert np.all(np.abs(np.asarray(logits[..., 7])) > 0)
    zero_head = tf.forward({**untied, "lm_head": jnp.zeros_like(untied["lm_head"])}, untied_cfg, tokens, mask)
    np.testing.assert_array_equal(zero_head, 0.0)


def test_param_logical_axes():
    for cfg in (CFG, dataclasses.replace(CFG, tie_embeddings=False)):
        params, axes = _params(cfg), tf.param_logical_axes(cfg)
        assert jax.tree.structure(params) == jax.tree.structure(axes)
        for p, spec in zip(jax.tree.leaves(params), jax.tree.leaves(axes)):
            assert len(spec) == p.ndim and set(spec) <= set(tf.LOGICAL_AXIS_NAMES)
    assert tuple(axes["blocks"]["attn"]["k"]) == ("layers", "embed", "kv_heads", "head_dim")
    assert tuple(axes["embedding"]) == ("vocab", "embed")
    assert tuple(axes["blocks"]["mlp"]["down"]) == ("layers", "mlp", "embed")
    assert tuple(axes["lm_head"]) == ("embed", "vocab")


def test_token_logprobs_matches_forward():
    params = _params()
    P, T = 5, 4
    prompt, pmask = _left_padded([3, 5], P)
    comp = _tokens((2, T), seed=9)
    logp, ent = tf.token_logprobs(params, CFG, prompt, pmask, comp, jnp.ones((2, T)), 0.7)
    full = tf.forward(
        params, CFG, jnp.concatenate([prompt, comp], 1), jnp.concatenate([pmask, jnp.ones((2, T), jnp.int32)], 1)
    )
    lp_all = jax.nn.log_softmax(full[:, P - 1 : P + T - 1] / 0.7, -1)
    np.testing.assert_allclose(logp, jnp.take_along_axis(lp_all, comp[..., None], -1)[..., 0], atol=1e-5)
    np.testing.assert_allclose(ent, -jnp.sum(jnp.exp(lp_all) * lp_all, -1), atol=1e-5)
    assert np.all(np.asarray(ent) > 0) and np.all(np.asarray(logp) < 0)


def test_token_logprobs_gradient_reaches_every_param():
    params = _params()
    prompt, pmask = _left_padded([3, 5], 5)
    comp = _tokens((2, 4), seed=9)

    def loss(p):
        return jnp.sum(tf.token_logprobs(p, CFG, prompt, pmask, comp, jnp.ones((2, 4)), 1.0)[0])

    grads = jax.jit(jax.grad(loss))(params)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert np.all(np.isfinite(np.asarray(g))) and float(jnp.max(jnp.abs(g))) > 0, path


@functools.partial(jax.jit, static_argnames="cfg")
def _decode_step(params, cfg, token_B, cache: kv_cache.Cache, index):
    """One token per row at stacked-cache slot `index` (the scanned layers, no per-layer split)."""
    valid_BxS = jax.lax.dynamic_update_slice(cache.valid_BxS, jnp.ones((token_B.shape[0], 1), bool), (0, index))
    stacked = StackedKV(cache.k_LxBxSxKxHd, cache.v_LxBxSxKxHd)
    logits_Bx1xV, kv, _ = run_decoder(params, cfg, token_B[:, None], cache.pos_B[:, None], valid_BxS, index, stacked)
    return logits_Bx1xV[:, 0], kv_cache.Cache(kv.k_LxBxSxKxHd, kv.v_LxBxSxKxHd, valid_BxS, cache.pos_B + 1)


@pytest.mark.parametrize("cfg", [CFG, dataclasses.replace(CFG, n_kv_heads=1)])
def test_prefill_then_decode_matches_forward(cfg):
    params = _params(cfg)
    P, T = 5, 4
    prompt, pmask = _left_padded([2, 5], P)
    gen = _tokens((2, T), seed=11)
    full = tf.forward(
        params, cfg, jnp.concatenate([prompt, gen], 1), jnp.concatenate([pmask, jnp.ones((2, T), jnp.int32)], 1)
    )
    cache = kv_cache.init_cache(cfg, 2, P + T + 2)  # spare slots must stay invisible
    logits, cache, _ = kv_cache.prefill(params, cfg, prompt, pmask, cache)
    np.testing.assert_allclose(logits, full[:, P - 1], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(cache.pos_B, [2, 5])
    for t in range(T):
        logits, cache = _decode_step(params, cfg, gen[:, t], cache, jnp.int32(P + t))
        np.testing.assert_allclose(logits, full[:, P + t], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(cache.pos_B, [2 + T, 5 + T])
    np.testing.assert_array_equal(cache.valid_BxS[:, P:], [[1] * T + [0, 0]] * 2)


def test_bfloat16_activations():
    cfg = dataclasses.replace(CFG, dtype="bfloat16")
    params = _params()  # dtype only changes activations, so CFG's params serve
    abstract = jax.eval_shape(tf.init_params, cfg, jax.random.PRNGKey(0))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(abstract))
    tokens, mask = _left_padded([6, 9])
    logits = tf.forward(params, cfg, tokens, mask)
    assert logits.dtype == jnp.float32 and np.all(np.isfinite(np.asarray(logits)))
    ref = tf.forward(params, CFG, tokens, mask)
    np.testing.assert_allclose(logits[:, 3:], ref[:, 3:], atol=0.1)
    assert kv_cache.init_cache(cfg, 2, 8).k_LxBxSxKxHd.dtype == jnp.bfloat16
