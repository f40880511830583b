"""The long-tail task (long addition written out column by column): its length distribution, its
verifier, its reference solutions, its registry entry and its shipped config."""

import json
import re
import statistics

import pytest
from conftest import REPO, TINY

from jaxrl.config import ConfigError, DataConfig, load_config
from jaxrl.data import long_addition, tasks
from jaxrl.data.registry import get_task
from jaxrl.data.rewards import score, verify_long_addition
from jaxrl.data.teachers import fallible_answer
from jaxrl.data.tokenizer import DEFAULT_ALPHABET, CharTokenizer

pytestmark = pytest.mark.usefixtures("persistent_compile_cache")  # training runs repeat programs

CONFIG = REPO / "configs" / "grpo_longtail.py"
TOK = CharTokenizer()


@pytest.fixture(scope="module")
def shipped():
    """The config as shipped and every record of its task (train + test), as generated."""
    cfg = load_config(CONFIG)
    d = cfg.data
    splits = long_addition.generate_splits(d.digits, d.operations, d.num_train, d.num_test, d.seed)
    return cfg, splits["train"] + splits["test"]


def _record(a: int, b: int) -> dict:
    return {
        "id": "t/0",
        "prompt": f"{a}+{b}=",
        "answer": long_addition.solution(a, b),
        "info": json.dumps({"a": a, "b": b, "op": "+", "answer": a + b}),
    }


# ---------------------------------------------------------------------------------------------
# The generator


def test_solutions_worked_by_hand():
    # 4735 + 968: 5+8=13 (write 3, carry 1); 3+6+1=10 (0, carry 1); 7+9+1=17 (7, carry 1);
    # 4+0+1=5 -> 5703. 968 has no thousands digit, so that column adds 0.
    assert long_addition.solution(4735, 968) == "5+8+0=13,3+6+1=10,7+9+1=17,4+0+1=5:5703"
    assert long_addition.solution(3, 4) == "3+4+0=7:7"  # the shortest kind: 9 characters
    assert long_addition.solution(7, 5) == "7+5+0=12:12"  # a final carry gives one more answer digit
    assert long_addition.solution(5, 95) == "5+5+0=10,0+9+1=10:100"
    assert long_addition.format_prompt(5, 95) == "5+95="


def test_length_statistics_meet_the_long_tail_targets(shipped):
    cfg, records = shipped
    lengths = [len(TOK.encode(r["answer"])) for r in records]  # char-level: tokens = characters
    assert min(lengths) == 9  # e.g. 3+4+0=7:7
    assert max(lengths) >= 8 * min(lengths), (min(lengths), max(lengths))
    assert statistics.median(lengths) >= 24, statistics.median(lengths)
    # long-tailed: more short solutions than long ones
    assert sum(n <= 40 for n in lengths) > 2 * sum(n > 60 for n in lengths)
    # everything fits the shipped config: answer + EOS, BOS + prompt
    assert max(lengths) + 1 <= cfg.rollout.max_new_tokens
    assert max(len(r["prompt"]) for r in records) + 1 <= cfg.data.max_prompt_len
    assert cfg.data.max_prompt_len + cfg.rollout.max_new_tokens <= cfg.model.max_seq_len


def test_uses_only_the_existing_alphabet(shipped):
    """The task reuses DEFAULT_ALPHABET, so the vocab (and every other task's cached model) is unchanged."""
    assert DEFAULT_ALPHABET == "0123456789+-*/()=,: "
    _, records = shipped
    used = set("".join(r["prompt"] + r["answer"] for r in records))
    assert used <= set(DEFAULT_ALPHABET)


def test_reference_solutions_are_all_verified_correct(shipped):
    _, records = shipped
    rewards_BxK, n_failed = score(verify_long_addition, [r["answer"] for r in records], [True] * len(records), records)
    assert n_failed == 0
    assert rewards_BxK.tolist() == [[1.0, 1.0]] * len(records)


