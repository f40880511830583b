"""What the decode engine hands back: `Group`s of samples per prompt, and the trainer's batch built
from them (`batch_of_groups`); also the host record of a group still decoding (`Flight`) and how a
complete one becomes a Group. driver.py drives the slots; checkpoint.py saves flights."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from jaxrl.rollout.batch import RolloutBatch


class Group(NamedTuple):
    """The samples of one prompt, in admission order: G from `collect`, k from `sample`."""

    tag: Any  # what the caller paired with the prompt
    prompt_P: np.ndarray  # int32, left-padded to the engine's prompt_len
    prompt_mask_P: np.ndarray  # int32
    tokens_GxT: np.ndarray  # int32; pad after each sample's last token
    completion_mask_GxT: np.ndarray  # float32
    logp_GxT: np.ndarray  # float32: log-prob under softmax(logits / temperature), 0 where masked
    version_GxT: np.ndarray  # int32: version of the chunk that drew each token; -1 where masked
    finished_G: np.ndarray  # bool: ended with EOS
    truncated_G: np.ndarray  # bool: stopped at max_new_tokens without EOS
    routing_GxSxLxK: np.ndarray | None  # MoE only: experts per slot S = P + T (see sampler.py)


@dataclasses.dataclass
class Flight:
    """A group admitted and not yet complete: its prompt, its slots, the rows retired so far."""

    tag: Any
    prompt_P: np.ndarray
    mask_P: np.ndarray
    slots_G: np.ndarray  # its samples' slots: G, or fewer for `sample`'s pieces
    rows: dict  # member index -> that sample's readout row
    sink: list | None  # where its Group goes once all samples are retired: a `sample` call's list; None: `_ready`
    born: int = 0  # the version of the call that admitted it (its first token's version)


def left_pad(tokens, prompt_len: int, pad_id: int):
    """A 1-D sequence of real tokens -> (tokens_P, mask_P), left-padded."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    if not 0 < len(tokens) <= prompt_len:
        raise ValueError(f"prompt: {len(tokens)} tokens, expected 1..prompt_len={prompt_len}")
    out, mask = np.full(prompt_len, pad_id, np.int32), np.zeros(prompt_len, np.int32)
    out[prompt_len - len(tokens) :], mask[prompt_len - len(tokens) :] = tokens, 1
    return out, mask


def first_version(group: Group) -> int:
    """The version that drew the group's oldest token."""
    drawn = group.version_GxT[group.version_GxT >= 0]
    return int(drawn.min()) if drawn.size else 0


def flight_group(flight: Flight) -> Group:
    rows = [flight.rows[g] for g in range(len(flight.slots_G))]

    def col(name):
        return np.stack([getattr(r, name) for r in rows])

    routing = None if rows[0].routing_RxCxLxK is None else col("routing_RxCxLxK")
    return Group(
        flight.tag,
        flight.prompt_P,
        flight.mask_P,
        col("tokens_RxT"),
        col("completion_mask_RxT"),
        col("logp_RxT"),
        col("version_RxT"),
        col("finished_R"),
        col("truncated_R"),
        routing,
    )


def concat_groups(parts: list[Group], tag, prompt_P, prompt_mask_P) -> Group:
    """One Group of a prompt from samples drawn in several admissions (its rows in `parts` order)."""
    if not parts:  # k = 0 samples asked for: the sample fields are None (`Engine.sample`'s contract)
        return Group._make((tag, prompt_P, prompt_mask_P) + (None,) * 7)

    def cat(name) -> np.ndarray:
        return np.concatenate([getattr(p, name) for p in parts])

    routing = None if parts[0].routing_GxSxLxK is None else cat("routing_GxSxLxK")
    return Group(
        tag,
        prompt_P,
        prompt_mask_P,
        cat("tokens_GxT"),
        cat("completion_mask_GxT"),
        cat("logp_GxT"),
        cat("version_GxT"),
        cat("finished_G"),
        cat("truncated_G"),
        routing,
    )


def batch_of_groups(groups: list[Group]) -> RolloutBatch:
    """The engine's groups -> the batch (rows of group i contiguous, group_id_B = i; truncated_B = no
    EOS), with each token's `version_BxT` and, for MoE, routing_BxSxLxK."""
    routed = bool(groups) and groups[0].routing_GxSxLxK is not None
    return RolloutBatch.from_groups(
        groups,
        [g.completion_mask_GxT for g in groups],
        [~g.finished_G for g in groups],
        versions_GxT=[g.version_GxT for g in groups],
        routing_GxSxLxK=[g.routing_GxSxLxK for g in groups] if routed else None,
    )
