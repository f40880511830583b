"""Long addition written out column by column: a task whose completions have long-tailed lengths.

Prompt `4735+968=`; reference completion, one step per column from the ones column up, each step
`digit+digit+carry_in=column_sum`, then `:` and the final answer:

    5+8+0=13,3+6+1=10,7+9+1=17,4+0+1=5:5703

A column beyond the shorter operand uses digit 0; every character is in DEFAULT_ALPHABET. A solution of
n columns has between 9n and 10n+1 characters; n (digits of the longer operand) is drawn with
probability proportional to LENGTH_DECAY**(n-1), so most problems are short and a few are long.
"""

from __future__ import annotations

import json
import random

from jaxrl.config import ConfigError
from jaxrl.data.arithmetic import check_sizes

OPERATIONS = "+"
MAX_DIGITS = 8  # the prompt `99999999+99999999=` plus BOS is 19 tokens; the longest solution 81 + EOS
LENGTH_DECAY = 0.75
# Stop sampling after this many draws in a row yield nothing new: the space is (nearly) exhausted.
_PATIENCE = 20_000


def column_steps(a: int, b: int, carries: bool = True) -> tuple[list[str], str]:
    """The worked columns of a + b, ones first, and the answer they spell:
    57+68 -> (['7+8+0=15', '5+6+1=12'], '125'). With carries=False every carry is dropped, as a
    fallible teacher does: (['7+8+0=15', '5+6+0=11'], '15')."""
    steps, digits, carry = [], "", 0
    for i in range(max(len(str(a)), len(str(b)))):
        da, db = a // 10**i % 10, b // 10**i % 10
        total = da + db + carry
        steps.append(f"{da}+{db}+{carry}={total}")
        carry, digits = (total // 10 if carries else 0), str(total % 10) + digits
    answer = (str(carry) if carry else "") + digits
    return steps, str(int(answer))  # int(): a dropped carry may leave leading zeros ('0+0+0=0' is '0')


def solution(a: int, b: int, carries: bool = True) -> str:
    """The reference completion: 57+68 -> '7+8+0=15,5+6+1=12:125' (carries=False: '...5+6+0=11:15')."""
    steps, answer = column_steps(a, b, carries)
    return ",".join(steps) + f":{answer}"


def format_prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def _random_operand(n_digits: int, rnd: random.Random) -> int:
    low = 0 if n_digits == 1 else 10 ** (n_digits - 1)
    return rnd.randint(low, 10**n_digits - 1)


def _random_problem(digits: int, rnd: random.Random) -> tuple[int, int]:
    weights = [LENGTH_DECAY**k for k in range(digits)]
    n_long = rnd.choices(range(1, digits + 1), weights)[0]
    long_, short = _random_operand(n_long, rnd), _random_operand(rnd.randint(1, n_long), rnd)
    return (long_, short) if rnd.random() < 0.5 else (short, long_)


def generate_splits(digits: int, operations: str, num_train: int, num_test: int, seed: int) -> dict[str, list[dict]]:
    """{'train': records, 'test': records} with str fields id, prompt, answer (the worked solution), info.

    Problems are distinct ordered pairs (a, b), so train and test are disjoint.
    """
    if not 1 <= digits <= MAX_DIGITS:
        raise ConfigError(f"data.digits: got {digits!r}, expected an integer in [1, {MAX_DIGITS}] for long_addition")
    if operations != OPERATIONS:
        raise ConfigError(f"data.operations: got {operations!r}, expected '+' (long_addition is addition only)")
    check_sizes(num_train, num_test)
    n_total = num_train + num_test
    rnd = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    problems: list[tuple[int, int]] = []
    misses = 0
    while len(problems) < n_total and misses < _PATIENCE:
        pair = _random_problem(digits, rnd)
        if pair in seen:  # only the few 1- and 2-column problems run out
            misses += 1
            continue
        misses = 0
        seen.add(pair)
        problems.append(pair)
    if len(problems) < n_total:
        raise ConfigError(
            f"data.num_train + data.num_test = {n_total} but only {len(problems)} distinct long_addition problems "
            f"were found for data.digits={digits}; lower data.num_train/num_test or raise data.digits"
        )
    return {
        "train": [_record(f"train/{i}", a, b) for i, (a, b) in enumerate(problems[:num_train])],
        "test": [_record(f"test/{i}", a, b) for i, (a, b) in enumerate(problems[num_train:])],
    }


def _record(record_id: str, a: int, b: int) -> dict:
    info = json.dumps({"a": a, "b": b, "op": "+", "answer": a + b})
    return {"id": record_id, "prompt": format_prompt(a, b), "answer": solution(a, b), "info": info}
