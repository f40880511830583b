"""Partial rollouts on the slot engine: the staleness bound (groups restarted whole from their
prompt) and the re-prefill of carried samples under new params (jaxrl.rollout.engine.partial)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_engine import CFG, MOE, NEVER, PAD, G, P, T, _eos, _items, _params, _plain, _prompts

from jaxrl import config as C
from jaxrl.config import ConfigError, EngineConfig, SpeculativeConfig
from jaxrl.models import transformer as tf
from jaxrl.models.cache_kinds import LayerKV
from jaxrl.rollout.engine import state as es
from jaxrl.rollout.engine.driver import Engine
from jaxrl.rollout.engine.groups import batch_of_groups, left_pad
from jaxrl.rollout.engine.partial import fed_mask, release_slots, reprefill
from jaxrl.rollout.sampler import SamplingParams
from jaxrl.rollout.speculative.engine import speculative_spec


def _engine(max_staleness=-1, reprefill=False, slots=6, chunk=1, eos=None, greedy=True, seed=0, temperature=1.0):
    ecfg = EngineConfig(
        enabled=True,
        slots=slots,
        chunk=chunk,
        admit_groups=1,
        admission="fill",
        max_staleness=max_staleness,
        reprefill=reprefill,
    )
    return Engine(
        CFG,
        ecfg,
        group_size=G,
        prompt_len=P,
        sampling=SamplingParams(
            max_new_tokens=T,
            temperature=temperature,
            eos_id=_eos(CFG) if eos is None else eos,
            pad_id=PAD,
            greedy=greedy,
        ),
        rng=jax.random.PRNGKey(seed),
    )


def _one_group_per_version(engine, params=None):
    """collect(n_groups=1) at versions 0, 1, .. until the five prompts are back ->
    [(version, tag, first token's version, last token's version)], and the groups by tag."""
    items, rows, groups = iter(_items()), [], {}
    for v in range(12):
        for g in engine.collect(_params() if params is None else params, v, items, 1):
            drawn = g.version_GxT[g.completion_mask_GxT > 0]
            rows.append((v, g.tag, int(drawn.min()), int(drawn.max())))
            groups[g.tag] = g
    return rows, [groups[i] for i in sorted(groups)]


# Greedy lengths with this EOS: prompt 0 -> 3 tokens, prompt 1 -> 4, prompts 2..4 -> 6 (T). Six slots
# hold three groups; chunk=1; one group per collect. Unbounded (hand-worked):
#   v0: prompts 0,1,2 admitted; 3 chunks: 0 done -> returned.          (1 and 2 hold 3 tokens @v0)
#   v1: prompt 3 admitted; 1 chunk: 1 done (tokens @0,0,0,1).
#   v2: prompt 4 admitted; 2 chunks: 2 done (tokens @0 x3, @1, @2 x2): first token 2 versions old.
#   v3: 3 chunks: 3 done (@1, @2 x2, @3 x3).   v4: 1 chunk: 4 done (@2 x5, @4).     10 chunks.
UNBOUNDED = [(0, 0, 0, 0), (1, 1, 0, 1), (2, 2, 0, 2), (3, 3, 1, 3), (4, 4, 2, 4)]
# max_staleness=1: at v2 prompt 2 (first token @0, in flight) is restarted with prompt 4; prompt 3
# (@1) needs 5 more chunks and is returned; at v3 prompts 2 and 4 (6 tokens after one more chunk)
# both finish, 2 is returned and 4 waits; at v4 the waiting prompt 4 (first token @2) is restarted
# too and redrawn in 6 chunks. Two restarts; 3 + 1 + 5 + 1 + 6 = 16 chunks, 7 prefills.
BOUND_1 = [(0, 0, 0, 0), (1, 1, 0, 1), (2, 3, 1, 2), (3, 2, 2, 3), (4, 4, 4, 4)]


def test_staleness_bound_restarts_whole_groups_in_flight_and_waiting():
    rows, groups = _one_group_per_version(_engine(max_staleness=-1))
    assert rows == UNBOUNDED  # the pattern breaks a bound of 1 (prompt 2 at v2, prompt 4 at v4)
    engine = _engine(max_staleness=1)
    rows, groups = _one_group_per_version(engine)
    assert rows == BOUND_1 and all(v - first <= 1 for v, _, first, _ in rows)
    assert (engine.counts["restarted_groups"], engine.counts["restarted_samples"]) == (2, 2 * G)
    assert (engine.counts["chunks"], engine.counts["prefill_calls"]) == (16, 7)
    # Restarted groups were redrawn from their own prompts into clean slots: the greedy sampler's tokens.
    batch = batch_of_groups(groups).fields()
    ref = _plain(CFG, _eos(CFG))
    np.testing.assert_array_equal(batch["tokens_BxT"], np.asarray(ref.tokens_BxT))
    np.testing.assert_allclose(batch["rollout_logp_BxT"], np.asarray(ref.logp_BxT), atol=1e-5, rtol=0)
    assert engine.groups_in_flight == 0 and not engine.host.restart and np.all(engine.pool.owner_S < 0)


def test_staleness_zero_never_spans_an_update_and_a_loose_bound_changes_nothing():
    engine = _engine(max_staleness=0)
    rows, _ = _one_group_per_version(engine)
    assert all(v == first == last for v, _, first, last in rows) and engine.counts["restarted_groups"] > 0
    unbounded = batch_of_groups(_one_group_per_version(_engine(max_staleness=-1))[1]).fields()
    loose_engine = _engine(max_staleness=2)  # the largest staleness the pattern reaches (UNBOUNDED)
    rows, groups = _one_group_per_version(loose_engine)
    assert rows == UNBOUNDED and loose_engine.counts["restarted_groups"] == 0
    loose = batch_of_groups(groups).fields()
    for key in ("tokens_BxT", "rollout_logp_BxT", "version_BxT", "completion_mask_BxT"):
        np.testing.assert_array_equal(loose[key], unbounded[key])


def test_staleness_bound_sampled_returns_valid_versions():
    """Sampled (temperature 1): whatever lengths come out, no returned token is > 1 version old."""
    engine = _engine(max_staleness=1, greedy=False, seed=5)
    rows, groups = _one_group_per_version(engine)
    assert sorted(tag for _, tag, _, _ in rows) == list(range(5))
    assert all(v - first <= 1 for v, _, first, _ in rows) and engine.counts["restarted_groups"] > 0
    for g in groups:  # every sample ran to its end: EOS, or T tokens (none was cut off by a release)
        lengths_G = g.completion_mask_GxT.sum(1)
        assert np.all(g.finished_G | (lengths_G == T)) and np.all(g.finished_G != g.truncated_G)


def test_release_slots_stops_only_the_marked_slots():
    spec = es.EngineSpec(
        CFG, slots=4, prompt_len=P, max_new_tokens=T, group_size=G, eos_id=NEVER, pad_id=PAD, greedy=True
    )
    prompt, mask = _prompts()
    state = es.init_state(spec, jax.random.PRNGKey(0))
    state = es.admit(_params(), spec, state, prompt[[0, 1]], mask[[0, 1]], np.arange(4, dtype=np.int32))
    state = es.decode_chunk(_params(), spec, state, 2, 0, 1.0)
    state = release_slots(spec, state, np.asarray([0, 1, 1, 0], bool))
    state = es.decode_chunk(_params(), spec, state, 2, 0, 1.0)
    assert np.asarray(state.col_S).tolist() == [4, 2, 2, 4]  # released slots drew nothing more
    assert np.asarray(state.done_S).tolist() == [False, True, True, False] and not np.asarray(state.eos_S).any()


# ---------------------------------------------------------------------------------------------
# Re-prefill

K = 3  # tokens drawn under params A before the switch to B


@functools.cache
def _params_b(cfg=CFG):
    return tf.init_params(cfg, jax.random.PRNGKey(1))


def _spec(prompt_len=P, max_new_tokens=T, greedy=True, cfg=CFG):
    return es.EngineSpec(
        cfg,
        slots=4,
        prompt_len=prompt_len,
        max_new_tokens=max_new_tokens,
        group_size=G,
        eos_id=NEVER,
        pad_id=PAD,
        greedy=greedy,
    )


def _after_k_under_a(greedy=True, redo=True, cfg=CFG):
    """Prompt 0 (2 real tokens) admitted into slots 1, 2 under params A, K steps at version 0, then
    (redo) re-prefilled under B. -> (spec, state, prompt_SxP, mask_SxP)."""
    prompt, mask = _prompts()
    spec = _spec(greedy=greedy, cfg=cfg)
    state = es.init_state(spec, jax.random.PRNGKey(7))
    state = es.admit(_params(cfg), spec, state, prompt[[0]], mask[[0]], np.asarray([1, 2], np.int32))
    state = es.decode_chunk(_params(cfg), spec, state, K, 0, 1.0)
    prompt_SxP, mask_SxP = np.full((4, P), PAD, np.int32), np.zeros((4, P), np.int32)
    prompt_SxP[1:3], mask_SxP[1:3] = prompt[0], mask[0]
    if redo:
        state = reprefill(_params_b(cfg), spec, state, prompt_SxP, mask_SxP, np.asarray([0, 1, 1, 0], bool))
    return spec, state, prompt_SxP, mask_SxP


def _fresh_under_b(prefix_2xK, rng, greedy=True, cfg=CFG):
    """A fresh engine (prompt_len P+K, T-K new tokens) that admits prompt 0 + slot 1's (slot 2's)
    prefix as its prompt under B into slot 1 (2): the same cache layout as the re-prefilled engine."""
    prompt, mask = _prompts()
    spec = _spec(P + K, T - K, greedy, cfg)
    # The same key stream from here (a copy: admit donates its state).
    state = es.init_state(spec, jax.random.PRNGKey(0))._replace(rng=jnp.copy(rng))
    for slot, prefix_K in zip((1, 2), prefix_2xK):
        tokens, pmask = left_pad(np.concatenate([prompt[0][mask[0] > 0], prefix_K]), P + K, PAD)
        state = es.admit(_params_b(cfg), spec, state, tokens[None], pmask[None], np.asarray([slot, 4], np.int32))
    return spec, state


@pytest.mark.slow
@pytest.mark.parametrize("cfg,greedy", [(CFG, True), (CFG, False), (MOE, True)], ids=["greedy", "sampled", "moe"])
def test_reprefill_equals_a_clean_prefill_under_the_new_params(cfg, greedy):
    spec, state, prompt_SxP, mask_SxP = _after_k_under_a(greedy, cfg=cfg)
    spec_b, fresh = _fresh_under_b(np.asarray(state.tokens_SxT)[1:3, :K], state.rng, greedy, cfg)
    # The caches agree on every slot fed so far (prompt + K-1 tokens; the K-th is the next input).
    fed_SxC = np.asarray(fed_mask(spec, state, mask_SxP))[1:3]
    assert fed_SxC.sum(1).tolist() == [2 + K - 1] * 2
    for (k, v), (fk, fv) in zip(state.cache.kv, fresh.cache.kv):
        for ours, theirs in ((k, fk), (v, fv)):  # S x Kv x C x Hd; same C = P + T
            ours, theirs = np.asarray(ours)[1:3].transpose(0, 2, 1, 3), np.asarray(theirs)[1:3].transpose(0, 2, 1, 3)
            np.testing.assert_allclose(ours[fed_SxC], theirs[fed_SxC], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(state.last_S)[1:3], np.asarray(fresh.last_S)[1:3])
    if cfg.n_experts:  # the recorded routing of the fed slots is the re-prefill's, as a fresh prefill's
        np.testing.assert_array_equal(
            np.asarray(state.routing_SxCxLxK)[1:3][fed_SxC], np.asarray(fresh.routing_SxCxLxK)[1:3][fed_SxC]
        )
    # Continuing under B draws what the fresh engine draws (same key stream, same slots).
    state = es.decode_chunk(_params_b(cfg), spec, state, T, 1, 1.0)
    fresh = es.decode_chunk(_params_b(cfg), spec_b, fresh, T, 1, 1.0)
    np.testing.assert_array_equal(np.asarray(state.tokens_SxT)[1:3, K:], np.asarray(fresh.tokens_SxT)[1:3])
    np.testing.assert_allclose(np.asarray(state.logp_SxT)[1:3, K:], np.asarray(fresh.logp_SxT)[1:3], atol=1e-5)
    # The tokens drawn before the switch keep their A log-probs and version 0.
    np.testing.assert_array_equal(np.asarray(state.version_SxT)[1:3], [[0] * K + [1] * (T - K)] * 2)
    _, under_a, _, _ = _after_k_under_a(greedy, redo=False, cfg=cfg)
    np.testing.assert_array_equal(np.asarray(state.logp_SxT)[1:3, :K], np.asarray(under_a.logp_SxT)[1:3, :K])


def test_reprefill_on_a_speculative_engine_writes_the_plain_engines_keys():
    """A speculative engine's cache has room for the verify window past P + T; re-prefill fills the
    fed slots as the plain engine's does and leaves that room alone (it used to fail on the shapes)."""
    spec, state, prompt_SxP, mask_SxP = _after_k_under_a()
    spec_s = speculative_spec(spec, SpeculativeConfig(enabled=True, draft_layers=1, max_draft=2))
    room = spec_s.cache_len - spec.cache_len
    assert room > 0

    def widen(x_SxKvxCxHd):  # the plain state's buffers with the speculative engine's room, zeroed
        return jnp.pad(x_SxKvxCxHd, ((0, 0), (0, 0), (0, room), (0, 0)))

    assert state.routing_SxCxLxK is None  # CFG is dense: no routing record to widen
    wide = jax.tree.map(jnp.copy, state)  # reprefill donates its state: each call gets its own
    kv = tuple(LayerKV(widen(k), widen(v)) for k, v in wide.cache.kv)
    wide = wide._replace(cache=wide.cache._replace(kv=kv, valid_BxS=jnp.pad(wide.cache.valid_BxS, ((0, 0), (0, room)))))
    redo_S = np.asarray([0, 1, 1, 0], bool)
    got = reprefill(_params(), spec_s, wide, prompt_SxP, mask_SxP, redo_S)
    want = reprefill(_params(), spec, state, prompt_SxP, mask_SxP, redo_S)
    C = spec.cache_len
    for got_kv, want_kv in zip(got.cache.kv, want.cache.kv):
        for buf, ref in zip(got_kv, want_kv):
            np.testing.assert_allclose(np.asarray(buf)[:, :, :C], np.asarray(ref), atol=1e-5, rtol=0)
            np.testing.assert_array_equal(np.asarray(buf)[:, :, C:], 0.0)


