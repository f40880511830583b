"""The slot-based decode engine: greedy equality with the static sampler whatever the admission
pattern, recorded log-probs and versions, the fill admission policy, and config errors.
(The sampled distribution against enumeration: tests/test_engine_distribution.py.)"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import config as C
from jaxrl.config import ConfigError, EngineConfig, ModelConfig
from jaxrl.models import transformer as tf
from jaxrl.rollout.engine import state as es
from jaxrl.rollout.engine.driver import Engine
from jaxrl.rollout.engine.groups import batch_of_groups, left_pad
from jaxrl.rollout.sampler import SamplingParams, sample

CFG = ModelConfig(vocab_size=29, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)
MOE = dataclasses.replace(CFG, n_experts=4, experts_per_token=2, expert_mlp_dim=32)
NEVER = CFG.vocab_size  # an eos id the model can never emit
PAD = 0
P, T, G = 5, 6, 2
LENGTHS = (2, 5, 4, 1, 3)  # real prompt tokens per prompt (left-padded to P)


@functools.cache
def _params(cfg=CFG, scale=1.0):
    params = tf.init_params(cfg, jax.random.PRNGKey(0))
    return dict(params, embedding=params["embedding"] * scale)  # scale > 1: peakier distributions


def _prompts(lengths=LENGTHS, seed=3):
    toks = np.random.default_rng(seed).integers(1, CFG.vocab_size, (len(lengths), P), dtype=np.int32)
    mask = np.zeros((len(lengths), P), np.int32)
    for i, n in enumerate(lengths):
        mask[i, P - n :] = 1
    return np.where(mask, toks, PAD), mask


def _items():
    """(tag, real tokens) per prompt: what `Engine.collect` takes."""
    prompt, mask = _prompts()
    return [(i, prompt[i][mask[i] > 0]) for i in range(len(prompt))]


def _plain(cfg, eos_id, greedy=True, temperature=1.0, rng=0):
    prompt, mask = _prompts()
    return sample(
        _params(cfg),
        cfg,
        jnp.asarray(prompt),
        jnp.asarray(mask),
        jax.random.PRNGKey(rng),
        group_size=G,
        sampling=SamplingParams(max_new_tokens=T, temperature=temperature, eos_id=eos_id, pad_id=PAD, greedy=greedy),
    )


def _engine(cfg, eos_id, slots, chunk, admit_groups=1, admission="exact", greedy=True, temperature=1.0, seed=0):
    ecfg = EngineConfig(enabled=True, slots=slots, chunk=chunk, admit_groups=admit_groups, admission=admission)
    return Engine(
        cfg,
        ecfg,
        group_size=G,
        prompt_len=P,
        sampling=SamplingParams(max_new_tokens=T, temperature=temperature, eos_id=eos_id, pad_id=PAD, greedy=greedy),
        rng=jax.random.PRNGKey(seed),
    )


@functools.cache
def _greedy_by_forward(cfg):
    """The five prompts' greedy completions (no EOS) from full forwards over prompt + the tokens so
    far, no cache -> (tokens_NxT, logp_NxT at temperature 1). One compiled `forward` (right-filled
    to a fixed width; causality makes the slots after the query irrelevant): cheaper than compiling
    a second `sample` program (its eos_id is static) just to find an EOS."""
    prompt, mask = _prompts()
    n = len(prompt)
    tokens, logp = np.zeros((n, T), np.int32), np.zeros((n, T), np.float32)
    for t in range(T):
        gen_mask = np.broadcast_to(np.arange(T) < t, (n, T)).astype(np.int32)
        seq, seq_mask = (
            np.concatenate([prompt, np.where(gen_mask, tokens, PAD)], 1),
            np.concatenate([mask, gen_mask], 1),
        )
        logits_NxV = np.asarray(tf.forward(_params(cfg), cfg, seq, seq_mask))[:, P - 1 + t]
        tokens[:, t] = np.argmax(logits_NxV, -1)
        logp[:, t] = np.asarray(jax.nn.log_softmax(logits_NxV, -1))[np.arange(n), tokens[:, t]]
    return tokens, logp


@functools.cache
def _eos(cfg):
    """A token that some greedy row first emits at a step t >= 2 and another row never emits: as
    EOS it makes groups finish at different steps (so slots free up at different times). (The
    tests check that the sampler's greedy rollout with this EOS really has such lengths.)"""
    toks = _greedy_by_forward(cfg)[0]
    for t in range(2, T):
        for r in range(len(toks)):
            tok = toks[r, t]
            if tok not in toks[r, :t] and any(tok not in row for row in toks):
                return int(tok)
    raise AssertionError("no usable EOS token for this model")


def _by_tag(groups):
    return sorted(groups, key=lambda g: g.tag)


def _check_same_rollout(batch, ref, cfg):
    np.testing.assert_array_equal(batch["tokens_BxT"], np.asarray(ref.tokens_BxT))
    np.testing.assert_array_equal(batch["completion_mask_BxT"], np.asarray(ref.completion_mask_BxT))
    np.testing.assert_array_equal(batch["truncated_B"], (~np.asarray(ref.finished_B)).astype(np.float32))
    # Same tokens from a different attention layout (cache + window vs cache): float32 noise only.
    np.testing.assert_allclose(batch["rollout_logp_BxT"], np.asarray(ref.logp_BxT), atol=1e-5, rtol=0)
    if cfg.n_experts:  # experts per slot; left-padding slots attend to nothing real and are not compared
        pmask = np.repeat(_prompts()[1] > 0, G, axis=0)
        live = np.concatenate([pmask[:, : P - 1], np.asarray(ref.completion_mask_BxT) > 0], 1)
        np.testing.assert_array_equal(
            batch["routing_BxSxLxK"][:, : P - 1 + T][live], np.asarray(ref.routing_BxSxLxK)[:, : P - 1 + T][live]
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    "cfg,slots,chunk,admit_groups,reverse",
    [(CFG, 4, 1, 1, False), (CFG, 4, 3, 2, True), (CFG, 6, 7, 1, True), (CFG, 10, 3, 5, False), (MOE, 4, 3, 1, True)],
    ids=["S4-chunk1", "S4-chunk3-admit2-reversed", "S6-chunk7-reversed", "all-at-once", "moe-S4-chunk3-reversed"],
)
def test_greedy_equals_static_sampler_whatever_the_admission(cfg, slots, chunk, admit_groups, reverse):
    """Five prompts of lengths 1..5, G=2: tokens, masks, truncation (and MoE routing) identical to
    `sampler.sample(greedy=True)`, log-probs to float32 noise, with slots reused and groups admitted
    at different times (fewer slots than samples) or all at once. Admitted in prompt order, short
    completions come first and long ones reuse their slots; reversed, a short completion lands in a
    slot a long one left (nothing of the old sample may show through)."""
    eos = _eos(cfg)
    ref = _plain(cfg, eos)
    lengths = np.asarray(ref.length_B)
    assert len(set(lengths.tolist())) > 1 and lengths.max() == T  # groups finish at different steps
    engine = _engine(cfg, eos, slots, chunk, admit_groups)
    items = _items()[::-1] if reverse else _items()
    groups = engine.collect(_params(cfg), 0, items, n_groups=len(LENGTHS))
    assert sorted(g.tag for g in groups) == list(range(len(LENGTHS)))
    _check_same_rollout(batch_of_groups(_by_tag(groups)).fields(), ref, cfg)
    if slots < len(LENGTHS) * G:  # slots really were reused: more prefills than fit at once
        assert engine.counts["admitted_groups"] == len(LENGTHS) > slots // G
    assert engine.groups_in_flight == 0 and np.all(engine.pool.owner_S < 0)


@pytest.mark.slow
def test_direct_api_staggered_admission_and_versions():
    """Device functions by hand: prompt 2 admitted, 2 steps at version 3; prompt 3 admitted, 3 steps
    at version 4; the rest at version 5. Each token records its chunk's version, and both samples
    equal the greedy tokens (full forwards) although they were admitted 2 steps apart."""
    prompt, mask = _prompts()
    # The decode program of the S6 engine tests (compiled once, seconds): their spec (with the EOS
    # that prompts 2-4's greedy completions never emit, so every sample runs all T tokens), the
    # per-layer params and an explicit stop_at, as the Engine passes them. (Unsplit params and
    # stop_at=None: tests/test_engine_chunks.py.)
    eos = _eos(CFG)
    tokens_NxT, logp_NxT = _greedy_by_forward(CFG)  # the greedy sampler's (tests/test_sampler.py's oracle)
    assert not np.any(tokens_NxT[2:] == eos)
    spec = es.EngineSpec(
        CFG, slots=6, prompt_len=P, max_new_tokens=T, group_size=G, eos_id=eos, pad_id=PAD, greedy=True
    )
    params, lparams = _params(), es.split_params(_params(), CFG)
    state = es.init_state(spec, jax.random.PRNGKey(0))
    # Two prompts per prefill call; the second is padding (dest 6 = S: dropped).
    state = es.admit(params, spec, state, prompt[[2, 2]], mask[[2, 2]], np.asarray([4, 1, 6, 6], np.int32))
    state = es.decode_chunk(lparams, spec, state, 2, 3, 1.0, 6)
    state = es.admit(params, spec, state, prompt[[3, 4]], mask[[3, 4]], np.asarray([0, 5, 2, 3], np.int32))
    state = es.decode_chunk(lparams, spec, state, 3, 4, 1.0, 6)
    state = es.decode_chunk(lparams, spec, state, 100, 5, 1.0, 6)  # stops once every slot is done
    out = jax.device_get(es.read_slots(spec, state, np.asarray([4, 1, 0, 5, 2, 3], np.int32)))
    np.testing.assert_array_equal(out.tokens_RxT, np.repeat(tokens_NxT[2:], G, 0))
    np.testing.assert_allclose(out.logp_RxT, np.repeat(logp_NxT[2:], G, 0), atol=1e-5, rtol=0)
    first, second = [3, 3, 4, 4, 4, 5], [4, 4, 4, 5, 5, 5]  # T = 6 tokens each
    np.testing.assert_array_equal(out.version_RxT, [first, first, second, second, second, second])
    assert np.all(out.truncated_R) and not np.any(out.finished_R) and np.all(out.length_R == T)
    assert bool(np.asarray(state.done_S).all())


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [CFG, MOE], ids=["dense", "moe"])
def test_recorded_logprobs_equal_trainer_recomputation(cfg):
    """Sampled at temperature 0.7 with 4 slots for 10 samples: the recorded log-probs equal
    `token_logprobs` over the assembled batch (MoE: replaying the recorded routing)."""
    eos = _eos(cfg)
    engine = _engine(cfg, eos, slots=4, chunk=2, greedy=False, temperature=0.7, seed=3)
    batch = batch_of_groups(engine.collect(_params(cfg), 0, _items(), n_groups=len(LENGTHS))).fields()
    logp, _ = tf.token_logprobs(
        _params(cfg),
        cfg,
        batch["prompt_tokens_BxP"],
        batch["prompt_mask_BxP"],
        batch["tokens_BxT"],
        batch["completion_mask_BxT"],
        0.7,
        replay_BxSxLxK=batch.get("routing_BxSxLxK"),
    )
    mask = batch["completion_mask_BxT"] > 0
    assert mask.sum() > 15 and not mask.all()
    np.testing.assert_allclose(batch["rollout_logp_BxT"][mask], np.asarray(logp)[mask], atol=2e-5, rtol=0)
    assert np.all(batch["rollout_logp_BxT"][~mask] == 0) and np.all(batch["version_BxT"][~mask] == -1)
    np.testing.assert_array_equal(batch["group_id_B"], np.repeat(np.arange(len(LENGTHS)), G))


