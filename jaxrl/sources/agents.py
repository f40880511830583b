"""Multi-turn episodes as the loop's rollout source (data.task names an environment: jaxrl.agents).

    produced = source.produce(params, stream, rng, step)   # the same interface as groups.py

Each step takes prompts_per_step records (ceil(prompts_per_step / agent.keep_top_variance) with
StarPO-S filtering), plays group_size episodes of each on the episode engine
(jaxrl.rollout.episodes.driver), and returns a RolloutBatch whose completions hold the model's tokens
and the observations, `completion_mask_BxT` = 1 on the model's tokens only. Reward column 0 is the
trajectory's return, column 1 the optional per-turn shaping (agent.shaping_weight); with
keep_top_variance < 1 the groups whose rewards vary most are kept (StarPO-S). The source has no state
to checkpoint: a step's episodes finish inside it and a resumed step replays them (docs/agents.md).

With P processes the step's draw is split into P contiguous blocks (`processes.ProcessShare.block`):
process p plays the p-th on its own episode engine (its own devices, rollout.engine.slots / P slots;
its environments and tools in its own threads), episode j of the draw seeded as in one process, so
the step's rows in process order are a one-process run's (StarPO-S keeps the most varied groups of
each process's block). The stream position stays the run's, the same on every process, so there is
still nothing to checkpoint, and a run resumes with any number of processes. The metrics and the
evaluation's means are computed over every process's episodes (gathered), as one process does.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import NamedTuple

import numpy as np

from jaxrl.agents.env import AlphabetChecked
from jaxrl.agents.formats import check_model_format, check_prompt_fits, episode_format
from jaxrl.config import Config, ConfigError
from jaxrl.data.registry import get_task
from jaxrl.data.stream import StreamState, next_batch
from jaxrl.multihost import gather_objects
from jaxrl.rollout.batch import RolloutBatch
from jaxrl.rollout.episodes.driver import EpisodeEngine
from jaxrl.rollout.sampler import SamplingParams
from jaxrl.sources.base import Produced
from jaxrl.sources.processes import LocalLayout, ProcessShare, combine_metrics
from jaxrl.sources.scoring import combined_reward, reward_metrics


def check_agent_config(cfg: Config) -> None:
    """What multi-turn episodes cannot be combined with (one-line errors naming the field)."""
    if cfg.rollout.speculative.enabled:
        raise ConfigError(
            f"rollout.speculative.enabled: not available with multi-turn episodes "
            f"(data.task={cfg.data.task!r}); set it to false"
        )
    if cfg.rollout.engine.dynamic_sampling or cfg.rollout.engine.allocation != "uniform":
        raise ConfigError(
            "rollout.engine.dynamic_sampling / rollout.engine.allocation: not available with "
            "multi-turn episodes; use agent.keep_top_variance (StarPO-S) to filter groups"
        )
    check_model_format(cfg, get_task(cfg.data.task).suite)  # a checkpoint's run needs the Hermes tool format
    if cfg.data.skip_long_prompts:
        raise ConfigError(
            "data.skip_long_prompts: not available with multi-turn episodes (every record's prompt "
            "is the environment's reset text); raise data.max_prompt_len instead"
        )
    ProcessShare.current().rollout(cfg.rollout, group_slots=False)  # each process's share divides


def make_episode_engine(
    cfg: Config, model_cfg, tokenizer, suite, errors: list, *, greedy: bool = False, parallel=None
) -> EpisodeEngine:
    """The episode engine a run's config describes (rollout.*, rollout.engine.slots/chunk, agent.*); its
    tool format follows the tokenizer (jaxrl.agents.formats: Hermes for a Hugging Face checkpoint).
    errors: collects the observations outside a character tokenizer's alphabet (raise_first after a run).
    parallel (MoE): the run's `sharding.parallel_for(mesh, preset)`, as the update's."""
    rc = cfg.rollout
    fmt, end_of_turn = episode_format(cfg, tokenizer, suite)
    check_prompt_fits(cfg, tokenizer, suite, fmt)
    make_env = functools.partial(suite.make, cfg.agent, fmt)
    alphabet = getattr(tokenizer, "alphabet", None)
    if alphabet is not None:
        make_env = functools.partial(_alphabet_checked, make_env, alphabet, suite.name, errors)
    return EpisodeEngine(
        model_cfg,
        rc.engine,
        cfg.agent,
        make_env=make_env,
        tokenizer=tokenizer,
        end_of_turn=end_of_turn,
        prompt_len=cfg.data.max_prompt_len,
        sampling=SamplingParams(
            temperature=1.0 if greedy else rc.temperature,
            top_k=0 if greedy else rc.top_k,
            top_p=1.0 if greedy else rc.top_p,
            greedy=greedy,
            max_new_tokens=rc.max_new_tokens,
            eos_id=tokenizer.eos_id,
            pad_id=tokenizer.pad_id,
        ),
        parallel=parallel,
    )


def _alphabet_checked(make_env, alphabet: str, task: str, errors: list) -> AlphabetChecked:
    return AlphabetChecked(make_env(), alphabet, task, errors)


def raise_first(errors: list) -> None:
    """An observation outside the alphabet stops the run with its one-line error (the engine only counted it)."""
    if errors:
        raise errors[0]


def episode_rewards(groups, shaping_weight: float) -> list[np.ndarray]:
    """Each group's rewards_GxK: column 0 the trajectory return, column 1 the weighted shaping."""
    return [np.stack([g.return_G, shaping_weight * g.shaping_G], axis=1).astype(np.float32) for g in groups]