def test_without_reprefill_the_cache_keeps_the_old_params_keys():
    spec, kept, _, mask_SxP = _after_k_under_a(redo=False)
    _, redone, _, _ = _after_k_under_a(redo=True)
    fed = np.asarray(fed_mask(spec, kept, mask_SxP))
    untouched = ~fed | np.asarray([0, 1, 1, 0], bool)[:, None] == 0  # slots 0, 3 and unfed cache slots
    for (k, _), (rk, _) in zip(kept.cache.kv, redone.cache.kv):
        k, rk = np.asarray(k).transpose(0, 2, 1, 3), np.asarray(rk).transpose(0, 2, 1, 3)
        assert np.abs(k[fed] - rk[fed]).max() > 1e-2  # A's keys vs B's
        np.testing.assert_array_equal(k[untouched], rk[untouched])  # nothing else written
    kept = es.decode_chunk(_params_b(), spec, kept, 1, 1, 1.0)
    redone = es.decode_chunk(_params_b(), spec, redone, 1, 1, 1.0)
    assert np.abs(np.asarray(kept.logp_SxT)[1:3, K] - np.asarray(redone.logp_SxT)[1:3, K]).max() > 1e-3


@pytest.mark.parametrize("redo", [True, False], ids=["reprefill", "kept-cache"])
def test_engine_reprefill_option_makes_continued_logprobs_the_new_params(redo):
    """Engine level: collect at version 0 under A leaves samples in flight; collect at version 1 under
    B continues them. With reprefill, every version-1 token's recorded log-prob equals the trainer's
    recomputation under B (a clean forward over prompt + completion); without, they differ. Version-0
    tokens keep A's log-probs either way."""
    engine = _engine(reprefill=redo, slots=6, chunk=2, greedy=False, seed=3, temperature=0.7)
    items = iter(_items())
    first = engine.collect(_params(), 0, items, 1)
    carried = engine.groups_in_flight
    rest = engine.collect(_params_b(), 1, items, 4)
    assert carried > 0 and engine.counts["reprefilled_samples"] == (carried * G if redo else 0)
    batch = batch_of_groups(first + rest).fields()
    mask, version = batch["completion_mask_BxT"] > 0, batch["version_BxT"]
    args = (
        batch["prompt_tokens_BxP"],
        batch["prompt_mask_BxP"],
        batch["tokens_BxT"],
        batch["completion_mask_BxT"],
        0.7,
    )
    logp_a, logp_b = (np.asarray(tf.token_logprobs(p, CFG, *args)[0]) for p in (_params(), _params_b()))
    spans_B = np.any(mask & (version == 0), 1) & np.any(mask & (version == 1), 1)
    assert spans_B.any()
    old, new = mask & (version == 0), mask & (version == 1) & spans_B[:, None]
    np.testing.assert_allclose(batch["rollout_logp_BxT"][old], logp_a[old], atol=2e-5, rtol=0)
    gap = np.abs(batch["rollout_logp_BxT"][new] - logp_b[new])
    if redo:
        assert gap.max() < 2e-5
    else:
        assert gap.max() > 1e-2


