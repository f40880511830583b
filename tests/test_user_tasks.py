"""A task and an environment brought by a config file outside the repository: one `register_task` each,
then `jaxrl train` and `jaxrl eval` as for a built-in; a misspelt task name and a character outside the
character model's alphabet are one-line errors naming them."""

import json
import textwrap

import numpy as np
import pytest
from conftest import REPO, TINY

from jaxrl import cli
from jaxrl.agents.env import AGENT_ALPHABET, AlphabetChecked, EnvSuite, StepResult
from jaxrl.agents.warmstart import teacher_batch
from jaxrl.config import ConfigError, load_config
from jaxrl.data.registry import Task, get_task, register_task
from jaxrl.data.tokenizer import CharTokenizer

TINY_ARGS = sum((["--set", t] for t in TINY), [])
# Two steps that move the greedy eval: a large step size, and the format reward in the loss.
MOVING = [
    *("--set", "train.steps=2", "--set", "train.eval_every=1", "--set", "optim.learning_rate=1e-2"),
    *("--set", "optim.warmup_steps=0", "--set", "loss.reward_weights=(1.0,1.0)"),
]
GREEDY = ("accuracy", "format", "response_len")

TEXT_TASK = '''
from jaxrl.config import Config, DataConfig, RolloutConfig
from jaxrl.data.registry import Task, register_task


def records(split, n, seed):
    """n doubling problems: prompt '7+7=', answer '14'."""
    first = 0 if split == "train" else 50
    return [{"id": f"{split}/{i}", "prompt": f"{(first + i) % 100}+{(first + i) % 100}=",
             "answer": str(2 * ((first + i) % 100))} for i in range(n)]


def verify(completion, finished, record):
    return float(completion.strip() == record["answer"]), float(finished)


register_task(Task("user_double", records=records, verifier=verify))


def get_config():
    return Config(data=DataConfig(task="{task}", max_prompt_len=8), rollout=RolloutConfig(max_new_tokens=4))
'''

ENVIRONMENT = '''
from jaxrl.agents.env import EnvSuite, StepResult
from jaxrl.agents.tools import NO_TOOL_INFO, TagFormat, Tool, ToolRegistry, ToolUse
from jaxrl.config import Config, DataConfig, EngineConfig, RolloutConfig, WarmStartConfig
from jaxrl.data.registry import Task, register_task


class Doubler:
    """Double the number: the model may call [dbl n] (one tool), then answers."""

    def __init__(self):
        self.tools = ToolUse(ToolRegistry([Tool("dbl", lambda n: str(2 * int(n)), "double n")], 20), TagFormat())

    def reset(self, record, rng):
        self.answer = record["answer"]
        return record["prompt"]

    def step(self, action):
        turn = self.tools.respond(action)
        if turn is not None:
            return StepResult(turn.observation, 0.0, False, turn.info)
        success = action.strip() == self.answer
        return StepResult("", float(success), True, {**NO_TOOL_INFO, "success": success})


def records(split, n, seed):
    first = 0 if split == "train" else 500
    return [{"id": str(first + i), "prompt": f"{first + i}:", "answer": str(2 * (first + i))} for i in range(n)]


# Given demonstrations instead of a teacher: call the tool, copy its answer.
DEMOS = tuple(
    (r, [(f"[dbl {r['id']}]", True), (f">{r['answer']}\\n", False), (r["answer"], True)])
    for r in records("train", 32, 0)
)
register_task(Task("user_doubler", environment=EnvSuite(
    "user_doubler", make=lambda agent_cfg, fmt=None: Doubler(), records=records, demonstrations=DEMOS)))


def get_config():
    return Config(
        data=DataConfig(task="user_doubler", max_prompt_len=6),
        rollout=RolloutConfig(max_new_tokens=24, engine=EngineConfig(slots=8)),
        warmstart=WarmStartConfig(source="{source}"),
    )
'''


def _write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def _cli(capsys, *args) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(capsys, *args) -> str:
    code, _, err = _cli(capsys, *args)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.slow
