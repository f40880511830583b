"""Multi-turn episodes on the slot engine (jaxrl.rollout.episodes.driver): greedy equality with a reference
host loop over the plain sampler, recorded log-probs against the trainer's recomputation, and
episodes that do not depend on how long environment steps take."""

import jax.numpy as jnp
import numpy as np
import pytest
from episode_helpers import CFG, MOE, RECORDS, TOK, CountEnv, P, T, engine, params, reference_episode, requests

from jaxrl.models import transformer as tf
from jaxrl.rollout.episodes.records import EpisodeGroup
from jaxrl.rollout.sampler import SamplingParams, sample

EOT_GREEDY = "1"  # with params(), greedy episodes of RECORDS take 3, 1, 2, 1, 1 turns (checked below)


def _stack(groups, field):
    return np.concatenate([getattr(g, field) for g in groups])


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_episodes_equal_the_plain_sampler_turn_by_turn(overlap):
    eot = TOK.encode(EOT_GREEDY)[0]
    ref = [reference_episode(params(), CFG, r, eot, max_turns=4, max_obs=6) for r in RECORDS]
    assert sorted(r[3] for r in ref) == [1, 1, 1, 2, 3]  # several episodes of several turns
    eng = engine(slots=3, overlap=overlap, greedy=True, eot=EOT_GREEDY)  # 10 episodes over 3 slots
    groups = eng.run(params(), 7, requests(), 2, (0, 1))
    assert [g.tag for g in groups] == list(range(len(RECORDS)))
    for g, (tokens, loss, logp, turns) in zip(groups, ref):
        for row in range(2):
            np.testing.assert_array_equal(g.tokens_GxT[row], tokens)
            np.testing.assert_array_equal(g.loss_mask_GxT[row], loss)
            np.testing.assert_allclose(g.logp_GxT[row], logp, atol=1e-5, rtol=0)
            np.testing.assert_array_equal(g.version_GxT[row], np.where(loss > 0, 7, -1))
        assert list(g.turns_G) == [turns, turns]
    assert eng.stats["place_calls"] >= 2 and eng.stats["env_steps"] == 2 * sum(r[3] for r in ref) - 2 * 3
    # Every turn is stepped except the last turns of records 2, 3, 4, which the budget cut: 2 x (8 - 3) = 10.


def _sampled(cfg=CFG, temperature=0.7, **kw):
    eng = engine(cfg, slots=4, temperature=temperature, **kw)
    return eng, eng.run(params(cfg), 3, requests(), 3, (5,))


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [CFG, MOE], ids=["dense", "moe"])
def test_recorded_logps_equal_the_trainers_recomputation_over_the_multi_turn_sequence(cfg):
    eng, groups = _sampled(cfg)
    tokens, loss = _stack(groups, "tokens_GxT"), _stack(groups, "loss_mask_GxT")
    prompt = np.repeat(np.stack([g.prompt_P for g in groups]), 3, 0)
    mask = np.repeat(np.stack([g.prompt_mask_P for g in groups]), 3, 0)
    replay = None if cfg.n_experts == 0 else jnp.asarray(_stack(groups, "routing_GxCxLxK"))
    logp, _ = tf.token_logprobs(
        params(cfg),
        cfg,
        jnp.asarray(prompt),
        jnp.asarray(mask),
        jnp.asarray(tokens),
        jnp.asarray(loss),
        0.7,
        replay_BxSxLxK=replay,
    )
    recorded = _stack(groups, "logp_GxT")
    on = loss > 0
    np.testing.assert_allclose(recorded[on], np.asarray(logp)[on], atol=2e-5, rtol=0)
    # Observations are in the sequence but carry no loss, no log-prob, no version.
    obs = (~on) & (tokens != TOK.pad_id)
    assert obs.sum() >= 10 and _stack(groups, "turns_G").max() >= 3
    assert np.all(recorded[~on] == 0) and np.all(_stack(groups, "version_GxT")[~on] == -1)
    assert np.all(_stack(groups, "version_GxT")[on] == 3)
    # Observation tokens are the environment's "<k" + length + ">" (k = the step), right after each turn's "]".
    text = TOK.decode(tokens[0])
    assert "]<1" in text or _stack(groups, "turns_G")[0] == 1


def _model_turns(tokens_T, loss_T):
    """The model turns of an episode: the runs of loss-mask 1 (CountEnv's observations are never empty)."""
    turns, cur = [], []
    for tok, m in zip(tokens_T, loss_T):
        if m > 0:
            cur.append(int(tok))
        elif cur:
            turns, cur = turns + [cur], []
    return turns + [cur] if cur else turns