@pytest.mark.parametrize(
    "item, needle",
    [
        (
            "rollout.engine.max_staleness=-2",
            "rollout.engine.max_staleness: got -2, expected -1 (no bound) or an integer >= 0",
        ),
    ],
)
def test_partial_config_errors_name_the_field(item, needle):
    with pytest.raises(ConfigError) as e:
        C.apply_overrides(C.Config(), [item]).validate()
    assert needle in str(e.value) and "\n" not in str(e.value)
    cfg = C.apply_overrides(C.Config(), ["rollout.engine.max_staleness=1", "rollout.engine.reprefill=true"])
    assert (cfg.rollout.engine.max_staleness, cfg.rollout.engine.reprefill) == (1, True)


# ---------------------------------------------------------------------------------------------
# The behaviour / trainer log-prob mismatch split by staleness (the update's metrics)


def test_update_splits_the_logprob_mismatch_by_staleness():
    """stale_BxT marks tokens an older version drew: the update reports mean |rollout - old logp|
    over those and over the rest, and their share; the overall mean is their mix."""
    from test_preset_numbers import PRESETS, _toy_batch, _toy_logp, _update

    batch = _toy_batch(8, seed=1)
    live = batch["completion_mask_BxT"] > 0
    stale = np.zeros_like(live)
    stale[:3, :2] = True  # the first three rows' first two tokens (some may be masked: live & stale count)
    batch["stale_BxT"] = stale.astype(np.float32)
    (_, m), params = _update(PRESETS["m2po"](tau=0.01), 2, batch, 2, 1)
    gap = np.abs(batch["rollout_logp_BxT"] - np.asarray(_toy_logp(params, batch)[0]))
    old, fresh = live & stale, live & ~stale
    assert 0 < old.sum() < live.sum()
    np.testing.assert_allclose(float(m["mismatch_abs_logp_stale"]), gap[old].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["mismatch_abs_logp_fresh"]), gap[fresh].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["stale_tokens"]), old.sum() / live.sum(), rtol=1e-6)
    np.testing.assert_allclose(float(m["mismatch_abs_logp"]), gap[live].mean(), rtol=1e-5)
    del batch["stale_BxT"]  # a batch without it: no split reported
    (_, m), _ = _update(PRESETS["m2po"](tau=0.01), 2, batch, 2, 1)
    assert "mismatch_abs_logp_stale" not in m and "stale_tokens" not in m


