"""Fallible teachers: plausible wrong demonstrations for the supervised warm start.

A base policy that imitated a teacher who is sometimes systematically wrong often knows the right
answer without preferring it: the situation RL post-training is for. The warm start mixes these
demonstrations in with probability `warmstart.teacher_error`.
"""

from __future__ import annotations

import json

from jaxrl.config import ConfigError
from jaxrl.data import long_addition


def carry_free_sum(a: int, b: int) -> int:
    """a + b computed digit by digit with every carry dropped: 64 + 69 -> 23 (4+9=13 -> 3, 6+6=12 -> 2)."""
    out, place = 0, 1
    while a or b:
        out += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def without_parentheses(expression: str) -> str:
    """A countdown answer written by a teacher who forgets parentheses: `(9-3)*7` -> `9-3*7` (= -12, not
    42). Expressions whose precedence needs no parentheses stay right: `25+3*7`."""
    return expression.replace("(", "").replace(")", "")


def fallible_answer(record: dict) -> str:
    """The answer a fallible teacher gives: for an addition record (arithmetic or long_addition) it
    forgets every carry; for a countdown record, every parenthesis."""
    info = json.loads(record["info"])
    if "target" in info and "numbers" in info:  # countdown
        return without_parentheses(record["answer"])
    if info.get("op") != "+":
        raise ConfigError(
            "warmstart.teacher_error: the fallible teacher is defined for addition (arithmetic, long_addition: "
            f"it forgets carries) and countdown (it forgets parentheses); record {record['id']!r} is neither"
        )
    if ":" in record.get("answer", ""):  # a worked long_addition solution: the same columns, every carry dropped
        return long_addition.solution(int(info["a"]), int(info["b"]), carries=False)
    return str(carry_free_sum(int(info["a"]), int(info["b"])))
