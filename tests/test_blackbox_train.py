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


@pytest.mark.slow
def test_the_real_servers_rows_carry_the_trainers_logprobs():
    """An async agent against the real in-process server (ServingEngine + uvicorn on 127.0.0.1): two
    requests per episode with the agent's own text in between. Every row's model tokens carry the
    version they were drawn with and the log-prob the trainer's `token_logprobs` recomputes from the
    row, at the run's temperature (0.7, whatever the agent asked); the agent's text is observation."""
    import jax
    import numpy as np

    from jaxrl.agents.env import AGENT_ALPHABET
    from jaxrl.config import ModelConfig, load_config
    from jaxrl.data.registry import Task
    from jaxrl.data.tokenizer import CharTokenizer
    from jaxrl.models import transformer as tf
    from jaxrl.sources import blackbox

    cfg = load_config(RUN_ARGS[0], [*SMALL, "rollout.max_new_tokens=24"])
    tok = CharTokenizer(AGENT_ALPHABET)
    model_cfg = ModelConfig(
        vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64
    )
    params = tf.init_params(model_cfg, jax.random.PRNGKey(0))

    async def agent(client, record):
        first = await client.completions.create(model="policy", prompt=record["prompt"], max_tokens=6, temperature=0)
        prompt = record["prompt"] + first.choices[0].text + ">ok\n"
        # more than the episode has left: the recorder cuts it to the budget (rollout.max_new_tokens=24)
        second = await client.completions.create(model="policy", prompt=prompt, max_tokens=1000)
        return float(len(second.choices[0].text))

    records = [{"id": str(i), "prompt": f"{i}*{i}="} for i in range(3)]
    task = Task("t", agent=agent, records=records)
    server = blackbox.AgentServer(cfg, model_cfg, tok)
    try:
        server.use(params, 5, (0.7, 1.0))
        played = blackbox.play_episodes(server, task, agent, records, 2, (0, 1), "t")
    finally:
        server.close()
    assert [o.error for o in played.outcomes] == [None] * 6
    assert [t.requests for t in played.traces] == [2] * 6
    assert all(t.loss_mask_T.sum() <= 24 - 4 for t in played.traces)  # the budget held (">ok\n" is 4)
    batch = blackbox.played_batch(played, 2)
    logp_BxT, _ = tf.token_logprobs(
        params,
        model_cfg,
        batch.prompt_tokens_BxP,
        batch.prompt_mask_BxP,
        batch.tokens_BxT,
        batch.completion_mask_BxT,
        0.7,
    )
    m = batch.completion_mask_BxT > 0
    assert m.sum() >= 12  # at least one model token per request
    np.testing.assert_allclose(np.asarray(logp_BxT)[m], batch.rollout_logp_BxT[m], atol=1e-5)
    version_BxT = np.stack([t.version_T for t in played.traces])
    assert (version_BxT[m] == 5).all() and (version_BxT[~m] == -1).all()
    for t in played.traces:  # the agent's ">ok\n" sits between the two turns, as observation
        text = tok.decode([int(x) for x, keep in zip(t.tokens_T, t.loss_mask_T) if not keep and x != tok.pad_id])
        assert text == ">ok\n"
