"""The engine with self-speculative early-exit drafting (jaxrl/rollout/speculative/engine.py): greedy
tokens identical to the plain engine and `sampler.sample` whatever the admission pattern, the sampled
distribution against enumeration (chi-square) with drafts both accepted and rejected, recorded
log-probs equal the trainer's recomputation, EOS inside an accepted draft ends the sample, and the
config errors. Helpers and models are those of tests/test_engine.py and test_engine_distribution.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_engine as te
import test_engine_distribution as td
from chi_square import chi_square_pvalue

from jaxrl import config as C
from jaxrl.config import ConfigError, EngineConfig, SpeculativeConfig
from jaxrl.models import transformer as tf
from jaxrl.rollout.engine.driver import Engine
from jaxrl.rollout.engine.groups import batch_of_groups
from jaxrl.rollout.sampler import SamplingParams, sample
from jaxrl.rollout.speculative import acceptance
from jaxrl.rollout.speculative import engine as engine_speculative
from jaxrl.rollout.speculative.engine import SpeculativeEngineSpec

K = 3  # drafted tokens per step: a verify window of 4


def _spec(max_draft=K, drafter="early_exit"):
    return SpeculativeConfig(enabled=True, drafter=drafter, draft_layers=1, max_draft=max_draft)


def _engine(cfg, eos_id, slots, chunk, admit_groups=1, greedy=True, temperature=1.0, seed=0, speculative=None):
    ecfg = EngineConfig(enabled=True, slots=slots, chunk=chunk, admit_groups=admit_groups)
    return Engine(
        cfg,
        ecfg,
        group_size=te.G,
        prompt_len=te.P,
        sampling=SamplingParams(
            max_new_tokens=te.T, temperature=temperature, eos_id=eos_id, pad_id=te.PAD, greedy=greedy
        ),
        rng=jax.random.PRNGKey(seed),
        speculative=_spec() if speculative is None else speculative,
    )


def _check_drafts_tested(counts):
    """Both paths of the acceptance rule ran: some drafts accepted, some rejected."""
    assert counts["drafted"] > 0 and 0 < counts["accepted"] < counts["drafted"], counts


@pytest.mark.slow
@pytest.mark.parametrize(
    "cfg,slots,chunk,admit_groups,reverse",
    [(te.CFG, 4, 1, 1, False), (te.CFG, 4, 3, 2, True), (te.MOE, 4, 3, 1, True)],
    ids=["S4-chunk1", "S4-chunk3-admit2-reversed", "moe-S4-chunk3-reversed"],
)
def test_greedy_equals_plain_engine_and_sampler(cfg, slots, chunk, admit_groups, reverse):
    """Five prompts of lengths 1..5, G=2, greedy: tokens, masks, truncation (and MoE routing) identical
    to `sampler.sample(greedy=True)`, log-probs to float32 noise, with slots reused and groups admitted
    at different times (all at once: the EOS test below); the first case also against the plain engine."""
    eos = te._eos(cfg)
    ref = te._plain(cfg, eos)
    engine = _engine(cfg, eos, slots, chunk, admit_groups)
    assert isinstance(engine.spec, SpeculativeEngineSpec)
    items = te._items()[::-1] if reverse else te._items()
    groups = te._by_tag(engine.collect(te._params(cfg), 0, items, n_groups=len(te.LENGTHS)))
    batch = batch_of_groups(groups).fields()
    te._check_same_rollout(batch, ref, cfg)
    if cfg.n_experts:  # the trainer's replay contract: one entry per prompt + completion slot, not per cache slot
        assert batch["routing_BxSxLxK"].shape[1] == te.P + te.T < engine.spec.cache_len
    _check_drafts_tested(engine.counts)
    if slots < len(te.LENGTHS) * te.G:
        assert engine.counts["admitted_groups"] == len(te.LENGTHS) > slots // te.G
    assert engine.groups_in_flight == 0 and np.all(engine.pool.owner_S < 0)
    if slots == 4 and chunk == 1:
        plain = te._engine(cfg, eos, slots, chunk, admit_groups)
        plain_groups = plain.collect(te._params(cfg), 0, items, n_groups=len(te.LENGTHS))
        plain_batch = batch_of_groups(te._by_tag(plain_groups)).fields()
        for name in ("tokens_BxT", "completion_mask_BxT", "truncated_B", "version_BxT"):
            np.testing.assert_array_equal(batch[name], plain_batch[name])
        # Fewer policy forwards than tokens: 4 slots x 1 step per chunk.
        assert engine.counts["chunks"] < plain.counts["chunks"]
        # Engine.sample (the allocation policies' call) drafts too: 3 more greedy samples of prompt 0,
        # after a checkpoint round trip (which replaces engine.counts: the new dict must count on).
        engine.load_state(*engine.to_state())
        drafted = engine.counts["drafted"]
        (more,) = engine.sample(te._params(cfg), 1, [(0, te._items()[0][1], 3)])
        np.testing.assert_array_equal(more.tokens_GxT, np.repeat(np.asarray(ref.tokens_BxT)[:1], 3, 0))
        assert engine.counts["drafted"] > drafted and np.all(more.version_GxT[more.completion_mask_GxT > 0] == 1)


@pytest.mark.slow
def test_recorded_logprobs_and_versions_equal_trainer_recomputation():
    """Sampled at temperature 0.7 with 4 slots for 10 samples, two collects at versions 5 and 6: the
    recorded log-probs equal `token_logprobs` over the assembled batch (the target distribution
    softmax(logits / 0.7), not the drafter's), and every kept token records its collect's version."""
    cfg, eos = te.CFG, te._eos(te.CFG)
    engine = _engine(cfg, eos, slots=4, chunk=2, greedy=False, temperature=0.7, seed=0)
    items = iter(te._items())
    groups = engine.collect(te._params(cfg), 5, items, n_groups=2)
    groups += engine.collect(te._params(cfg), 6, items, n_groups=3)
    batch = batch_of_groups(groups).fields()
    logp, _ = tf.token_logprobs(
        te._params(cfg),
        cfg,
        batch["prompt_tokens_BxP"],
        batch["prompt_mask_BxP"],
        batch["tokens_BxT"],
        batch["completion_mask_BxT"],
        0.7,
    )
    mask = batch["completion_mask_BxT"] > 0
    assert mask.sum() > 15 and not mask.all()
    np.testing.assert_allclose(batch["rollout_logp_BxT"][mask], np.asarray(logp)[mask], atol=2e-5, rtol=0)
    assert np.all(batch["rollout_logp_BxT"][~mask] == 0) and np.all(batch["version_BxT"][~mask] == -1)
    np.testing.assert_array_equal(np.where(mask, batch["version_BxT"], 0), np.where(mask, [[5]] * 4 + [[6]] * 6, 0))
    _check_drafts_tested(engine.counts)


def _perfect_drafter_params():
    """Layer 2 of te.CFG made the identity (attention and MLP outputs zeroed): the early-exit drafter
    (layer 1, final norm, head) then equals the policy, and every greedy draft is accepted."""
    params = te._params(te.CFG, 1.5)
    blocks = params["blocks"]
    attn = dict(blocks["attn"], o=blocks["attn"]["o"].at[1].set(0.0))
    mlp = dict(blocks["mlp"], down=blocks["mlp"]["down"].at[1].set(0.0))
    return dict(params, blocks=dict(blocks, attn=attn, mlp=mlp))


def _first(row, token):
    return next((i for i, t in enumerate(row) if t == token), None)


@pytest.mark.slow
def test_eos_inside_an_accepted_draft_ends_the_sample():
    """With a perfect drafter every step keeps K=3 drafts + 1 bonus token: step 1 emits columns 0..3
    (0..2 accepted drafts), step 2 columns 4..7 (4..6 drafts; 6 and 7 lie past T=6). EOS is a token
    that one prompt's greedy completion first emits at column 1 and another's at column 6 or 7:
    the first must end at column 1 (length 2, pad and mask 0 after it, finished) although the drafts
    after its EOS were accepted too; the second must end truncated at T, not finished by an EOS that
    was never kept. The whole batch equals `sampler.sample`'s greedy tokens cut at that EOS."""
    params = _perfect_drafter_params()
    prompt, mask = te._prompts()

    toks = sample(  # two columns past T: the second window's end
        params,
        te.CFG,
        jnp.asarray(prompt),
        jnp.asarray(mask),
        jax.random.PRNGKey(0),
        group_size=te.G,
        sampling=SamplingParams(max_new_tokens=te.T + 2, temperature=1.0, eos_id=te.NEVER, pad_id=te.PAD, greedy=True),
    ).tokens_BxT
    toks = np.asarray(toks)
    eos = next(
        e
        for e in range(te.CFG.vocab_size)
        if {1} <= {_first(r, e) for r in toks} and {6, 7} & {_first(r, e) for r in toks}
    )
    early = next(r for r in range(len(toks)) if _first(toks[r], eos) == 1)
    late = next(r for r in range(len(toks)) if _first(toks[r], eos) in (6, 7))
    # sampler.sample with this EOS: the same greedy tokens (EOS only stops rows), cut after the first
    # EOS within T; one sampler compile fewer than running it again with eos_id=eos.
    cut_B = [te.T if _first(r[: te.T], eos) is None else _first(r[: te.T], eos) + 1 for r in toks]
    want_mask = np.asarray([[1] * n + [0] * (te.T - n) for n in cut_B])
    want_tokens = np.where(want_mask > 0, toks[:, : te.T], te.PAD)
    want_truncated = np.asarray([float(eos not in r[: te.T]) for r in toks], np.float32)
    engine = _engine(te.CFG, eos, slots=10, chunk=8, admit_groups=5)
    batch = batch_of_groups(te._by_tag(engine.collect(params, 0, te._items(), n_groups=len(te.LENGTHS)))).fields()
    assert engine.counts["accepted"] == engine.counts["drafted"] > 0  # every draft accepted, EOS's included
    np.testing.assert_array_equal(batch["tokens_BxT"][early], [toks[early, 0], eos] + [te.PAD] * (te.T - 2))
    np.testing.assert_array_equal(batch["completion_mask_BxT"][early], [1, 1] + [0] * (te.T - 2))
    assert batch["truncated_B"][early] == 0 and batch["truncated_B"][late] == 1
    np.testing.assert_array_equal(batch["tokens_BxT"][late], toks[late, : te.T])
    for name, want in (
        ("tokens_BxT", want_tokens),
        ("completion_mask_BxT", want_mask),
        ("truncated_B", want_truncated),
    ):
        np.testing.assert_array_equal(batch[name], want)


# --- the sampled distribution, against enumeration --------------------------------------------

N_GROUPS = 750  # per prompt: 3,000 samples each
_exact_distribution = functools.cache(td._exact_distribution)  # both chi-square tests enumerate prompt 0


def _speculative_samples(seed, n_groups=N_GROUPS):
    ecfg = EngineConfig(enabled=True, slots=64, chunk=2, admit_groups=8)
    engine = Engine(
        td.SMALL,
        ecfg,
        group_size=td.G,
        prompt_len=td.P,
        sampling=SamplingParams(max_new_tokens=td.T, temperature=1.0, eos_id=td.EOS, pad_id=td.PAD),
        rng=jax.random.PRNGKey(seed),
        speculative=_spec(max_draft=2),
    )
    items = ((i % 2, td.PROMPTS[i % 2]) for i in range(2 * n_groups))
    groups = engine.collect(td._params(), 0, items, n_groups=2 * n_groups)
    assert len(groups) == 2 * n_groups and engine.counts["chunks"] > n_groups // 20  # 64 slots reused many times
    out = {0: [], 1: []}
    for g in groups:
        out[g.tag] += [tuple(int(t) for t in row[m > 0]) for row, m in zip(g.tokens_GxT, g.completion_mask_GxT)]
    return out, engine.counts


@pytest.mark.slow
def test_sampled_distribution_equals_enumeration():
    """3,000 samples per prompt (vocab 5, EOS inside it, 3 new tokens, two prompts interleaved through
    64 slots) against the exact distribution: chi-square p-value > 1e-3 (fixed seed), with a good
    share of the drafts accepted and a good share rejected."""
    samples, counts = _speculative_samples(seed=11)
    for tag, prompt in enumerate(td.PROMPTS):
        pvalue, df = chi_square_pvalue(samples[tag], _exact_distribution(prompt, 1.0, 0))
        assert df >= 8
        assert pvalue > 1e-3, (prompt, pvalue)
    assert 0.2 < counts["accepted"] / counts["drafted"] < 0.9, counts


# --- configuration, the training loop's source, the benchmark -------------------------------------


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError) as e:
        C.apply_overrides(
            C.Config(),
            ["rollout.engine.enabled=true", "rollout.speculative.enabled=true", "rollout.speculative.drafter=int8"],
        ).validate()
    assert str(e.value) == (
        "rollout.speculative.drafter: got 'int8', expected 'early_exit' with "
        "rollout.engine.enabled=true (the engine's only drafter)"
    )
    C.apply_overrides(C.Config(), ["rollout.speculative.enabled=true", "rollout.speculative.drafter=int8"]).validate()
    with pytest.raises(ConfigError, match=r"^rollout.speculative.drafter: got 'reuse', expected 'early_exit'"):
        _engine(te.CFG, te.NEVER, 4, 1, speculative=_spec(drafter="reuse"))
    with pytest.raises(ConfigError, match=r"^rollout.speculative.draft_layers: got 2, expected 1..1 "):
        _engine(te.CFG, te.NEVER, 4, 1, speculative=SpeculativeConfig(enabled=True, draft_layers=2))


