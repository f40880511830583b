"""Tokenizer, task generation, TFDS build/cache, and the prompt stream."""

import dataclasses
import json
import os
import sys

import numpy as np
import pytest

from jaxrl.config import ConfigError, DataConfig
from jaxrl.data import arithmetic, countdown, stream, tasks
from jaxrl.data.registry import get_task
from jaxrl.data.tokenizer import CharTokenizer, decode_completions, encode_prompts

TOK = CharTokenizer()


# ---------------------------------------------------------------------------------------------
# Tokenizer


def test_tokenizer_round_trip_and_ids():
    text = "12,7,3:46=(25+3*7)-8/2 "
    ids = TOK.encode(text)
    assert len(ids) == len(text)
    assert min(ids) >= 3 and max(ids) < TOK.vocab_size
    assert TOK.decode(ids) == text
    assert (TOK.pad_id, TOK.bos_id, TOK.eos_id) == (0, 1, 2)
    assert TOK.vocab_size <= 48
    assert len(set(TOK.encode(TOK.alphabet))) == len(TOK.alphabet)


def test_decode_stops_at_eos_and_drops_pad_bos():
    ids = [TOK.pad_id, TOK.bos_id] + TOK.encode("95") + [TOK.eos_id] + TOK.encode("7")
    assert TOK.decode(ids) == "95"
    assert TOK.decode(np.array(ids, np.int32)) == "95"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        TOK.decode([TOK.vocab_size])


def test_unknown_character_names_char_and_text():
    with pytest.raises(ValueError) as e:
        TOK.encode("12x3")
    assert "'x'" in str(e.value) and "'12x3'" in str(e.value)


def test_encode_prompts_left_pads():
    tokens, mask, kept, skipped = encode_prompts(TOK, ["1+2=", "10+20="], 16, skip_long=False, record_ids=["a", "b"])
    assert tokens.dtype == np.int32 and mask.dtype == bool
    assert tokens.shape == (2, 7)
    assert tokens[0].tolist() == [0, 0, TOK.bos_id] + TOK.encode("1+2=")
    assert tokens[1].tolist() == [TOK.bos_id] + TOK.encode("10+20=")
    assert mask[0].tolist() == [False, False] + [True] * 5
    assert mask[1].all()
    assert kept == [0, 1] and skipped == 0
    tokens, mask, _, _ = encode_prompts(TOK, ["1+2="], 16, skip_long=False, record_ids=["a"], pad_to=8)
    assert tokens.shape == (1, 8) and mask.sum() == 5 and not mask[0, :3].any()


def test_encode_prompts_too_long_names_record_and_lengths():
    prompts = ["1+2=", "123456+654321="]  # the second is 15 tokens with BOS
    with pytest.raises(ConfigError) as e:
        encode_prompts(TOK, prompts, 10, skip_long=False, record_ids=["train/1", "train/123"])
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("prompt of record 'train/123' has 15 tokens, longer than data.max_prompt_len=10")
    assert "data.skip_long_prompts=true" in msg


def test_encode_prompts_skips_and_counts():
    prompts = ["123456+654321=", "1+2=", "999999*999999=", "3+4="]
    tokens, mask, kept, skipped = encode_prompts(TOK, prompts, 10, skip_long=True, record_ids=list("abcd"))
    assert kept == [1, 3] and skipped == 2
    assert tokens.shape == (2, 5)
    assert TOK.decode(tokens[1]) == "3+4="


def test_decode_completions_reports_finished():
    eos, pad = TOK.eos_id, TOK.pad_id
    rows = np.array([TOK.encode("95") + [eos, pad], TOK.encode("1234")], np.int32)
    texts, finished = decode_completions(TOK, rows)
    assert texts == ["95", "1234"] and finished == [True, False]


# ---------------------------------------------------------------------------------------------
# Generators


def _recompute(prompt: str) -> int:
    for op in "+*":
        if op in prompt:
            a, b = prompt.rstrip("=").split(op)
            return int(a) + int(b) if op == "+" else int(a) * int(b)
    a, b = prompt.rstrip("=").split("-")
    return int(a) - int(b)


