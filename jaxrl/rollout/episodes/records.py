"""The host side of multi-turn episodes (driver.py schedules them on the slot engine): an episode's
record between turns (`Episode`), its noise keys (`episode_keys`), the environment step a worker
thread runs (`env_step`), and the `EpisodeGroup` the G episodes of a request become."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, NamedTuple

import jax
import numpy as np


class EpisodeGroup(NamedTuple):
    """The G episodes of one request (numpy). tokens hold model and observation tokens; loss_mask 1 on model tokens."""

    tag: Any
    prompt_P: np.ndarray  # int32, left-padded
    prompt_mask_P: np.ndarray  # int32
    tokens_GxT: np.ndarray  # int32; pad after the episode's last token
    loss_mask_GxT: np.ndarray  # float32: 1 on model tokens (EOS / end of turn included), 0 on observations
    logp_GxT: np.ndarray  # float32: log-prob under softmax(logits / temperature); 0 off the loss mask
    version_GxT: np.ndarray  # int32; -1 off the loss mask
    finished_G: np.ndarray  # bool: ended by the environment (done) or EOS
    truncated_G: np.ndarray  # bool: ended by a limit (max_turns, the token budget)
    return_G: np.ndarray  # float32: sum of the step rewards
    shaping_G: np.ndarray  # float32: sum of info["shaping"]
    turns_G: np.ndarray  # int32: model turns
    tool_calls_G: np.ndarray  # int32
    tool_errors_G: np.ndarray  # int32
    env_errors_G: np.ndarray  # int32: steps that raised
    obs_cut_G: np.ndarray  # int32: observations cut to agent.max_obs_tokens
    success_G: np.ndarray  # bool: info["success"] of the last step, else return > 0
    routing_GxCxLxK: np.ndarray | None = None  # MoE: experts per cache slot (C = P + T), for replay


@dataclasses.dataclass
class Episode:
    """One episode's host state between and during its turns (numpy buffers of its whole budget)."""

    j: int
    g: int
    env: Any
    prompt_P: np.ndarray
    mask_P: np.ndarray
    key: np.ndarray
    tokens_T: np.ndarray
    logp_T: np.ndarray
    loss_T: np.ndarray
    version_T: np.ndarray
    n: int = 0  # tokens so far (model + observation)
    turn_start: int = 0  # where the current turn began
    turns: int = 0
    ret: float = 0.0
    shaping: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0
    env_errors: int = 0
    obs_cut: int = 0
    success: bool | None = None
    finished: bool = False
    truncated: bool = False
    routing: np.ndarray | None = None


class StepOutcome(NamedTuple):
    result: Any  # StepResult, or None when the step raised
    obs_ids: list
    error: BaseException | None
    seconds: float


def env_step(env, tokenizer, action_ids, final: bool) -> StepOutcome:
    """Runs in a worker thread: decode the turn, step the environment, encode its observation."""
    start = time.perf_counter()
    try:
        result = env.step(tokenizer.decode(action_ids))
        seconds = time.perf_counter() - start
        obs_ids = [] if final or result.done else list(tokenizer.encode(result.observation))
        return StepOutcome(result, obs_ids, None, seconds)
    except Exception as err:  # an environment must not crash the run: the episode ends, counted
        return StepOutcome(None, [], err, time.perf_counter() - start)


def episode_keys(seed, n_requests: int, group_size: int, first: int = 0) -> np.ndarray:
    """(n_requests * group_size, key) raw keys: row j*G+g = fold_in(fold_in(K, first + j), g), K = the
    seed folded (first: the index of the first request among all of the step's, on every process)."""
    seed = [int(s) for s in np.atleast_1d(seed)]
    base = jax.random.PRNGKey(seed[0])
    for s in seed[1:]:
        base = jax.random.fold_in(base, s)
    j, g = np.divmod(np.arange(n_requests * group_size), group_size)
    j = j + first
    fold = jax.vmap(lambda a, b: jax.random.fold_in(jax.random.fold_in(base, a), b))
    return np.asarray(fold(j.astype(np.uint32), g.astype(np.uint32)))


def episode_group(tag, eps: list) -> EpisodeGroup:
    """The G finished episodes of one request -> their EpisodeGroup (fields stacked in member order)."""

    def col(f, dtype):
        return np.array([f(e) for e in eps], dtype)

    routing = None if eps[0].routing is None else np.stack([e.routing for e in eps])
    return EpisodeGroup(
        tag,
        eps[0].prompt_P,
        eps[0].mask_P,
        np.stack([e.tokens_T for e in eps]),
        np.stack([e.loss_T for e in eps]),
        np.stack([e.logp_T for e in eps]),
        np.stack([e.version_T for e in eps]),
        col(lambda e: e.finished, bool),
        col(lambda e: e.truncated, bool),
        col(lambda e: e.ret, np.float32),
        col(lambda e: e.shaping, np.float32),
        col(lambda e: e.turns, np.int32),
        col(lambda e: e.tool_calls, np.int32),
        col(lambda e: e.tool_errors, np.int32),
        col(lambda e: e.env_errors, np.int32),
        col(lambda e: e.obs_cut, np.int32),
        col(lambda e: e.ret > 0 if e.success is None else e.success, bool),
        routing,
    )
