"""Verifiers: per-sample reward functions, and `score`, which turns them into a rewards_BxK array.

A verifier is `verifier(completion, finished, record) -> (correctness, format)` where `completion` is
the decoded, EOS-stopped text, `finished` says whether the sample emitted EOS, and `record` is the
prompt's dataset record (str fields id, prompt, answer, info). `score` isolates failures: a verifier
that raises or returns a non-finite value zeroes that sample and is counted, so a reward function can
never stop training.

Countdown completions are evaluated by a tiny recursive-descent parser over exact rationals
(fractions.Fraction); user text never reaches eval/exec/ast.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Protocol, runtime_checkable

import numpy as np

REWARD_NAMES = ("correctness", "format")
_INTEGER = re.compile(r"-?(0|[1-9][0-9]*)")
# ASCII only: str.isdigit() would also accept digits like '²' that int() rejects.
_TOKEN = re.compile(r"([0-9]+)|([-+*/()])|([ \t\n]+)|(.)", re.DOTALL)
# Bounds on untrusted text: completions are short, and these keep parsing and evaluation cheap.
MAX_EXPRESSION_CHARS = 256
MAX_NESTING = 32
MAX_LITERAL_DIGITS = 12


class Verifier(Protocol):
    def __call__(self, completion: str, finished: bool, record: Mapping[str, str]) -> Sequence[float]: ...


@runtime_checkable
class BatchVerifier(Protocol):
    """A verifier that scores a step's rows together (a reward model's one forward, jaxrl.rewards):
    `score_batch` returns what `score` would, (rewards_BxK, failures), with its own columns."""

    def __call__(self, completion: str, finished: bool, record: Mapping[str, str]) -> Sequence[float]: ...

    def score_batch(
        self, completions: list[str], finished: list[bool], records: Sequence[Mapping[str, str]]
    ) -> tuple[np.ndarray, int]: ...


def score(
    verifier: Verifier, completions: list[str], finished: list[bool], records: Sequence[Mapping[str, str]]
) -> tuple[np.ndarray, int]:
    """(rewards_BxK float32 with columns REWARD_NAMES, number of samples whose verifier failed)."""
    if not len(completions) == len(finished) == len(records):
        raise ValueError(
            f"score: got {len(completions)} completions, {len(finished)} finished flags, {len(records)} records"
        )
    rewards_BxK = np.zeros((len(completions), len(REWARD_NAMES)), dtype=np.float32)
    n_failed = 0
    for b, (text, done, record) in enumerate(zip(completions, finished, records)):
        try:
            with np.errstate(over="ignore", invalid="ignore"):  # huge values become inf, caught below
                values_K = np.asarray(verifier(text, bool(done), record), dtype=np.float32)
        except Exception:  # any reward bug must cost one sample, not the run
            n_failed += 1
            continue
        if values_K.shape != (len(REWARD_NAMES),) or not np.all(np.isfinite(values_K)):
            n_failed += 1
            continue
        rewards_BxK[b] = values_K
    return rewards_BxK, n_failed


# ---------------------------------------------------------------------------------------------
# Arithmetic


def verify_arithmetic(completion: str, finished: bool, record: Mapping[str, str]) -> tuple[float, float]:
    """Correct iff the text (surrounding spaces stripped) equals the answer; formatted iff it is an
    integer literal (no leading zeros, no '-0') terminated by EOS."""
    text = completion.strip()
    correct = float(text == record["answer"].strip())
    well_formed = bool(_INTEGER.fullmatch(text)) and text != "-0"
    return correct, float(well_formed and finished)


# ---------------------------------------------------------------------------------------------
# Countdown
#
# Grammar (no unary minus, no leading zeros, spaces allowed between tokens):
#   expr   := term (('+' | '-') term)*
#   term   := factor (('*' | '/') factor)*
#   factor := INTEGER | '(' expr ')'
# A parsed expression is a tree of tuples: ('num', n) or (op, left, right).


class ExpressionError(ValueError):
    """The text is not an expression of the grammar above."""


def tokenize_expression(text: str) -> list[str]:
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    tokens = []
    for number, symbol, space, other in _TOKEN.findall(text):
        if other:
            raise ExpressionError(f"unexpected character {other!r}")
        if not space:
            tokens.append(number or symbol)
    return tokens


def parse_expression(text: str) -> tuple:
    tokens = tokenize_expression(text)
    if not tokens:
        raise ExpressionError("empty expression")
    tree, pos = _parse_sum(tokens, 0, 0)
    if pos != len(tokens):
        raise ExpressionError(f"unexpected {tokens[pos]!r} at token {pos}")
    return tree


def _parse_sum(tokens: list[str], pos: int, depth: int) -> tuple[tuple, int]:
    tree, pos = _parse_product(tokens, pos, depth)
    while pos < len(tokens) and tokens[pos] in "+-":
        op = tokens[pos]
        right, pos = _parse_product(tokens, pos + 1, depth)
        tree = (op, tree, right)
    return tree, pos


def _parse_product(tokens: list[str], pos: int, depth: int) -> tuple[tuple, int]:
    tree, pos = _parse_factor(tokens, pos, depth)
    while pos < len(tokens) and tokens[pos] in "*/":
        op = tokens[pos]
        right, pos = _parse_factor(tokens, pos + 1, depth)
        tree = (op, tree, right)
    return tree, pos


def _parse_factor(tokens: list[str], pos: int, depth: int) -> tuple[tuple, int]:
    if pos >= len(tokens):
        raise ExpressionError("expression ends early")
    token = tokens[pos]
    if token == "(":
        if depth >= MAX_NESTING:
            raise ExpressionError(f"parentheses nested deeper than {MAX_NESTING}")
        tree, pos = _parse_sum(tokens, pos + 1, depth + 1)
        if pos >= len(tokens) or tokens[pos] != ")":
            raise ExpressionError("missing ')'")
        return tree, pos + 1
    if token[0] in "0123456789":
        if len(token) > MAX_LITERAL_DIGITS or (len(token) > 1 and token[0] == "0"):
            raise ExpressionError(f"bad integer literal {token!r}")
        return ("num", int(token)), pos + 1
    raise ExpressionError(f"unexpected {token!r} at token {pos}")


def literals(tree: tuple) -> list[int]:
    if tree[0] == "num":
        return [tree[1]]
    return literals(tree[1]) + literals(tree[2])


def evaluate(tree: tuple) -> Fraction:
    """Exact value; raises ZeroDivisionError on division by zero."""
    if tree[0] == "num":
        return Fraction(tree[1])
    a, b = evaluate(tree[1]), evaluate(tree[2])
    op = tree[0]
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a / b


def uses_allowed_numbers(used: list[int], given: list[int]) -> bool:
    """Each provided number used at most once (as a multiset), and no other numbers."""
    remaining = list(given)
    for n in used:
        if n not in remaining:
            return False
        remaining.remove(n)
    return True


def verify_countdown(completion: str, finished: bool, record: Mapping[str, str]) -> tuple[float, float]:
    """Correct iff the expression uses each provided number at most once and no other numbers, and
    evaluates exactly to the target; formatted iff it parses and is terminated by EOS."""
    info = json.loads(record["info"])
    try:
        tree = parse_expression(completion)
    except ExpressionError:
        return 0.0, 0.0
    well_formed = float(finished)
    # Check numbers before evaluating, so only the given (small) numbers are ever multiplied.
    if not uses_allowed_numbers(literals(tree), info["numbers"]):
        return 0.0, well_formed
    try:
        value = evaluate(tree)
    except ZeroDivisionError:
        return 0.0, well_formed
    return float(value == info["target"]), well_formed


# ---------------------------------------------------------------------------------------------
# Long addition (jaxrl.data.long_addition): column steps `d+d+c=s`, ones first, then `:answer`.

_COLUMN_STEP = r"[0-9]\+[0-9]\+[01]=(1[0-9]|[0-9])"
_WORKED_SUM = re.compile(rf"{_COLUMN_STEP}(,{_COLUMN_STEP})*:(0|[1-9][0-9]*)")


def verify_long_addition(completion: str, finished: bool, record: Mapping[str, str]) -> tuple[float, float]:
    """Correct iff the text after the last ':' (spaces stripped) is the sum, written without leading
    zeros; formatted iff the whole text is column steps then ':answer' (the grammar, not the
    arithmetic of each step) and is terminated by EOS."""
    _, colon, answer = completion.rpartition(":")
    correct = bool(colon) and answer.strip() == str(json.loads(record["info"])["answer"])
    well_formed = bool(_WORKED_SUM.fullmatch(completion.strip()))
    return float(correct), float(well_formed and finished)


# ---------------------------------------------------------------------------------------------
# Final answers: what each verifier judges, read the same way (maj@k votes with them: jaxrl.eval).


def arithmetic_answer(completion: str) -> str | None:
    """verify_arithmetic compares the stripped text with the answer."""
    return completion.strip() or None


def long_addition_answer(completion: str) -> str | None:
    """verify_long_addition reads the text after the last ':'."""
    _, colon, answer = completion.rpartition(":")
    return answer.strip() if colon and answer.strip() else None


def countdown_answer(completion: str) -> str | None:
    """The expression, spaces removed, when it parses (verify_countdown judges the parsed expression)."""
    try:
        parse_expression(completion)
    except ExpressionError:
        return None
    return "".join(completion.split())
