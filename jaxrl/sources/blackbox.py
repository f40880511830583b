"""Black-box agents as the loop's rollout source (a task with `Task.agent`; docs/agents.md).

    produced = source.produce(params, stream, rng, step)   # the same interface as agents.py

The run serves its own engine in-process: a `ServingEngine` (jaxrl.serve.engine) behind the
OpenAI-compatible app (jaxrl.serve.app) on 127.0.0.1 at a free port, with an `EpisodeRecorder`
(jaxrl.serve.recorder) as its Service. Each step takes prompts_per_step records and plays group_size
episodes of each: episode g of record j calls `agent(client, record)` with a client whose base_url is
http://127.0.0.1:PORT/episodes/<step.j.g>/v1, all episodes concurrently (plain agents in threads,
`async def` agents on one asyncio loop). The engine's params are the step's policy (version step - 1);
every request is seeded from (train.seed, step, j, g, its number in the episode), so a replayed step
plays the same episodes. The recorder turns each episode into one row (its tokens, loss mask on the
model's tokens, their log-probs and versions); the reward is what the agent returns (column 0), or,
when it returns None, the task's verifier on the last completion (correctness, format). An agent that
raises ends its episode with reward 0, counted in agent/agent_errors. The source has no state to
checkpoint: a step's episodes finish inside it and a resumed step replays them.

One process only for now (a ConfigError with several). MoE: the rows carry no routing (the recorder
keeps tokens, not the experts the serving engine chose), so `train.routing_replay=true` is a ConfigError
naming it; with it false the update routes with its own router (`moe/routing_mismatch` is not logged).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxrl.config import Config, ConfigError
from jaxrl.data.stream import StreamState, next_batch
from jaxrl.rollout.batch import RolloutBatch
from jaxrl.serve.recorder import Budget, EpisodeRecorder, EpisodeTrace, episode_id
from jaxrl.sources.base import Produced
from jaxrl.sources.processes import ProcessShare
from jaxrl.sources.scoring import combined_reward, reward_metrics

API_KEY = "jaxrl-local"  # the in-process server listens on 127.0.0.1 only; a key keeps stray clients out
REQUEST_TIMEOUT_S = 600.0
EVAL_VERSION = -1  # the policy version an evaluation serves (its tokens train nothing)
UNLIMITED = 1 << 30  # the app's prompt and max_tokens limits in a run: the recorder applies the budget


def check_blackbox_config(cfg: Config, task_name: str, model_cfg=None) -> None:
    """What black-box agents cannot be combined with (one-line errors naming the field). model_cfg: the
    resolved model (an HF checkpoint's architecture), else cfg.model."""
    rc = cfg.rollout
    if (model_cfg or cfg.model).n_experts and cfg.train.routing_replay:
        raise ConfigError(
            f"train.routing_replay: black-box agents (data.task={task_name!r}) do not record the MoE routing "
            "(the serving engine's requests re-prefill each turn's context); set train.routing_replay=false "
            "to let the update route with its own router"
        )
    if ProcessShare.current().count > 1:
        raise ConfigError(f"data.task: {task_name!r} runs a black-box agent, which needs one process (for now)")
    if rc.speculative.enabled:
        raise ConfigError("rollout.speculative.enabled: not available with black-box agents; set it to false")
    if rc.top_k != 0:
        raise ConfigError(f"rollout.top_k: got {rc.top_k}, the serving engine samples with top_p only; set it to 0")
    if rc.engine.dynamic_sampling or rc.engine.allocation != "uniform":
        raise ConfigError(
            "rollout.engine.dynamic_sampling / rollout.engine.allocation: not available with black-box agents"
        )
    if rc.engine.slots < 1:
        raise ConfigError(f"rollout.engine.slots: got {rc.engine.slots}, expected >= 1")


class AgentServer:
    """The run's engine behind the app on 127.0.0.1 at a free port, in this process (threads: the
    engine's decode loop and uvicorn's event loop). Started at the first `use(params, version)`."""

    def __init__(self, cfg: Config, model_cfg, tokenizer, parallel=None):
        self.cfg, self.model_cfg, self.tokenizer, self.parallel = cfg, model_cfg, tokenizer, parallel
        self.engine = self.recorder = self._server = self._thread = None
        self.port = 0

    def use(self, params, version: int, sampling: tuple[float, float] | None) -> EpisodeRecorder:
        """Serve `params` as policy `version` from now on (starting the engine and the server the first
        time); sampling: the (temperature, top_p) every request gets, None: the agent's own. `params`
        come as the loop and `jaxrl eval` hand a policy over, already cast to the compute dtype once per
        version (`transformer.rollout_params`), so they are not cast again here."""
        if self.engine is None:
            self._start(params, version)
        else:
            self.engine.set_params(params, version)
            self._await_version(version)
        assert self.recorder is not None
        self.recorder.set_sampling(sampling)
        return self.recorder

    def _await_version(self, version: int, timeout: float = 60.0) -> None:
        """Wait until the decode thread runs `version`: a chunk it was decoding when set_params came
        (a cancelled request's last one) must not admit this step's first requests with the old params.
        (The version a run serves changes at every call: step s serves s - 1, an evaluation EVAL_VERSION,
        and two evaluations never follow each other.)"""
        assert self.engine is not None
        deadline = time.monotonic() + timeout
        while self.engine.stats()["version"] != version:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the serving engine did not switch to policy version {version} within {timeout} s")
            time.sleep(0.001)

    def _start(self, params, version: int) -> None:
        import uvicorn

        from jaxrl.serve.app import create_app
        from jaxrl.serve.engine import ServingEngine
        from jaxrl.serve.schema import Limits

        rc, P = self.cfg.rollout, self.cfg.data.max_prompt_len
        T = rc.max_new_tokens
        self.engine = ServingEngine(
            params,
            self.model_cfg,
            eos_id=self.tokenizer.eos_id,
            pad_id=self.tokenizer.pad_id,
            slots=rc.engine.slots,
            max_prompt_tokens=P + T,  # a later turn's prompt is the whole context so far
            max_new_tokens=T,
            max_n=1,
            chunk=rc.engine.chunk,
            rng=jax.random.PRNGKey(self.cfg.train.seed),
            version=version,
            max_queue=1 << 16,
            parallel=self.parallel,
        )
        self.recorder = EpisodeRecorder(self.engine, self.tokenizer, "policy", Budget(P, T), None)
        # The recorder, not the app, fits requests to the episode's budget (max_tokens cut to what is left;
        # a context past it refused with a 400 naming max_tokens, the episode truncated), so the app takes
        # any prompt and max_tokens its body limit (1 MiB) lets through.
        limits = Limits(max_prompt_tokens=UNLIMITED, max_tokens=UNLIMITED, max_n=1, api_key=API_KEY)
        app = create_app(self.recorder, limits)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self.engine.start()
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="jaxrl-agent-server", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the black-box agents' in-process server did not start on 127.0.0.1")
            time.sleep(0.01)

    def base_url(self, episode: str) -> str:
        return f"http://127.0.0.1:{self.port}/episodes/{episode}/v1"

    def close(self) -> None:
        """Stop the server and the engine (idempotent)."""
        if self._server is not None:
            self._server.should_exit = True
            assert self._thread is not None
            self._thread.join(timeout=30)
            self._server = None
        if self.engine is not None:
            self.engine.stop()


class Outcome(NamedTuple):
    """What one agent call gave."""

    reward: float | None
    error: BaseException | None


def _client_kwargs(url: str, http_client) -> dict:
    return dict(base_url=url, api_key=API_KEY, max_retries=0, timeout=REQUEST_TIMEOUT_S, http_client=http_client)


def _call_sync(agent, url: str, record: dict, http_client) -> Outcome:
    import openai

    client = openai.OpenAI(**_client_kwargs(url, http_client))  # not closed: the HTTP client is shared
    try:
        return Outcome(agent(client, record), None)
    except Exception as err:  # the agent's own failure (or a refused request) ends the episode, counted
        return Outcome(None, err)


async def _call_async(agent, url: str, record: dict, limit: asyncio.Semaphore, http_client) -> Outcome:
    import openai

    async with limit:
        client = openai.AsyncOpenAI(**_client_kwargs(url, http_client))
        try:
            return Outcome(await agent(client, record), None)
        except Exception as err:
            return Outcome(None, err)


def play(agent: Callable[..., Any], calls: list[tuple[str, dict]], concurrency: int) -> list[Outcome]:
    """Run agent(client, record) for every (base_url, record), at most `concurrency` at once -> the
    outcomes in order (plain agents in threads, async ones on one asyncio loop). The episodes' clients
    share one HTTP connection pool: a client of its own costs each episode ~20-40 ms of CPU (an SSL
    context), several seconds a step."""
    import openai

    if not calls:
        return []
    if inspect.iscoroutinefunction(agent):

        async def run_all():
            limit = asyncio.Semaphore(concurrency)
            async with openai.DefaultAsyncHttpxClient(timeout=REQUEST_TIMEOUT_S) as http:
                return await asyncio.gather(*(_call_async(agent, url, dict(r), limit, http) for url, r in calls))

        return list(asyncio.run(run_all()))
    workers = min(concurrency, len(calls))
    with (
        openai.DefaultHttpxClient(timeout=REQUEST_TIMEOUT_S) as http,
        concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jaxrl-agent") as pool,
    ):
        return list(pool.map(lambda c: _call_sync(agent, c[0], dict(c[1]), http), calls))


def episode_reward(task, outcome: Outcome, trace: EpisodeTrace, record: dict) -> np.ndarray:
    """rewards_K of one episode: [the agent's reward, 0], or the verifier's (correctness, format) on
    the last completion when the agent returned None; [0, 0] when the agent raised."""
    if outcome.error is not None:
        return np.zeros(2, np.float32)
    if outcome.reward is None:
        if task.verifier is None:
            raise ConfigError(
                f"data.task: the agent of {task.name!r} returned None for record {record.get('id')!r} and the "
                "task has no verifier (Task.verifier); return a float reward"
            )
        values = np.asarray(task.verifier(trace.final_text, not trace.truncated, record), np.float32).reshape(-1)
        if values.shape != (2,) or not np.all(np.isfinite(values)):
            raise ConfigError(f"data.task: the verifier of {task.name!r} returned {values!r}, expected 2 finite floats")
        return values
    reward = outcome.reward
    if isinstance(reward, bool) or not isinstance(reward, int | float | np.floating | np.integer):
        raise ConfigError(
            f"data.task: the agent of {task.name!r} returned {reward!r} for record {record.get('id')!r}, "
            "expected a float reward or None"
        )
    if not math.isfinite(float(reward)):
        raise ConfigError(f"data.task: the agent of {task.name!r} returned a non-finite reward {reward!r}")
    return np.array([float(reward), 0.0], np.float32)


class Played(NamedTuple):
    """A set of episodes (records x group_size, record-major) and what they gave."""

    traces: list[EpisodeTrace]
    outcomes: list[Outcome]
    rewards_NxK: np.ndarray


def play_episodes(
    server: AgentServer, task, agent, records: list[dict], group_size: int, seed: tuple[int, ...], name: str
) -> Played:
    """Open every episode in the recorder, run the agents, close the episodes -> their rows and rewards.
    Episode (j, g) is `name.j.g`, seeded (*seed, j, g)."""
    recorder = server.recorder
    assert recorder is not None
    ids = [(episode_id(name, j, g), r) for j, r in enumerate(records) for g in range(group_size)]
    for n, (eid, _) in enumerate(ids):
        recorder.open(eid, (*seed, *divmod(n, group_size)))
    try:
        outcomes = play(agent, [(server.base_url(eid), r) for eid, r in ids], server.cfg.rollout.engine.slots)
    finally:
        traces = [recorder.close(eid) for eid, _ in ids]
    rewards = [episode_reward(task, o, t, r) for o, t, (_, r) in zip(outcomes, traces, ids)]
    return Played(traces, outcomes, np.stack(rewards))


def played_batch(played: Played, group_size: int) -> RolloutBatch:
    """The update's batch: one row per episode, the G episodes of a record contiguous (group_id_B = j)."""
    tr = played.traces

    def stack(field, dtype):
        return np.stack([getattr(t, field) for t in tr]).astype(dtype)

    return RolloutBatch(
        prompt_tokens_BxP=stack("prompt_P", np.int32),
        prompt_mask_BxP=stack("prompt_mask_P", np.int32),
        tokens_BxT=stack("tokens_T", np.int32),
        completion_mask_BxT=stack("loss_mask_T", np.float32),
        rollout_logp_BxT=stack("logp_T", np.float32),
        truncated_B=np.array([t.truncated for t in tr], np.float32),
        rewards_BxK=played.rewards_NxK.astype(np.float32),
        group_id_B=np.repeat(np.arange(len(tr) // group_size, dtype=np.int32), group_size),
        stale_BxT=np.zeros((len(tr), tr[0].tokens_T.shape[0]), np.float32),  # no episode outlives its step
    )


def played_metrics(played: Played, group_size: int, reward_weights) -> dict:
    """agent/*: per-episode requests, segments, dropped model tokens, agent errors and outcomes, and the
    spread of rewards per group."""
    r_N = combined_reward(played.rewards_NxK, reward_weights)
    stds = r_N.reshape(-1, group_size).std(axis=1)
    tr = played.traces
    return {
        "agent/success_rate": float(np.mean(played.rewards_NxK[:, 0] > 0)),
        "agent/return_mean": float(played.rewards_NxK[:, 0].mean()),
        "agent/turns_mean": float(np.mean([t.requests for t in tr])),
        "agent/segments_mean": float(np.mean([t.segments for t in tr])),
        "agent/dropped_tokens": int(sum(t.dropped_tokens for t in tr)),
        # an agent whose request the budget refused raised too: that episode counts as truncated only
        "agent/agent_errors": int(sum(o.error is not None and not t.truncated for o, t in zip(played.outcomes, tr))),
        "agent/truncated": float(np.mean([t.truncated for t in tr])),
        "agent/reward_std_mean": float(stds.mean()),
        "agent/zero_std_groups": float(np.mean(stds == 0)),
    }


def first_error(played: Played) -> str | None:
    """The first agent error, as one line (for the log)."""
    for o, t in zip(played.outcomes, played.traces):
        if o.error is not None and not t.truncated:
            return f"{type(o.error).__name__}: {o.error}"
    return None


class BlackBoxSource:
    """The step's episodes, played by the task's agent through the run's server (see the module docstring)."""

    def __init__(self, cfg: Config, model_cfg, tokenizer, task, host: dict, server: AgentServer):
        del host  # nothing to restore: no episode outlives its step, the stream position is the run's
        check_blackbox_config(cfg, task.spec.name, model_cfg)
        self.cfg, self.task, self.server = cfg, task, server
        self.agent = task.spec.agent_fn

    def produce(self, params, stream: StreamState, rng, step: int) -> Produced:
        """`rng` is unused: every request's noise comes from (train.seed, step, episode, request number)."""
        del rng
        cfg, t0 = self.cfg, time.perf_counter()
        rc = cfg.rollout
        records, stream = next_batch(self.task.train, stream, rc.prompts_per_step, cfg.data.seed)
        self.server.use(params, step - 1, (rc.temperature, rc.top_p))
        played = play_episodes(
            self.server, self.task.spec, self.agent, list(records), rc.group_size, (cfg.train.seed, step), str(step)
        )
        seconds = time.perf_counter() - t0
        if (error := first_error(played)) is not None:  # the agent's failure is the user's to see
            print(f"jaxrl: step {step}: an agent of {self.task.spec.name!r} raised {error}", file=sys.stderr)
        batch = played_batch(played, rc.group_size)
        assert batch.rewards_BxK is not None
        metrics = reward_metrics(
            batch.rewards_BxK, batch.completion_mask_BxT, batch.truncated_B == 0, 0, 0, cfg.loss.reward_weights
        )
        model_tokens = float(batch.completion_mask_BxT.sum())
        metrics.update(
            {
                "rollout/tokens_per_s": model_tokens / max(seconds, 1e-9),
                "rollout/seconds": seconds,
                "rollout/samples": len(played.traces),
                **played_metrics(played, rc.group_size, cfg.loss.reward_weights),
            }
        )
        return Produced(batch, None, metrics, stream)

    def checkpoint_state(self) -> dict:
        return {}

    def close(self) -> None:
        self.server.close()


def make_blackbox_evaluator(cfg: Config, task, records: list[dict], server: AgentServer):
    """evaluate(params) -> eval/accuracy (greedy episodes with a positive reward on the test records),
    eval/return, eval/turns (requests per episode), eval/response_len (model tokens per episode)."""
    agent, count = task.spec.agent_fn, [0]

    def evaluate(params) -> dict:
        server.use(params, EVAL_VERSION, (0.0, 1.0))  # greedy: temperature 0 is the engine's argmax
        count[0] += 1
        played = play_episodes(server, task.spec, agent, records, 1, (cfg.train.seed, 0), f"eval{count[0]}")
        r = played.rewards_NxK[:, 0]
        return {
            "eval/accuracy": float(np.mean(r > 0)),
            "eval/return": float(r.mean()),
            "eval/turns": float(np.mean([t.requests for t in played.traces])),
            "eval/response_len": float(np.mean([t.loss_mask_T.sum() for t in played.traces])),
        }

    return evaluate