@pytest.mark.slow
def test_fill_admission_carries_samples_across_collects():
    """admission=fill: the first collect (version 1) leaves samples decoding in their slots; the
    second (version 2, a new prompt iterable) finishes them. Every group comes back exactly once,
    tokens equal the greedy sampler's, and a carried sample's versions run 1.. then 2.. ."""
    eos = _eos(CFG)
    engine = _engine(CFG, eos, slots=6, chunk=2, admission="fill")
    items = iter(_items())
    first = engine.collect(_params(), 1, items, n_groups=1)
    # Fill admitted 3 groups; prompts 0 and 1 end with EOS at tokens 3 and 4, both in the second
    # chunk: one is returned, one waits for the next collect, prompt 2 is still decoding.
    assert [g.tag for g in first] == [0] and engine.groups_in_flight == 1 and len(engine.host.ready) == 1
    rest = engine.collect(_params(), 2, list(items), n_groups=len(LENGTHS) - 1)
    groups = _by_tag(first + rest)
    assert [g.tag for g in groups] == list(range(len(LENGTHS))) and engine.groups_in_flight == 0
    batch = batch_of_groups(groups).fields()
    _check_same_rollout(batch, _plain(CFG, eos), CFG)
    v, m = batch["version_BxT"], batch["completion_mask_BxT"] > 0
    assert np.all(v[m] >= 1) and np.all(np.diff(np.where(m, v, 99), axis=1) >= 0)  # 1s then 2s, per row
    mixed = [r for r in range(len(v)) if {1, 2} <= set(v[r][m[r]].tolist())]
    assert mixed  # some sample really spans both versions
    assert np.all(first[0].version_GxT[first[0].completion_mask_GxT > 0] == 1)


