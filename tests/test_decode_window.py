"""The window form of decoding (`decode.window_layers` + `commit_window`) against the sampler's
decode step, and the measured step costs (`rollout/calibrate.py`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import ModelConfig, SpeculativeConfig
from jaxrl.models import transformer as tf
from jaxrl.models.cache_kinds import LayerKV
from jaxrl.models.decode import LayerCache, commit_window, decode_layers, empty_window, window_layers
from jaxrl.rollout.sampler import prefill_groups
from jaxrl.rollout.speculative.calibrate import constant_costs, measure_step_costs

CFG = ModelConfig(vocab_size=29, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)
P, S = 5, 16

# Jitted, not eager: op-by-op dispatch compiles every primitive of the model for every shape (about
# twice the time of compiling each call's program once); the arithmetic is the same.
_prefill_groups = jax.jit(prefill_groups, static_argnums=(1, 4, 5, 6))
_commit_window = jax.jit(commit_window)
_decode_layers = jax.jit(decode_layers, static_argnums=(1, 5))
_window_layers = jax.jit(window_layers, static_argnums=(1, 7))


def _setup():
    params = tf.init_params(CFG, jax.random.PRNGKey(0))
    rng = np.random.default_rng(3)
    mask = np.zeros((3, P), np.int32)
    for i, n in enumerate((2, 5, 4)):
        mask[i, P - n :] = 1
    prompt = jnp.asarray(np.where(mask, rng.integers(1, 29, (3, P)), 0), jnp.int32)
    cache, lparams, _, last_B = _prefill_groups(params, CFG, prompt, jnp.asarray(mask), 1, S, S)
    fed_Bx4 = jnp.concatenate([last_B[:, None], jnp.asarray(rng.integers(1, 29, (3, 3)), jnp.int32)], axis=1)
    return lparams, cache, fed_Bx4


def _window_cache(cache: LayerCache) -> LayerCache:
    return cache._replace(valid_BxS=cache.valid_BxS.at[:, P - 1 :].set(True))


@pytest.mark.slow
def test_window_calls_equal_decode_layers():
    """One 1-token call then one 2-token call into the same window give the logits of a 3-token
    decode at the shared cache slots."""
    lparams, cache, fed_Bx4 = _setup()
    ref_Bx3xV, _, _ = _decode_layers(lparams, CFG, fed_Bx4[:, :3], cache, P - 1)
    wcache, fill_B = _window_cache(cache), jnp.full((3,), P - 1, jnp.int32)
    window = empty_window(wcache, 4, CFG.n_layers)
    first, window, _ = _window_layers(lparams, CFG, fed_Bx4[:, :1], wcache, fill_B, window, 0)
    rest, window, _ = _window_layers(lparams, CFG, fed_Bx4[:, 1:3], wcache, fill_B, window, 1)
    np.testing.assert_allclose(jnp.concatenate([first, rest], axis=1), ref_Bx3xV, atol=1e-5)
    # The early-exit view (first layer only) reads and fills only that layer's window.
    ref1, _, _ = _decode_layers(lparams, CFG, fed_Bx4[:, :2], cache, P - 1, n_layers=1)
    got1, win1, _ = _window_layers(lparams, CFG, fed_Bx4[:, :2], wcache, fill_B, empty_window(wcache, 4, 1), 0, 1)
    assert len(win1) == 1
    np.testing.assert_allclose(got1, ref1, atol=1e-5)


@pytest.mark.slow
def test_commit_keeps_a_different_number_of_tokens_per_row():
    """Rows keep 1, 3 and 2 of the 4 window tokens; the next token of each row then sees exactly its
    kept tokens: its logits equal a plain decode of that row alone over those tokens."""
    lparams, cache, fed_Bx4 = _setup()
    wcache, fill_B = _window_cache(cache), jnp.full((3,), P - 1, jnp.int32)
    _, window, _ = _window_layers(lparams, CFG, fed_Bx4, wcache, fill_B, empty_window(wcache, 4, CFG.n_layers), 0)
    keep_B = jnp.asarray([1, 3, 2], jnp.int32)
    committed = _commit_window(wcache, window, fill_B, keep_B)
    next_B = jnp.asarray([11, 12, 13], jnp.int32)
    got_BxV, _, _ = _window_layers(
        lparams, CFG, next_B[:, None], committed, fill_B + keep_B, empty_window(committed, 4, CFG.n_layers), 0
    )
    for b in range(3):
        row = LayerCache(
            tuple(LayerKV(k[b : b + 1], v[b : b + 1]) for k, v in cache.kv),
            cache.valid_BxS[b : b + 1],
            cache.pos_B[b : b + 1],
        )
        tokens = jnp.concatenate([fed_Bx4[b, : int(keep_B[b])], next_B[b : b + 1]])[None]
        ref, _, _ = _decode_layers(lparams, CFG, tokens, row, P - 1)
        np.testing.assert_allclose(got_BxV[b, 0], ref[0, -1], atol=1e-5)


@pytest.mark.slow
def test_measured_costs_are_positive_per_draft_length():
    params = tf.init_params(CFG, jax.random.PRNGKey(0))
    spec = SpeculativeConfig(enabled=True, drafter="early_exit", max_draft=3)
    costs = measure_step_costs(params, CFG, spec, n_rows=4, cache_len=12, calls=3, repeats=1)
    assert costs.verify_K.shape == (3,) and np.all(np.isfinite(costs.verify_K)) and np.all(costs.verify_K > 0)
    assert np.isfinite(float(costs.draft)) and float(costs.draft) > 0
    # Interpolated linearly from the 1-token and the widest forward.
    np.testing.assert_allclose(np.diff(np.asarray(costs.verify_K)), np.diff(np.asarray(costs.verify_K))[0], rtol=1e-4)
    # Reuse without a self-drafter: the verify widths up to reuse_width are timed, the draft cost is
    # the configured one.
    reuse = SpeculativeConfig(enabled=True, drafter="reuse", fallback="none", reuse_width=5, draft_cost=0.25)
    got = measure_step_costs(params, CFG, reuse, n_rows=4, cache_len=12, calls=3, repeats=1)
    assert got.verify_K.shape == (5,) and np.all(np.asarray(got.verify_K) > 0) and float(got.draft) == 0.25
    assert constant_costs(reuse).verify_K.shape == (5,)