def test_a_registered_text_task_trains_and_evaluates(capsys, tmp_path, in_process_cache):
    config = _write(tmp_path, "double.py", TEXT_TASK.replace("{task}", "user_double"))
    run = tmp_path / "run"
    code, _, err = _cli(capsys, "train", config, "--workdir", str(run), *TINY_ARGS, *MOVING)
    assert code == 0, err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2]
    evals = [tuple(r[f"eval/{k}"] for k in GREEDY) for r in rows]
    assert evals[0] != evals[-1]  # the greedy eval moved (so a run starting from step 2 can be told apart)
    code, table, err = _cli(capsys, "eval", config, "--workdir", str(run), *TINY_ARGS, "--samples", "2")
    assert code == 0, err
    report = json.loads((run / "eval" / "step_2.json").read_text())
    assert report["task"] == "user_double" and report["prompts"] == 60 and "pass@2" in report["metrics"]
    assert "greedy accuracy" in table
    # Another run starts from this one's newest checkpoint: its step-0 eval is this run's step-2 eval.
    later = tmp_path / "later"
    from_run = ["--set", "warmstart.source=checkpoint", "--set", f"warmstart.checkpoint={run}"]
    from_run += ["--set", "train.steps=1"]
    code, _, err = _cli(capsys, "train", config, "--workdir", str(later), *TINY_ARGS, *from_run)
    assert code == 0, err
    first = json.loads((later / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0 and tuple(first[f"eval/{k}"] for k in GREEDY) == evals[-1]


@pytest.mark.slow
def test_a_registered_environment_trains_from_demonstrations_and_evaluates(capsys, tmp_path, in_process_cache):
    config = _write(tmp_path, "doubler.py", ENVIRONMENT.replace("{source}", "demonstrations"))
    run = tmp_path / "run"
    args = [*TINY_ARGS, "--set", "train.eval_prompts=8", "--set", "data.num_test=8"]
    code, _, err = _cli(capsys, "train", config, "--workdir", str(run), *args, "--set", "train.steps=2")
    assert code == 0, err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "agent/turns_mean" in r] == [1, 2]
    code, table, err = _cli(capsys, "eval", config, "--workdir", str(run), *args)
    assert code == 0, err
    report = json.loads((run / "eval" / "step_2.json").read_text())
    assert report["task"] == "user_doubler" and report["prompts"] == 8
    assert {"greedy/accuracy", "greedy/return", "greedy/turns"} <= set(report["metrics"])


def test_a_checkpoint_start_names_its_run_directory(capsys, tmp_path):
    config = _write(tmp_path, "double.py", TEXT_TASK.replace("{task}", "user_double"))
    err = _one_line_error(capsys, "train", config, "--set", "warmstart.source=checkpoint")
    assert "warmstart.checkpoint: got '', expected a run directory exactly when warmstart.source='checkpoint'" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    args = ["--set", "warmstart.source=checkpoint", "--set", f"warmstart.checkpoint={empty}"]
    err = _one_line_error(capsys, "train", config, "--workdir", str(tmp_path / "run"), *TINY_ARGS, *args)
    assert f"warmstart.checkpoint {str(empty)!r}: the run has no finished checkpoint" in err


def test_an_environment_without_a_teacher_names_the_choices(capsys, tmp_path):
    config = _write(tmp_path, "doubler.py", ENVIRONMENT.replace("{source}", "teacher"))
    err = _one_line_error(capsys, "train", config, "--workdir", str(tmp_path / "run"), *TINY_ARGS)
    assert "warmstart.source: got 'teacher', but environment 'user_doubler' has no teacher" in err
    assert "'demonstrations'" in err and "'none'" in err and "model.hf_path" in err


def test_a_misspelt_task_names_it_and_suggests_the_registered_one(capsys, tmp_path):
    config = _write(tmp_path, "double.py", TEXT_TASK.replace("{task}", "user_dubble"))
    err = _one_line_error(capsys, "train", config, "--workdir", str(tmp_path / "run"))
    assert "data.task: got 'user_dubble'" in err and "did you mean 'user_double'" in err
    err = _one_line_error(capsys, "train", config, "--workdir", str(tmp_path / "run"), "--set", "data.task=arithmetc")
    assert "data.task: got 'arithmetc'" in err and "did you mean 'arithmetic'" in err


def test_a_character_outside_the_alphabet_names_it_the_task_and_the_record(capsys, tmp_path, in_process_cache):
    text = TEXT_TASK.replace("{task}", "user_double").replace('f"{(first + i) % 100}+', 'f"x{(first + i) % 100}+')
    config = _write(tmp_path, "double.py", text)
    err = _one_line_error(capsys, "train", config, "--workdir", str(tmp_path / "run"), *TINY_ARGS)
    assert "character 'x' in the prompt of record 'train/0' of task 'user_double'" in err


def test_an_observation_outside_the_alphabet_is_an_error_naming_it():
    class Shouting:
        def reset(self, record, rng):
            return record["prompt"]

        def step(self, action):
            return StepResult("WRONG\n", 0.0, False, {})

    # In the warm start: a demonstration's observation.
    suite = EnvSuite(
        "user_shouting",
        make=lambda agent_cfg, fmt=None: Shouting(),
        records=lambda split, n, seed: [{"id": "r1", "prompt": "1:"}],
        teacher=lambda record, rng, error_rate: [("[go]", True), ("WRONG\n", False), ("2", True)],
    )
    tokenizer = CharTokenizer(AGENT_ALPHABET)
    with pytest.raises(ConfigError, match="character 'G' in a demonstration of environment 'user_shouting'.*'r1'"):
        teacher_batch(suite, suite.records("train", 1, 0), tokenizer, 4, 16, 0.0, np.random.default_rng(0))
    # In an episode: the engine only counts a raising step, so the checked environment keeps the error.
    errors = []
    env = AlphabetChecked(Shouting(), AGENT_ALPHABET, "user_shouting", errors)
    assert env.reset({"id": "r1", "prompt": "1:"}, np.random.default_rng(0)) == "1:"
    with pytest.raises(ConfigError, match="character 'G' in an observation of environment 'user_shouting'"):
        env.step("[go]")
    assert len(errors) == 1 and "'r1'" in str(errors[0])


def test_registration_errors_name_the_task():
    with pytest.raises(ConfigError, match="'arithmetic' is a built-in task"):
        register_task(Task("arithmetic", records=[], verifier=lambda c, f, r: (0.0, 0.0)))
    with pytest.raises(ConfigError, match="task 'half' has records but no verifier"):
        register_task(Task("half", records=[{"id": "0", "prompt": "1"}]))
    with pytest.raises(ConfigError, match="'both'.*exactly one of the two"):
        register_task(Task("both", records=[], verifier=lambda c, f, r: (0.0, 0.0), environment="x:y"))
    task = register_task(Task("user_list", records=[{"id": str(i), "prompt": f"{i}="} for i in range(5)],
                              verifier=lambda c, f, r: (0.0, 0.0)))  # fmt: skip
    from jaxrl.config import DataConfig

    train, test = get_task("user_list").split_records(DataConfig(task="user_list", num_train=10, num_test=2))
    assert task is get_task("user_list") and [r["id"] for r in train] == ["0", "1", "2"]
    assert [r["id"] for r in test] == ["3", "4"]


@pytest.mark.parametrize("section", ["## Bring your own task", "## Bring your own environment"])
def test_the_docs_examples_load_and_register(section, tmp_path):
    text = (REPO / "docs" / "extending.md").read_text()
    body = text.split(section, 1)[1].split("\n## ", 1)[0]
    code = body.split("```python\n", 1)[1].split("```", 1)[0]
    cfg = load_config(_write(tmp_path, "example.py", code))
    task = get_task(cfg.data.task)
    train, _ = task.split_records(cfg.data)
    if task.episodic:  # its teacher's demonstrations fit the model's alphabet and budget
        batch, cut = teacher_batch(
            task.suite, train[:4], CharTokenizer(task.char_alphabet), cfg.data.max_prompt_len,
            cfg.rollout.max_new_tokens, 0.0, np.random.default_rng(0),
        )  # fmt: skip
        assert cut == 0 and batch["completion_mask_BxT"].sum() > 0
    else:
        assert all(task.verifier(r["answer"], True, r) == (1.0, 1.0) for r in train)