def keep_most_varied(rewards: list[np.ndarray], n: int, reward_weights) -> list[int]:
    """StarPO-S: the indices (in draw order) of the n groups whose combined rewards have the largest
    standard deviation; ties keep the earlier group."""
    std = np.array([combined_reward(r, reward_weights).std() for r in rewards])
    order = sorted(range(len(rewards)), key=lambda i: (-std[i], i))
    return sorted(order[:n])


def episode_batch(groups, rewards: list[np.ndarray], first_id: int = 0) -> RolloutBatch:
    """Episode groups -> the update's batch (rows of group i contiguous, group_id_B = first_id + i: a
    process's ids differ from every other's; the loss sees the model's tokens; no token is stale: no
    episode outlives its step). MoE: `routing_BxSxLxK`, the experts of every token of the row, the
    observations' (prefilled when the episode was placed) as the model's (decoded): cache slot c of an
    episode holds what the update's slot c does (prompt token c < P, then row token c - P)."""
    routing = None
    if groups and groups[0].routing_GxCxLxK is not None:
        width = groups[0].prompt_P.shape[0] + groups[0].tokens_GxT.shape[1]  # S = P + T
        routing = [g.routing_GxCxLxK[:, :width] for g in groups]
    batch = RolloutBatch.from_groups(
        groups, [g.loss_mask_GxT for g in groups], [g.truncated_G for g in groups], routing_GxSxLxK=routing
    )
    assert batch.group_id_B is not None  # from_groups numbers the groups
    stale_BxT = np.zeros(batch.tokens_BxT.shape, np.float32)
    return batch._replace(
        rewards_BxK=np.concatenate(rewards), stale_BxT=stale_BxT, group_id_B=batch.group_id_B + np.int32(first_id)
    )


def episode_metrics(groups, rewards: list[np.ndarray], reward_weights) -> dict:
    """agent/*: per-episode turns, tool calls, errors and outcomes, and the spread of rewards per group."""

    def col(name):
        return np.concatenate([getattr(g, name) for g in groups]).astype(np.float64)

    stds = [combined_reward(r, reward_weights).std() for r in rewards]
    return {
        "agent/success_rate": float(col("success_G").mean()),
        "agent/return_mean": float(col("return_G").mean()),
        "agent/turns_mean": float(col("turns_G").mean()),
        "agent/tool_calls_mean": float(col("tool_calls_G").mean()),
        "agent/tool_errors": int(col("tool_errors_G").sum()),
        "agent/env_errors": int(col("env_errors_G").sum()),
        "agent/obs_cut": int(col("obs_cut_G").sum()),
        "agent/truncated": float(col("truncated_G").mean()),
        "agent/reward_std_mean": float(np.mean(stds)),
        "agent/zero_std_groups": float(np.mean([s == 0 for s in stds])),
    }


