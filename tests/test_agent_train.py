"""Multi-turn episodes in the training loop: a run on each embedded environment trains and logs the
agent metrics, combinations that cannot work are one-line config errors, and a run SIGKILLed while
its episodes are in flight resumes to the same metrics as an uninterrupted run."""

import pytest
from conftest import REPO, TINY
from test_resume import killed_and_resumed_runs, straight_run_once

from jaxrl.config import load_config

pytestmark = pytest.mark.usefixtures("persistent_compile_cache")  # training runs repeat programs

# Timing-dependent fields: wall-clock figures, and how the environment time split into hidden and
# exposed (which depends on thread scheduling). Everything else must replay exactly.
TIMING = {
    "rollout/seconds",
    "rollout/tokens_per_s",
    "step_seconds",
    "wall_time",
    "agent/env_seconds",
    "agent/env_exposed_seconds",
    "agent/env_hidden_seconds",
}
SMALL = [t for t in TINY if not t.startswith("data.")] + [
    "data.num_train=200",
    "data.num_test=20",
    "rollout.engine.slots=8",
    "train.eval_prompts=8",
]


def _config(name: str):
    return REPO / "configs" / f"agent_{name}.py"


def _cfg(name, *extra):
    return load_config(_config(name), SMALL + list(extra))


STEPS = 4
RUN_ARGS = [
    str(_config("gridworld")),
    *sum((["--set", t] for t in SMALL), []),
    "--set",
    f"train.steps={STEPS}",
    "--set",
    "checkpoint.every=1",
    "--set",
    "train.eval_every=2",
]


@pytest.fixture()
def gridworld_run(tmp_path_factory, cache_env):
    """The uninterrupted gridworld run of RUN_ARGS, trained once in this process (test_resume's
    straight_run_once): the metrics test's run and the SIGKILL test's reference. -> its rows by step."""
    return straight_run_once(RUN_ARGS, tmp_path_factory, cache_env)[1]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["calculator", "gridworld"])
def test_agent_run_trains_and_logs_episode_metrics(name, tmp_path, in_process_cache, request):
    from jaxrl.train.loop import train

    if name == "gridworld":  # the module's 4-step run: the same checks on its first two steps
        by_step = request.getfixturevalue("gridworld_run")
        rows = [by_step[s] for s in sorted(by_step)]
        assert [r["step"] for r in rows] == list(range(STEPS + 1))
    else:
        rows = train(_cfg(name, "train.steps=2", "train.eval_every=2"), tmp_path / "run")
        assert [r["step"] for r in rows] == [0, 1, 2]
    step = rows[1]
    for key in (
        "agent/turns_mean",
        "agent/tool_calls_mean",
        "agent/tool_errors",
        "agent/env_seconds",
        "agent/env_exposed_seconds",
        "agent/env_hidden_seconds",
        "agent/reward_std_mean",
        "loss",
        "grad_norm",
    ):
        assert key in step, key
    # 4 prompts x 4 episodes; an episode the token budget cuts mid-turn ends without a step
    assert step["agent/turns_mean"] >= 1 and step["agent/env_steps"] > 0
    assert 0 <= rows[2]["eval/accuracy"] <= 1 and rows[2]["eval/turns"] >= 1
    assert step["rollout/samples"] == 16


@pytest.mark.slow
def test_starpo_s_draws_more_groups_and_keeps_the_batch_size(tmp_path, in_process_cache):
    from jaxrl.train.loop import train

    rows = train(_cfg("calculator", "train.steps=1", "agent.keep_top_variance=0.5"), tmp_path / "run")
    assert rows[1]["rollout/samples"] == 32  # ceil(4 / 0.5) = 8 groups of 4 drawn, 4 kept
    assert rows[1]["agent/kept_reward_std_mean"] >= rows[1]["agent/reward_std_mean"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra, field",
    [
        (["rollout.speculative.enabled=true"], "rollout.speculative.enabled"),
        (["rollout.engine.dynamic_sampling=true"], "rollout.engine.dynamic_sampling"),
        (["agent.keep_top_variance=0"], "agent.keep_top_variance"),
        (["agent.max_turns=0"], "agent.max_turns"),
        (["data.skip_long_prompts=true"], "data.skip_long_prompts"),
        (["data.task=agent_gridworld"], "data.max_prompt_len=9: the rendered prompt"),  # the calculator's 9 < 21
    ],
)
def test_agent_config_errors_name_the_field(tmp_path, extra, field, capsys, in_process_cache):
    # In this process: what the CLI prints and returns is what `python -m jaxrl.cli` exits with.
    from jaxrl import cli

    sets = sum((["--set", t] for t in SMALL + extra), [])
    code = cli.main(["train", str(_config("calculator")), *sets, "--workdir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("jaxrl: error:") and field in last, err[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_sigkill_mid_episodes_resumes_to_the_same_metrics(tmp_path, cache_env, gridworld_run):
    """Killed while a step's episodes are in flight (the rollout is most of a step), the run resumes from
    the previous step's checkpoint and replays that step's episodes from scratch: same environment
    seeds, same token keys, so every metric but the timing ones matches the uninterrupted run."""
    reference = gridworld_run
    _, resumed, _ = killed_and_resumed_runs(
        RUN_ARGS, tmp_path / "killed", cache_env, STEPS, kill_at=2, resume_in_process=True
    )

    def untimed(row):
        return {k: v for k, v in row.items() if k not in TIMING}

    for step in range(1, STEPS + 1):
        assert untimed(resumed[step]) == untimed(reference[step]), step
