"""Multi-turn episodes as the loop's rollout source (data.task names an environment: jaxrl.agents).

    produced = source.produce(params, stream, rng, step)   # the same interface as groups.py

Each step takes prompts_per_step records (ceil(prompts_per_step / agent.keep_top_variance) with
StarPO-S filtering), plays group_size episodes of each on the episode engine
(jaxrl.rollout.episodes.driver), and returns a RolloutBatch whose completions hold the model's tokens
and the observations, `completion_mask_BxT` = 1 on the model's tokens only. Reward column 0 is the
trajectory's return, column 1 the optional per-turn shaping (agent.shaping_weight); with
keep_top_variance < 1 the groups whose rewards vary most are kept (StarPO-S). The source has no state
to checkpoint: a step's episodes finish inside it and a resumed step replays them (docs/agents.md).
"""

from __future__ import annotations

import functools
import math
import time

import jax
import numpy as np

from jaxrl.agents.env import AlphabetChecked
from jaxrl.agents.formats import check_model_format, check_prompt_fits, episode_format
from jaxrl.config import Config, ConfigError
from jaxrl.data.registry import get_task
from jaxrl.data.stream import StreamState, next_batch
from jaxrl.rollout.batch import RolloutBatch
from jaxrl.rollout.episodes.driver import EpisodeEngine
from jaxrl.rollout.sampler import SamplingParams
from jaxrl.sources.base import Produced
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
    if jax.process_count() > 1:
        raise ConfigError(
            f"data.task={cfg.data.task!r}: multi-turn episodes run in one process; this run has {jax.process_count()}"
        )


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


def episode_batch(groups, rewards: list[np.ndarray]) -> RolloutBatch:
    """Episode groups -> the update's batch (rows of group i contiguous, group_id_B = i; the loss sees
    the model's tokens; no token is stale: no episode outlives its step)."""
    batch = RolloutBatch.from_groups(groups, [g.loss_mask_GxT for g in groups], [g.truncated_G for g in groups])
    stale_BxT = np.zeros(batch.tokens_BxT.shape, np.float32)
    return batch._replace(rewards_BxK=np.concatenate(rewards), stale_BxT=stale_BxT)


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


class AgentSource:
    """The step's episode groups, scored by their environments (see the module docstring)."""

    def __init__(self, cfg: Config, model_cfg, tokenizer, task, suite, host: dict, parallel=None):
        del host  # nothing to restore: no episode outlives its step
        check_agent_config(cfg)
        self.cfg, self.task, self.errors = cfg, task, []
        ep = parallel
        self.engine = make_episode_engine(cfg, model_cfg, tokenizer, suite, self.errors, parallel=ep)

    def produce(self, params, stream: StreamState, rng, step: int) -> Produced:
        """`rng` is unused: the episodes' environment seeds and token keys come from (train.seed, step,
        episode index), so a replayed step plays the same episodes whatever the timing. With StarPO-S
        the agent/* metrics describe every episode drawn, reward/* the groups kept for the update."""
        del rng
        cfg, t0, stats0 = self.cfg, time.perf_counter(), dict(self.engine.stats)
        n = cfg.rollout.prompts_per_step
        n_draw = math.ceil(n / cfg.agent.keep_top_variance - 1e-9)
        records, stream = next_batch(self.task.train, stream, n_draw, cfg.data.seed)
        groups = self.engine.run(
            params, step - 1, [(r, r) for r in records], cfg.rollout.group_size, seed=(cfg.train.seed, step)
        )
        raise_first(self.errors)
        seconds = time.perf_counter() - t0
        rewards = episode_rewards(groups, cfg.agent.shaping_weight)
        kept = keep_most_varied(rewards, n, cfg.loss.reward_weights) if n_draw > n else list(range(n))
        drawn_metrics = episode_metrics(groups, rewards, cfg.loss.reward_weights)
        drawn_tokens = sum(float(g.loss_mask_GxT.sum()) for g in groups)  # the model's tokens, all episodes
        groups, rewards = [groups[i] for i in kept], [rewards[i] for i in kept]
        batch = episode_batch(groups, rewards)
        mask_BxT = batch.completion_mask_BxT
        metrics = reward_metrics(batch.rewards_BxK, mask_BxT, batch.truncated_B == 0, 0, 0, cfg.loss.reward_weights)
        metrics.update(
            {
                "rollout/tokens_per_s": drawn_tokens / max(seconds, 1e-9),
                "rollout/seconds": seconds,
                "rollout/samples": n_draw * cfg.rollout.group_size,
                **drawn_metrics,
                **timing_metrics(self.engine.stats, stats0),
            }
        )
        if n_draw > n:
            metrics["agent/kept_reward_std_mean"] = episode_metrics(groups, rewards, cfg.loss.reward_weights)[
                "agent/reward_std_mean"
            ]
        return Produced(batch, None, metrics, stream)

    def checkpoint_state(self) -> dict:
        return {}


def make_agent_evaluator(cfg: Config, model_cfg, tokenizer, suite, records: list[dict], parallel=None):
    """evaluate(params) -> eval/accuracy (greedy episodes' success rate on the test records), eval/return,
    eval/turns, eval/tool_calls, eval/response_len (model tokens per episode). Environment seeds are
    fixed, so a slippery environment plays the same dice at every evaluation."""
    errors: list = []
    engine = make_episode_engine(cfg, model_cfg, tokenizer, suite, errors, greedy=True, parallel=parallel)

    def evaluate(params) -> dict:
        # seed (train.seed, 0): training steps use (train.seed, step >= 1)
        groups = engine.run(params, 0, [(r, r) for r in records], 1, seed=(cfg.train.seed, 0))
        raise_first(errors)

        def col(name):
            return np.concatenate([getattr(g, name) for g in groups]).astype(np.float64)

        return {
            "eval/accuracy": float(col("success_G").mean()),
            "eval/return": float(col("return_G").mean()),
            "eval/turns": float(col("turns_G").mean()),
            "eval/tool_calls": float(col("tool_calls_G").mean()),
            "eval/response_len": float(np.concatenate([g.loss_mask_GxT.sum(1) for g in groups]).mean()),
        }

    return evaluate
