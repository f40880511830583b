"""Arithmetic problems `a<op>b=` -> integer answer, generated without TensorFlow or TFDS.

Every problem is an index into the space ops x [0, 10**digits) x [0, 10**digits); drawing distinct
indices makes train and test disjoint by construction and lets us count the space exactly.
"""

from __future__ import annotations

import json

import numpy as np

from jaxrl.config import ConfigError

OPERATIONS = "+-*"


def canonical_operations(operations: str, allowed: str = OPERATIONS, field: str = "data.operations") -> str:
    """The set of operations in a fixed order, so '-+' and '+-' name (and build) the same data."""
    if not operations or not set(operations) <= set(allowed):
        raise ConfigError(f"{field}: got {operations!r}, expected a non-empty string over {allowed!r}")
    return "".join(op for op in allowed if op in operations)


def check_sizes(num_train: int, num_test: int) -> None:
    for field, n in (("data.num_train", num_train), ("data.num_test", num_test)):
        if n <= 0:
            raise ConfigError(f"{field}: got {n!r}, expected a positive integer (a split may not be empty)")


def check_space(digits: int, operations: str, n_total: int) -> int:
    """The number of distinct problems; raises ConfigError if the splits need more."""
    space = len(canonical_operations(operations)) * (10**digits) ** 2
    if n_total > space:
        raise ConfigError(
            f"data.num_train + data.num_test = {n_total} but only {space} distinct problems exist for "
            f"data.digits={digits}, data.operations={operations!r}; lower data.num_train/num_test or raise data.digits"
        )
    return space


def generate_splits(digits: int, operations: str, num_train: int, num_test: int, seed: int) -> dict[str, list[dict]]:
    """{'train': records, 'test': records}; each record has str fields id, prompt, answer, info."""
    if not 1 <= digits <= 6:
        raise ConfigError(f"data.digits: got {digits!r}, expected an integer in [1, 6]")
    ops = canonical_operations(operations)
    check_sizes(num_train, num_test)
    n_total = num_train + num_test
    space = check_space(digits, ops, n_total)
    rng = np.random.default_rng(seed)
    problem_ids = rng.choice(space, size=n_total, replace=False)  # distinct -> disjoint splits
    base = 10**digits
    op_index, a, b = problem_ids // (base * base), (problem_ids // base) % base, problem_ids % base
    # int64 is exact here: the largest product is (10**6 - 1)**2 < 2**63.
    results = {"+": a + b, "-": a - b, "*": a * b}
    answers = np.select([op_index == k for k in range(len(ops))], [results[op] for op in ops])
    rows = list(zip(op_index.tolist(), a.tolist(), b.tolist(), answers.tolist()))
    return {
        "train": [_record(f"train/{i}", ops[k], x, y, z) for i, (k, x, y, z) in enumerate(rows[:num_train])],
        "test": [_record(f"test/{i}", ops[k], x, y, z) for i, (k, x, y, z) in enumerate(rows[num_train:])],
    }


def _record(record_id: str, op: str, a: int, b: int, answer: int) -> dict:
    info = json.dumps({"a": a, "b": b, "op": op, "answer": answer})
    return {"id": record_id, "prompt": f"{a}{op}{b}=", "answer": str(answer), "info": info}
