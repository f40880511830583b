"""Multi-turn episodes at their limits: an environment that raises, a 1 MB observation, max_turns,
the token budget, and the user mistakes EpisodeEngine refuses."""

import numpy as np
import pytest
from episode_helpers import CFG, RECORDS, TOK, CountEnv, P, T, engine, params, requests

from jaxrl.config import EngineConfig, SpeculativeConfig
from jaxrl.config.agent import AgentConfig
from jaxrl.rollout.episodes.driver import EpisodeEngine
from jaxrl.rollout.sampler import SamplingParams


def _run(make_env, **kw):
    eng = engine(slots=4, temperature=1.0, make_env=make_env, **kw)
    return eng, eng.run(params(), 0, requests(), 4, (2,))


def _cat(groups, field):
    return np.concatenate([getattr(g, field) for g in groups])


def test_an_environment_that_raises_ends_its_episode_counted_never_a_crash():
    eng, groups = _run(lambda: CountEnv(fail_at=2))
    errors, steps = _cat(groups, "env_errors_G"), _cat(groups, "tool_calls_G")
    turns = _cat(groups, "turns_G")
    assert errors.sum() >= 3 and set(errors) <= {0, 1}
    # The failing second step ended the episode: no reward for it, no observation after it, no third turn.
    assert np.all(turns[errors == 1] == 2) and np.all(steps[errors == 1] == 1)
    assert not (_cat(groups, "finished_G")[errors == 1].any() or _cat(groups, "truncated_G")[errors == 1].any())
    assert eng.stats["env_steps"] == steps.sum() + errors.sum()
    # Unaffected episodes are the ones a healthy environment gives (same seed, same keys).
    _, healthy = _run(CountEnv)
    ok = errors == 0
    np.testing.assert_array_equal(_cat(groups, "tokens_GxT")[ok], _cat(healthy, "tokens_GxT")[ok])
    np.testing.assert_array_equal(_cat(groups, "return_G")[ok], _cat(healthy, "return_G")[ok])


def test_a_huge_observation_is_cut_and_counted():
    _, groups = _run(lambda: CountEnv(obs="<" + "7" * 1_000_000 + ">"), max_obs_tokens=5)
    tokens, loss, cut = _cat(groups, "tokens_GxT"), _cat(groups, "loss_mask_GxT"), _cat(groups, "obs_cut_G")
    seven = TOK.encode("7")[0]
    for row in range(len(tokens)):
        obs = [t for t, m in zip(tokens[row], loss[row]) if m == 0 and t != TOK.pad_id]
        # Each observation: its first 5 tokens "<7777" (or fewer where the budget ends), never more.
        n_obs = cut[row]
        assert len(obs) <= 5 * n_obs and obs[:1] in ([], [TOK.encode("<")[0]])
        assert all(t == seven for i, t in enumerate(obs) if i % 5)
    assert cut.sum() >= 5  # every observation of a going episode was cut


def test_max_turns_truncates():
    _, groups = _run(CountEnv, max_turns=1)
    turns, trunc, fin = _cat(groups, "turns_G"), _cat(groups, "truncated_G"), _cat(groups, "finished_G")
    assert np.all(turns == 1) and np.all(_cat(groups, "loss_mask_GxT")[:, :1] == 1)
    # Nothing after the first turn: the loss mask has no zero before the last model token.
    for row in _cat(groups, "loss_mask_GxT"):
        assert np.all(np.diff(row) <= 0)
    # Records asking for more turns: an episode whose first turn ended with "]" was cut by max_turns
    # (truncated); EOS finishes it. Record 3 asks for one turn: its "]" step says done (finished).
    tokens, loss = _cat(groups, "tokens_GxT"), _cat(groups, "loss_mask_GxT")
    last = tokens[np.arange(len(tokens)), loss.sum(1).astype(int) - 1]
    many = np.repeat([r["turns"] > 1 for r in RECORDS], 4)
    eot = last == TOK.encode("]")[0]
    assert np.all(trunc[many & eot]) and np.all(fin[~many & eot]) and np.all(fin[last == TOK.eos_id])
    assert (many & eot).sum() >= 3 and np.all(trunc != fin)


@pytest.mark.slow
def test_the_token_budget_counts_observations_and_truncates():
    eng, groups = _run(CountEnv, max_new_tokens=12)
    tokens = _cat(groups, "tokens_GxT")
    assert tokens.shape[1] == 12
    full = np.all(tokens != TOK.pad_id, axis=1) & ~np.any(tokens == TOK.eos_id, axis=1)
    trunc = _cat(groups, "truncated_G")
    assert full.sum() >= 5 and np.all(trunc[full] | _cat(groups, "finished_G")[full])
    # An episode whose buffer ends inside an observation was cut by the budget (its obs partly kept).
    obs_at_end = full & (_cat(groups, "loss_mask_GxT")[:, -1] == 0)
    assert np.all(trunc[obs_at_end])


def test_user_mistakes_name_the_field():
    with pytest.raises(ValueError, match="end_of_turn '\\]\\]'.*exactly one token"):
        engine(eot="]]")
    with pytest.raises(ValueError, match="end_of_turn '!'"):
        engine(eot="!")
    with pytest.raises(ValueError, match="rollout.speculative.enabled"):
        engine(speculative=SpeculativeConfig(enabled=True))
    for field in ("eos_id", "pad_id"):  # the episodes end and pad with the tokenizer's ids
        wrong = {"eos_id": TOK.eos_id, "pad_id": TOK.pad_id, field: 99}
        with pytest.raises(ValueError, match=f"sampling.{field}: got 99, the tokenizer's is"):
            EpisodeEngine(
                CFG,
                EngineConfig(slots=3, chunk=4),
                AgentConfig(),
                make_env=CountEnv,
                tokenizer=TOK,
                end_of_turn="]",
                prompt_len=P,
                sampling=SamplingParams(max_new_tokens=T, **wrong),
            )
    long = [("x", {"id": "too-long", "prompt": "1" * P, "turns": 1})]  # BOS + P tokens > P
    with pytest.raises(ValueError, match="'too-long'"):
        engine().run(params(), 0, long, 1, (0,))
