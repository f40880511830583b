"""The environment protocol of multi-turn episodes, and what an embedded environment brings.

`observation = env.reset(record, rng)` is the prompt text; each turn the policy writes an action (its
text up to and including the end-of-turn string, or up to EOS) and `env.step(action)` returns a
`StepResult`: the observation appended after the action (context only: no loss, no log-prob), a
reward, and whether the episode is over. EOS, `agent.max_turns` and `rollout.max_new_tokens` also end it.

Environments are plain Python objects, one per episode, stepped from a thread pool. An environment must
not raise for anything the model writes (error observations, `info["tool_errors"]`); if `step` raises
anyway the episode ends with reward 0 and `agent/env_errors` counts it. Episodes never span a
checkpoint: a resumed step replays them with the same record and rng (docs/agents.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple, Protocol

import numpy as np

from jaxrl.config import ConfigError
from jaxrl.data.tokenizer import DEFAULT_ALPHABET

# The character alphabet of the embedded environments' models: the arithmetic characters, lower-case
# letters and a few marks for tool tags and rendered grids ("]" ends a turn).
AGENT_ALPHABET = DEFAULT_ALPHABET + "abcdefghijklmnopqrstuvwxyz[]<>_.#\n"


class StepResult(NamedTuple):
    observation: str  # appended after the action ("" for none); the episode's next turn reads it
    reward: float  # this step's reward; the trajectory's return is the sum over its steps
    done: bool  # the episode is over (the policy writes no more turns)
    # Counters and extras, all optional: "tool_calls" / "tool_errors" (ints, this step's),
    # "shaping" (float: a per-turn shaping reward, weighted by agent.shaping_weight), "success" (bool).
    info: dict


class Environment(Protocol):
    def reset(self, record: dict, rng: np.random.Generator) -> str:
        """Start an episode for a task record; -> the first observation (the prompt text)."""
        ...

    def step(self, action: str) -> StepResult:
        """The policy's turn (its text, end-of-turn string included when it ended the turn) -> the answer."""
        ...


@dataclasses.dataclass(frozen=True)
class EnvSuite:
    """An environment: how to make its episodes, its task records, and what its warm start imitates.

    make(agent_cfg, fmt=None) -> a fresh Environment (one per episode), given the run's `agent.*` section
        (e.g. agent.tool_max_output for its tools) and the tool-call format its episodes speak
        (jaxrl.agents.tools: TagFormat, HermesFormat; None: the suite's own char syntax, whose turns
        end with `end_of_turn`).
    records(split, n, seed) -> n task records (dicts of str, with "id"), deterministic in (split, seed).
    alphabet: the character tokenizer's alphabet for the embedded models (every observation, and every
        action a demonstration writes, must use only these characters: else a ConfigError names it).
    end_of_turn: the string that ends a model turn with fmt=None; one token of the run's tokenizer.
    teacher(record, rng, error_rate) -> one demonstration episode as segments [(text, by_model), ...] in order,
        starting with the first model turn (the prompt is reset()'s observation): by_model=True segments
        are trained on, the observations between them are context (the teacher plays a real
        environment, so they are what `step` answers). A fallible teacher (error_rate =
        warmstart.teacher_error) leaves RL room to improve. None: no teacher (warmstart.source picks
        the demonstrations, none, or a checkpoint in model.hf_path).
    demonstrations: given episodes, ((record, segments), ...) with segments as the teacher's; the warm
        start's data with warmstart.source='demonstrations'.
    formats: the names of the tool formats `make` takes as fmt (`fmt.name`: "tag", "hermes"); a
        Hugging Face checkpoint's run needs "hermes" (jaxrl.agents.formats), so a suite without it
        (its actions end with a character a BPE tokenizer may merge into other tokens) runs on the
        embedded char models only.
    """

    name: str
    make: Callable[..., Environment]
    records: Callable[[str, int, int], list]
    alphabet: str = AGENT_ALPHABET
    end_of_turn: str = "]"
    teacher: Callable[[dict, np.random.Generator, float], list] | None = None
    demonstrations: tuple = ()
    formats: tuple = ()


class AlphabetChecked:
    """An Environment whose observations must be in the run's character alphabet; the first one that is not
    is kept in `errors` (a one-line ConfigError naming the character, the task and the record) and ends
    the episode, and the rollout source raises it after the step (the episode engine counts, not raises)."""

    def __init__(self, env: Environment, alphabet: str, task: str, errors: list):
        self.env, self.allowed, self.alphabet, self.task, self.errors = env, set(alphabet), alphabet, task, errors
        self.record_id = None

    def _checked(self, text: str) -> str:
        extra = set(text) - self.allowed
        if extra:
            error = ConfigError(
                f"data.task: character {min(extra)!r} in an observation of environment {self.task!r} (record "
                f"{self.record_id!r}) is not in its alphabet {self.alphabet!r} (EnvSuite.alphabet)"
            )
            self.errors.append(error)
            raise error
        return text

    def reset(self, record: dict, rng: np.random.Generator) -> str:
        self.record_id = record.get("id")
        return self._checked(self.env.reset(record, rng))

    def step(self, action: str) -> StepResult:
        result = self.env.step(action)
        self._checked(result.observation)
        return result