# ---------------------------------------------------------------------------------------------
# In the training loop's EngineSource


# The persistent XLA cache only where training runs repeat programs (the module-scoped fixture stays
# on from the first of these to the module's end: keep them last). For the engine-level tests above,
# writing every program to disk costs more than it saves.
@pytest.mark.slow
@pytest.mark.usefixtures("persistent_compile_cache")
def test_engine_source_bounds_staleness_and_logs_restarts_and_reprefills(in_process_cache):
    from test_engine_train import _cfg, _source

    from jaxrl.data.stream import StreamState

    fill = ["rollout.engine.slots=32", "rollout.engine.chunk=1", "rollout.engine.admission=fill"]
    for extra, bound in ((["rollout.engine.max_staleness=0"], 0), (["rollout.engine.reprefill=true"], None)):
        source, _, _, params = _source(_cfg(*fill, *extra), in_process_cache, warm=True)
        stream, totals = StreamState(0, 0), {"restarted_samples": 0, "reprefilled_samples": 0, "partial_frac": 0}
        for step in (1, 2, 3):
            produced = source.produce(params, stream, None, step)
            stream, m, batch = produced.stream, produced.metrics, produced.host_batch.fields()
            for k in totals:
                totals[k] += m[f"engine/{k}"]
            # stale_BxT marks exactly the tokens older than the step's version (staleness_0 is their complement)
            live = batch["completion_mask_BxT"] > 0
            assert batch["stale_BxT"][live].mean() == pytest.approx(1 - m["engine/staleness_0"])
            if bound == 0:
                assert m["engine/staleness_max"] == 0 and not batch["stale_BxT"].any()
        if bound == 0:  # groups carried over were restarted: nothing spans a step
            assert totals["restarted_samples"] > 0 and totals["partial_frac"] == 0
            assert totals["reprefilled_samples"] == 0
        else:  # unbounded, re-prefilled: carried samples span steps and their caches were recomputed
            assert totals["restarted_samples"] == 0 and totals["partial_frac"] > 0 and totals["reprefilled_samples"] > 0


