"""`jaxrl eval`: a run of the default config (newest step, --step, the initial policy), a tiny Hugging
Face checkpoint, and a one-line error for each bad path or flag."""

import json
import pathlib

import pytest
from conftest import DEFAULT_CONFIG, REPO, TINY

from jaxrl import cli
from jaxrl.config import load_config, to_dict
from jaxrl.eval.run import EvalRequest, report_path
from jaxrl.eval.sources import locate, run_model

pytestmark = pytest.mark.usefixtures("persistent_compile_cache")  # training runs repeat programs

TINY_ARGS = sum((["--set", t] for t in TINY), [])


def _eval(capsys, *args):
    code = cli.main(["eval", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip()


def _error(capsys, *args) -> str:
    code, _, err = _eval(capsys, *args)
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("jaxrl: error: "), err
    return err


def _fake_run(root, steps=(1, 2), **model):
    """A run directory as locate() sees it: config.json and numbered step folders (never restored)."""
    root.mkdir()
    (root / "config.json").write_text(
        json.dumps(to_dict(load_config(DEFAULT_CONFIG, TINY + [f"model.{k}={v}" for k, v in model.items()])))
    )
    for s in steps:
        (root / "checkpoints" / str(s) / "state").mkdir(parents=True)
    return root


def test_source_path_errors_name_the_path_or_flag(capsys, tmp_path):
    config = str(DEFAULT_CONFIG)
    missing = tmp_path / "nowhere"
    assert f"--workdir {missing}: directory not found" in _error(capsys, config, "--workdir", str(missing))
    assert f"--checkpoint {missing}: directory not found" in _error(capsys, config, "--checkpoint", str(missing))
    assert f"--hf {missing}: directory not found" in _error(capsys, config, "--hf", str(missing))
    empty = tmp_path / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    assert f"--workdir {empty} has no checkpoints" in _error(capsys, config, "--workdir", str(empty))
    err = _error(capsys, config, "--checkpoint", str(empty))
    assert f"--checkpoint {empty} holds no checkpoint" in err and "--workdir" in err
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(b"")
    assert f"--hf {hf}: no config.json" in _error(capsys, config, "--hf", str(hf))


def test_report_path_never_lands_in_the_working_directory(tmp_path):
    """--out wins; a run's step goes to the run's eval/; anything else to runs/eval/ (git-ignored)."""
    run = _fake_run(tmp_path / "run")
    hf = tmp_path / "Qwen2.5-0.5B"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    req = EvalRequest("configs/grpo_arithmetic.py")
    where = {
        "workdir": report_path(req, locate(str(run), None, None, None)),
        "checkpoint": report_path(req, locate(None, str(run / "checkpoints" / "1"), None, None)),
        "hf": report_path(req, locate(None, None, str(hf), None)),
        "initial": report_path(req, locate(None, None, None, None)),
        "out": report_path(req._replace(out="x/y.json"), locate(None, None, str(hf), None)),
    }
    assert where == {
        "workdir": run / "eval" / "step_2.json",
        "checkpoint": run / "eval" / "step_1.json",
        "hf": pathlib.Path("runs/eval/grpo_arithmetic_hf_Qwen2.5-0.5B.json"),
        "initial": pathlib.Path("runs/eval/grpo_arithmetic_initial.json"),
        "out": pathlib.Path("x/y.json"),
    }


def test_unsaved_step_lists_the_saved_ones(capsys, tmp_path):
    run = _fake_run(tmp_path / "run")
    err = _error(capsys, str(DEFAULT_CONFIG), "--workdir", str(run), "--step", "5", *TINY_ARGS)
    assert f"--step 5 was not saved in {run / 'checkpoints'}; saved steps: 1, 2" in err
    err = _error(capsys, str(DEFAULT_CONFIG), "--checkpoint", str(run / "checkpoints"), "--step", "3")
    assert "--step 3 was not saved" in err and "saved steps: 1, 2" in err
    err = _error(capsys, str(DEFAULT_CONFIG), "--checkpoint", str(run / "checkpoints" / "1"), "--step", "2")
    assert "--step 2" in err and "one step" in err


def test_flag_errors(capsys, tmp_path):
    config = str(DEFAULT_CONFIG)
    run = _fake_run(tmp_path / "run")
    assert "--samples 0: expected at least 1" in _error(capsys, config, "--workdir", str(run), "--samples", "0")
    assert "--prompts 0" in _error(capsys, config, "--prompts", "0")
    assert "--temperature -1.0" in _error(capsys, config, "--temperature", "-1")
    err = _error(capsys, config, "--workdir", str(run), "--hf", str(tmp_path))
    assert "give one source" in err and "--workdir" in err and "--hf" in err
    assert "--step 2: a step is chosen with --workdir or --checkpoint" in _error(capsys, config, "--step", "2")


def test_a_run_of_another_model_names_the_fields(capsys, tmp_path):
    run = _fake_run(tmp_path / "run", d_model=64)  # TINY_ARGS asks for d_model=32 with --set
    err = _error(capsys, str(DEFAULT_CONFIG), "--workdir", str(run), *TINY_ARGS)
    assert str(run / "config.json") in err and "--set model.d_model=32 but the run has 64" in err


def test_a_run_lends_its_model_to_a_config_that_names_another(capsys, tmp_path):
    """Without --set model.*, the run's config.json decides the model (the checkpoint holds its weights)."""
    run = _fake_run(tmp_path / "run", d_model=64)
    located = locate(str(run), None, None, None)
    cfg = run_model(load_config(DEFAULT_CONFIG), located)  # the config file's model: d_model 128, 2 layers
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.mlp_dim) == (64, 1, 64)  # the run's
    assert f"the run's model from {run / 'config.json'} (model.d_model=64" in capsys.readouterr().err
    tiny = load_config(DEFAULT_CONFIG, TINY)
    assert run_model(tiny, located, ["model.n_layers=1"]).model.d_model == 64  # an agreeing --set is fine


def test_tasks_without_a_verified_test_split(capsys, tmp_path, in_process_cache):
    err = _error(capsys, str(REPO / "configs" / "agent_calculator.py"), "--samples", "4")
    assert "data.task='agent_calculator'" in err and "environment" in err
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "answer": "4"}\n')
    test.write_text("")
    err = _error(
        capsys,
        str(DEFAULT_CONFIG),
        *TINY_ARGS,
        *["--set", "data.task=math_jsonl", "--set", f"data.train_file={train}", "--set", f"data.test_file={test}"],
    )
    assert f"data.test_file: {str(test)!r} holds no problems" in err
    err = _error(capsys, str(DEFAULT_CONFIG), *TINY_ARGS, "--prompts", "1000")
    assert "--prompts 1000: the test split has 60 records" in err


