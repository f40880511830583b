"""Black-box agents in the training loop (configs/agent_openai_calculator.py, tiny): the run serves its own
engine on 127.0.0.1, the agent's episodes train token-exactly (the update's recomputed log-probs match
the engine's to float noise), and a run SIGKILLed mid-run resumes to the same metrics as an
uninterrupted run (the agents re-run from their seeds)."""

import json

import pytest
from conftest import REPO, TINY
from test_resume import killed_and_resumed_runs, straight_run_once

pytestmark = pytest.mark.usefixtures("persistent_compile_cache")  # training runs repeat programs

TIMING = {"rollout/seconds", "rollout/tokens_per_s", "step_seconds", "wall_time"}
STEPS = 4
SMALL = [t for t in TINY if not t.startswith("data.")] + [
    "data.num_train=200",
    "data.num_test=20",
    "rollout.engine.slots=8",
    "train.eval_prompts=8",
    "warmstart.steps=60",  # enough for the tiny model to call the tool now and then
    "warmstart.learning_rate=0.01",
]
RUN_ARGS = [
    str(REPO / "configs" / "agent_openai_calculator.py"),
    *sum((["--set", t] for t in SMALL), []),
    "--set",
    f"train.steps={STEPS}",
    "--set",
    "checkpoint.every=1",
    "--set",
    "train.eval_every=2",
]


@pytest.fixture()
def blackbox_run(tmp_path_factory, cache_env):
    """The uninterrupted run of RUN_ARGS, trained once in this process. -> its rows by step."""
    return straight_run_once(RUN_ARGS, tmp_path_factory, cache_env)[1]


@pytest.mark.slow
def test_jaxrl_eval_plays_the_runs_greedy_episodes(tmp_path_factory, cache_env, blackbox_run, tmp_path):
    """`jaxrl eval` of the run's last checkpoint plays the agent's greedy episodes on the same test
    records as the run's own evaluation: the same accuracy."""
    from jaxrl import cli

    workdir = straight_run_once(RUN_ARGS, tmp_path_factory, cache_env)[0]
    out = tmp_path / "eval.json"
    args = [RUN_ARGS[0], "--workdir", str(workdir), "--prompts", "8", "--out", str(out), *RUN_ARGS[1:-6]]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXRL_DATA_DIR", cache_env["JAXRL_DATA_DIR"])
        mp.setenv("JAXRL_CACHE_DIR", cache_env["JAXRL_CACHE_DIR"])
        assert cli.main(["eval", *args]) == 0
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics["greedy/accuracy"] == blackbox_run[STEPS]["eval/accuracy"]
    assert metrics["greedy/turns"] == blackbox_run[STEPS]["eval/turns"]


@pytest.mark.slow
def test_blackbox_run_trains_token_exactly_and_logs_agent_metrics(blackbox_run):
    rows = blackbox_run
    assert sorted(rows) == list(range(STEPS + 1))
    for step in range(1, STEPS + 1):
        row = rows[step]
        assert row["rollout/samples"] == 16  # 4 records x 4 episodes, one row each
        for key in ("agent/turns_mean", "agent/segments_mean", "agent/dropped_tokens", "agent/reward_std_mean"):
            assert key in row, key
        assert row["agent/agent_errors"] == 0  # the calculator agent never raises on its own
        assert row["agent/segments_mean"] == 1.0  # it only ever extends its transcript
        assert row["agent/turns_mean"] >= 1
        # The rows are the engine's own tokens: the update's recomputed log-probs are the sampled ones.
        assert row["mismatch_abs_logp"] < 1e-4, (step, row["mismatch_abs_logp"])
        assert row["stale_tokens"] == 0.0
    assert max(rows[s]["agent/turns_mean"] for s in range(1, STEPS + 1)) > 1  # tool calls happen
    assert 0 <= rows[2]["eval/accuracy"] <= 1 and rows[2]["eval/turns"] >= 1


@pytest.mark.slow
def test_sigkill_mid_run_resumes_to_the_same_metrics(tmp_path, cache_env, blackbox_run):
    """Killed once checkpoint 2 exists (a step's agents in flight, or about to be), the run resumes from
    its last checkpoint and replays the steps after it: the same records, the same request seeds, so
    every metric but the timing ones matches the uninterrupted run."""
    _, resumed, restored = killed_and_resumed_runs(
        RUN_ARGS, tmp_path / "killed", cache_env, STEPS, kill_at=2, resume_in_process=True
    )
    assert restored < STEPS

    def untimed(row):
        return {k: v for k, v in row.items() if k not in TIMING}

    for step in range(1, STEPS + 1):
        assert untimed(resumed[step]) == untimed(blackbox_run[step]), step