@pytest.mark.slow
@pytest.mark.usefixtures("persistent_compile_cache")
def test_grpo_trains_with_partial_rollouts_and_reports_the_split_mismatch(tmp_path, in_process_cache):
    from test_engine_train import _cfg

    from jaxrl.train.loop import train

    # 24 slots hold 6 groups of 4; a step needs 4: the 2 groups over are returned by step 2, drawn
    # by version 0 (1 version old, within the bound): about half of step 2's tokens.
    cfg = _cfg(
        "rollout.engine.slots=24",
        "rollout.engine.admission=fill",
        "rollout.engine.max_staleness=1",
        "rollout.engine.reprefill=true",
    )
    rows = train(cfg, tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        for key in (
            "engine/restarted_samples",
            "engine/reprefilled_samples",
            "mismatch_abs_logp_stale",
            "mismatch_abs_logp_fresh",
            "stale_tokens",
        ):
            assert key in row and np.isfinite(row[key]), key
        share = row["stale_tokens"]
        mix = share * row["mismatch_abs_logp_stale"] + (1 - share) * row["mismatch_abs_logp_fresh"]
        assert mix == pytest.approx(row["mismatch_abs_logp"], rel=1e-4, abs=1e-6)
        assert row["mismatch_abs_logp_fresh"] < 0.05  # tokens of the current version: the trainer's log-probs
    assert rows[1]["stale_tokens"] == 0  # the first step has nothing older
    assert 0 < rows[2]["stale_tokens"] < 1  # (the tiny run's rewards are flat: its update barely moves,
    # so the stale tokens' mismatch is small too; the split's arithmetic is checked by hand above)