# A run whose greedy eval moves within 2 steps: a large step size, and the format reward in the loss
# (the tiny base policy answers nothing right, so correctness alone would give zero advantages).
RUN = TINY + [
    "train.steps=2",
    "train.eval_every=1",
    "checkpoint.every=1",
    "optim.learning_rate=1e-2",
    "optim.warmup_steps=0",
    "loss.reward_weights=(1.0,1.0)",
]
GREEDY = ("accuracy", "format", "response_len")


def _greedy(metrics: dict, prefix: str) -> dict:
    return {k: pytest.approx(metrics[f"{prefix}/{k}"], abs=1e-6) for k in GREEDY}


@pytest.mark.slow
def test_eval_of_a_run_matches_the_trainers_greedy_eval(capsys, tmp_path, in_process_cache):
    """Newest step, --step 1 and the initial policy each score exactly what the trainer logged for that
    step on the same 20 prompts (train.eval_prompts); sampled at temperature 0, every sample is the
    greedy completion, so pass@k and maj@k equal the greedy accuracy."""
    from jaxrl.train.loop import train

    run = tmp_path / "run"
    rows = {r["step"]: r for r in train(load_config(DEFAULT_CONFIG, RUN), run) if "eval/accuracy" in r}
    assert sorted(rows) == [0, 1, 2]
    # The check can fail: the greedy eval differs at steps 0, 1 and 2 (with this seed, the format rate
    # 0.1 -> 0.5 -> 1.0), so restoring the wrong step would show.
    logged = [tuple(round(rows[s][f"eval/{k}"], 6) for k in GREEDY) for s in (0, 1, 2)]
    assert len(set(logged)) == 3, logged
    args = [str(DEFAULT_CONFIG), *sum((["--set", s] for s in RUN), []), "--prompts", "20", "--samples", "2"]
    for source, step, out in (
        (["--workdir", str(run)], 2, run / "eval" / "step_2.json"),
        (["--workdir", str(run), "--step", "1"], 1, run / "eval" / "step_1.json"),
        (["--checkpoint", str(run / "checkpoints" / "1")], 1, tmp_path / "ckpt.json"),
        ([], 0, tmp_path / "initial.json"),
    ):
        extra = [] if "--workdir" in source else ["--out", str(out)]
        code, table, err = _eval(capsys, *args, *source, *extra, "--temperature", "0")
        assert code == 0, err
        report = json.loads(out.read_text())
        assert report["step"] == (None if step == 0 else step) and report["prompts"] == 20
        assert {k: report["metrics"][f"greedy/{k}"] for k in GREEDY} == _greedy(rows[step], "eval"), source
        m = report["metrics"]
        assert [m["pass@1"], m["pass@2"], m["maj@1"], m["maj@2"]] == [m["greedy/accuracy"]] * 4
        assert m["sampled/response_len"] == pytest.approx(m["greedy/response_len"])
        assert f"| pass@k | 2 | {m['pass@2']:.4f} |" in table
    # The last report: the initial policy is the cached warm start, as step 0 of `jaxrl train` used it.
    assert report["source"] == {"kind": "initial", "path": None}
    assert report["params"].startswith(in_process_cache["JAXRL_CACHE_DIR"])


