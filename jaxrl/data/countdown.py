"""Countdown problems: reach a target from given numbers with + - * /, e.g. prompt `3,7,25:46=` and
reference answer `25+3*7`. Generated without TensorFlow or TFDS.

Solvability is guaranteed by construction: a random expression over the numbers is built first and
its value becomes the target. The reference keeps every intermediate value a positive integer (the
classic rule), although the verifier only checks the final value with exact rational arithmetic.
"""

from __future__ import annotations

import json
import random

from jaxrl.config import ConfigError
from jaxrl.data.arithmetic import canonical_operations, check_sizes

OPERATIONS = "+-*/"
NUM_NUMBERS = 3  # with digits=2 the longest prompt `99,99,99:999=` plus BOS is 14 tokens
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_ATOM = 3
# Stop sampling after this many draws in a row yield nothing new: the space is (nearly) exhausted.
_PATIENCE = 20_000


def generate_splits(
    digits: int, operations: str, num_train: int, num_test: int, seed: int, num_numbers: int = NUM_NUMBERS
) -> dict[str, list[dict]]:
    """{'train': records, 'test': records} with str fields id, prompt, answer, info.

    Numbers are in [1, 10**digits - 1]; targets in [1, 10**(digits + 1) - 1]. Problems are distinct by
    (sorted numbers, target), so a test problem is never a reordering of a train problem.
    """
    if not 1 <= digits <= 6:
        raise ConfigError(f"data.digits: got {digits!r}, expected an integer in [1, 6]")
    if num_numbers < 2:
        raise ValueError(f"countdown needs at least 2 numbers, got num_numbers={num_numbers}")
    ops = canonical_operations(operations, OPERATIONS)
    check_sizes(num_train, num_test)
    n_total = num_train + num_test
    max_number, max_target = 10**digits - 1, 10 ** (digits + 1) - 1
    rnd = random.Random(seed)
    seen: set[tuple] = set()
    problems: list[tuple[list[int], int, str]] = []
    misses = 0
    while len(problems) < n_total and misses < _PATIENCE:
        numbers = [rnd.randint(1, max_number) for _ in range(num_numbers)]
        order = rnd.sample(numbers, len(numbers))
        made = _random_expression(order, ops, rnd)
        key = (tuple(sorted(numbers)), made[2] if made else None)
        if made is None or not 1 <= made[2] <= max_target or key in seen:
            misses += 1
            continue
        misses = 0
        seen.add(key)
        problems.append((numbers, made[2], made[0]))
    if len(problems) < n_total:
        raise ConfigError(
            f"data.num_train + data.num_test = {n_total} but only {len(problems)} distinct countdown problems "
            f"were found for data.digits={digits}, data.operations={ops!r} ({num_numbers} numbers); "
            "lower data.num_train/num_test or raise data.digits"
        )
    return {
        "train": [_record(f"train/{i}", *p) for i, p in enumerate(problems[:num_train])],
        "test": [_record(f"test/{i}", *p) for i, p in enumerate(problems[num_train:])],
    }


def format_prompt(numbers: list[int], target: int) -> str:
    return ",".join(str(n) for n in numbers) + f":{target}="


def _record(record_id: str, numbers: list[int], target: int, expression: str) -> dict:
    info = json.dumps({"numbers": numbers, "target": target})
    return {"id": record_id, "prompt": format_prompt(numbers, target), "answer": expression, "info": info}


def _random_expression(numbers: list[int], ops: str, rnd: random.Random) -> tuple[str, int, int] | None:
    """(text, precedence, value) of a random binary expression using every number once, or None if an
    intermediate value is not a positive integer."""
    if len(numbers) == 1:
        return str(numbers[0]), _ATOM, numbers[0]
    split = rnd.randint(1, len(numbers) - 1)
    left = _random_expression(numbers[:split], ops, rnd)
    right = _random_expression(numbers[split:], ops, rnd)
    op = rnd.choice(ops)
    if left is None or right is None:
        return None
    value = _apply(op, left[2], right[2])
    if value is None:
        return None
    prec = _PRECEDENCE[op]
    # Minimal parentheses: a right operand of equal precedence needs them only under - and /.
    left_text = f"({left[0]})" if left[1] < prec else left[0]
    right_text = f"({right[0]})" if right[1] < prec or (right[1] == prec and op in "-/") else right[0]
    return left_text + op + right_text, prec, value


def _apply(op: str, a: int, b: int) -> int | None:
    if op == "+":
        value = a + b
    elif op == "-":
        value = a - b
    elif op == "*":
        value = a * b
    else:
        if a % b:
            return None
        value = a // b
    return value if value > 0 else None