def test_arithmetic_answers_and_disjoint_splits():
    splits = arithmetic.generate_splits(2, "+-*", 300, 100, seed=3)
    train, test = splits["train"], splits["test"]
    assert len(train) == 300 and len(test) == 100
    for r in train + test:
        info = json.loads(r["info"])
        assert int(r["answer"]) == _recompute(r["prompt"]) == info["answer"]
        assert r["prompt"] == f"{info['a']}{info['op']}{info['b']}="
    assert any(r["answer"].startswith("-") for r in train)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert len({r["prompt"] for r in train}) == 300
    assert [r["id"] for r in test[:2]] == ["test/0", "test/1"]
    # Canonical operations: the same set in any order generates the same data.
    assert arithmetic.generate_splits(2, "*-+", 300, 100, seed=3) == splits
    assert arithmetic.generate_splits(2, "+-*", 300, 100, seed=4) != splits


def test_arithmetic_space_too_small_names_fields():
    # digits=1 with '+' has exactly 10 * 10 problems; all of them fit, one more does not.
    every = arithmetic.generate_splits(1, "+", 90, 10, seed=0)
    assert len({r["prompt"] for r in every["train"] + every["test"]}) == 100
    with pytest.raises(ConfigError, match=r"data.num_train \+ data.num_test = 101 but only 100 distinct"):
        arithmetic.generate_splits(1, "+", 91, 10, seed=0)
    with pytest.raises(ConfigError, match="data.operations"):
        arithmetic.generate_splits(1, "/", 1, 1, seed=0)


def test_countdown_prompts_are_solvable_and_disjoint():
    from jaxrl.data.rewards import evaluate, literals, parse_expression

    splits = countdown.generate_splits(2, "+-*", 300, 100, seed=1)
    keys = {}
    for split, records in splits.items():
        for r in records:
            info = json.loads(r["info"])
            assert r["prompt"] == countdown.format_prompt(info["numbers"], info["target"])
            tree = parse_expression(r["answer"])
            assert evaluate(tree) == info["target"]
            assert sorted(literals(tree)) == sorted(info["numbers"])
            assert 1 <= info["target"] <= 999 and all(1 <= n <= 99 for n in info["numbers"])
            assert len(TOK.encode(r["prompt"])) + 1 <= 16
            keys.setdefault(split, set()).add((tuple(sorted(info["numbers"])), info["target"]))
    assert len(keys["train"]) == 300 and not keys["train"] & keys["test"]


def test_countdown_space_too_small():
    # With only '+', a problem is determined by its multiset of 3 numbers in 1..9: C(11, 3) = 165.
    with pytest.raises(ConfigError, match="data.num_train \\+ data.num_test = 200 but only 165 distinct"):
        countdown.generate_splits(1, "+", 150, 50, seed=0)


# ---------------------------------------------------------------------------------------------
# TFDS build and cache


def test_load_task_builds_without_tensorflow_and_reuses_cache(tmp_path, monkeypatch):
    cfg = DataConfig(task="arithmetic", digits=2, operations="+-", num_train=200, num_test=50, seed=7)
    data = tasks.load_task(cfg, str(tmp_path))
    assert "tensorflow" not in sys.modules
    assert len(data.train) == 200 and len(data.test) == 50
    train = [data.train[i] for i in range(len(data.train))]
    test = [data.test[i] for i in range(len(data.test))]
    assert all(isinstance(v, str) for r in train for v in r.values())
    assert set(train[0]) == {"id", "prompt", "answer", "info"}
    for r in train + test:
        assert int(r["answer"]) == _recompute(r["prompt"])
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert sorted(r["id"] for r in test) == sorted(f"test/{i}" for i in range(50))
    assert data.verifier is get_task("arithmetic").verifier
    assert "d2-add-sub-train200-test50-seed7" in data.data_dir
    mtimes = {f: os.stat(os.path.join(data.data_dir, f)).st_mtime_ns for f in os.listdir(data.data_dir)}

    def no_regeneration(**kwargs):
        raise AssertionError("cached dataset was regenerated")

    monkeypatch.setattr(arithmetic, "generate_splits", no_regeneration)
    again = tasks.load_task(dataclasses.replace(cfg, operations="-+"), str(tmp_path))
    assert again.data_dir == data.data_dir
    assert [again.train[i] for i in range(len(again.train))] == train
    assert {f: os.stat(os.path.join(data.data_dir, f)).st_mtime_ns for f in os.listdir(data.data_dir)} == mtimes
    # A different seed is a different config, so it must generate (and here, hit the patched generator).
    with pytest.raises(AssertionError, match="regenerated"):
        tasks.load_task(dataclasses.replace(cfg, seed=8), str(tmp_path))


