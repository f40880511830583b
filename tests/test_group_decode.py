"""The shared-prefix decode cache (`models.group_decode.GroupCache`) against the per-row cache, and
the sampler's segmented decode loop at segment boundaries."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import ModelConfig
from jaxrl.models import transformer as tf
from jaxrl.models.decode import decode_layers
from jaxrl.models.group_decode import decode_group_layers, default_segments, grow_own, segment_ends
from jaxrl.rollout.sampler import SamplingParams, prefill_groups, prefill_shared, sample

CFG = ModelConfig(vocab_size=29, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)
P, G, STEPS = 5, 3, 6
LENGTHS = (1, 5, 3)  # real prompt tokens; 1 leaves a group with no valid prefix slot at all


def _prompts(lengths=LENGTHS, prompt_len=P, seed=3):
    rng = np.random.default_rng(seed)
    mask = np.zeros((len(lengths), prompt_len), np.int32)
    for i, n in enumerate(lengths):
        mask[i, prompt_len - n :] = 1
    prompt = np.where(mask, rng.integers(1, CFG.vocab_size, mask.shape), 0)
    return jnp.asarray(prompt, jnp.int32), jnp.asarray(mask)


# Jitted, not eager: op-by-op dispatch compiles every primitive of the model for every shape (about
# twice the time of compiling each call's program once); the arithmetic is the same.
_prefill_groups = jax.jit(prefill_groups, static_argnums=(1, 4, 5, 6))
_prefill_shared = jax.jit(prefill_shared, static_argnums=(1, 4, 5, 6))
_decode_layers = jax.jit(decode_layers, static_argnums=1)
_decode_group_layers = jax.jit(decode_group_layers, static_argnums=1)
_grow_own = jax.jit(grow_own, static_argnums=1)


@pytest.fixture(scope="module")
def params():
    return tf.init_params(CFG, jax.random.PRNGKey(0))


@pytest.mark.slow
def test_group_cache_logits_equal_row_cache_with_left_padding(params):
    """Feed the same tokens (different per row, so the G rows of a group diverge) through both caches:
    the last prompt token at step 0, then 2 tokens in one call, then 1, then 2. The own buffers start
    3 slots long and grow before steps 3 and 4 (segment boundaries: a call writes the first slots of
    a fresh segment). Every step's logits match the per-row cache's."""
    prompt, pmask = _prompts()
    rows, lparams, _, last_N = _prefill_groups(params, CFG, prompt, pmask, G, P + STEPS, P + STEPS)
    shared, _, _, last_N2 = _prefill_shared(params, CFG, prompt, pmask, G, 3, P + STEPS)
    np.testing.assert_array_equal(last_N, last_N2)
    assert shared.prefix[0][0].shape == (3, CFG.n_kv_heads, P - 1, CFG.head_dim)  # once per group
    assert shared.own[0][0].shape == (3, CFG.n_kv_heads, G, 3, CFG.head_dim)
    fed_NxS = jnp.concatenate([last_N[:, None], jax.random.randint(jax.random.PRNGKey(2), (9, STEPS - 1), 1, 29)], 1)
    calls = [(0, 1, None), (1, 3, None), (3, 4, 4), (4, 6, 6)]  # (first step, end, grow to)
    for start, end, grow in calls:
        if grow:
            shared = _grow_own(shared, grow)
        want, rows, _ = _decode_layers(lparams, CFG, fed_NxS[:, start:end], rows, P - 1 + start)
        got, shared, _ = _decode_group_layers(lparams, CFG, fed_NxS[:, start:end], shared, start)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=f"steps {start}..{end - 1}")
    np.testing.assert_array_equal(shared.pos_B, rows.pos_B)
    # The rows of a group really saw different tokens (else a row mix-up could go unnoticed).
    assert not np.allclose(got[0], got[1], atol=1e-3)


def test_segment_ends_and_default():
    # 7 steps in 3 segments: 7 = 3 + 2 + 2, so each segment's buffer holds slots 0..end-1.
    assert segment_ends(7, 3) == (3, 5, 7)
    assert segment_ends(128, 4) == (32, 64, 96, 128)
    assert segment_ends(5, 1) == (5,)
    assert segment_ends(3, 3) == (1, 2, 3)
    with pytest.raises(ValueError, match="decode_segments"):
        segment_ends(3, 4)
    with pytest.raises(ValueError, match="decode_segments"):
        segment_ends(3, 0)
    assert default_segments(128) == 4 and default_segments(40) == 1 and default_segments(6) == 1


@pytest.mark.slow
@pytest.mark.parametrize("segments", [3, 7])
def test_sampler_segments_match_row_cache(params, segments):
    """Sampled tokens (temperature 1, same key) and recorded log-probs of the segmented shared-prefix
    loop equal the per-row loop's, at every segment boundary; 7 segments = one step each."""
    prompt, pmask = _prompts()
    kw = dict(group_size=G, sampling=SamplingParams(max_new_tokens=7, temperature=1.0, eos_id=99, pad_id=0))
    want = sample(params, CFG, prompt, pmask, jax.random.PRNGKey(4), share_prefix=False, **kw)
    got = sample(params, CFG, prompt, pmask, jax.random.PRNGKey(4), decode_segments=segments, **kw)
    np.testing.assert_array_equal(got.tokens_BxT, want.tokens_BxT)
    np.testing.assert_allclose(got.logp_BxT, want.logp_BxT, atol=1e-5, rtol=0)
    assert int(got.num_steps) == 7


