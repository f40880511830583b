"""The multi-turn warm start: supervised batches from an environment suite's teacher episodes.

A demonstration is one teacher episode played against the real environment: the prompt is
`env.reset(record, rng)` (left-padded as in rollouts), the completion the episode's segments
concatenated, the loss mask 1 on the model's segments only (observations are context, as in RL).
A final model segment that does not end the turn is a final answer and gets a trained EOS; a segment
that ends the turn or a final observation gets none (`done` or the turn limit ends those episodes).
Episodes longer than rollout.max_new_tokens are cut there, as the engine cuts them, and counted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np

from jaxrl.config import AgentConfig, ConfigError
from jaxrl.data.tokenizer import encode_prompts


def episode_targets(tokenizer, segments: list, end_of_turn: str, width: int):
    """One teacher episode -> (tokens_T int32, loss_mask_T float32, truncated): segments concatenated,
    EOS after a final answer (see the module docstring), right-padded with PAD or cut at `width`."""
    ids, mask = [], []
    for text, by_model in segments:
        piece = tokenizer.encode(text)
        ids += piece
        mask += [1.0 if by_model else 0.0] * len(piece)
    if segments and segments[-1][1] and not segments[-1][0].endswith(end_of_turn):
        ids.append(tokenizer.eos_id)
        mask.append(1.0)
    truncated = any(mask[width:])  # a model token past the budget (a trailing observation is only context)
    tokens_T = np.full(width, tokenizer.pad_id, np.int32)
    mask_T = np.zeros(width, np.float32)
    tokens_T[: min(len(ids), width)] = ids[:width]
    mask_T[: min(len(mask), width)] = mask[:width]
    return tokens_T, mask_T, truncated


def teacher_batch(
    suite, records: list[dict], tokenizer, max_prompt_len: int, width: int, error_rate: float, rng: np.random.Generator
) -> tuple[dict, int]:
    """SFT batch of teacher episodes, one per record -> (batch, number of episodes that lost model tokens
    to the `width` cut).

    Each episode gets a seed from `rng`; its prompt is `reset(record, default_rng(seed))` and the teacher
    plays from a generator seeded alike, so the prompt is the observation the teacher started from.
    """
    alphabet = getattr(tokenizer, "alphabet", None)
    if alphabet is not None and set(suite.alphabet) - set(alphabet):
        raise ConfigError(
            f"data.task: the {suite.name!r} environment needs a tokenizer over its alphabet "
            f"(jaxrl.agents.env.AGENT_ALPHABET); this one lacks "
            f"{''.join(sorted(set(suite.alphabet) - set(alphabet)))!r}"
        )
    seeds = rng.integers(2**63, size=len(records))
    prompts, tokens, masks, cut = [], [], [], 0
    for record, seed in zip(records, seeds):
        prompts.append(suite.make(AgentConfig()).reset(record, np.random.default_rng(seed)))
        if suite.teacher is None:
            raise ConfigError(f"warmstart.source: environment {suite.name!r} has no teacher (EnvSuite.teacher)")
        segments = suite.teacher(record, np.random.default_rng(seed), error_rate)
        if alphabet is not None:
            _check_episode(suite.name, alphabet, record, [prompts[-1], *(text for text, _ in segments)])
        tokens_T, mask_T, truncated = episode_targets(tokenizer, segments, suite.end_of_turn, width)
        tokens.append(tokens_T)
        masks.append(mask_T)
        cut += truncated
    prompt_BxP, pmask_BxP, _, _ = encode_prompts(
        tokenizer,
        prompts,
        max_prompt_len,
        skip_long=False,
        record_ids=[r["id"] for r in records],
        pad_to=max_prompt_len,
    )
    batch = {
        "prompt_tokens_BxP": prompt_BxP,
        "prompt_mask_BxP": pmask_BxP,
        "tokens_BxT": np.stack(tokens),
        "completion_mask_BxT": np.stack(masks),
    }
    return batch, cut


def _check_episode(task: str, alphabet: str, record: dict, texts: list[str]) -> None:
    extra = set("".join(texts)) - set(alphabet)
    if extra:
        raise ConfigError(
            f"data.task: character {min(extra)!r} in a demonstration of environment {task!r} (record "
            f"{record.get('id')!r}) is not in its alphabet {alphabet!r} (EnvSuite.alphabet)"
        )


def suite_fingerprint(suite) -> str:
    """A hash of a few of the suite's records and teacher episodes: the warm-start cache key changes
    when the environment's maps, dynamics or teacher change, not only when its name does."""
    sample = suite.records("train", 4, 0)
    teacher = suite.teacher or (lambda record, rng, error_rate: None)
    what = {
        "name": suite.name,
        "alphabet": suite.alphabet,
        "end_of_turn": suite.end_of_turn,
        "records": sample,
        "episodes": [teacher(r, np.random.default_rng(i), 0.5) for i, r in enumerate(sample)],
    }
    if suite.demonstrations:
        what["demonstrations"] = list(suite.demonstrations)
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def demonstrated(suite):
    """The suite with its given demonstrations as its teacher (warmstart.source='demonstrations'): the
    teacher replays the episode given for the record's id. -> (the suite, the demonstrations' records)."""
    episodes = {record["id"]: segments for record, segments in suite.demonstrations}
    records = [dict(record) for record, _ in suite.demonstrations]
    return dataclasses.replace(suite, teacher=lambda record, rng, error_rate: episodes[record["id"]]), records
