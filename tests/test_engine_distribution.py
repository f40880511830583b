"""The engine's sampled sequences have the plain sampler's distribution: chi-square against brute-force
enumeration of every completion (vocab 5, 3 new tokens, EOS inside the vocab), with two prompts of
different lengths interleaved so that slots are reused across prompts during the run; and the same
test fails for an engine that reuses its Gumbel noise across steps."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from chi_square import chi_square_pvalue

from jaxrl.config import EngineConfig, ModelConfig
from jaxrl.models import transformer as tf
from jaxrl.rollout.engine import state as engine_state
from jaxrl.rollout.engine.driver import Engine
from jaxrl.rollout.sampler import SamplingParams
from jaxrl.rollout.speculative import acceptance

SMALL = ModelConfig(vocab_size=5, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, mlp_dim=32)
EOS, PAD, P, T, G = 1, 0, 4, 3, 4
PROMPTS = ((2, 4, 3), (3, 2))  # real tokens; left-padded to P = 4
N_GROUPS = 1500  # per prompt: 6000 samples each


@functools.cache
def _params():
    params = tf.init_params(SMALL, jax.random.PRNGKey(0))
    return dict(params, embedding=params["embedding"] * 1.5)


def _exact_distribution(prompt, temperature, top_k):
    """{completion (up to and including EOS): probability}: every length-T string's probability
    under the plain sampler's per-step distribution (`acceptance.target_probs`), cut at EOS."""
    strings = np.array(list(itertools.product(range(SMALL.vocab_size), repeat=T)), np.int32)
    seq = np.concatenate([np.repeat(np.asarray([prompt], np.int32), len(strings), 0), strings], 1)
    n = len(prompt)
    logits = np.asarray(tf.forward(_params(), SMALL, seq, np.ones_like(seq)))[:, n - 1 : n - 1 + T]
    probs = np.asarray(acceptance.target_probs(jnp.asarray(logits), temperature, top_k, 1.0))
    dist = {}
    for s, p in zip(strings, probs):
        cut = next((i + 1 for i, t in enumerate(s) if t == EOS), T)
        key = tuple(int(t) for t in s[:cut])
        if key not in dist:
            dist[key] = float(np.prod([p[i, s[i]] for i in range(cut)]))
    assert abs(sum(dist.values()) - 1) < 1e-4
    return dist


def _engine_samples(temperature, top_k, seed, n_groups=N_GROUPS, slots=64):
    """All samples of 2 x n_groups groups (the two prompts alternating), through `slots` slots."""
    ecfg = EngineConfig(enabled=True, slots=slots, chunk=2, admit_groups=8)
    engine = Engine(
        SMALL,
        ecfg,
        group_size=G,
        prompt_len=P,
        sampling=SamplingParams(max_new_tokens=T, temperature=temperature, top_k=top_k, eos_id=EOS, pad_id=PAD),
        rng=jax.random.PRNGKey(seed),
    )
    items = ((i % 2, PROMPTS[i % 2]) for i in range(2 * n_groups))
    groups = engine.collect(_params(), 0, items, n_groups=2 * n_groups)
    assert len(groups) == 2 * n_groups and engine.counts["chunks"] > 100  # slots reused many times
    out = {0: [], 1: []}
    for g in groups:
        out[g.tag] += [tuple(int(t) for t in row[m > 0]) for row, m in zip(g.tokens_GxT, g.completion_mask_GxT)]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.8, 3)])
def test_sampled_distribution_equals_enumeration(temperature, top_k):
    """6,000 samples per prompt against the exact distribution: chi-square p-value > 1e-3 (fixed seed)."""
    samples = _engine_samples(temperature, top_k, seed=11)
    for tag, prompt in enumerate(PROMPTS):
        pvalue, df = chi_square_pvalue(samples[tag], _exact_distribution(prompt, temperature, top_k))
        assert df >= 8
        assert pvalue > 1e-3, (prompt, pvalue)


@pytest.mark.slow
def test_chi_square_catches_noise_reused_across_steps(monkeypatch):
    """An engine that draws every step's Gumbel noise from the same key (a plausible bug: splitting
    the key once per chunk instead of once per step) correlates a sample's tokens; the test above
    fails it by a wide margin, even with a third of its samples (more samples only add power)."""
    real_split = jax.random.split

    def frozen_split(key, num=2):
        return jnp.stack([key, key]) if num == 2 else real_split(key, num)

    monkeypatch.setattr(engine_state.jax.random, "split", frozen_split)
    try:
        # decode_chunk is jitted: 60 slots (a spec no other test compiles) make it trace again, now
        # with the broken split, and leave every other cached program as it is (no jax.clear_caches,
        # which would make every later test in this process compile again).
        samples = _engine_samples(1.0, 0, seed=11, n_groups=N_GROUPS // 3, slots=60)
    finally:
        monkeypatch.undo()
    pvalue, _ = chi_square_pvalue(samples[0], _exact_distribution(PROMPTS[0], 1.0, 0))
    assert pvalue < 1e-6, pvalue