def test_from_config_picks_the_speculative_chunk_only_when_enabled():
    base = [
        "model.n_layers=2",
        "rollout.engine.enabled=true",
        "rollout.group_size=2",
        "rollout.engine.slots=4",
        "rollout.speculative.max_draft=2",
    ]
    for extra, speculative in (([], False), (["rollout.speculative.enabled=true"], True)):
        cfg = C.apply_overrides(C.Config(), base + extra)
        cfg.validate()
        engine = Engine.from_config(cfg, prompt_len=4, eos_id=1, pad_id=0, rng=jax.random.PRNGKey(0))
        assert isinstance(engine.spec, SpeculativeEngineSpec) == speculative
        assert ("drafted" in engine.counts) == speculative
        assert engine.spec.cache_len == 4 + cfg.rollout.max_new_tokens + (2 if speculative else 0)


def test_benchmark_speculative_row(monkeypatch):
    """benchmarks/engine.py --speculative: with the workloads' zeroed final norm the drafter's and the
    policy's distributions are both uniform, so every draft is accepted (the ceiling the docstring
    claims). Run at the shapes of the log-prob test above (G=2, 4 slots, K=3), so nothing recompiles."""
    import argparse
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from benchmarks import engine as bench

    monkeypatch.setattr(bench, "G", te.G)
    params = te._params(te.CFG)
    params = dict(params, final_norm=jax.tree.map(lambda x: x * 0.0, params["final_norm"]))
    args = argparse.Namespace(slots=4, chunk=2, samples=16, max_draft=K, draft_layers=1)
    prompt_P = np.arange(1, te.P + 1, dtype=np.int32)
    row = bench._speculative(params, te.CFG, prompt_P, args, te.T, te._eos(te.CFG), 1.0)
    assert row["acceptance"] == 1.0 and row["drafted"] > 0
    assert 16 <= row["tokens"] <= 16 * te.T and row["chunks"] > 0


