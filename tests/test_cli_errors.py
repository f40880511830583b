"""Each user mistake on the command line is one line on stderr naming the problem, exit code 2; a run
that cannot go on (NaN loss) one line, exit code 1. Nothing saved is changed by a refused run."""

import json
import os

import pytest
from conftest import DEFAULT_CONFIG, TINY

from jaxrl import cli

TINY_ARGS = sum((["--set", t] for t in TINY), [])


def _run(capsys, *args):
    code = cli.main(["train", *args])
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize(
    "override, needle",
    [
        ("train.stepz=3", "train.stepz: unknown field 'stepz'"),
        ("train.steps=ten", "train.steps: got 'ten', expected an integer"),
        ("rollout.prompts_per_step=-8", "rollout.prompts_per_step: got -8, expected a positive integer"),
        ("data.num_train=0", "data.num_train: got 0"),
        ("optim.learning_rate=inf", "optim.learning_rate: got inf, expected a finite number"),
        ("optim.learning_rate=nan", "optim.learning_rate: got nan, expected a finite number"),
        ("warmstart.learning_rate=inf", "warmstart.learning_rate: got inf, expected a finite number"),
    ],
)
def test_bad_config_values(capsys, tmp_path, override, needle):
    code, err = _run(capsys, str(DEFAULT_CONFIG), "--workdir", str(tmp_path), "--set", override)
    assert code == 2
    assert needle in err
    assert len(err.splitlines()) == 1


def test_missing_config_file(capsys, tmp_path):
    code, err = _run(capsys, str(tmp_path / "nope.py"))
    assert code == 2 and "nope.py" in err and "not found" in err


def test_prompt_longer_than_limit_names_record_and_lengths(capsys, tmp_path, in_process_cache):
    code, err = _run(
        capsys,
        str(DEFAULT_CONFIG),
        "--workdir",
        str(tmp_path),
        *sum((["--set", t] for t in TINY), []),
        "--set",
        "data.max_prompt_len=4",
    )
    assert code == 2, err
    assert len(err.splitlines()) == 1
    assert "record 'train/" in err and "data.max_prompt_len=4" in err
    assert "7 tokens" in err  # BOS + "37+58=" is 7 tokens for 2-digit addition


def test_empty_split_is_rejected(capsys, tmp_path, in_process_cache):
    code, err = _run(
        capsys,
        str(DEFAULT_CONFIG),
        "--workdir",
        str(tmp_path),
        *sum((["--set", t] for t in TINY), []),
        "--set",
        "data.digits=1",
        "--set",
        "data.num_train=100",
        "--set",
        "data.num_test=1",
    )
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


@pytest.mark.parametrize("exc", ["RuntimeError('no GPU here')", "KeyError('lr')"])
def test_exception_inside_get_config_names_file_and_exception(capsys, tmp_path, exc):
    config = tmp_path / "broken_config.py"
    config.write_text(f"def get_config():\n    raise {exc}\n")
    code, err = _run(capsys, str(config), "--workdir", str(tmp_path / "run"))
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "broken_config.py" in err and exc.split("(")[0] in err


def _workdir_error(capsys, workdir, *extra):
    code, err = _run(capsys, str(DEFAULT_CONFIG), "--workdir", str(workdir), *TINY_ARGS, *extra)
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("jaxrl: error: "), err
    return err


def test_workdir_that_is_a_file_or_under_one(capsys, tmp_path, in_process_cache):
    f = tmp_path / "notes.txt"
    f.write_text("keep me")
    assert "is a file, not a directory" in _workdir_error(capsys, f)
    assert "notes.txt' is a file" in _workdir_error(capsys, f / "run")
    assert f.read_text() == "keep me"


def test_unwritable_workdir(capsys, tmp_path, in_process_cache, monkeypatch):
    # A chmod'ed directory does not stop root, so the permission check itself is stubbed out.
    locked = tmp_path / "readonly"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(locked) else real_access(p, mode))
    assert "readonly' is not writable" in _workdir_error(capsys, locked / "run")
    assert not (locked / "run").exists()


def test_hf_checkpoint_given_as_workdir_is_refused_untouched(capsys, tmp_path, in_process_cache):
    hf = tmp_path / "qwen"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
    (hf / "model.safetensors").write_bytes(b"\0" * 16)
    before = {p.name: p.read_bytes() for p in hf.iterdir()}
    err = _workdir_error(capsys, hf)
    assert "not a jaxrl run" in err and "model.hf_path" in err
    assert {p.name: p.read_bytes() for p in hf.iterdir()} == before  # nothing written, not even a lock
    other = tmp_path / "home"
    other.mkdir()
    (other / "thesis.tex").write_text("x")
    assert "not empty and is not a jaxrl run" in _workdir_error(capsys, other)
    assert sorted(p.name for p in other.iterdir()) == ["thesis.tex"]


def _fake_run(workdir, overrides=()):
    """A run directory as `jaxrl train` leaves it: config.json and a finished checkpoint folder."""
    from jaxrl.config import load_config, to_dict

    workdir.mkdir()
    (workdir / "config.json").write_text(
        json.dumps(to_dict(load_config(DEFAULT_CONFIG, [*TINY, *overrides])), indent=1)
    )
    (workdir / "checkpoints" / "2").mkdir(parents=True)
    return (workdir / "config.json").read_bytes()


