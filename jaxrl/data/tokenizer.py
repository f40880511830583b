"""Tokenizers: a small Protocol any tokenizer (e.g. a Hugging Face one) can satisfy, a fixed-alphabet
character tokenizer for the embedded tasks, and batch helpers for prompts and completions."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from jaxrl.config import ConfigError

# Fixed so that a vocab (and every model trained on it) never changes with the data; covers both
# embedded tasks: arithmetic `37+58=` -> `95`, countdown `3,7,25:46=` -> `25+3*7`.
DEFAULT_ALPHABET = "0123456789+-*/()=,: "


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS/EOS."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, stopping at the first EOS and dropping PAD/BOS."""
        ...


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
    """One token per character; ids 0/1/2 are PAD/BOS/EOS, then the alphabet in order."""

    alphabet: str = DEFAULT_ALPHABET
    pad_id: int = dataclasses.field(default=0, init=False)
    bos_id: int = dataclasses.field(default=1, init=False)
    eos_id: int = dataclasses.field(default=2, init=False)
    _char_to_id: dict[str, int] = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if len(set(self.alphabet)) != len(self.alphabet):
            raise ValueError(f"tokenizer alphabet {self.alphabet!r} has repeated characters")
        table = {ch: i + 3 for i, ch in enumerate(self.alphabet)}
        object.__setattr__(self, "_char_to_id", table)  # frozen: derived once from `alphabet`

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet) + 3

    def encode(self, text: str) -> list[int]:
        ids = []
        for ch in text:
            i = self._char_to_id.get(ch)
            if i is None:
                raise ValueError(f"character {ch!r} is not in the tokenizer alphabet {self.alphabet!r} (text {text!r})")
            ids.append(i)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        chars = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i in (self.pad_id, self.bos_id):
                continue
            if not 3 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
            chars.append(self.alphabet[i - 3])
        return "".join(chars)


def encode_prompts(
    tokenizer: Tokenizer,
    prompts: list[str],
    max_prompt_len: int,
    *,
    skip_long: bool,
    record_ids: list[str],
    pad_to: int | None = None,
) -> tuple[np.ndarray, np.ndarray, list[int], int]:
    """BOS + prompt for each prompt (no BOS for a tokenizer with `add_bos` False, e.g. Qwen's), LEFT-padded
    with PAD so every prompt ends at the last column (generation then continues from the same position for
    the whole batch).

    Returns (tokens_BxP int32, mask_BxP bool, kept_indices, n_skipped). P is the longest kept prompt,
    or `pad_to` if given. A prompt longer than `max_prompt_len` (BOS included) raises ConfigError
    naming its record, unless `skip_long`, in which case it is dropped and counted. If every prompt
    is dropped the arrays have B=0.
    """
    if len(record_ids) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but {len(record_ids)} record ids")
    kept_ids: list[list[int]] = []
    kept_indices: list[int] = []
    n_skipped = 0
    for i, (prompt, rid) in enumerate(zip(prompts, record_ids)):
        ids = ([tokenizer.bos_id] if getattr(tokenizer, "add_bos", True) else []) + tokenizer.encode(prompt)
        if len(ids) > max_prompt_len:
            if skip_long:
                n_skipped += 1
                continue
            raise ConfigError(
                f"prompt of record {rid!r} has {len(ids)} tokens, longer than data.max_prompt_len={max_prompt_len} "
                "(set data.skip_long_prompts=true to skip such prompts)"
            )
        kept_ids.append(ids)
        kept_indices.append(i)
    longest = max((len(ids) for ids in kept_ids), default=0)
    if pad_to is not None and pad_to < longest:
        raise ValueError(f"pad_to={pad_to} is shorter than the longest kept prompt ({longest} tokens)")
    width_P = longest if pad_to is None else pad_to
    tokens_BxP = np.full((len(kept_ids), width_P), tokenizer.pad_id, dtype=np.int32)
    mask_BxP = np.zeros((len(kept_ids), width_P), dtype=bool)
    for row, ids in enumerate(kept_ids):
        if ids:
            tokens_BxP[row, width_P - len(ids) :] = ids
            mask_BxP[row, width_P - len(ids) :] = True
    return tokens_BxP, mask_BxP, kept_indices, n_skipped


def decode_completions(tokenizer: Tokenizer, tokens_BxT: np.ndarray) -> tuple[list[str], list[bool]]:
    """Texts of sampled completions (EOS-stopped) and whether each one emitted EOS."""
    tokens_BxT = np.asarray(tokens_BxT)
    texts = [tokenizer.decode(row) for row in tokens_BxT]
    finished = [bool(f) for f in (tokens_BxT == tokenizer.eos_id).any(axis=-1)]
    return texts, finished
