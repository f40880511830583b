"""`Engine.sample`: k samples of a prompt (also more samples of a prompt already drawn, prefilled
again), in pieces of at most G per prefill, decoded to the end. Greedy: every extra sample equals
the prompt's first ones; sampled: recorded log-probs equal the trainer's and the draws have the
plain sampler's distribution (chi-square against enumeration)."""

import jax
import numpy as np
import pytest
import test_engine_distribution as dist
from chi_square import chi_square_pvalue
from test_engine import CFG, LENGTHS, _engine, _eos, _items, _params

from jaxrl.config import EngineConfig
from jaxrl.models import transformer as tf
from jaxrl.rollout.engine.driver import Engine
from jaxrl.rollout.engine.groups import batch_of_groups, concat_groups
from jaxrl.rollout.sampler import SamplingParams


def test_more_greedy_samples_of_a_scored_prompt_equal_its_first_ones():
    """Collect G=2 samples of five prompts; then ask for 3 more of prompt 0, none of 1, 5 more of
    2 (pieces of 2+1 and 2+2+1 through 4 slots, so pieces wait for slots). Under greedy decoding
    each new sample is the prompt's first sample, token for token; concatenated, a prompt's group
    has 2 + k rows under one group id."""
    eos = _eos(CFG)
    engine = _engine(CFG, eos, slots=4, chunk=3)
    items = _items()
    first = sorted(engine.collect(_params(), 0, items, n_groups=len(LENGTHS)), key=lambda g: g.tag)
    more = engine.sample(_params(), 1, [(0, items[0][1], 3), (1, items[1][1], 0), (2, items[2][1], 5)])
    assert [g.tag for g in more] == [0, 1, 2] and more[1].tokens_GxT is None
    for group, k in ((more[0], 3), (more[2], 5)):
        ref = first[group.tag]
        assert group.tokens_GxT.shape == (k, ref.tokens_GxT.shape[1])
        np.testing.assert_array_equal(group.prompt_P, ref.prompt_P)
        for name in ("tokens_GxT", "completion_mask_GxT", "finished_G"):
            np.testing.assert_array_equal(getattr(group, name), np.repeat(getattr(ref, name)[:1], k, 0), name)
        np.testing.assert_allclose(group.logp_GxT, np.repeat(ref.logp_GxT[:1], k, 0), atol=1e-5, rtol=0)
        assert np.all(group.version_GxT[group.completion_mask_GxT > 0] == 1)
    merged = concat_groups([first[2], more[2]], 2, first[2].prompt_P, first[2].prompt_mask_P)
    batch = batch_of_groups([first[0], merged]).fields()
    np.testing.assert_array_equal(batch["group_id_B"], [0, 0] + [1] * 7)
    assert engine.groups_in_flight == 0 and np.all(engine.pool.owner_S < 0)


@pytest.mark.slow
def test_sampled_logprobs_equal_trainer_recomputation():
    """Temperature 0.7, 3 slots for 3 + 1 + 4 samples: the recorded log-probs equal
    `token_logprobs` over the assembled batch."""
    engine = _engine(CFG, _eos(CFG), slots=3, chunk=2, greedy=False, temperature=0.7, seed=5)
    items = _items()
    groups = engine.sample(_params(), 0, [(i, items[i][1], k) for i, k in ((0, 3), (3, 1), (4, 4))])
    batch = batch_of_groups(groups).fields()
    logp, _ = tf.token_logprobs(
        _params(),
        CFG,
        batch["prompt_tokens_BxP"],
        batch["prompt_mask_BxP"],
        batch["tokens_BxT"],
        batch["completion_mask_BxT"],
        0.7,
    )
    mask = batch["completion_mask_BxT"] > 0
    assert mask.sum() > 15
    np.testing.assert_allclose(batch["rollout_logp_BxT"][mask], np.asarray(logp)[mask], atol=2e-5, rtol=0)
    np.testing.assert_array_equal(batch["group_id_B"], [0] * 3 + [1] + [2] * 4)


@pytest.mark.slow
def test_sample_draws_have_the_plain_distribution():
    """Temperature 0.8, top-k 3: 600 requests of 3 samples of one prompt and 5 of the other
    (pieces of 3, and 4 + 1, with G=4) through 64 slots -> chi-square p-value > 1e-3 against
    enumeration (tests/test_engine_distribution.py's model and prompts)."""
    temperature, top_k = 0.8, 3
    ecfg = EngineConfig(enabled=True, slots=64, chunk=2, admit_groups=8)
    engine = Engine(
        dist.SMALL,
        ecfg,
        group_size=dist.G,
        prompt_len=dist.P,
        sampling=SamplingParams(
            max_new_tokens=dist.T, temperature=temperature, top_k=top_k, eos_id=dist.EOS, pad_id=dist.PAD
        ),
        rng=jax.random.PRNGKey(7),
    )
    requests = [(0, dist.PROMPTS[0], 3), (1, dist.PROMPTS[1], 5)] * 600
    out = {0: [], 1: []}
    for g in engine.sample(dist._params(), 0, requests):
        out[g.tag] += [tuple(int(t) for t in row[m > 0]) for row, m in zip(g.tokens_GxT, g.completion_mask_GxT)]
    assert (len(out[0]), len(out[1])) == (1800, 3000)
    for tag, prompt in enumerate(dist.PROMPTS):
        pvalue, df = chi_square_pvalue(out[tag], dist._exact_distribution(prompt, temperature, top_k))
        assert df >= 5 and pvalue > 1e-3, (prompt, pvalue, df)
