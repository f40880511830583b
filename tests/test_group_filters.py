"""Which groups and prompts a step uses: DAPO dynamic sampling (jaxrl/sources/filters.py) and
the Beta / Thompson online difficulty filter (jaxrl/sources/prompt_filter.py), by hand and through
EngineSource on the TINY config."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from preset_configs import config_path, overrides

from jaxrl.config import ConfigError, load_config
from jaxrl.data.rewards import score
from jaxrl.data.stream import StreamState
from jaxrl.data.tasks import load_task
from jaxrl.data.tokenizer import CharTokenizer
from jaxrl.models.transformer import init_params
from jaxrl.sources import prompt_filter as prompt_filter_module
from jaxrl.sources.filters import ScoredGroup, informative, select_informative
from jaxrl.sources.groups import EngineSource
from jaxrl.sources.prompt_filter import BetaPromptFilter
from jaxrl.train import checkpoint as ckpt

# ---------------------------------------------------------------------------------------------
# Dynamic sampling, by hand

W = (1.0, 0.5)  # loss.reward_weights: combined r = correctness + 0.5 * format
INF = np.array([[1, 0], [0, 1]], np.float32)  # combined 1.0, 0.5: informative
EQ_MIXED = np.array([[1, 0], [0, 2]], np.float32)  # combined 1.0, 1.0: all equal though the columns differ
EQ_ZERO = np.zeros((2, 2), np.float32)  # combined 0, 0


def _drawer(rewards: dict):
    """draw(n) over the named groups in order, recording each request size."""
    order, asked = list(rewards), []

    def draw(n):
        asked.append(n)
        out = [ScoredGroup(name, rewards[name]) for name in order[:n]]
        del order[:n]
        return out

    return draw, asked


def test_informative_compares_the_combined_reward():
    assert informative(INF, W) and not informative(EQ_MIXED, W) and not informative(EQ_ZERO, W)
    assert informative(EQ_MIXED, None)  # weights 1, 1: combined 1.0, 2.0


def test_dynamic_sampling_drops_all_equal_groups_and_draws_until_full():
    # N=2, cap 10: draw(2) -> a(eq) b(inf): 1 kept; draw(1) -> c(eq); draw(1) -> d(inf): 2 kept.
    draw, asked = _drawer({"a": EQ_ZERO, "b": INF, "c": EQ_MIXED, "d": INF, "e": INF})
    sel = select_informative(draw, 2, 10, W)
    assert [g.group for g in sel.groups] == ["b", "d"] and asked == [2, 1, 1]
    assert (sel.n_drawn, sel.n_dropped, sel.n_filled, sel.n_extra, sel.cap_hit) == (4, 2, 0, 2, False)
    # combined rewards drawn: a 0,0  b 1,.5  c 1,1  d 1,.5 -> 5 / 8
    assert sel.drawn_reward_mean == pytest.approx(5 / 8)


def test_dynamic_sampling_stops_at_the_cap_and_fills_with_dropped_groups_in_draw_order():
    # N=3, cap 2: draw(3) -> A(inf) B(eq) C(eq): 1 kept; draw(min(2, 2)) -> D(inf) E(eq): 2 kept, 2 extra
    # = cap. One group short: fill with the first dropped, B. Dropped: B C E (3), B put back.
    draw, asked = _drawer({"A": INF, "B": EQ_MIXED, "C": EQ_ZERO, "D": INF, "E": EQ_ZERO, "F": INF})
    sel = select_informative(draw, 3, 2, W)
    assert [g.group for g in sel.groups] == ["A", "D", "B"] and asked == [3, 2]
    assert (sel.n_drawn, sel.n_dropped, sel.n_filled, sel.n_extra, sel.cap_hit) == (5, 3, 1, 2, True)
    # cap 0: no extra draw; the batch is the first draw, informative first
    draw, asked = _drawer({"A": EQ_ZERO, "B": INF, "C": EQ_ZERO})
    sel = select_informative(draw, 3, 0, W)
    assert [g.group for g in sel.groups] == ["B", "A", "C"] and asked == [3] and sel.cap_hit


def test_dynamic_sampling_stops_when_the_prompts_run_out():
    draw, asked = _drawer({"A": EQ_ZERO, "B": INF})
    sel = select_informative(draw, 2, 10, W)
    assert [g.group for g in sel.groups] == ["B", "A"] and asked == [2, 1] and sel.cap_hit and sel.n_extra == 0


# ---------------------------------------------------------------------------------------------
# Dynamic sampling through EngineSource (random TINY params; a verifier on the first character)


def _cfg(*extra):
    return load_config(
        config_path("grpo"),
        overrides("grpo")
        + ["rollout.engine.enabled=true", "rollout.engine.slots=8", "rollout.engine.admission=exact", *extra],
    )


def _first_char_verifier(completion, finished, record):
    """Correct iff the completion starts with a character of odd code: about half of random samples."""
    return float(bool(completion) and ord(completion[0]) % 2 == 1), 0.0


def _source(cfg, verifier, host=None):
    tok = CharTokenizer()
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tok.vocab_size)
    task = dataclasses.replace(load_task(cfg.data), verifier=verifier)
    return EngineSource(cfg, model_cfg, tok, task, host or {}), task, tok, init_params(model_cfg, jax.random.key(0))


def _rescored(batch, task, tok):
    """Each row re-scored against the record of its prompt (found by its text)."""
    by_prompt = {task.train[i]["prompt"]: task.train[i] for i in range(len(task.train))}
    texts = [tok.decode(t.tolist()) for t in batch["tokens_BxT"]]
    prompts = [tok.decode(p[m > 0].tolist()) for p, m in zip(batch["prompt_tokens_BxP"], batch["prompt_mask_BxP"])]
    rewards, _ = score(task.verifier, texts, list(batch["truncated_B"] == 0), [by_prompt[p] for p in prompts])
    return rewards


def test_engine_source_with_dynamic_sampling_yields_only_informative_groups(in_process_cache):
    cfg = _cfg("rollout.engine.dynamic_sampling=true", "rollout.engine.max_extra_groups=16")
    source, task, tok, params = _source(cfg, _first_char_verifier)
    N, G = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    stream, dropped = StreamState(0, 0), 0
    for step in (1, 2, 3):
        produced = source.produce(params, stream, None, step)
        batch, m = produced.host_batch.fields(), produced.metrics
        np.testing.assert_array_equal(batch["group_id_B"], np.repeat(np.arange(N), G))  # B rows, N groups
        np.testing.assert_array_equal(batch["rewards_BxK"], _rescored(batch, task, tok))
        for r_GxK in batch["rewards_BxK"].reshape(N, G, -1):
            assert informative(r_GxK, cfg.loss.reward_weights)
        assert m["engine/dyn_cap_hit"] == 0 and m["engine/dyn_filled"] == 0
        # exact admission: one prompt per group drawn; every group drawn beyond N replaced a dropped one
        assert produced.stream.index - stream.index == N + m["engine/dyn_extra"]
        assert m["rollout/samples"] == (N + m["engine/dyn_extra"]) * cfg.rollout.group_size  # dropped ones count
        assert m["engine/dyn_dropped"] == m["engine/dyn_extra"]
        assert m["reward/mean"] == pytest.approx(batch["rewards_BxK"][:, 0].mean())  # the kept batch
        stream, dropped = produced.stream, dropped + m["engine/dyn_dropped"]
    assert dropped > 0  # some groups were all-equal (P = 1/8 each) and were replaced


def test_engine_source_at_the_cap_fills_the_batch_with_dropped_groups(in_process_cache):
    cfg = _cfg("rollout.engine.dynamic_sampling=true", "rollout.engine.max_extra_groups=3")
    source, task, tok, params = _source(cfg, lambda completion, finished, record: (0.0, 0.0))  # nothing informative
    N, G = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    produced = source.produce(params, StreamState(0, 0), None, 1)
    m = produced.metrics
    assert produced.host_batch.fields()["tokens_BxT"].shape[0] == N * G
    np.testing.assert_array_equal(produced.host_batch.fields()["group_id_B"], np.repeat(np.arange(N), G))
    # 4 + 3 drawn, all uninformative: 7 dropped, the first 4 put back
    assert (m["engine/dyn_extra"], m["engine/dyn_dropped"], m["engine/dyn_filled"], m["engine/dyn_cap_hit"]) == (
        3,
        7,
        4,
        1,
    )
    assert produced.stream.index == N + 3


# ---------------------------------------------------------------------------------------------
# The Beta / Thompson prompt filter


def _filter(seed=0, low=0.05, high=0.95, prior=(1.0, 1.0)):
    return BetaPromptFilter(low, high, prior, np.random.default_rng(seed))


def _rewards(correctness):
    return np.stack([np.asarray(correctness, np.float32), np.zeros(len(correctness), np.float32)], 1)


def test_beta_posterior_counts_successes_above_one_half():
    f = _filter(prior=(2.0, 0.5))
    f.update("p", _rewards([1, 0.6, 0.5, 0]))  # successes: 1 and 0.6 -> a 2+2, b 0.5+2
    assert f.posteriors["p"] == [4.0, 2.5]
    f.update("p", _rewards([1, 1]))  # a 4+2, b 2.5
    f.update(7, _rewards([0, 0, 0]))  # ids are kept as strings (JSON keys): a 2, b 0.5+3
    assert f.posteriors == {"p": [6.0, 2.5], "7": [2.0, 3.5]}


def test_thompson_decision_against_the_drawn_value():
    # The filter's first draw for Beta(9, 1) is seed 0's first beta(9, 1) draw; place high just below
    # and just above it: skip, then admit. Unseen prompts pass without a draw.
    p0 = np.random.default_rng(0).beta(9.0, 1.0)
    for high, admitted in ((p0 - 1e-6, False), (p0 + 1e-6, True)):
        f = _filter(seed=0, low=0.0, high=high)
        before = f.rng.bit_generator.state
        assert f.admit("never seen") and f.rng.bit_generator.state == before
        f.update("p", _rewards([1] * 8))  # Beta(1 + 8, 1)
        assert f.admit("p") is admitted
    f = _filter(seed=0, low=p0 + 1e-6, high=1.0)  # the low side: p0 < low -> skip
    f.update("p", _rewards([1] * 8))
    assert not f.admit("p")


def test_thompson_skip_rates_match_the_beta_tails():
    # Beta(a, 1): P(p > h) = 1 - h^a; Beta(9, 1), h = 0.95: 1 - 0.95^9 = 0.3698.
    # Beta(1, b): P(p < l) = 1 - (1 - l)^b; Beta(1, 4), l = 0.1: 1 - 0.9^4 = 0.3439.
    n = 20000  # binomial sd ~ 0.0034: 0.012 is 3.5 sd
    f = _filter(seed=1)
    f.update("solved", _rewards([1] * 8))
    f.update("failed", _rewards([0] * 3))
    assert 1 - np.mean([f.admit("solved") for _ in range(n)]) == pytest.approx(0.3698, abs=0.012)
    f = _filter(seed=2, low=0.1, high=1.0)
    f.update("failed", _rewards([0] * 3))
    assert 1 - np.mean([f.admit("failed") for _ in range(n)]) == pytest.approx(0.3439, abs=0.012)


def _feed(ids):
    return [({"id": i}, np.array([1, 2], np.int32)) for i in ids]


def test_a_prompt_solved_every_time_stops_being_admitted():
    # Each round offers prompts "solved" (all 8 correct when run) and "mixed" (4 of 8).
    f, rounds = _filter(seed=3), {"solved": [], "mixed": []}
    for r in range(60):
        for record, _tokens in f.admitted(_feed(["solved", "mixed"])):
            rounds[record["id"]].append(r)
            f.update(record["id"], _rewards([1] * 8 if record["id"] == "solved" else [1, 0] * 4))
    # After k runs "solved" is Beta(1 + 8k, 1), admitted w.p. 0.95^(1 + 8k): 0.63 (k=1), 0.28 (k=3),
    # 0.09 (k=6), 0.036 (k=8); "mixed" is Beta(1 + 4k, 1 + 4k), inside [0.05, 0.95] almost surely.
    assert rounds["mixed"] == list(range(60))
    early, late = [r for r in rounds["solved"] if r < 10], [r for r in rounds["solved"] if r >= 30]
    assert len(early) >= 4 and len(late) <= 1, rounds["solved"]
    assert f.n_filtered == 60 - len(rounds["solved"])


def test_the_filter_skips_in_the_stream_and_admits_after_too_many_skips(monkeypatch):
    f = _filter()
    f.update("a", _rewards([1] * 1000))  # Beta(1001, 1): admitted w.p. 0.95^1001 ~ 5e-23
    got = [r["id"] for r, _ in f.admitted(_feed(["a", "b", "a", "c"]))]
    assert got == ["b", "c"] and (f.n_filtered, f.n_forced) == (2, 0)
    monkeypatch.setattr(prompt_filter_module, "MAX_SKIPS_IN_A_ROW", 2)
    got = [r["id"] for r, _ in f.admitted(_feed(["a"] * 5))]  # skip, skip, forced, skip, skip
    assert got == ["a"] and (f.n_filtered, f.n_forced) == (6, 1)


def test_filter_state_round_trip_gives_the_same_future_decisions():
    f = _filter(seed=4, low=0.2, high=0.8)
    for i, c in enumerate([[1, 1, 1, 0], [0, 0, 0, 1], [1, 0, 1, 0]]):
        f.update(f"p{i}", _rewards(c))
    [f.admit("p0") for _ in range(7)]  # advance the generator
    state = json.loads(json.dumps(f.to_state()))  # what the checkpoint's JSON item holds
    g = BetaPromptFilter.from_state(state, 0.2, 0.8, (1.0, 1.0))
    ids = ["p0", "p1", "p2"] * 30
    future_f, future_g = [f.admit(i) for i in ids], [g.admit(i) for i in ids]
    assert future_f == future_g and g.posteriors == f.posteriors and g.n_filtered == f.n_filtered
    fresh = BetaPromptFilter(0.2, 0.8, (1.0, 1.0), np.random.default_rng(4))  # same posteriors, generator not restored
    fresh.posteriors = {k: list(v) for k, v in f.posteriors.items()}
    assert [fresh.admit(i) for i in ids] != future_g


@pytest.mark.slow
def test_engine_source_learns_the_filter_and_checkpoints_it(in_process_cache):
    cfg = _cfg("rollout.engine.prompt_filter=beta")
    source, task, tok, params = _source(cfg, _first_char_verifier)
    N, G = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    produced = source.produce(params, StreamState(0, 0), None, 1)
    post = source.prompt_filter.posteriors  # one Beta per group drawn, G samples each
    assert len(post) == N and sum(a + b - 2 for a, b in post.values()) == N * G
    correct = produced.host_batch.fields()["rewards_BxK"][:, 0] > 0.5
    assert sum(a - 1 for a, _ in post.values()) == correct.sum()
    assert produced.metrics["engine/filtered_prompts"] == 0  # unseen prompts always pass
    saved = source.checkpoint_state()
    arrays = saved.pop(ckpt.ARRAYS)  # the engine's arrays: their own orbax item, not JSON
    host = json.loads(json.dumps(saved))
    resumed, *_ = _source(cfg, _first_char_verifier, host={"stream": {}, **host, ckpt.ARRAYS: arrays})
    assert resumed.prompt_filter.to_state() == source.prompt_filter.to_state()


def test_prompt_filter_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="rollout.engine.prompt_filter"):
        _cfg("rollout.engine.prompt_filter=thompson")
    with pytest.raises(ConfigError, match="rollout.engine.filter_low"):
        _cfg("rollout.engine.filter_low=0.9", "rollout.engine.filter_high=0.5")
    with pytest.raises(ConfigError, match="rollout.engine.filter_prior"):
        _cfg("rollout.engine.filter_prior=1,0")
    with pytest.raises(ConfigError, match="rollout.engine.max_extra_groups"):
        _cfg("rollout.engine.max_extra_groups=-1")