def test_episode_bookkeeping_of_returns_and_counters():
    eng, groups = _sampled(temperature=1.0)
    eot = TOK.encode("]")[0]
    for g in groups:
        for row in range(3):
            turns = _model_turns(g.tokens_GxT[row], g.loss_mask_GxT[row])
            stepped = [t for t in turns if t[-1] in (eot, TOK.eos_id)]  # a budget-cut turn gets no step
            assert len(turns) == g.turns_G[row] and len(stepped) == g.tool_calls_G[row]  # 1 tool call per step
            # CountEnv's reward: the "a"s of each stepped action (EOS excluded, which is no "a" anyway).
            assert g.return_G[row] == sum(t.count(TOK.encode("a")[0]) for t in stepped)
            assert g.shaping_G[row] == pytest.approx(0.5 * len(stepped))
            assert g.finished_G[row] + g.truncated_G[row] == 1  # no env errors here
            # success: the last step's info["success"] = CountEnv's done.
            assert g.success_G[row] == (len(stepped) >= RECORDS[g.tag]["turns"])
    assert eng.stats["env_steps"] == _stack(groups, "tool_calls_G").sum()
    finished, turns = _stack(groups, "finished_G"), _stack(groups, "turns_G")
    assert finished.any() and (~finished).any() and len(set(turns)) >= 3  # the sample exercises several paths


def test_episodes_do_not_depend_on_environment_timing():
    """Sampled episodes (temperature 1) with random 0-20 ms environment steps, two different sleep
    patterns, overlap and turn-synchronous: identical tokens, log-probs and returns."""
    outs = []
    for sleep_seed, overlap in [(1, True), (2, True), (3, False)]:
        sleeper = np.random.default_rng(sleep_seed)

        def env(sleeper=sleeper):
            return CountEnv(sleep=lambda _: sleeper.uniform(0, 0.02))

        eng = engine(slots=4, chunk=2, temperature=1.0, make_env=env, overlap=overlap)
        outs.append(eng.run(params(), 0, requests(), 3, (9, 4)))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            for field in ("tokens_GxT", "loss_mask_GxT", "logp_GxT", "return_G", "turns_G", "finished_G"):
                np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
    assert len({tuple(r) for g in outs[0] for r in g.tokens_GxT}) > 5  # sampled: the rows differ
    # A different seed gives different episodes.
    again = engine(slots=4, chunk=2, temperature=1.0).run(params(), 0, requests(), 3, (9, 5))
    assert any(not np.array_equal(a.tokens_GxT, b.tokens_GxT) for a, b in zip(outs[0], again))


def test_group_fields_are_numpy_with_g_rows():
    _, groups = _sampled(temperature=1.0)
    g = groups[0]
    assert isinstance(g, EpisodeGroup) and g.routing_GxCxLxK is None
    for name in EpisodeGroup._fields[3:-1]:
        assert getattr(g, name).shape[0] == 3, name
    assert g.tokens_GxT.shape == (3, T) and g.prompt_P.shape == (P,)


@pytest.mark.slow
def test_an_end_of_turn_token_ends_decoding_without_eos_and_place_starts_like_the_sampler():
    """Kernel level: a new episode placed with n=0 decodes the plain sampler's greedy tokens; the
    stop id ends the slot (done) with eos_S False, its column recorded; other slots go on."""
    import jax

    from jaxrl.rollout.engine import state as es
    from jaxrl.rollout.episodes.state import place

    eot = TOK.encode(EOT_GREEDY)[0]
    prompt, mask = np.zeros((2, P), np.int32), np.zeros((2, P), np.int32)
    for r, rec in enumerate([RECORDS[0], RECORDS[2]]):
        ids = [TOK.bos_id] + TOK.encode(rec["prompt"])
        prompt[r, P - len(ids) :], mask[r, P - len(ids) :] = ids, 1
    spec = es.EngineSpec(CFG, 3, P, T, 1, TOK.eos_id, TOK.pad_id, greedy=True, stop_ids=(eot,), slot_keys=True)
    state = es.init_state(spec, jax.random.PRNGKey(0))

    def blank(fill, dtype):
        return np.full((2, T), fill, dtype)

    keys = np.zeros((2, 2), np.uint32)
    state = place(
        params(),
        spec,
        state,
        np.array([2, 0], np.int32),
        prompt,
        mask,
        blank(0, np.int32),
        blank(0, np.float32),
        blank(0, np.float32),
        blank(-1, np.int32),
        np.zeros(2, np.int32),
        keys,
    )
    state = es.decode_chunk(params(), spec, state, 4, 0, 1.0, None)
    host = es.host_slots(state)
    # Greedy with eot "1": record 0 writes "1" first (one token), record 2 writes "2222..." (no "1" yet).
    assert host.done_S[2] and not host.eos_S[2] and host.col_S[2] == 1 and host.tokens_SxT[2, 0] == eot
    assert not host.done_S[0] and host.col_S[0] == 4 and host.done_S[1]  # slot 1 was never placed
    ref = sample(
        params(),
        CFG,
        jnp.asarray(prompt),
        jnp.asarray(mask),
        jax.random.PRNGKey(0),
        group_size=1,
        sampling=SamplingParams(max_new_tokens=4, temperature=1.0, eos_id=TOK.eos_id, pad_id=TOK.pad_id, greedy=True),
    )
    np.testing.assert_array_equal(host.tokens_SxT[0, :4], np.asarray(ref.tokens_BxT[1]))
    assert int(ref.tokens_BxT[0, 0]) == eot
