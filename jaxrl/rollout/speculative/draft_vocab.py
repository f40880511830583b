"""A reduced-vocabulary draft head (FR-Spec, arXiv 2502.14856) for the engine's early-exit drafter.

The drafter computes its logits only over a fixed subset of token ids (the N most frequent ones):
its distribution q is the softmax over that subset and 0 elsewhere. Exact speculative rejection
sampling stays exact for any q: a token outside the subset is never drafted, and the residual
max(0, p - q) after a rejection covers the whole vocabulary, so the samples keep the plain
sampler's distribution; greedy verification compares drafts with the policy's own argmax. What
changes is the cost: the drafter's head reads |S| columns of the LM head instead of V per token.

`rollout.speculative.draft_vocab` = N picks the subset; `frequent_ids` ranks ids by how often they
occur in sample text (the training loop passes its task's training prompts) with EOS first.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Sequence

import jax.numpy as jnp

from jaxrl.config import ConfigError, ModelConfig


def frequent_ids(sequences: Iterable[Sequence[int]], n: int, vocab_size: int, first: Sequence[int] = ()) -> tuple:
    """The n ids of [0, vocab_size) ranked: `first` (in order), then by count over `sequences`
    (ties: lower id first), then the ids never seen, ascending. -> a tuple of n distinct ints."""
    counts = collections.Counter(int(t) for seq in sequences for t in seq if 0 <= int(t) < vocab_size)
    ranked = list(dict.fromkeys(int(t) for t in first if 0 <= int(t) < vocab_size))
    seen = set(ranked)
    for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if t not in seen:
            ranked.append(t)
            seen.add(t)
    ranked += [t for t in range(vocab_size) if t not in seen][: max(0, n - len(ranked))]
    return tuple(ranked[:n])


def check_draft_ids(draft_vocab: int, draft_ids, vocab_size: int) -> tuple:
    """The drafter's token ids for `rollout.speculative.draft_vocab` -> () (the full vocabulary) or
    the first draft_vocab of draft_ids, validated (distinct, inside the vocabulary)."""
    if draft_vocab == 0:
        return ()
    field = "rollout.speculative.draft_vocab"
    if draft_vocab > vocab_size:
        raise ConfigError(f"{field}: got {draft_vocab}, expected at most the vocabulary size {vocab_size}")
    if draft_ids is None or len(draft_ids) < draft_vocab:
        have = 0 if draft_ids is None else len(draft_ids)
        raise ConfigError(
            f"{field}: got {draft_vocab}, but the engine was given {have} draft token ids "
            f"(Engine(draft_ids=...): the ids ranked by frequency)"
        )
    ids = tuple(int(t) for t in draft_ids[:draft_vocab])
    if len(set(ids)) != len(ids) or not all(0 <= t < vocab_size for t in ids):
        raise ConfigError(f"{field}: its {draft_vocab} draft token ids must be distinct ids in [0, {vocab_size})")
    return ids


def subset_head(lparams, cfg: ModelConfig, ids_N):
    """The drafter's weights and config with an LM head over the ids ids_N only: `window_layers` on
    them returns logits [.., N] (column j: token ids_N[j]). Gathered once per call, not per token."""
    head_DxV = lparams["embedding"].T if cfg.tie_embeddings else lparams["lm_head"]
    head_DxN = jnp.take(head_DxV, ids_N, axis=1)
    return dict(lparams, lm_head=head_DxN), dataclasses.replace(cfg, tie_embeddings=False)


def task_draft_ids(records, tokenizer, n: int, vocab_size: int, limit: int = 512) -> tuple:
    """The training loop's drafter ids: the n most frequent over the prompt and reference answer
    texts of the first `limit` training records (what completions are made of), EOS first."""
    texts = [
        r[k] for i in range(min(limit, len(records))) for r in (records[i],) for k in ("prompt", "answer") if r.get(k)
    ]
    return frequent_ids((tokenizer.encode(t) for t in texts), n, vocab_size, first=(tokenizer.eos_id,))
