"""`decode.decode_rows` (one token per row at the row's own cache slot: the slot engine's step)
against the sampler's decode step, and the compiled engine chunk's cache traffic."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import ModelConfig
from jaxrl.models import transformer as tf
from jaxrl.models.cache_kinds import LayerKV
from jaxrl.models.decode import LayerCache, decode_layers, decode_rows
from jaxrl.rollout.engine.state import EngineSpec, decode_chunk, init_state
from jaxrl.rollout.sampler import prefill_groups

CFG = ModelConfig(vocab_size=29, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)
P, S = 5, 16

# Jitted, not eager: op-by-op dispatch compiles every primitive of the model for every shape (about
# twice the time of compiling each call's program once); the arithmetic is the same.
_prefill_groups = jax.jit(prefill_groups, static_argnums=(1, 4, 5, 6))
_decode_layers = jax.jit(decode_layers, static_argnums=(1, 5))
_decode_rows = jax.jit(decode_rows, static_argnums=1)


def _setup():
    params = tf.init_params(CFG, jax.random.PRNGKey(0))
    rng = np.random.default_rng(3)
    mask = np.zeros((3, P), np.int32)
    for i, n in enumerate((2, 5, 4)):
        mask[i, P - n :] = 1
    prompt = jnp.asarray(np.where(mask, rng.integers(1, 29, (3, P)), 0), jnp.int32)
    cache, lparams, _, last_B = _prefill_groups(params, CFG, prompt, jnp.asarray(mask), 1, S, S)
    fed_Bx4 = jnp.concatenate([last_B[:, None], jnp.asarray(rng.integers(1, 29, (3, 3)), jnp.int32)], axis=1)
    return lparams, cache._replace(valid_BxS=cache.valid_BxS.at[:, P - 1 :].set(True)), fed_Bx4


@pytest.mark.slow
def test_rows_at_one_fill_level_give_the_samplers_logits():
    """All rows at fill P-1: the same logits, bit for bit, as `decode_layers` at index P-1."""
    lparams, cache, fed_Bx4 = _setup()
    ref_Bx1xV, ref_cache, _ = _decode_layers(lparams, CFG, fed_Bx4[:, :1], cache, P - 1)
    got_BxV, got_cache, _ = _decode_rows(lparams, CFG, fed_Bx4[:, 0], cache, jnp.full((3,), P - 1), jnp.ones(3, int))
    np.testing.assert_array_equal(got_BxV, ref_Bx1xV[:, 0])
    for (k, v), (rk, rv) in zip(got_cache.kv, ref_cache.kv):
        np.testing.assert_array_equal(k, rk)
        np.testing.assert_array_equal(v, rv)
    np.testing.assert_array_equal(got_cache.pos_B, ref_cache.pos_B)


@pytest.mark.slow
def test_rows_advance_at_their_own_rate():
    """Three steps where row b only advances from step b on (advance 0 before: the row re-feeds its
    first token at the same slot). Row b then holds 3-b tokens, and its last logits equal a plain
    decode of that row alone over those tokens."""
    lparams, cache, fed_Bx4 = _setup()
    fill_B, col_B = jnp.full((3,), P - 1, jnp.int32), jnp.zeros(3, jnp.int32)
    for step in range(3):
        advance_B = (jnp.arange(3) <= step).astype(jnp.int32)
        token_B = fed_Bx4[jnp.arange(3), col_B]
        logits_BxV, cache, _ = _decode_rows(lparams, CFG, token_B, cache, fill_B, advance_B)
        fill_B, col_B = fill_B + advance_B, col_B + advance_B
    _, ref_cache, _ = _setup()
    for b in range(3):
        row = LayerCache(
            tuple(LayerKV(k[b : b + 1], v[b : b + 1]) for k, v in ref_cache.kv),
            ref_cache.valid_BxS[b : b + 1],
            ref_cache.pos_B[b : b + 1],
        )
        ref, _, _ = _decode_layers(lparams, CFG, fed_Bx4[b : b + 1, : 3 - b], row, P - 1)
        np.testing.assert_allclose(logits_BxV[b], ref[0, -1], atol=1e-5)
    np.testing.assert_array_equal(cache.pos_B - ref_cache.pos_B, [3, 2, 1])


@pytest.mark.slow
def test_compiled_chunk_copies_no_cache_buffer():
    """The chunk's decode loop updates the cache in place: no copy of a whole S x K x C x Hd layer
    buffer in the compiled program (the window form once cost two such copies per layer per step)."""
    spec = EngineSpec(CFG, slots=6, prompt_len=P, max_new_tokens=S - P, group_size=2, eos_id=1, pad_id=0)
    params = tf.init_params(CFG, jax.random.PRNGKey(0))
    hlo = decode_chunk.lower(params, spec, init_state(spec, jax.random.PRNGKey(1)), 4, 0, 1.0).compile().as_text()
    shape = f"f32[6,{CFG.n_kv_heads},{S},{CFG.head_dim}]"
    assert shape in hlo  # the buffers are there under this name
    assert not re.findall(re.escape(shape) + r"\{[0-9,]*\} copy\(", hlo)
