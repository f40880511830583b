"""The update's memory options: chunked log-softmax, block rematerialisation, bfloat16 compute.

Each must leave the log-probs, entropies and gradients of `token_logprobs` unchanged (float32: to
1e-5; bfloat16: close, with float32 master weights), and the first two must shrink what XLA keeps.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import ModelConfig
from jaxrl.models import transformer as tf
from jaxrl.models.logprobs import chunked_token_logprobs

CFG = ModelConfig(
    vocab_size=29, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64, tie_embeddings=False
)
P, T = 5, 4


@functools.cache
def _params(cfg=CFG):
    return tf.init_params(cfg, jax.random.PRNGKey(0))


def _batch(seed=1):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, CFG.vocab_size, (2, P), dtype=np.int32)
    pmask = np.ones((2, P), np.int32)
    pmask[0, :2] = 0  # row 0 left-padded
    comp = rng.integers(0, CFG.vocab_size, (2, T), dtype=np.int32)
    return jnp.asarray(prompt), jnp.asarray(pmask), jnp.asarray(comp)


def _value_and_grad(cfg, temperature=0.7, **kw):
    """(logp, entropy, grads of sum(w1*logp + w2*entropy), XLA temporaries in bytes); the weights make
    every position count differently."""
    return _cached_value_and_grad(cfg, temperature, tuple(sorted(kw.items())))


@functools.cache  # the references are shared by several tests: compile each once
def _cached_value_and_grad(cfg, temperature, kw):
    kw = dict(kw)
    prompt, pmask, comp = _batch()
    w1 = jnp.linspace(0.5, 1.5, 2 * T).reshape(2, T)
    w2 = jnp.linspace(-1.0, 0.3, 2 * T).reshape(2, T)

    def loss(p):
        logp, ent = tf.token_logprobs(p, cfg, prompt, pmask, comp, jnp.ones((2, T)), temperature, **kw)
        return jnp.sum(w1 * logp + w2 * ent), (logp, ent)

    compiled = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(_params(cfg)).compile()
    (_, (logp, ent)), grads = compiled(_params(cfg))
    return logp, ent, grads, compiled.memory_analysis().temp_size_in_bytes


def _assert_same(a, b, atol=1e-5):
    for x, y in zip(a[:2], b[:2]):
        np.testing.assert_allclose(x, y, atol=atol, rtol=0)
    for (path, g), h in zip(jax.tree_util.tree_leaves_with_path(a[2]), jax.tree.leaves(b[2])):
        np.testing.assert_allclose(g, h, atol=atol, rtol=0, err_msg=str(path))


def test_chunked_logprobs_equal_unchunked_values_and_grads():
    # 2 x 4 = 8 rows in chunks of 3: three chunks, the last padded with one row. (A tied head, whose
    # gradient also flows into the embedding: the MoE test below, on the same pair of compiles.)
    _assert_same(_value_and_grad(CFG, logits_chunk=3), _value_and_grad(CFG))


def test_chunked_logprobs_hand_values():
    # One row, head = identity on a 3-token vocabulary, hidden (0, ln 2, ln 3): logits (0, ln2, ln3),
    # softmax = (1, 2, 3) / 6. logp(token 2) = ln(3/6) = -ln 2; entropy = -sum p ln p
    # = -(1/6 ln(1/6) + 2/6 ln(2/6) + 3/6 ln(3/6)) = 1.0114043. Second row: temperature 2 on the same.
    h = jnp.log(jnp.array([[[1.0, 2.0, 3.0]]])) * jnp.ones((1, 2, 1))
    logp, ent = chunked_token_logprobs(h, jnp.eye(3), jnp.array([[2, 0]]), 1.0, 1)
    np.testing.assert_allclose(logp[0, 0], -np.log(2.0), rtol=1e-6)
    np.testing.assert_allclose(logp[0, 1], np.log(1 / 6), rtol=1e-6)
    np.testing.assert_allclose(ent[0], [1.0114043] * 2, rtol=1e-6)


def test_chunked_logprobs_keep_less_alive():
    # V = 4096, 256 rows: unchunked, the backward keeps several 256 x 4096 float32 tensors (4 MiB each);
    # in chunks of 32 rows the biggest is 32 x 4096 (0.5 MiB).
    D, V, B, Tn = 16, 4096, 8, 32
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    h = jax.random.normal(k1, (B, Tn, D))
    head = jax.random.normal(k2, (D, V)) * 0.1
    tok = jnp.zeros((B, Tn), jnp.int32)

    def temp_bytes(chunk):
        if chunk:

            def f(hh, w):
                return jnp.sum(chunked_token_logprobs(hh, w, tok, 1.0, chunk)[0])
        else:
            from jaxrl.models.logprobs import logprob_and_entropy

            def f(hh, w):
                return jnp.sum(logprob_and_entropy(jnp.einsum("btd,dv->btv", hh, w), tok, 1.0)[0])

        return jax.jit(jax.grad(f, argnums=(0, 1))).lower(h, head).compile().memory_analysis().temp_size_in_bytes

    full, chunked = temp_bytes(0), temp_bytes(32)
    assert full > 2 * B * Tn * V * 4, full  # at least two whole logits-sized tensors
    assert chunked < B * Tn * V * 4 / 2, (chunked, full)  # never even one


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_leaves_values_and_grads_unchanged_and_keeps_less(remat):
    rematted, plain = _value_and_grad(CFG, remat=remat), _value_and_grad(CFG)
    _assert_same(rematted, plain)
    assert rematted[3] < plain[3], (rematted[3], plain[3])


def test_remat_unknown_policy_names_it():
    with pytest.raises(ValueError, match="remat"):
        _value_and_grad(CFG, remat="everything")


@pytest.mark.slow
def test_bfloat16_compute_float32_master_weights():
    bf = dataclasses.replace(CFG, dtype="bfloat16")
    logp, ent, grads, _ = _value_and_grad(bf, logits_chunk=3)
    ref = _value_and_grad(CFG)
    assert logp.dtype == ent.dtype == jnp.float32  # the log-softmax runs in float32
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))  # gradients of the float32 weights
    np.testing.assert_allclose(logp, ref[0], atol=0.05)  # bfloat16 has 8 mantissa bits: ~1e-2 relative
    cos = [  # in numpy: eager jnp would compile a vdot and two norms for every leaf shape
        float(np.vdot(g, h) / (np.linalg.norm(g) * np.linalg.norm(h) + 1e-30))
        for g, h in ((np.ravel(g), np.ravel(h)) for g, h in zip(jax.tree.leaves(grads), jax.tree.leaves(ref[2])))
    ]
    assert min(cos) > 0.99, cos


@pytest.mark.slow
def test_remat_and_chunks_on_a_moe_model_with_a_tied_head():
    """MoE blocks rematerialised, and the logits chunked through a tied head (the embedding's
    gradient then comes from both ends): the values and gradients of the plain compute."""
    moe = dataclasses.replace(
        CFG, n_experts=4, experts_per_token=2, expert_mlp_dim=16, moe_dispatch="naive", tie_embeddings=True
    )
    _assert_same(_value_and_grad(moe, remat="full", logits_chunk=5), _value_and_grad(moe))
