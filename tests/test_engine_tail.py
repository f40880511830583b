"""The engine's speculation toggle (speculative.engine.ToggleChunk): plain chunks while more than
`max_active_rows` slots decode, speculative chunks on just the decoding rows once that many or fewer
do. The threshold from measured costs and acceptance (calibrate.tail_threshold, hand-worked), greedy
tokens identical to the plain engine and sampler across switches, the sampled distribution of a
run that switches mid-sample (chi-square), and a checkpoint round trip mid-rollout."""

import json

import jax
import numpy as np
import pytest
import test_engine as te
import test_engine_distribution as td
from chi_square import chi_square_pvalue

from jaxrl.config import EngineConfig, SpeculativeConfig
from jaxrl.rollout.engine.driver import Engine
from jaxrl.rollout.engine.groups import batch_of_groups
from jaxrl.rollout.sampler import SamplingParams
from jaxrl.rollout.speculative.calibrate import StepCosts, expected_tokens, tail_gain, tail_threshold
from jaxrl.rollout.speculative.engine import chunk_kind


def _costs(verify_k4, draft):
    # verify_K for k = 1..4 (only k = 4 is read below)
    return StepCosts(np.array([1.1, 1.2, 1.3, verify_k4], np.float32), np.float32(draft))


def test_tail_threshold_from_costs_and_acceptance_by_hand():
    costs = {1: _costs(1.5, 0.3), 4: _costs(1.7, 0.35), 8: _costs(2.1, 0.4), 16: _costs(3.0, 0.5)}
    # a = 0.8, k = 4: E = (1 - 0.8^5) / 0.2 = (1 - 0.32768) / 0.2 = 3.3616 tokens per step;
    # cost 1.5 + 4 x 0.3 = 2.7 -> 1.245; 1.7 + 1.4 = 3.1 -> 1.084; 2.1 + 1.6 = 3.7 -> 0.9085; 3.0 + 2.0 = 5 -> 0.672
    assert expected_tokens(0.8, 4) == pytest.approx(3.3616)
    gains = [tail_gain(costs[r], 0.8, 4) for r in (1, 4, 8, 16)]
    np.testing.assert_allclose(gains, [3.3616 / 2.7, 3.3616 / 3.1, 3.3616 / 3.7, 3.3616 / 5.0], rtol=1e-6)
    assert tail_threshold(costs, 0.8, 4) == 4
    # a = 0.5: E = (1 - 0.5^5) / 0.5 = 1.9375 < 2.7: no row count gains.
    assert tail_threshold(costs, 0.5, 4) == 0
    # a = 1: E = 5; 5 / 3.7 = 1.35 at 8 rows, 5 / 5 = 1.0 (no gain) at 16.
    assert expected_tokens(1.0, 4) == 5.0 and tail_threshold(costs, 1.0, 4) == 8
    # k = 1 at a = 0.8: E = 1.8; verify 1.1 + 0.3 = 1.4 -> 1.29 at 1 row, 1.1 + 0.5 = 1.6 -> 1.125 at 16.
    assert tail_threshold(costs, 0.8, 1) == 16
    # The engine speculates at the threshold and below, plain above it.
    assert [chunk_kind(n, 4) for n in (8, 5, 4, 1)] == ["plain", "plain", "speculative", "speculative"]


def _toggle(max_active_rows, max_draft=3):
    return SpeculativeConfig(
        enabled=True, drafter="early_exit", draft_layers=1, max_draft=max_draft, max_active_rows=max_active_rows
    )


def _both_kinds_ran(counts):
    assert 0 < counts["speculative_chunks"] < counts["chunks"], counts  # some chunks plain, some speculative
    assert counts["drafted"] > 0, counts


@pytest.mark.slow
def test_greedy_with_the_toggle_equals_plain_engine_and_sampler(cfg=te.CFG):
    """Five prompts (G=2) through 4 slots, one step a chunk, speculating once 2 or fewer slots decode:
    tokens, masks and truncation identical to `sampler.sample(greedy=True)` (so to the plain engine,
    which tests/test_engine.py holds to the same sampler), every drawn token at the collect's
    version, with both chunk kinds run on the same slots."""
    eos = te._eos(cfg)
    ref = te._plain(cfg, eos)
    ecfg = EngineConfig(enabled=True, slots=4, chunk=1, admit_groups=1)
    engine = Engine(
        cfg,
        ecfg,
        group_size=te.G,
        prompt_len=te.P,
        sampling=SamplingParams(max_new_tokens=te.T, temperature=1.0, eos_id=eos, pad_id=te.PAD, greedy=True),
        rng=jax.random.PRNGKey(0),
        speculative=_toggle(2),
    )
    assert engine.tail_rows == 2
    groups = engine.collect(te._params(cfg), 0, te._items(), n_groups=len(te.LENGTHS))
    batch = batch_of_groups(te._by_tag(groups)).fields()
    te._check_same_rollout(batch, ref, cfg)
    _both_kinds_ran(engine.counts)
    # What a plain engine records (without compiling one here): version 0 on every drawn token, -1 after.
    np.testing.assert_array_equal(batch["version_BxT"], np.where(batch["completion_mask_BxT"] > 0, 0, -1))


N_GROUPS = 500  # per prompt: 2,000 samples each
TEMP = 2.0  # flatter than td's 1.0: EOS comes often enough that most collects switch mid-sample


