"""A trained reward model as one of an RL run's reward functions (reward_model.workdir).

    verifier = with_reward_model(task.verifier, load_scorer(cfg.reward_model))
    rewards_BxK, n_failed = verifier.score_batch(completions, finished, records)

`RewardModelScorer` scores (prompt, completion) texts: each row BOS + prompt + completion + EOS, left-
padded to the reward model's max_seq_len (a longer one keeps its last tokens), the rows padded up to a
whole number of `batch` rows so every call runs the same compiled forward: one jitted forward over the
step's rows (reward_model.score_batch = 0) or several of that many. `RewardModelVerifier` puts its score
after the task verifier's columns, so rewards_BxK gains a column (correctness, format, reward model); a
non-finite score zeroes the row's reward-model column and counts as a failed verifier call.
The forward runs on this process's first device with the reward model's params there.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxrl.config import ConfigError, ModelConfig, RewardModelConfig
from jaxrl.data.hf_tokenizer import load_tokenizer
from jaxrl.data.rewards import Verifier, score
from jaxrl.data.tokenizer import CharTokenizer
from jaxrl.rewards.judge import load_judge
from jaxrl.rewards.model import encode_sequences, sequence_scores
from jaxrl.rewards.train import load_reward_model


@dataclasses.dataclass(frozen=True)
class RewardModelScorer:
    """(prompts, completions) -> score_B float32, through one compiled forward of `batch` rows."""

    params: Any
    model_cfg: ModelConfig
    tokenizer: Any
    batch: int = 0  # rows per forward; 0: all rows of the call at once

    def __call__(self, prompts: Sequence[str], completions: Sequence[str]) -> np.ndarray:
        n = len(prompts)
        if n == 0:
            return np.zeros((0,), np.float32)
        tokens_BxS, mask_BxS = encode_sequences(
            self.tokenizer, list(prompts), list(completions), self.model_cfg.max_seq_len, truncate=True
        )
        chunk = self.batch or n
        pad = -n % chunk
        tokens_BxS = np.concatenate([tokens_BxS, np.repeat(tokens_BxS[:1], pad, 0)])
        mask_BxS = np.concatenate([mask_BxS, np.repeat(mask_BxS[:1], pad, 0)])
        out = [
            np.asarray(sequence_scores(self.params, self.model_cfg, tokens_BxS[i : i + chunk], mask_BxS[i : i + chunk]))
            for i in range(0, n + pad, chunk)
        ]
        return np.concatenate(out)[:n].astype(np.float32)


@dataclasses.dataclass(frozen=True)
class RewardModelVerifier:
    """The task's verifier's columns, then the reward model's score: a batch verifier (`score_batch`)."""

    verifier: Verifier
    scorer: RewardModelScorer

    def __call__(self, completion: str, finished: bool, record: Mapping[str, str]):
        """One sample alone (the per-sample protocol): the verifier's values and this one score."""
        return (*self.verifier(completion, finished, record), float(self.scorer([record["prompt"]], [completion])[0]))

    def score_batch(
        self, completions: list[str], finished: list[bool], records: Sequence[Mapping[str, str]]
    ) -> tuple[np.ndarray, int]:
        base_BxK, n_failed = score(self.verifier, completions, finished, records)
        rm_B = self.scorer([r["prompt"] for r in records], completions)
        bad_B = ~np.isfinite(rm_B)
        rm_B = np.where(bad_B, 0.0, rm_B).astype(np.float32)
        return np.concatenate([base_BxK, rm_B[:, None]], axis=1), n_failed + int(bad_B.sum())


def load_scorer(rm: RewardModelConfig, field: str = "reward_model.workdir") -> RewardModelScorer:
    """The reward model saved in rm.workdir, with its tokenizer, ready to score."""
    params, model_cfg, record = load_reward_model(rm.workdir, field)
    if record.get("hf_path"):
        tokenizer = load_tokenizer(pathlib.Path(record["hf_path"]).expanduser())
    elif record.get("alphabet") is not None:
        tokenizer = CharTokenizer(record["alphabet"])
    else:
        raise ConfigError(f"{field}: {rm.workdir}/reward_model.json names no tokenizer (alphabet or hf_path)")
    params = jax.device_put(params, jax.local_devices()[0])
    return RewardModelScorer(params, model_cfg, tokenizer, rm.score_batch)


def model_rewards(verifier: Verifier | None, rm: RewardModelConfig, seed: int) -> Verifier | None:
    """The run's verifier with reward_model.*: the judge in judge_path instead of the task's verifier
    (if set), then the reward model in workdir scoring after it (if set)."""
    if rm.judge_path:
        verifier = load_judge(rm, seed)
    return with_reward_model(verifier, rm)


def with_reward_model(verifier: Verifier | None, rm: RewardModelConfig) -> Verifier | None:
    """`verifier` itself when no reward model is configured, else it followed by the reward model's score."""
    if not rm.workdir:
        return verifier
    if verifier is None:
        raise ConfigError(
            "reward_model.workdir: the task has no verifier (an environment); a reward model scores text tasks"
        )
    return RewardModelVerifier(verifier, load_scorer(rm))
