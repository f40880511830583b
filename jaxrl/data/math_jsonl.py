"""Math word problems from local JSONL files (GSM8K style) and their answer verifier.

Each line is {"question": ..., "answer": ...}; the reference answer is the text after the last
"####" (GSM8K's convention), else the whole answer, with thousands separators dropped. Prompts are
`prompt_template.format(question=...)`, so a chat format can be written into the template (e.g.
Qwen's "<|im_start|>user\\n{question}<|im_end|>\\n<|im_start|>assistant\\n"). Without a test file
the last `num_test` training lines are held out.

The verifier reads the completion's final answer from, in order: the last "#### x", the last
"\\boxed{x}", the last "answer is x", else the last number in the text; it is correct iff it equals the
reference as an exact rational (so "72", "72.0" and "$72" all match 72). Format reward: the sample
ended with EOS and marked its answer (#### or \\boxed).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import re
from collections.abc import Mapping
from fractions import Fraction

from jaxrl.config import ConfigError

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_MARKED = (re.compile(r"####\s*([^\n]*)"), re.compile(r"\\boxed\{([^{}]*)\}"))
_ANSWER_IS = re.compile(r"answer is[:\s]*([^\n]*)", re.IGNORECASE)
MAX_COMPLETION_CHARS = 20_000


def reference_answer(answer: str) -> str:
    text = answer.rsplit("####", 1)[-1] if "####" in answer else answer
    return text.strip().replace(",", "")


def _read_lines(path: pathlib.Path, field: str) -> list[dict]:
    if not path.is_file():
        raise ConfigError(f"{field}: file {str(path)!r} not found")
    rows = []
    for n, raw in enumerate(path.read_bytes().splitlines(), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:  # JSON text is UTF-8 (RFC 8259); name where it is not
            raise ConfigError(
                f"{path}:{n}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                "re-encode the file as UTF-8"
            ) from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"{path}:{n}: not valid JSON ({e})") from e
        if not isinstance(row, dict) or not isinstance(row.get("question"), str) or "answer" not in row:
            raise ConfigError(f"{path}:{n}: expected an object with string 'question' and 'answer'")
        rows.append(row)
    return rows


def digest(train_file: str, test_file: str) -> str:
    """Content hash of the files: an edited file gets a new TFDS config (and a rebuild)."""
    h = hashlib.sha256()
    for f in (train_file, test_file):
        h.update(pathlib.Path(f).read_bytes() if f else b"")
    return h.hexdigest()[:16]


def generate_splits(
    train_file: str, test_file: str, prompt_template: str, num_train: int, num_test: int, digest: str = ""
) -> dict[str, list[dict]]:
    """{'train': records, 'test': records}; records have str fields id, prompt, answer, info."""
    train = _read_lines(pathlib.Path(train_file), "data.train_file")
    if test_file:
        test = _read_lines(pathlib.Path(test_file), "data.test_file")[:num_test]
        if not test:  # TFDS cannot write an empty split; and a run needs held-out problems
            raise ConfigError(f"data.test_file: {test_file!r} holds no problems; the test split may not be empty")
    else:
        if len(train) < 2:
            raise ConfigError(f"data.train_file: {len(train)} problems; holding out a test split needs >= 2")
        n_test = min(num_test, len(train) // 2)
        train, test = train[:-n_test], train[-n_test:]
    splits = {"train": train[:num_train], "test": test}
    return {
        name: [_record(f"{name}/{i}", row, prompt_template) for i, row in enumerate(rows)]
        for name, rows in splits.items()
    }


def _record(record_id: str, row: dict, template: str) -> dict:
    return {
        "id": record_id,
        "prompt": template.format(question=row["question"].strip()),
        "answer": reference_answer(str(row["answer"])),
        "info": json.dumps({"solution": str(row["answer"])}),
    }


def _as_number(text: str) -> Fraction | None:
    m = _NUMBER.search(text.replace("$", ""))
    if m is None:
        return None
    try:
        return Fraction(m.group().replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(completion: str) -> tuple[Fraction | None, bool]:
    """(the completion's final answer or None, whether it was explicitly marked)."""
    text = completion[-MAX_COMPLETION_CHARS:]
    for pattern in _MARKED:
        found = pattern.findall(text)
        if found:
            return _as_number(found[-1]), True
    found = _ANSWER_IS.findall(text)
    if found and _as_number(found[-1]) is not None:
        return _as_number(found[-1]), False
    numbers = _NUMBER.findall(text.replace("$", ""))
    return (_as_number(numbers[-1]) if numbers else None), False


def verify_math_answer(completion: str, finished: bool, record: Mapping[str, str]) -> tuple[float, float]:
    value, marked = extract_answer(completion)
    want = _as_number(record["answer"])
    return float(value is not None and value == want), float(marked and finished)


def math_answer(completion: str) -> Fraction | None:
    """The completion's final number as an exact rational (so '72', '72.0' and '$72' vote together)."""
    return extract_answer(completion)[0]