def _switching_samples(seed):
    """td's two prompts through 8 slots, collects of two groups of G=4 (one of each prompt), one
    step a chunk, speculating (k=2) once 7 or fewer slots decode: each collect starts plain with 8
    samples in lockstep and, once one of them has drawn EOS, finishes the others speculatively
    (7 gathered rows), so samples switch chunk kinds mid-completion."""
    ecfg = EngineConfig(enabled=True, slots=8, chunk=1, admit_groups=2)
    engine = Engine(
        td.SMALL,
        ecfg,
        group_size=td.G,
        prompt_len=td.P,
        sampling=SamplingParams(max_new_tokens=td.T, temperature=TEMP, eos_id=td.EOS, pad_id=td.PAD),
        rng=jax.random.PRNGKey(seed),
        speculative=_toggle(7, 2),
    )
    items = iter([(i % 2, td.PROMPTS[i % 2]) for i in range(2 * N_GROUPS)])
    groups = []
    for _ in range(N_GROUPS):
        groups += engine.collect(td._params(), 0, items, n_groups=2)
    assert len(groups) == 2 * N_GROUPS
    out = {0: [], 1: []}
    for g in groups:
        out[g.tag] += [tuple(int(t) for t in row[m > 0]) for row, m in zip(g.tokens_GxT, g.completion_mask_GxT)]
    return out, engine.counts


@pytest.mark.slow
def test_switching_run_samples_the_plain_distribution():
    """2,000 samples per prompt against the exact distribution at temperature 2: chi-square p > 1e-3
    (fixed seed), with many chunks of each kind and drafts both accepted and rejected."""
    samples, counts = _switching_samples(seed=5)
    for tag, prompt in enumerate(td.PROMPTS):
        pvalue, df = chi_square_pvalue(samples[tag], td._exact_distribution(prompt, TEMP, 0))
        assert df >= 8
        assert pvalue > 1e-3, (prompt, pvalue)
    _both_kinds_ran(counts)
    assert counts["speculative_chunks"] > 100 and counts["chunks"] - counts["speculative_chunks"] > 100, counts
    assert 0.2 < counts["accepted"] / counts["drafted"] < 0.9, counts


@pytest.mark.slow
def test_resumed_toggle_engine_continues_like_the_original():
    """fill admission, 8 slots, sampled: a checkpoint (through JSON) taken with groups in flight,
    loaded into a fresh engine, gives the same next three collects (tokens, log-probs, versions),
    the last draining the tail with speculative chunks, and the same counters as the engine that
    went on."""
    ecfg = EngineConfig(enabled=True, slots=8, chunk=1, admit_groups=1, admission="fill")

    def make():
        return Engine(
            te.CFG,
            ecfg,
            group_size=te.G,
            prompt_len=te.P,
            sampling=SamplingParams(
                max_new_tokens=te.T, temperature=1.0, eos_id=te._eos(te.CFG), pad_id=te.PAD, greedy=False
            ),
            rng=jax.random.PRNGKey(3),
            speculative=_toggle(3),
        )

    items = te._items() * 4  # 20 prompts
    engine = make()
    engine.collect(te._params(te.CFG), 0, iter(items[:8]), n_groups=2)
    host, arrays = engine.to_state()
    assert host["flights"]  # groups in flight across the save
    resumed = make()
    resumed.load_state(json.loads(json.dumps(host)), arrays)
    # The last collect drains: no new prompts, every group in flight finishes (the tail speculates).
    for version, prompts, n in ((1, items[8:14], 3), (2, items[14:], 3), (3, [], 20)):
        a = batch_of_groups(engine.collect(te._params(te.CFG), version, iter(prompts), n_groups=n)).fields()
        b = batch_of_groups(resumed.collect(te._params(te.CFG), version, iter(prompts), n_groups=n)).fields()
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert engine.counts == resumed.counts
    _both_kinds_ran(engine.counts)


@pytest.mark.slow
def test_rows_chunk_over_every_slot_in_order_equals_the_full_chunk():
    """speculative_rows_chunk with rows_R = 0..S-1 gathers the whole state: it must give exactly
    speculative_chunk's state (tokens, log-probs, cache, fill levels and the advanced RNG key) and counts,
    sampled at temperature 1, 3 steps over 4 slots of which 2 decode. A write-back that dropped the
    chunk's RNG (the next chunk would reuse its noise) or misplaced a row fails here."""
    from jaxrl.rollout.engine.state import EngineSpec, admit, init_state
    from jaxrl.rollout.speculative.engine import speculative_chunk, speculative_rows_chunk, speculative_spec

    spec = speculative_spec(EngineSpec(te.CFG, 4, te.P, te.T, te.G, te.NEVER, te.PAD), _toggle(4))
    params = te._params(te.CFG)
    prompt, mask = te._prompts()
    state = admit(
        params, spec, init_state(spec, jax.random.PRNGKey(1)), prompt[1:2], mask[1:2], np.array([1, 3], np.int32)
    )

    def copy():
        return jax.tree.map(jax.numpy.copy, state)

    full, d_full, a_full = speculative_chunk(params, spec, copy(), 3, 0, 1.0)
    rows, d_rows, a_rows = speculative_rows_chunk(params, spec, copy(), np.arange(4, dtype=np.int32), 3, 0, 1.0)
    assert (int(d_full), int(a_full)) == (int(d_rows), int(a_rows)) and 0 < int(a_full) < int(d_full)

    def same(x, y):
        return np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    jax.tree.map(same, full._replace(rng=None), rows._replace(rng=None))
    same(jax.random.key_data(full.rng), jax.random.key_data(rows.rng))
    assert not np.array_equal(jax.random.key_data(full.rng), jax.random.key_data(state.rng))