def test_rerun_with_another_model_is_refused_before_writing(capsys, tmp_path, in_process_cache):
    run = tmp_path / "run"
    saved = _fake_run(run)
    err = _workdir_error(capsys, run, "--set", "model.d_model=64")
    assert "model.d_model 32 -> 64" in err and "new --workdir" in err
    assert (run / "config.json").read_bytes() == saved
    assert "model.d_model 32 -> 64" in _workdir_error(
        capsys, run, "--set", "model.d_model=64", "--allow-config-change"
    )  # never allowed
    assert (run / "config.json").read_bytes() == saved


def test_rerun_with_changed_settings_needs_the_flag(capsys, tmp_path, in_process_cache):
    run = tmp_path / "run"
    saved = _fake_run(run, ["train.steps=6"])
    err = _workdir_error(capsys, run, "--set", "train.steps=9", "--set", "optim.learning_rate=0.001")
    assert "train.steps 6 -> 9" in err and "optim.learning_rate" in err and "--allow-config-change" in err
    assert "learning-rate schedule" in err
    assert (run / "config.json").read_bytes() == saved


def test_second_run_on_a_held_workdir_is_refused(capsys, tmp_path, in_process_cache):
    import fcntl

    run = tmp_path / "run"
    run.mkdir()
    with open(run / "jaxrl.lock", "w") as held:  # what a running `jaxrl train` holds
        held.write("pid 4242 on host trainer-7")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        err = _workdir_error(capsys, run)
    assert "is in use by another jaxrl train (pid 4242 on host trainer-7" in err and str(run) in err
    assert sorted(p.name for p in run.iterdir()) == ["jaxrl.lock"]  # nothing else written


def test_non_utf8_jsonl_names_file_and_line(capsys, tmp_path, in_process_cache):
    data = tmp_path / "problems.jsonl"
    data.write_bytes(b'{"question": "1+1?", "answer": "2"}\n{"question": "caf\xe9?", "answer": "3"}\n')
    code, err = _run(
        capsys,
        str(DEFAULT_CONFIG),
        "--workdir",
        str(tmp_path / "run"),
        *TINY_ARGS,
        "--set",
        "data.task=math_jsonl",
        "--set",
        f"data.train_file={data}",
    )
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "problems.jsonl:2: not UTF-8 (byte 0xe9 at column 18)" in err


def test_convert_from_run_with_torn_config_names_the_file(capsys, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text('{"model": {"d_model": 3')  # killed mid-write by an older jaxrl
    code = cli.main(["convert", "--from", str(run), "--to-hf", str(tmp_path / "hf")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"{run / 'config.json'}: not valid JSON" in err


@pytest.mark.slow
def test_nan_loss_stops_without_saving_it(capsys, tmp_path, in_process_cache):
    """A learning rate of 1e30 makes the second update's parameters overflow: the run stops at the
    first non-finite loss / grad norm, exit code 1, and every checkpoint left holds finite weights."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    run = tmp_path / "run"
    code, err = _run(
        capsys,
        str(DEFAULT_CONFIG),
        "--workdir",
        str(run),
        *TINY_ARGS,
        "--set",
        "train.steps=8",
        "--set",
        "checkpoint.every=1",
        "--set",
        "optim.learning_rate=1e30",
        "--set",
        "optim.warmup_steps=0",
        "--set",
        "loss.reward_weights=1,1",
    )
    assert code == 1 and len(err.splitlines()) == 1, err
    bad_step = int(err.split("step ")[1].split(":")[0])
    assert "is nan" in err or "is inf" in err
    saved = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert saved and max(saved) == bad_step - 1, (saved, err)
    for step in saved:
        params = ocp.PyTreeCheckpointer().restore((run / "checkpoints" / str(step) / "state").absolute())["params"]
        assert all(np.isfinite(x).all() for x in jax.tree.leaves(params)), step


def test_ctrl_c_outside_the_step_loop_is_one_line_and_130(capsys, monkeypatch):
    """A Ctrl-C before training starts (or a second one, which aborts the save) prints no traceback."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "load_config", interrupted)
    assert cli.main(["train", str(DEFAULT_CONFIG)]) == 130
    err = capsys.readouterr().err.strip()
    assert err == "jaxrl: interrupted; the steps after its last checkpoint are not saved", err
    monkeypatch.setattr(cli, "variants_table", interrupted)
    assert cli.main(["variants"]) == 130
    assert capsys.readouterr().err.strip() == "jaxrl: interrupted"


def test_static_speculation_on_a_one_layer_policy_is_one_line(capsys, tmp_path, in_process_cache):
    """Early exit needs a policy of two or more layers; the static sampler's check raised a ValueError
    while tracing (a traceback), the engine's a ConfigError: both are one line naming the field now."""
    code, err = _run(
        capsys, str(DEFAULT_CONFIG), "--workdir", str(tmp_path), *TINY_ARGS, "--set", "rollout.speculative.enabled=true"
    )
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "rollout.speculative.draft_layers: got 1, expected fewer than model.n_layers=1: early exit needs" in err