@pytest.mark.slow
def test_sampler_segments_stop_early_on_eos_and_single_token_prompts(params):
    """EOS (a token rows draw often) ends rows inside the first of 3 segments; the later segments'
    loops must neither run past all-done nor disturb finished rows. P = 1: no prefix at all."""
    prompt, pmask = _prompts()
    kw, sp = dict(group_size=G), dict(max_new_tokens=7, temperature=1.0, pad_id=0)
    probe = sample(
        params,
        CFG,
        prompt,
        pmask,
        jax.random.PRNGKey(4),
        share_prefix=False,
        sampling=SamplingParams(eos_id=99, **sp),
        **kw,
    )
    eos = int(np.bincount(np.asarray(probe.tokens_BxT)[:, :2].ravel()).argmax())  # common early token
    n_programs = sample.__wrapped__._cache_size()  # temperature_checked(jax.jit(sample's body))
    want = sample(
        params,
        CFG,
        prompt,
        pmask,
        jax.random.PRNGKey(4),
        share_prefix=False,
        sampling=SamplingParams(eos_id=eos, **sp),
        **kw,
    )
    assert sample.__wrapped__._cache_size() == n_programs  # eos_id is traced: another EOS, the same program
    got = sample(
        params,
        CFG,
        prompt,
        pmask,
        jax.random.PRNGKey(4),
        decode_segments=3,
        sampling=SamplingParams(eos_id=eos, **sp),
        **kw,
    )
    for a, b in zip(got[:6], want[:6]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    finished_at = np.asarray(got.length_B)[np.asarray(got.finished_B)]
    assert finished_at.size and finished_at.min() <= 3  # some row ends inside the first segment (3 steps)
    one, one_mask = _prompts(lengths=(1, 1), prompt_len=1)
    kw1 = dict(group_size=2, sampling=SamplingParams(max_new_tokens=4, temperature=1.0, eos_id=99, pad_id=0))
    want1 = sample(params, CFG, one, one_mask, jax.random.PRNGKey(1), share_prefix=False, **kw1)
    got1 = sample(params, CFG, one, one_mask, jax.random.PRNGKey(1), decode_segments=2, **kw1)
    np.testing.assert_array_equal(got1.tokens_BxT, want1.tokens_BxT)
    np.testing.assert_allclose(got1.logp_BxT, want1.logp_BxT, atol=1e-5, rtol=0)
