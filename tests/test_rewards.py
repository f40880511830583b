"""Verifiers, the safe countdown evaluator, and failure isolation in score()."""

import json
import math
from fractions import Fraction

import numpy as np
import pytest

from jaxrl.data import countdown
from jaxrl.data.rewards import (
    REWARD_NAMES,
    ExpressionError,
    evaluate,
    parse_expression,
    score,
    uses_allowed_numbers,
    verify_arithmetic,
    verify_countdown,
)


def _arith(answer):
    return {"id": "t/0", "prompt": "?", "answer": answer, "info": json.dumps({"answer": int(answer)})}


def _cd(numbers, target):
    return {
        "id": "t/0",
        "prompt": countdown.format_prompt(numbers, target),
        "answer": "",
        "info": json.dumps({"numbers": numbers, "target": target}),
    }


def test_reward_names():
    assert REWARD_NAMES == ("correctness", "format")


@pytest.mark.parametrize(
    "text, finished, answer, expected",
    [
        ("95", True, "95", (1.0, 1.0)),
        (" 95 ", True, "95", (1.0, 1.0)),
        ("95", False, "95", (1.0, 0.0)),  # right digits, but never stopped
        ("-21", True, "-21", (1.0, 1.0)),
        ("21", True, "-21", (0.0, 1.0)),
        ("095", True, "95", (0.0, 0.0)),
        ("9+5", True, "14", (0.0, 0.0)),
        ("", True, "0", (0.0, 0.0)),
        ("-0", True, "0", (0.0, 0.0)),
        ("0", True, "0", (1.0, 1.0)),
    ],
)
def test_verify_arithmetic(text, finished, answer, expected):
    assert verify_arithmetic(text, finished, _arith(answer)) == expected


@pytest.mark.parametrize(
    "text, value",
    [
        ("2+3*4", 14),
        ("(2+3)*4", 20),
        ("2*3+4", 10),
        ("8-4-2", 2),
        ("8-(4-2)", 6),
        ("8/4/2", 1),
        ("8/(4/2)", 4),
        ("7/2", Fraction(7, 2)),
        (" ( 1 + 2 ) * ( 3 + 4 ) ", 21),
        ("((((5))))", 5),
    ],
)
def test_evaluator_precedence_and_parentheses(text, value):
    assert evaluate(parse_expression(text)) == value


@pytest.mark.parametrize(
    "text",
    ["", "2+", "(2+3", "2+3)", "-3+5", "2**3", "2 3", "07+1", "__import__('os')", "1;2", "²+1", "x", "()"],
)
def test_parser_rejects(text):
    with pytest.raises(ExpressionError):
        parse_expression(text)


def test_parser_bounds_untrusted_text():
    with pytest.raises(ExpressionError, match="nested deeper"):
        parse_expression("(" * 100 + "1" + ")" * 100)
    with pytest.raises(ExpressionError, match="longer than"):
        parse_expression("1+" * 200 + "1")
    with pytest.raises(ExpressionError, match="bad integer literal"):
        parse_expression("9" * 40)


def test_uses_allowed_numbers_is_multiset_at_most_once():
    assert uses_allowed_numbers([3, 7], [3, 7, 25])
    assert uses_allowed_numbers([3, 3], [3, 3, 7])
    assert not uses_allowed_numbers([3, 3], [3, 7, 25])
    assert not uses_allowed_numbers([4], [3, 7, 25])


@pytest.mark.parametrize(
    "text, finished, numbers, target, expected",
    [
        ("25+3*7", True, [3, 7, 25], 46, (1.0, 1.0)),
        ("(25+3)*7", True, [3, 7, 25], 196, (1.0, 1.0)),
        ("25+3*7", True, [3, 7, 25], 47, (0.0, 1.0)),  # wrong value
        ("25+21", True, [3, 7, 25], 46, (0.0, 1.0)),  # 21 is not given
        ("25+7+7+7", True, [3, 7, 25], 46, (0.0, 1.0)),  # 7 reused
        ("3*7+25", False, [3, 7, 25], 46, (1.0, 0.0)),  # right but not EOS-terminated
        ("25+21", True, [25, 21, 3], 46, (1.0, 1.0)),  # a subset is enough
        ("5/(3-3)", True, [5, 3, 3], 1, (0.0, 1.0)),  # division by zero: no crash
        ("9/2*2", True, [9, 2, 2], 9, (1.0, 1.0)),  # exact rationals, not integer division
        ("9/2", True, [9, 2, 1], 4, (0.0, 1.0)),
        ("__import__('os')", True, [3, 7, 25], 46, (0.0, 0.0)),
        ("__import__('os').system('echo pwned')", True, [3, 7, 25], 46, (0.0, 0.0)),
        ("46", True, [3, 7, 25], 46, (0.0, 1.0)),
        ("", True, [3, 7, 25], 46, (0.0, 0.0)),
    ],
)
def test_verify_countdown(text, finished, numbers, target, expected):
    assert verify_countdown(text, finished, _cd(numbers, target)) == expected


def test_countdown_reference_answers_verify():
    splits = countdown.generate_splits(2, "+-*/", 200, 50, seed=2)
    records = splits["train"] + splits["test"]
    rewards, n_failed = score(verify_countdown, [r["answer"] for r in records], [True] * len(records), records)
    assert n_failed == 0
    assert rewards.shape == (250, 2) and (rewards == 1.0).all()
    assert any("/" in r["answer"] for r in records) and any("(" in r["answer"] for r in records)


def test_score_isolates_raising_and_non_finite_verifiers():
    def flaky(text, finished, record):
        if text == "raise":
            raise RuntimeError("bug in reward")
        if text == "nan":
            return (math.nan, 1.0)
        if text == "inf":
            return (1.0, 1e300)  # finite in float64, inf in float32
        if text == "short":
            return (1.0,)
        return (1.0, 0.5)

    texts = ["ok", "raise", "nan", "inf", "short", "ok"]
    records = [_arith("1")] * len(texts)
    rewards, n_failed = score(flaky, texts, [True] * len(texts), records)
    assert rewards.dtype == np.float32 and rewards.shape == (6, 2)
    assert n_failed == 4
    np.testing.assert_array_equal(rewards, [[1, 0.5], [0, 0], [0, 0], [0, 0], [0, 0], [1, 0.5]])


def test_score_survives_malformed_records():
    good = _arith("7")
    rewards, n_failed = score(verify_arithmetic, ["7", "7"], [True, True], [good, {"id": "broken"}])
    assert n_failed == 1
    np.testing.assert_array_equal(rewards, [[1, 1], [0, 0]])


def test_score_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="2 completions, 1 finished"):
        score(verify_arithmetic, ["1", "2"], [True], [_arith("1"), _arith("2")])