def timing_metrics(stats: dict, before: dict) -> dict:
    """Environment time this step: summed over its steps, how much of it the host waited with
    nothing to decode (exposed) and the rest (hidden behind decoding)."""
    d = {k: stats.get(k, 0) - before.get(k, 0) for k in ("env_seconds", "env_exposed_seconds", "env_steps")}
    return {
        "agent/env_steps": int(d["env_steps"]),
        "agent/env_seconds": float(d["env_seconds"]),
        "agent/env_exposed_seconds": float(d["env_exposed_seconds"]),
        "agent/env_hidden_seconds": max(float(d["env_seconds"] - d["env_exposed_seconds"]), 0.0),
    }


def _process_share(cfg: Config, param_sh, who: str) -> tuple[Config, LocalLayout | None]:
    """(this process's config: its share of prompts_per_step and rollout.engine.slots, where its
    episodes run: the rollout's preset on its own devices); one process: (cfg, None)."""
    share = ProcessShare.current()
    if share.count == 1:
        return cfg, None
    if param_sh is None:
        raise ValueError(f"{who}: param_sh (the params' shardings) is needed with several processes")
    rollout = share.rollout(cfg.rollout, group_slots=False)  # an episode holds one slot
    return dataclasses.replace(cfg, rollout=rollout), LocalLayout.of_rollout(cfg, param_sh)


class _Drawn(NamedTuple):
    """One process's part of a step's metrics: what every process's are gathered and combined from."""

    groups: list  # the EpisodeGroups drawn, their token arrays dropped (the agent/* columns stay)
    rewards: list  # each group's rewards_GxK
    kept: list  # the indices of the groups in the batch
    rewards_BxK: np.ndarray  # the batch's
    completion_mask_BxT: np.ndarray
    truncated_B: np.ndarray
    tokens: float  # the model's tokens over every episode drawn
    seconds: dict  # {"rollout/seconds", agent/env_* timings}: reduced by combine_metrics


_TOKEN_ARRAYS = dict.fromkeys(("prompt_P", "prompt_mask_P", "tokens_GxT", "logp_GxT", "version_GxT", "routing_GxCxLxK"))


def _step_metrics(everyone: list[_Drawn], n_samples: int, starpo: bool, reward_weights) -> dict:
    """The step's metrics over every process's episodes (one process: its own), in process order:
    reward/* over the batch's rows, agent/* over every episode drawn, timings summed (the wall-clock
    rollout/seconds: the slowest process's)."""
    drawn = [g for d in everyone for g in d.groups]
    rewards = [r for d in everyone for r in d.rewards]
    timings = combine_metrics([d.seconds for d in everyone])

    def cat(field):
        return np.concatenate([getattr(d, field) for d in everyone])

    metrics = reward_metrics(
        cat("rewards_BxK"), cat("completion_mask_BxT"), cat("truncated_B") == 0, 0, 0, reward_weights
    )
    seconds = timings.pop("rollout/seconds")
    metrics.update(
        {
            "rollout/tokens_per_s": sum(d.tokens for d in everyone) / max(seconds, 1e-9),
            "rollout/seconds": seconds,
            "rollout/samples": n_samples,
            **episode_metrics(drawn, rewards, reward_weights),
            **timings,
        }
    )
    if starpo:
        kept = [d.groups[i] for d in everyone for i in d.kept]
        kept_rewards = [d.rewards[i] for d in everyone for i in d.kept]
        metrics["agent/kept_reward_std_mean"] = episode_metrics(kept, kept_rewards, reward_weights)[
            "agent/reward_std_mean"
        ]
    return metrics


