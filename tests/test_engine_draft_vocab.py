"""The engine's early-exit drafter with a reduced-vocabulary head (jaxrl/rollout/speculative/draft_vocab.py,
`rollout.speculative.draft_vocab`): the sampled distribution against enumeration (chi-square) with
much of the target's mass outside the drafter's ids, greedy tokens identical to `sampler.sample`,
the id ranking, and the config errors. Models and helpers: tests/test_engine*.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_engine as te
import test_engine_distribution as td
from chi_square import chi_square_pvalue

from jaxrl import config as C
from jaxrl.config import ConfigError, EngineConfig, SpeculativeConfig
from jaxrl.rollout.engine.driver import Engine
from jaxrl.rollout.engine.groups import batch_of_groups
from jaxrl.rollout.sampler import SamplingParams
from jaxrl.rollout.speculative import draft_vocab

SUBSET = (3, 1)  # td.SMALL's drafter sees tokens 3 and EOS=1 only; 0, 2 and 4 are never drafted


def _spec(n, max_draft=3):
    return SpeculativeConfig(enabled=True, drafter="early_exit", draft_layers=1, max_draft=max_draft, draft_vocab=n)


def test_frequent_ids_ranks_first_then_by_count_then_unseen():
    # counts over the sequences: 7 -> 3, 2 -> 2, 5 -> 2, 9 -> 1 (12 lies outside vocab 10: ignored).
    seqs = [[7, 2, 7], [5, 7, 2, 12], [5, 9]]
    assert draft_vocab.frequent_ids(seqs, 4, 10, first=(9,)) == (9, 7, 2, 5)  # 2 before 5: tie, lower id
    assert draft_vocab.frequent_ids(seqs, 7, 10) == (7, 2, 5, 9, 0, 1, 3)  # then unseen ids, ascending
    assert draft_vocab.frequent_ids([], 3, 10, first=(4, 4)) == (4, 0, 1)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_subset_head_gives_the_full_logits_at_its_ids(tied):
    """`subset_head`'s drafter (first layer of te.CFG, tied or untied head) returns logits [B, T, 4]
    equal to the full head's logits at columns ids, in the ids' order."""
    import dataclasses

    from jaxrl.models import decode, kv_cache
    from jaxrl.models import transformer as tf

    cfg = dataclasses.replace(te.CFG, tie_embeddings=tied)
    lparams = decode.layer_params(tf.init_params(cfg, jax.random.PRNGKey(1)), cfg)
    ids = jnp.asarray([7, 0, 28, 3], jnp.int32)
    cache = decode.to_layer_cache(kv_cache.init_cache(cfg, 2, 4))
    tokens = jnp.asarray([[5, 9], [1, 2]], jnp.int32)
    full, _, _ = decode.decode_layers(lparams, cfg, tokens, cache, 0, n_layers=1)
    sub_params, sub_cfg = draft_vocab.subset_head(lparams, cfg, ids)
    sub, _, _ = decode.decode_layers(sub_params, sub_cfg, tokens, cache, 0, n_layers=1)
    assert sub.shape == (2, 2, 4)
    np.testing.assert_allclose(np.asarray(sub), np.asarray(full)[..., np.asarray(ids)], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_sampled_distribution_equals_enumeration_with_a_two_token_draft_head():
    """3,000 samples per prompt (vocab 5, 3 new tokens, 64 slots) drafted from a head over 2 of the
    5 ids: chi-square p-value > 1e-3 against the exact distribution (fixed seed), though the target
    puts much of its mass on tokens the drafter never proposes, with drafts both accepted and rejected."""
    ecfg = EngineConfig(enabled=True, slots=64, chunk=2, admit_groups=8)
    engine = Engine(
        td.SMALL,
        ecfg,
        group_size=td.G,
        prompt_len=td.P,
        sampling=SamplingParams(max_new_tokens=td.T, temperature=1.0, eos_id=td.EOS, pad_id=td.PAD),
        rng=jax.random.PRNGKey(11),
        speculative=_spec(len(SUBSET), max_draft=2),
        draft_ids=SUBSET,
    )
    assert engine.spec.draft_ids == SUBSET
    n_groups = 750
    groups = engine.collect(
        td._params(), 0, ((i % 2, td.PROMPTS[i % 2]) for i in range(2 * n_groups)), n_groups=2 * n_groups
    )
    samples = {0: [], 1: []}
    for g in groups:
        samples[g.tag] += [tuple(int(t) for t in row[m > 0]) for row, m in zip(g.tokens_GxT, g.completion_mask_GxT)]
    for tag, prompt in enumerate(td.PROMPTS):
        exact = td._exact_distribution(prompt, 1.0, 0)
        outside = sum(p for s, p in exact.items() if set(s) - set(SUBSET))
        assert outside > 0.3, outside  # completions holding a token the drafter cannot propose
        pvalue, df = chi_square_pvalue(samples[tag], exact)
        assert df >= 8
        assert pvalue > 1e-3, (prompt, pvalue)
    c = engine.counts
    assert 0.1 < c["accepted"] / c["drafted"] < 0.9, c


@pytest.mark.slow
def test_greedy_equals_sampler_with_a_reduced_draft_head():
    """Greedy with the drafter's head over 8 of te.CFG's 29 ids (the most frequent in the reference
    completions, then EOS): tokens, masks and truncation identical to `sampler.sample(greedy=True)`,
    some drafts accepted and some rejected."""
    cfg, eos = te.CFG, te._eos(te.CFG)
    ref = te._plain(cfg, eos)
    ids = draft_vocab.frequent_ids(np.asarray(ref.tokens_BxT), 8, cfg.vocab_size, first=(eos,))
    ecfg = EngineConfig(enabled=True, slots=4, chunk=3, admit_groups=2)
    engine = Engine(
        cfg,
        ecfg,
        group_size=te.G,
        prompt_len=te.P,
        sampling=SamplingParams(max_new_tokens=te.T, temperature=1.0, eos_id=eos, pad_id=te.PAD, greedy=True),
        rng=jax.random.PRNGKey(0),
        speculative=_spec(8),
        draft_ids=ids,
    )
    groups = engine.collect(te._params(cfg), 0, te._items(), n_groups=len(te.LENGTHS))
    batch = batch_of_groups(te._by_tag(groups)).fields()
    te._check_same_rollout(batch, ref, cfg)
    assert 0 < engine.counts["accepted"] < engine.counts["drafted"], engine.counts


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"^rollout.speculative.draft_vocab: got -1, expected 0 \(the full"):
        C.apply_overrides(C.Config(), ["rollout.speculative.draft_vocab=-1"]).validate()

    def make(n, ids):
        return Engine(
            te.CFG,
            EngineConfig(enabled=True, slots=4, chunk=1),
            group_size=te.G,
            prompt_len=te.P,
            sampling=SamplingParams(max_new_tokens=te.T, temperature=1.0, eos_id=te.NEVER, pad_id=te.PAD),
            rng=jax.random.PRNGKey(0),
            speculative=_spec(n),
            draft_ids=ids,
        )

    with pytest.raises(
        ConfigError,
        match=r"^rollout.speculative.draft_vocab: got 30, expected at most the "
        r"vocabulary size 29$",
    ):
        make(30, tuple(range(30)))
    with pytest.raises(ConfigError, match=r"^rollout.speculative.draft_vocab: got 3, but the engine was given 2 "):
        make(3, (1, 2))
    with pytest.raises(ConfigError, match=r"^rollout.speculative.draft_vocab: got 3, but the engine was given 0 "):
        make(3, None)
    with pytest.raises(ConfigError, match=r"^rollout.speculative.draft_vocab: its 2 draft token ids must be "):
        make(2, (4, 4))
    with pytest.raises(ConfigError, match=r"^rollout.speculative.draft_vocab: its 2 draft token ids must be "):
        make(2, (4, 29))
    assert make(0, None).spec.draft_ids == ()  # the default: the full vocabulary, no ids needed
    assert make(2, (5, 6, 7)).spec.draft_ids == (5, 6)  # the first draft_vocab of the ranked ids


@pytest.mark.slow
def test_training_source_ranks_the_draft_ids_over_the_task(in_process_cache):
    """EngineSource (the training loop's rollout source) built from a config with speculation on and
    rollout.speculative.draft_vocab=12 runs the speculative engine, giving it EOS and then the 11 ids
    most frequent in the task's training prompts and answers (recomputed here by counting), and logs
    engine/drafted and engine/accepted for the step; a 1-layer policy is a config error naming
    draft_layers. (One source for both: with draft_vocab=0 it only passes no ids, which
    tests/test_engine_speculative.py's from_config test covers.)"""
    import collections
    import dataclasses

    from preset_configs import config_path, overrides

    from jaxrl.data.stream import StreamState
    from jaxrl.data.tasks import load_task
    from jaxrl.data.tokenizer import CharTokenizer
    from jaxrl.models import transformer as tf
    from jaxrl.rollout.speculative.engine import SpeculativeEngineSpec
    from jaxrl.sources.groups import EngineSource

    on = [
        "rollout.engine.enabled=true",
        "rollout.engine.slots=8",
        "rollout.speculative.enabled=true",
        "rollout.speculative.max_draft=2",
        "rollout.speculative.draft_vocab=12",
    ]
    cfg = C.load_config(config_path("grpo"), overrides("grpo") + on + ["model.n_layers=2"])
    tok = CharTokenizer()
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tok.vocab_size)
    task = load_task(cfg.data)
    source = EngineSource(cfg, model_cfg, tok, task, {})
    assert isinstance(source.engine.spec, SpeculativeEngineSpec)
    recs = [task.train[i] for i in range(min(512, len(task.train)))]
    counts = collections.Counter(t for r in recs for k in ("prompt", "answer") for t in tok.encode(r[k]))
    ids = source.engine.spec.draft_ids
    assert len(ids) == 12 and ids[0] == tok.eos_id and tok.eos_id not in ids[1:]
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    assert list(ids[1:]) == [t for t in ranked if t != tok.eos_id][:11]
    produced = source.produce(tf.init_params(model_cfg, jax.random.key(0)), StreamState(0, 0), None, step=1)
    m = produced.metrics
    assert m["engine/drafted"] > 0 and 0 <= m["engine/accepted"] <= m["engine/drafted"]
    assert m["engine/drafted"] == source.engine.counts["drafted"]  # the step's own drafts (the first step)
    one_layer = dataclasses.replace(model_cfg, n_layers=1)
    with pytest.raises(ConfigError, match=r"^rollout.speculative.draft_layers: got 1, expected fewer than "):
        EngineSource(cfg, one_layer, tok, task, {})
