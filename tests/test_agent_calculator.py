"""agent_calculator: the safe calculator, episodes by hand, the fallible teacher replayed through a real
environment, and the task records."""

import numpy as np
import pytest

from jaxrl.agents.calculator import SUITE, CalculatorEnv, calculate, records, teacher
from jaxrl.agents.env import AGENT_ALPHABET
from jaxrl.agents.tools import ToolError
from jaxrl.config import AgentConfig
from jaxrl.data.registry import get_task
from jaxrl.data.tokenizer import CharTokenizer

RECORD = {"id": "123*456", "prompt": "123*456=", "expression": "123*456", "answer": "56088"}


@pytest.mark.parametrize(
    "expression, value",
    [
        ("123*456", "56088"),  # 123*400 + 123*56 = 49200 + 6888
        ("2+3*4", "14"),
        ("(2+3)*4", "20"),
        ("10-4-3", "3"),  # left-associative: (10-4)-3
        ("-(2+3)*4-5", "-25"),
        ("2*-3", "-6"),
        (" 7 * ( 1 + 1 ) ", "14"),
        ("999*999", "998001"),
    ],
)
def test_calculate(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression", ["", "1/2", "2**3", "1+", "(1+2", "1+2)", "__import__('os')", "1e3", "1" * 65, "٣*2"]
)
def test_calculate_rejects_what_it_does_not_evaluate(expression):
    with pytest.raises(ToolError):
        calculate(expression)


def _env():
    env = CalculatorEnv()
    assert env.reset(RECORD, np.random.default_rng(0)) == "123*456="
    return env


def test_episode_with_the_tool_and_the_right_answer():
    env = _env()
    call = env.step("[calc 123*456]")
    assert call == (">56088\n", 0.0, False, {"tool_calls": 1, "tool_errors": 0, "tool_truncated": 0})
    final = env.step("56088")
    assert (final.observation, final.reward, final.done, final.info["success"]) == ("", 1.0, True, True)
    assert final.info["tool_calls"] == 0


@pytest.mark.parametrize("answer", ["56087", "56088 7", "", "5608", "=56088"])
def test_wrong_final_answer_scores_zero(answer):
    result = _env().step(answer)
    assert (result.reward, result.done, result.info["success"]) == (0.0, True, False)


@pytest.mark.parametrize(
    "turn, observation",
    [
        ("[calc 1+]", ">error: expression ends early\n"),
        ("[calc 1/2]", ">error: unexpected _/_ at 1\n"),
        ("[sqrt 4]", ">error: unknown tool sqrt\n"),
        ("calc 1]", ">error: bad call, expected [tool argument]\n"),
    ],
)
def test_bad_calls_are_counted_and_the_episode_goes_on(turn, observation):
    env = _env()
    result = env.step(turn)
    assert result == (observation, 0.0, False, {"tool_calls": 1, "tool_errors": 1, "tool_truncated": 0})
    assert set(result.observation) <= set(AGENT_ALPHABET)
    assert env.step("[calc 123*456]").observation == ">56088\n"
    assert env.step("56088").reward == 1.0


def _replay(record, segments):
    """Play the teacher's model segments through a fresh env; its observations must be the env's."""
    env = CalculatorEnv()
    text, reward, done = env.reset(record, np.random.default_rng(0)), 0.0, False
    pending = None
    for segment, by_model in segments:
        if by_model:
            assert not done
            result = env.step(segment)
            pending, reward, done = result.observation, reward + result.reward, result.done
        else:
            assert segment == pending
        text += segment
    assert done  # the last segment is the final answer
    return text, reward


def test_teacher_transcripts_replay_to_the_right_reward():
    tok = CharTokenizer(alphabet=AGENT_ALPHABET)
    rng = np.random.default_rng(7)
    for record in records("train", 50, seed=3):
        good = teacher(record, rng, error_rate=0.0)
        assert [s for s, _ in good] == [f"[calc {record['expression']}]", f">{record['answer']}\n", record["answer"]]
        text, reward = _replay(record, good)
        assert reward == 1.0
        # every character is a token of the char model; a whole episode (+ EOS) fits 40 new tokens
        assert len(tok.encode(text)) - len(record["prompt"]) + 1 <= 40
        guess = teacher(record, rng, error_rate=1.0)
        assert len(guess) == 1 and guess[0][1] and guess[0][0] != record["answer"]
        assert len(guess[0][0]) == len(record["answer"]) and "[" not in guess[0][0]
        assert _replay(record, guess)[1] == 0.0
        tok.encode(guess[0][0])


def test_wrong_guesses_are_plausible_and_never_right():
    rng = np.random.default_rng(0)
    guesses = [teacher(RECORD, rng, error_rate=1.0)[0][0] for _ in range(5000)]
    # 5000 draws of 3 digits: about 5 would hit "088" if a guess could equal the answer
    assert all(g != "56088" and len(g) == 5 and g.startswith("56") for g in guesses)
    assert len(set(guesses)) > 900  # the last three digits vary


def test_teacher_error_rate():
    rng = np.random.default_rng(0)
    record = records("train", 1, seed=0)[0]
    guesses = sum(len(teacher(record, rng, 0.3)) == 1 for _ in range(2000))
    assert abs(guesses / 2000 - 0.3) < 0.035  # 3.4 sigma: sqrt(0.3 * 0.7 / 2000) = 0.0102


def test_records_are_deterministic_distinct_and_the_splits_disjoint():
    train, test = records("train", 3000, seed=1), records("test", 1000, seed=1)
    assert train == records("train", 3000, seed=1) and train != records("train", 3000, seed=2)
    assert len({r["id"] for r in train}) == 3000 and len({r["id"] for r in test}) == 1000
    other_seed_test = {r["id"] for r in records("test", 1000, seed=9)}
    assert not {r["id"] for r in train} & ({r["id"] for r in test} | other_seed_test)
    for r in train[:200] + test[:200]:
        a, b = map(int, r["expression"].split("*"))
        assert 100 <= a <= 999 and 100 <= b <= 999 and r["answer"] == str(a * b)
        assert r["prompt"] == r["expression"] + "=" and len(r["prompt"]) <= 16
        assert all(isinstance(v, str) for v in r.values())
    with pytest.raises(ValueError, match="split"):
        records("valid", 1, seed=0)


def test_suite_is_registered():
    suite = get_task("agent_calculator").suite
    assert suite is SUITE and suite.end_of_turn == "]" and suite.alphabet == AGENT_ALPHABET
    assert isinstance(suite.make(AgentConfig()), CalculatorEnv)