def test_load_task_countdown(tmp_path):
    data = tasks.load_task(DataConfig(task="countdown", operations="+-*", num_train=40, num_test=10), str(tmp_path))
    assert len(data.train) == 40 and len(data.test) == 10
    records = [data.test[i] for i in range(10)]
    rewards = [data.verifier(r["answer"], True, r) for r in records]
    assert rewards == [(1.0, 1.0)] * 10


def test_load_task_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="data.num_test"):
        tasks.load_task(DataConfig(num_train=10, num_test=0), str(tmp_path))
    with pytest.raises(ConfigError, match="data.task"):
        tasks.load_task(DataConfig(task="chess"), str(tmp_path))
    with pytest.raises(ConfigError, match="only 10000 distinct problems"):
        tasks.load_task(DataConfig(digits=2, operations="+", num_train=20000), str(tmp_path))
    assert not os.listdir(tmp_path)  # refused before TFDS created any folder


def test_record_source_bounds():
    source = tasks.RecordSource("toy", [{"id": b"x/0", "prompt": b"1+1="}])
    assert source[0] == {"id": "x/0", "prompt": "1+1="} and source[-1] == source[0]
    with pytest.raises(IndexError):
        source[1]


def test_resolve_data_dir_order(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXRL_DATA_DIR", str(tmp_path / "env"))
    assert tasks.resolve_data_dir(DataConfig(data_dir=str(tmp_path / "cfg")), str(tmp_path / "arg")) == str(
        tmp_path / "arg"
    )
    assert tasks.resolve_data_dir(DataConfig(data_dir=str(tmp_path / "cfg"))) == str(tmp_path / "cfg")
    assert tasks.resolve_data_dir(DataConfig()) == str(tmp_path / "env")
    monkeypatch.delenv("JAXRL_DATA_DIR")
    assert tasks.resolve_data_dir(DataConfig()) == os.path.expanduser("~/.cache/jaxrl/tfds")


# ---------------------------------------------------------------------------------------------
# Stream


def _toy(n):
    return [{"id": f"r/{i}"} for i in range(n)]


def _ids(records):
    return [r["id"] for r in records]


def test_stream_is_deterministic_and_covers_each_epoch():
    source = _toy(10)
    state = stream.StreamState()
    a, _ = stream.next_batch(source, state, 4, seed=0)
    b, _ = stream.next_batch(source, state, 4, seed=0)
    c, _ = stream.next_batch(source, state, 4, seed=1)
    assert a == b and a != c
    seen = []
    for _ in range(5):  # 20 records = exactly two epochs
        batch, state = stream.next_batch(source, state, 4, seed=0)
        seen.extend(_ids(batch))
    assert state == stream.StreamState(epoch=2, index=0)
    assert sorted(seen[:10]) == sorted(_ids(source)) == sorted(seen[10:])
    assert seen[:10] != seen[10:]  # each epoch has its own permutation


def test_stream_rolls_over_mid_batch_and_handles_big_batches():
    source = _toy(5)
    batch, state = stream.next_batch(source, stream.StreamState(0, 3), 4, seed=0)
    assert state == stream.StreamState(1, 2)
    epoch0, _ = stream.next_batch(source, stream.StreamState(0, 0), 5, seed=0)
    epoch1, _ = stream.next_batch(source, stream.StreamState(1, 0), 5, seed=0)
    assert batch == epoch0[3:] + epoch1[:2]
    big, state = stream.next_batch(source, stream.StreamState(), 12, seed=0)
    assert state == stream.StreamState(2, 2) and len(big) == 12


def test_stream_resume_from_saved_state():
    source = _toy(7)
    state, straight = stream.StreamState(), []
    for _ in range(5):
        batch, state = stream.next_batch(source, state, 3, seed=5)
        straight.append(_ids(batch))
    state, resumed = stream.StreamState(), []
    for _ in range(2):
        batch, state = stream.next_batch(source, state, 3, seed=5)
        resumed.append(_ids(batch))
    saved = stream.as_arrays(state)
    assert all(isinstance(v, np.ndarray) and v.dtype == np.int64 for v in saved.values())
    state = stream.from_arrays({k: np.array(v) for k, v in saved.items()})
    for _ in range(3):
        batch, state = stream.next_batch(source, state, 3, seed=5)
        resumed.append(_ids(batch))
    assert resumed == straight


def test_stream_errors():
    with pytest.raises(ConfigError, match="dataset toy is empty"):
        stream.next_batch(tasks.RecordSource("toy", []), stream.StreamState(), 2, seed=0)
    with pytest.raises(ConfigError, match="index=9"):
        stream.next_batch(_toy(5), stream.StreamState(0, 9), 2, seed=0)


def test_carry_free_teacher_drops_every_carry():
    from jaxrl.data.teachers import carry_free_sum, fallible_answer

    assert carry_free_sum(64, 69) == 23  # 4+9=13 -> 3, 6+6=12 -> 2, both carries dropped
    assert carry_free_sum(25, 23) == 48  # no carry: the teacher is right
    assert carry_free_sum(5, 7) == 2
    rec = {"id": "train/0", "info": '{"a": 99, "b": 1, "op": "+", "answer": 100}'}
    assert fallible_answer(rec) == "90"
    with pytest.raises(Exception, match="warmstart.teacher_error"):
        fallible_answer({"id": "train/1", "info": '{"a": 9, "b": 1, "op": "-", "answer": 8}'})


def test_countdown_teacher_forgets_parentheses_and_is_wrong_only_where_they_matter():
    from jaxrl.data import countdown
    from jaxrl.data.rewards import verify_countdown
    from jaxrl.data.teachers import fallible_answer

    rec = countdown._record("train/0", [9, 3, 7], 42, "(9-3)*7")
    assert fallible_answer(rec) == "9-3*7" and verify_countdown("9-3*7", True, rec) == (0.0, 1.0)
    records = countdown.generate_splits(1, "+-*/", 300, 10, seed=0)["train"]
    wrong = [r for r in records if verify_countdown(fallible_answer(r), True, r)[0] == 0.0]
    assert all("(" in r["answer"] for r in wrong)  # only a needed parenthesis, forgotten, makes it wrong
    assert 0.1 < len(wrong) / len(records) < 0.9, len(wrong)  # both kinds of problem are common


def test_the_countdown_config_fits_every_problem_and_its_teacher():
    """configs/grpo_countdown.py: every prompt (with BOS) fits data.max_prompt_len, every reference
    answer (with EOS) fits rollout.max_new_tokens, and the fallible teacher can answer every record."""
    from conftest import REPO

    from jaxrl.config import load_config
    from jaxrl.data import countdown
    from jaxrl.data.teachers import fallible_answer
    from jaxrl.data.tokenizer import CharTokenizer

    cfg = load_config(REPO / "configs" / "grpo_countdown.py")
    d, tok = cfg.data, CharTokenizer()
    splits = countdown.generate_splits(d.digits, d.operations, d.num_train, d.num_test, d.seed)
    records = splits["train"] + splits["test"]
    assert set("".join(r["answer"] for r in records)) >= set("+-*/()")  # all four operations occur
    assert max(len(tok.encode(r["prompt"])) + 1 for r in records) <= d.max_prompt_len
    assert max(len(tok.encode(r["answer"])) + 1 for r in records) <= cfg.rollout.max_new_tokens
    assert cfg.warmstart.teacher_error > 0 and all(fallible_answer(r) for r in records)