# The training loop's source (EngineSource) with speculation on: test_engine_draft_vocab.py's
# test_training_source_ranks_the_draft_ids_over_the_task (one source checks both, compiled once).


# --- a broken acceptance rule is caught ---------------------------------------------------------


def _accept_every_draft(rng, p, draft, drafted, q=None, approx_old_logp_NxW=None):
    """A broken rule: keep every draft, then draw the bonus token from the last p."""
    a = jnp.sum(drafted[:, 1:], axis=1, dtype=jnp.int32)
    p_a = jnp.take_along_axis(p, a[:, None, None], axis=1)[:, 0]
    return acceptance.Verdict(a, acceptance.categorical(rng, p_a))


@pytest.mark.slow
def test_chi_square_catches_accepting_every_draft(monkeypatch):
    """test_sampled_distribution_equals_enumeration fails an engine that accepts every draft (the
    drafter's distribution then leaks into the samples) by a wide margin, even with a third of the
    samples (p == 0.0 in float64)."""
    monkeypatch.setattr(acceptance, "verify_sampled", _accept_every_draft)
    # speculative_chunk is jitted: the engine gets its body under a new jit (an empty trace cache), so
    # it is traced with the broken rule without flushing jax's caches (jax.clear_caches() made every
    # later test on this worker compile its programs again).
    body = engine_speculative.speculative_chunk.__wrapped__

    @functools.wraps(body)  # body's signature: `spec` and `state` are found by name
    def retraced(*args, **kwargs):
        return body(*args, **kwargs)

    retraced_chunk = jax.jit(retraced, static_argnames="spec", donate_argnames="state")
    monkeypatch.setattr(engine_speculative, "speculative_chunk", retraced_chunk)
    try:
        samples, counts = _speculative_samples(seed=11, n_groups=N_GROUPS // 3)
    finally:
        monkeypatch.undo()
    assert counts["accepted"] == counts["drafted"]
    pvalue, _ = chi_square_pvalue(samples[0], _exact_distribution(td.PROMPTS[0], 1.0, 0))
    assert pvalue < 1e-6, pvalue