def test_collect_with_too_few_prompts_returns_what_there_is():
    engine = _engine(CFG, _eos(CFG), slots=4, chunk=4)  # the compiled engine of the S4 greedy tests
    groups = engine.collect(_params(), 0, _items()[:2], n_groups=5)
    assert sorted(g.tag for g in groups) == [0, 1] and engine.groups_in_flight == 0


@pytest.mark.parametrize(
    "item, needle",
    [
        ("rollout.engine.slots=0", "rollout.engine.slots: got 0, expected a positive integer"),
        ("rollout.engine.chunk=-1", "rollout.engine.chunk: got -1"),
        ("rollout.engine.admit_groups=0", "rollout.engine.admit_groups: got 0"),
        ("rollout.engine.admission=greedy", "rollout.engine.admission: got 'greedy', expected 'exact' or 'fill'"),
    ],
)
def test_engine_config_errors_name_the_field(item, needle):
    with pytest.raises(ConfigError) as e:
        C.apply_overrides(C.Config(), [item]).validate()
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_slots_below_group_size():
    """Only an enabled engine needs a group to fit in its slots; the Engine checks it too."""
    small = ["rollout.engine.slots=4", "rollout.group_size=8"]
    C.apply_overrides(C.Config(), small).validate()  # disabled: fine
    with pytest.raises(ConfigError, match=r"rollout.engine.slots: got 4, expected at least group_size=8"):
        C.apply_overrides(C.Config(), small + ["rollout.engine.enabled=true"]).validate()
    with pytest.raises(ConfigError, match=r"rollout.engine.slots: got 1, expected at least group_size=2"):
        _engine(CFG, NEVER, slots=1, chunk=1)