def test_reference_steps_add_up(shipped):
    """Independently of the verifier: every column step is right, carries chain, and the answer is the
    column sums' ones digits read backwards (plus the last carry)."""
    _, records = shipped
    for r in records[:2000]:
        info = json.loads(r["info"])
        a, b = info["a"], info["b"]
        assert info["answer"] == a + b and r["prompt"] == f"{a}+{b}="
        steps, answer = r["answer"].split(":")
        carry, digits = 0, ""
        for i, step in enumerate(steps.split(",")):
            da, db, c, total = map(int, re.fullmatch(r"(\d)\+(\d)\+(\d)=(\d+)", step).groups())
            assert (da, db, c) == (a // 10**i % 10, b // 10**i % 10, carry)
            assert total == da + db + c
            carry, digits = total // 10, str(total % 10) + digits
        assert i + 1 == max(len(str(a)), len(str(b)))
        assert answer == (str(carry) if carry else "") + digits == str(a + b)


def test_fallible_teacher_drops_every_carry():
    rec = _record(4735, 968)
    # 5+8=13 (write 3, carry forgotten); 3+6+0=9; 7+9+0=16 (write 6, forgotten); 4+0+0=4 -> 4693
    assert fallible_answer(rec) == "5+8+0=13,3+6+0=9,7+9+0=16,4+0+0=4:4693"
    assert verify_long_addition(fallible_answer(rec), True, rec) == (0.0, 1.0)  # well formed, wrong
    assert fallible_answer(_record(50, 50)) == "0+0+0=0,5+5+0=10:0"  # the final carry is dropped too
    assert fallible_answer(_record(123, 45)) == long_addition.solution(123, 45)  # no carry: nothing to forget


def test_fallible_teacher_is_wrong_exactly_when_a_carry_is_due(shipped):
    _, records = shipped
    for r in records[:2000]:
        column_sums = [int(step.split("=")[1]) for step in r["answer"].split(":")[0].split(",")]
        carry_due = any(total >= 10 for total in column_sums)
        correct, formatted = verify_long_addition(fallible_answer(r), True, r)
        assert formatted == 1.0
        assert correct == float(not carry_due), r


def test_splits_are_distinct_and_deterministic():
    first = long_addition.generate_splits(3, "+", 300, 100, seed=4)
    again = long_addition.generate_splits(3, "+", 300, 100, seed=4)
    assert first == again
    pairs = [r["prompt"] for r in first["train"] + first["test"]]
    assert len(set(pairs)) == 400  # no problem twice, so train and test are disjoint


def test_too_small_space_and_bad_parameters_name_the_field():
    with pytest.raises(ConfigError, match="data.num_train"):  # only 100 one-digit problems exist
        long_addition.generate_splits(1, "+", 90, 20, seed=0)
    with pytest.raises(ConfigError, match="data.operations"):
        long_addition.generate_splits(3, "*", 10, 10, seed=0)
    with pytest.raises(ConfigError, match="data.digits"):
        long_addition.generate_splits(9, "+", 10, 10, seed=0)


# ---------------------------------------------------------------------------------------------
# The verifier: (correctness of the final answer, format of the worked solution)


@pytest.mark.parametrize(
    "text, finished, expected",
    [
        ("7+8+0=15,5+6+1=12:125", True, (1.0, 1.0)),  # 57 + 68 = 125, worked right
        ("7+8+0=15,5+6+1=12:125", False, (1.0, 0.0)),  # no EOS: right answer, not formatted
        ("7+8+0=15,5+6+0=11:115", True, (0.0, 1.0)),  # forgot the carry: well formed, wrong
        ("7+8+0=15,5+6+1=12:0125", True, (0.0, 0.0)),  # leading zero: not the canonical answer
        ("7+8=15,5+6+1=12:125", True, (1.0, 0.0)),  # a step without its carry: malformed, answer right
        ("7+8+0=15;5+6+1=12:125", True, (1.0, 0.0)),  # wrong separator
        ("7+8+0=15,5+6+2=13:125", True, (1.0, 0.0)),  # carry 2 is not a carry
        ("7+8+0=15,5+6+1=12", True, (0.0, 0.0)),  # no final answer
        (":125", True, (1.0, 0.0)),  # the answer alone: no worked steps
        ("7+8+0=15,5+6+1=12:125 ", True, (1.0, 1.0)),  # surrounding spaces are ignored
        ("7+8+0=15,5+6+1=12:125:3", True, (0.0, 0.0)),  # the last ':' holds the answer
        ("", True, (0.0, 0.0)),
    ],
)
def test_verify_long_addition_hand_written(text, finished, expected):
    assert verify_long_addition(text, finished, _record(57, 68)) == expected


def test_verify_checks_the_record_answer_not_the_steps():
    # 99 + 1 = 100; the steps of 57 + 68 under a right answer are still well formed (format is grammar)
    assert verify_long_addition("9+1+0=10,9+0+1=10:100", True, _record(99, 1)) == (1.0, 1.0)
    assert verify_long_addition("7+8+0=15,5+6+1=12:125", True, _record(99, 1)) == (0.0, 1.0)


# ---------------------------------------------------------------------------------------------
# Registry and config


def test_registry_names_the_task():
    assert get_task("long_addition").verifier is verify_long_addition
    with pytest.raises(ConfigError, match="data.task.*long_addition"):
        tasks.task_params(DataConfig(task="nope"))
    with pytest.raises(ConfigError, match="data.task.*long_addition"):
        load_config(CONFIG, ["data.task=nope"])
    with pytest.raises(ConfigError, match="data.operations"):
        tasks.task_params(DataConfig(task="long_addition", operations="+-"))
    with pytest.raises(ConfigError, match=r"data.digits.*\[1, 8\]"):
        load_config(CONFIG, ["data.digits=9"])
    with pytest.raises(ConfigError, match=r"data.digits.*\[1, 6\]"):  # other tasks keep their range
        load_config(CONFIG, ["data.task=arithmetic", "data.digits=7"])


def test_load_task_builds_and_reads_back(tmp_path):
    data = tasks.load_task(DataConfig(task="long_addition", digits=4, num_train=40, num_test=10), str(tmp_path))
    assert data.verifier is verify_long_addition
    assert (len(data.train), len(data.test)) == (40, 10)
    record = data.test[3]
    info = json.loads(record["info"])
    assert record["answer"] == long_addition.solution(info["a"], info["b"])


@pytest.mark.slow
def test_config_trains_two_steps(tmp_path, in_process_cache):
    from jaxrl.train.loop import train

    cfg = load_config(CONFIG)
    assert cfg.loss.reward_weights == (1.0, 0.0) and cfg.data.task == "long_addition"
    tiny = [t for t in TINY if not t.startswith("train.eval_")]
    rows = train(
        load_config(
            CONFIG, tiny + ["train.steps=2", "train.eval_every=2", "train.eval_prompts=4", "checkpoint.every=0"]
        ),
        tmp_path / "run",
    )
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[1]["reward/failed"] == 0 and 0.0 <= rows[1]["reward/format"] <= 1.0  # the verifier ran
    assert 0.0 <= rows[-1]["eval/accuracy"] <= 1.0
    assert rows[-1]["eval/response_len"] > 0