class AgentSource:
    """The step's episode groups, scored by their environments (see the module docstring).
    parallel (one process): the rollout layout's `sharding.parallel_for` (training's unless rollout.mesh
    sets one); param_sh: the params' shardings under that layout (needed with several processes)."""

    def __init__(self, cfg: Config, model_cfg, tokenizer, task, suite, host: dict, parallel=None, param_sh=None):
        del host  # nothing to restore: no episode outlives its step, the stream position is the run's
        check_agent_config(cfg)
        self.share = ProcessShare.current()
        cfg, self.local = _process_share(cfg, param_sh, "AgentSource")
        if self.local is not None:
            parallel = self.local.parallel
        self.cfg, self.task, self.errors = cfg, task, []
        self.engine = make_episode_engine(cfg, model_cfg, tokenizer, suite, self.errors, parallel=parallel)

    def produce(self, params, stream: StreamState, rng, step: int) -> Produced:
        """`rng` is unused: the episodes' environment seeds and token keys come from (train.seed, step,
        episode index in the step's draw), so a replayed step plays the same episodes whatever the
        timing or the number of processes. With StarPO-S the agent/* metrics describe every episode
        drawn, reward/* the groups kept for the update. Several processes: this process's block of
        the draw, the batch its rows; `stream` and the metrics are the run's (a collective)."""
        del rng
        cfg, share, t0, stats0 = self.cfg, self.share, time.perf_counter(), dict(self.engine.stats)
        n = cfg.rollout.prompts_per_step  # this process's share
        n_draw = math.ceil(n / cfg.agent.keep_top_variance - 1e-9)
        records, stream = next_batch(self.task.train, stream, n_draw * share.count, cfg.data.seed)
        mine = share.block(len(records))
        if self.local is not None:
            params = self.local.params(params)
        groups = self.engine.run(
            params,
            step - 1,
            [(r, r) for r in records[mine]],
            cfg.rollout.group_size,
            seed=(cfg.train.seed, step),
            first=mine.start,
        )
        raise_first(self.errors)
        seconds = time.perf_counter() - t0
        rewards = episode_rewards(groups, cfg.agent.shaping_weight)
        kept = keep_most_varied(rewards, n, cfg.loss.reward_weights) if n_draw > n else list(range(n))
        batch = episode_batch([groups[i] for i in kept], [rewards[i] for i in kept], first_id=share.index * n)
        assert batch.rewards_BxK is not None  # episode_batch sets them
        mine_drawn = _Drawn(
            [g._replace(**_TOKEN_ARRAYS) for g in groups],
            rewards,
            kept,
            batch.rewards_BxK,
            batch.completion_mask_BxT,
            batch.truncated_B,
            sum(float(g.loss_mask_GxT.sum()) for g in groups),  # the model's tokens, all episodes
            {"rollout/seconds": seconds, **timing_metrics(self.engine.stats, stats0)},
        )
        n_samples = n_draw * share.count * cfg.rollout.group_size
        metrics = _step_metrics(gather_objects(mine_drawn), n_samples, n_draw > n, cfg.loss.reward_weights)
        return Produced(batch, None, metrics, stream)

    def checkpoint_state(self) -> dict:
        return {}


def make_agent_evaluator(cfg: Config, model_cfg, tokenizer, suite, records: list[dict], parallel=None, param_sh=None):
    """evaluate(params) -> eval/accuracy (greedy episodes' success rate on the test records), eval/return,
    eval/turns, eval/tool_calls, eval/response_len (model tokens per episode). Environment seeds are
    fixed, so a slippery environment plays the same dice at every evaluation. Several processes (give
    param_sh): each plays its block of the records, the means are over all of them (a collective),
    the numbers one process reports."""
    cfg, local = _process_share(cfg, param_sh, "make_agent_evaluator")
    errors: list = []
    engine = make_episode_engine(
        cfg, model_cfg, tokenizer, suite, errors, greedy=True, parallel=parallel if local is None else local.parallel
    )
    mine = ProcessShare.current().block(len(records))

    def evaluate(params) -> dict:
        if local is not None:
            params = local.params(params)
        # seed (train.seed, 0): training steps use (train.seed, step >= 1)
        requests = [(r, r) for r in records[mine]]
        groups = engine.run(params, 0, requests, 1, seed=(cfg.train.seed, 0), first=mine.start)
        raise_first(errors)

        def col(name):
            return np.concatenate([getattr(g, name) for g in groups] or [np.zeros(0)]).astype(np.float64)

        cols = {name: col(name) for name in ("success_G", "return_G", "turns_G", "tool_calls_G")}
        lengths = np.concatenate([g.loss_mask_GxT.sum(1) for g in groups] or [np.zeros(0, np.float32)])
        everyone = gather_objects((cols, lengths))  # in process order: the records' order

        def mean(name):
            return float(np.concatenate([c[name] for c, _ in everyone]).mean())

        return {
            "eval/accuracy": mean("success_G"),
            "eval/return": mean("return_G"),
            "eval/turns": mean("turns_G"),
            "eval/tool_calls": mean("tool_calls_G"),
            "eval/response_len": float(np.concatenate([n for _, n in everyone]).mean()),
        }

    return evaluate