@pytest.mark.slow
def test_eval_is_deterministic_in_its_seed(capsys, tmp_path, in_process_cache):
    """The initial policy at temperature 1: one seed twice gives one report; another seed other samples."""
    args = [str(DEFAULT_CONFIG), *TINY_ARGS, "--prompts", "8", "--samples", "4"]
    reports = []
    for seed, name in ((3, "a"), (3, "b"), (4, "c")):
        code, _, err = _eval(capsys, *args, "--seed", str(seed), "--out", str(tmp_path / f"{name}.json"))
        assert code == 0, err
        reports.append(json.loads((tmp_path / f"{name}.json").read_text()))
    assert reports[0] == reports[1] and reports[0]["seed"] == 3 and reports[0]["temperature"] == 1.0
    assert reports[2]["metrics"]["sampled/response_len"] != reports[0]["metrics"]["sampled/response_len"]


@pytest.mark.slow
def test_eval_of_a_tiny_hf_checkpoint_agrees_with_transformers(capsys, tmp_path, in_process_cache):
    """--hf on a tiny random Qwen2: the reference answer of each problem is the final number of
    transformers' own greedy completion, so jaxrl's greedy decode, tokenizer and verifier must together
    score exactly the problems where that completion has a number."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from hf_stand_in import CHATML_SPECIALS, save_bpe_tokenizer, save_tiny_qwen2

    from jaxrl.data.hf_tokenizer import load_tokenizer
    from jaxrl.data.math_jsonl import extract_answer

    questions = [f"Tom has {a} apples and buys {b} more. How many now?" for a, b in ((3, 4), (12, 5), (7, 70), (1, 9))]
    hf = tmp_path / "qwen_tiny"
    hf.mkdir()
    save_bpe_tokenizer(
        hf, [q + " #### 7 12 77 10" for q in questions] * 10, 300, CHATML_SPECIALS,
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    )  # fmt: skip
    model = save_tiny_qwen2(hf, 320, eos_token_id=2, pad_token_id=0)
    with torch.no_grad():  # at its init scale the model says '::::' to everything; louder, it says numbers too
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" not in name:
                p.mul_(20)
    model.save_pretrained(hf)
    tokenizer, T = load_tokenizer(hf), 8
    answers = []
    for q in questions:
        ids = tokenizer.encode(f"Q: {q} A:")
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=T, do_sample=False, eos_token_id=2, pad_token_id=0)
        value, _ = extract_answer(tokenizer.decode(out[0, len(ids) :].tolist()))
        answers.append(None if value is None else str(value))
    expected = sum(a is not None for a in answers) / len(answers)
    assert expected > 0, answers  # else the check below could not tell right from wrong
    data = tmp_path / "test.jsonl"
    data.write_text(
        "".join(json.dumps({"question": q, "answer": a or "-1"}) + "\n" for q, a in zip(questions, answers))
    )
    sets = [
        f"data.train_file={data}", f"data.test_file={data}", "data.num_test=4", "data.prompt_template=Q: {question} A:",
        "data.max_prompt_len=64", f"rollout.max_new_tokens={T}", "model.dtype=float32", "mesh.preset=single",
        "train.progress=false",
    ]  # fmt: skip
    recipe = REPO / "configs" / "qwen2.5_0.5b_gsm8k_grpo.py"
    out = tmp_path / "hf_eval.json"
    code, table, err = _eval(
        capsys, str(recipe), "--hf", str(hf), *sum((["--set", s] for s in sets), []),
        "--samples", "2", "--temperature", "0", "--out", str(out),
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(out.read_text())
    assert report["source"] == {"kind": "hf", "path": str(hf)} and report["prompts"] == 4
    m = report["metrics"]
    assert m["greedy/accuracy"] == pytest.approx(expected), (answers, m)
    assert m["pass@2"] == m["maj@2"] == pytest.approx(expected)  # temperature 0: each sample is the greedy one
    assert "| greedy accuracy | 1 |" in table