def test_prompt_errors():
    with pytest.raises(ValueError, match=r"prompt: 6 tokens, expected 1..prompt_len=5"):
        left_pad(np.arange(1, 7), P, PAD)
    with pytest.raises(ValueError, match=r"prompt: 0 tokens"):
        left_pad([], P, PAD)
    tokens, mask = left_pad([7, 8], P, PAD)
    np.testing.assert_array_equal(tokens, [0, 0, 0, 7, 8])
    np.testing.assert_array_equal(mask, [0, 0, 0, 1, 1])


@pytest.mark.slow
def test_benchmark_small_prints_json_last(capsys):
    """benchmarks/engine.py --small runs both workloads and ends with the JSON line the issue names."""
    import json
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from benchmarks import engine as bench

    bench.main(["--small"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["speedup_long_tail"] > 0 and last["uniform_ratio"] > 0
    # Same completed samples on both sides (--small: 64); uniform lengths: every sample runs exactly
    # uniform_len (16) tokens.
    assert last["uniform"]["samples"] == last["long_tail"]["samples"] == 64
    assert last["uniform"]["static_tokens"] == last["uniform"]["engine_tokens"] == 64 * 16
    assert last["long_tail"]["engine_tokens"] < 64 * 64  # EOS really cut samples short (max_new 64)
