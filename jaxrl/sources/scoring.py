"""Scoring, for every source: completions -> rewards (`score_completions`, the one place a verifier
meets sampled tokens), and the step's reward/length metrics (`reward_metrics`); then the batch on the
devices (`assemble_batch`).

`score_groups` is the static sampler's host work: score this process's completion rows, gather what
the metrics need from every process, and return its RolloutBatch (this process's rows) with the
step's reward/length metrics. `assemble_batch` puts a RolloutBatch on the devices, each field laid
out by its name (jaxrl.sharding.named_sharding).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from jaxrl.data.rewards import BatchVerifier, score
from jaxrl.data.tokenizer import decode_completions
from jaxrl.multihost import all_processes_sum, gather_rows, put_rows
from jaxrl.rollout.batch import RolloutBatch
from jaxrl.sharding import named_sharding
from jaxrl.sources.sampler import Rollout


class RowLayout(NamedTuple):
    """Where a step's B completion rows live: their sharding and the rows this process holds."""

    sharding: jax.sharding.NamedSharding
    mine: slice  # process_rows(sharding, n)
    n: int  # B = prompts_per_step * group_size


class ScoredGroups(NamedTuple):
    host_batch: RolloutBatch  # this process's rows of every update field but routing
    metrics: dict  # the step's reward / length metrics over all rows, in logged order
    n_tokens: float  # completion tokens over all rows (for rollout/tokens_per_s)


def score_groups(
    rollout: Rollout,
    records: list,
    prompt_BxP,
    prompt_mask_BxP,
    n_skipped: int,
    *,
    tokenizer,
    verifier,
    rows: RowLayout,
    group_size: int,
    reward_weights,
) -> ScoredGroups:
    """Score this process's rows of `rollout` (row i*G + g answers records[i]); host metrics see all rows."""
    G = group_size
    my_records = [r for r in records for _ in range(G)][rows.mine]
    my_rewards_BxK, n_failed = score_completions(
        rollout.tokens_BxT, rollout.finished_B, my_records, tokenizer=tokenizer, verifier=verifier
    )
    rewards_BxK = gather_rows(rows.sharding, my_rewards_BxK, rows.n)
    mask_BxT = gather_rows(rows.sharding, rollout.completion_mask_BxT, rows.n)
    finished_B = gather_rows(rows.sharding, rollout.finished_B, rows.n)
    n_failed = int(all_processes_sum(n_failed))
    host_batch = RolloutBatch(
        prompt_tokens_BxP=np.repeat(prompt_BxP, G, 0)[rows.mine],
        prompt_mask_BxP=np.repeat(prompt_mask_BxP, G, 0)[rows.mine],
        tokens_BxT=rollout.tokens_BxT,
        completion_mask_BxT=rollout.completion_mask_BxT,
        rollout_logp_BxT=rollout.logp_BxT,
        truncated_B=(~rollout.finished_B).astype(np.float32),
        rewards_BxK=my_rewards_BxK,
    )
    metrics = reward_metrics(rewards_BxK, mask_BxT, finished_B, n_failed, n_skipped, reward_weights)
    return ScoredGroups(host_batch, metrics, float(mask_BxT.sum()))


def score_completions(tokens_BxT, finished_B, records, *, tokenizer, verifier) -> tuple[np.ndarray, int]:
    """(rewards_BxK, verifier failures): each completion row decoded and verified against its record
    (a BatchVerifier, e.g. a reward model, scores all the rows in one call)."""
    texts, _ = decode_completions(tokenizer, tokens_BxT)
    if isinstance(verifier, BatchVerifier):
        return verifier.score_batch(texts, list(finished_B), records)
    return score(verifier, texts, list(finished_B), records)


def reward_metrics(rewards_BxK, mask_BxT, finished_B, n_failed: int, n_skipped: int, reward_weights) -> dict:
    """The step's reward / length metrics over all of its rows, in logged order."""
    r_B = combined_reward(rewards_BxK, reward_weights)
    return {
        "reward/mean": float(r_B.mean()),
        "reward/std": float(r_B.std()),
        "reward/correctness": float(rewards_BxK[:, 0].mean()),
        "reward/format": float(rewards_BxK[:, 1].mean()) if rewards_BxK.shape[1] > 1 else None,
        "reward/failed": int(n_failed),
        **({"reward/reward_model": float(rewards_BxK[:, 2].mean())} if rewards_BxK.shape[1] > 2 else {}),
        "data/skipped_prompts": int(n_skipped),
        "response_len/mean": float(mask_BxT.sum(1).mean()),
        "response/truncated": float((~finished_B).mean()),
    }


def assemble_batch(host_batch: RolloutBatch, routing_BxSxLxK, mesh, preset, n_rows: int) -> dict:
    """The update's batch: global arrays, each field laid out by its name. `routing_BxSxLxK` (MoE,
    else None) is a global array laid out by its name on the rollout's mesh (replayed in the update):
    moved onto training's when the rollout has a layout of its own (rollout.mesh)."""
    fields = host_batch.fields().items()
    batch = {k: put_rows(named_sharding(mesh, preset, k), v, n_rows) for k, v in fields}
    if routing_BxSxLxK is not None:
        sh = named_sharding(mesh, preset, "routing_BxSxLxK")
        batch["routing_BxSxLxK"] = (
            routing_BxSxLxK if routing_BxSxLxK.sharding == sh else jax.device_put(routing_BxSxLxK, sh)
        )
    return batch


def combined_reward(rewards_BxK: np.ndarray, reward_weights) -> np.ndarray:
    """r_B = sum_k w_k r_ik for the reward/mean metric, as the loss combines them (None: all weights 1)."""
    if reward_weights is None:
        return rewards_BxK.sum(axis=1)
    return rewards_BxK @ np.asarray(reward_weights, np.float32)
