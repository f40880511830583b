"""Preference pairs {"prompt", "chosen", "rejected"}: read from a JSONL file (every bad line an error
naming the file and line), or made by a synthetic generator for tests and demos, then tokenised into
the fixed-width arrays the reward model trains on.

Synthetic generators (reward_model.synthetic), prompts from the arithmetic task (`a+b=`, train and
test prompts disjoint by construction, jaxrl.data.arithmetic):
  arithmetic  chosen: the right answer; rejected: a wrong one (`wrong_sum`): its carries dropped (the
              warm-started policy's typical mistake), off by 1..10, a spurious carry, a digit added or dropped
  even_last   a hidden rule (`even_last_rule`): the chosen text is 1-3 random digits ending in an even
              one; the rejected one ends in an odd digit, or a non-digit, or is empty (without those
              two, RL against the model found the empty answer it had never seen scored high)
"""

from __future__ import annotations

import json
import pathlib
from typing import NamedTuple

import numpy as np

from jaxrl.config import ConfigError
from jaxrl.data import arithmetic
from jaxrl.rewards.model import encode_sequences

FIELDS = ("prompt", "chosen", "rejected")
# even_last's rejected endings: an odd digit (5 in 8), no text at all ("e": 1 in 8), a non-digit ("x": 2 in 8)
ODD_ENDS = "13579exx"
NOT_DIGITS = "+-*/()=,:"


class Pair(NamedTuple):
    prompt: str
    chosen: str
    rejected: str
    where: str  # "file:line" or "synthetic <kind> pair <i> of <split>": what an error about this pair names


def read_pairs(path: str | pathlib.Path, limit: int, field: str = "reward_model.pairs_file") -> list[Pair]:
    """At most `limit` pairs of a JSONL file, one {"prompt", "chosen", "rejected"} object (strings) a
    line; blank lines are skipped. A missing file or a bad line is a ConfigError naming it."""
    path = pathlib.Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"{field}: file {str(path)!r} not found")
    pairs: list[Pair] = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if len(pairs) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{field}: {where}: not a JSON object ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ConfigError(f"{field}: {where}: got a JSON {type(obj).__name__}, expected an object")
            missing = [k for k in FIELDS if k not in obj]
            if missing:
                raise ConfigError(f"{field}: {where}: missing {', '.join(map(repr, missing))} (needs {FIELDS})")
            bad = [k for k in FIELDS if not isinstance(obj[k], str)]
            if bad:
                raise ConfigError(f"{field}: {where}: {bad[0]!r} is a {type(obj[bad[0]]).__name__}, expected a string")
            pairs.append(Pair(obj["prompt"], obj["chosen"], obj["rejected"], where))
    if not pairs:
        raise ConfigError(f"{field}: {path} holds no pairs")
    return pairs


def carry_dropped(a: int, b: int) -> int:
    """a + b with every carry forgotten (each column's digit sum mod 10)."""
    out, scale = 0, 1
    while a or b:
        out += ((a % 10 + b % 10) % 10) * scale
        a, b, scale = a // 10, b // 10, scale * 10
    return out


def wrong_sum(right: int, a: int, b: int, rng: np.random.Generator) -> int:
    """A wrong answer to a + b = right, one of four mistakes drawn uniformly: the carries dropped (when
    that changes the sum, else the next kind), right +- 1..10, a spurious carry (+10 or +100), or a digit
    appended or the leading one dropped. Wrong answers are then longer about as often as shorter, so
    length alone does not tell the right answer (a reward model trained on dropped carries alone
    learned "longer is better", and RL against it wrote 3-digit sums: benchmarks/README.md)."""
    kind = int(rng.integers(0, 4))
    if kind == 0 and carry_dropped(a, b) != right:
        return carry_dropped(a, b)
    if kind <= 1:
        wrong = right + int(rng.choice([-1, 1])) * int(rng.integers(1, 11))
        return wrong if wrong >= 0 else right + int(rng.integers(1, 11))
    if kind == 2:
        return right + int(rng.choice([10, 100]))
    if right >= 10 and rng.random() < 0.5:
        return int(str(right)[1:])  # the leading digit dropped
    return right * 10 + int(rng.integers(0, 10))


def even_last_rule(completion: str) -> bool:
    """The hidden rule of the `even_last` pairs: the text (spaces stripped) ends in an even digit."""
    text = completion.strip()
    return bool(text) and text[-1] in "02468"


def synthetic_pairs(kind: str, digits: int, num_train: int, num_test: int, seed: int) -> tuple[list[Pair], list[Pair]]:
    """(train, test) pairs over disjoint `a+b=` prompts (jaxrl.data.arithmetic), deterministic in seed."""
    splits = arithmetic.generate_splits(digits, "+", num_train, num_test, seed)
    rng = np.random.default_rng(seed + 1)
    out = []
    for split in ("train", "test"):
        pairs = []
        for i, record in enumerate(splits[split]):
            where = f"synthetic {kind} pair {i} of {split}"
            if kind == "arithmetic":
                info = json.loads(record["info"])
                right = int(record["answer"])
                pairs.append(
                    Pair(record["prompt"], str(right), str(wrong_sum(right, info["a"], info["b"], rng)), where)
                )
            elif kind == "even_last":
                stem = "".join(str(d) for d in rng.integers(0, 10, size=int(rng.integers(0, 3))))
                stem2 = "".join(str(d) for d in rng.integers(0, 10, size=int(rng.integers(0, 3))))
                chosen = stem + str(int(rng.choice([0, 2, 4, 6, 8])))
                rejected = stem2 + str(rng.choice(list(ODD_ENDS)))
                rejected = "" if rejected[-1] == "e" else rejected.replace("x", str(rng.choice(list(NOT_DIGITS))))
                pairs.append(Pair(record["prompt"], chosen, rejected, where))
            else:
                raise ConfigError(f"reward_model.synthetic: got {kind!r}, expected 'arithmetic' or 'even_last'")
        out.append(pairs)
    return out[0], out[1]


def tokenize_pairs(pairs: list[Pair], tokenizer, width_S: int, field: str) -> dict:
    """{"chosen_BxS", "chosen_mask_BxS", "rejected_BxS", "rejected_mask_BxS"} as numpy arrays. A pair
    too long for the model (model.max_seq_len) or with a character the tokenizer lacks is a ConfigError
    naming the pair's file and line."""
    out = {}
    for side in ("chosen", "rejected"):
        tokens, masks = [], []
        for p in pairs:
            try:
                t, m = encode_sequences(tokenizer, [p.prompt], [getattr(p, side)], width_S, truncate=False)
            except ValueError as e:
                raise ConfigError(
                    f"{field}: {p.where}: {side}: {e} (model.max_seq_len={width_S}: BOS, prompt, text, EOS)"
                ) from None
            tokens.append(t[0])
            masks.append(m[0])
        out[f"{side}_BxS"], out[f"{side}_mask_BxS"] = np.stack(tokens), np.stack(masks)
    return out
