"""Each user mistake on the command line is one line on stderr naming the problem, exit code 2."""

import pytest

from jaxrl import cli
from conftest import DEFAULT_CONFIG, TINY


def _run(capsys, *args):
    code = cli.main(["train", *args])
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize("override, needle", [
    ("train.stepz=3", "train.stepz: unknown field 'stepz'"),
    ("train.steps=ten", "train.steps: got 'ten', expected an integer"),
    ("rollout.prompts_per_step=-8", "rollout.prompts_per_step: got -8, expected a positive integer"),
    ("data.num_train=0", "data.num_train: got 0"),
])
def test_bad_config_values(capsys, tmp_path, override, needle):
    code, err = _run(capsys, str(DEFAULT_CONFIG), "--workdir", str(tmp_path), "--set", override)
    assert code == 2
    assert needle in err
    assert len(err.splitlines()) == 1


def test_missing_config_file(capsys, tmp_path):
    code, err = _run(capsys, str(tmp_path / "nope.py"))
    assert code == 2 and "nope.py" in err and "not found" in err


def test_prompt_longer_than_limit_names_record_and_lengths(capsys, tmp_path, in_process_cache):
    code, err = _run(capsys, str(DEFAULT_CONFIG), "--workdir", str(tmp_path), *sum((["--set", t] for t in TINY), []),
                     "--set", "data.max_prompt_len=4")
    assert code == 2, err
    assert len(err.splitlines()) == 1
    assert "record 'train/" in err and "data.max_prompt_len=4" in err
    assert "7 tokens" in err  # BOS + "37+58=" is 7 tokens for 2-digit addition


def test_empty_split_is_rejected(capsys, tmp_path, in_process_cache):
    code, err = _run(capsys, str(DEFAULT_CONFIG), "--workdir", str(tmp_path), *sum((["--set", t] for t in TINY), []),
                     "--set", "data.digits=1", "--set", "data.num_train=100", "--set", "data.num_test=1")
    # 1-digit addition has only 100 distinct problems: 100 train + 1 test cannot be disjoint.
    assert code == 2
    assert "data.num" in err and len(err.splitlines()) == 1



def test_eval_split_with_every_prompt_too_long_names_the_fields():
    """Training prompts can fit while every held-out one is too long (and skipped): that is a config
    error naming the limit, not a crash in the evaluator."""
    import dataclasses

    from jaxrl.config import Config, ConfigError
    from jaxrl.data.tokenizer import CharTokenizer
    from jaxrl.train.evaluate import make_evaluator

    cfg = Config()
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_prompt_len=4, skip_long_prompts=True))
    tok = CharTokenizer()
    model = dataclasses.replace(cfg.model, vocab_size=tok.vocab_size)
    records = [{"id": f"test/{i}", "prompt": f"{10 + i}+{20 + i}=", "answer": "0"} for i in range(3)]
    with pytest.raises(ConfigError, match=r"every one of the 3 eval prompts.*data\.max_prompt_len=4"):
        make_evaluator(cfg, model, tok, records, verifier=None)
