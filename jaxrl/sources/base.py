"""The contract between a source and the training loop.

    produced = source.produce(params, stream, rng, step)   # -> Produced: host batch, metrics, stream
    host = source.checkpoint_state()                       # the source's part of the checkpoint

A source's checkpoint part is JSON, except `host[ARRAYS]`: numpy arrays saved as their own item.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import jax

from jaxrl.data.stream import StreamState
from jaxrl.rollout.batch import RolloutBatch

ARRAYS = "rollout_arrays"  # the checkpoint's host item key whose value is saved as arrays, not JSON


class Produced(NamedTuple):
    """One step's scored completions (this process's rows) and where the data stream now stands."""

    host_batch: RolloutBatch  # this process's rows
    routing_BxSxLxK: jax.Array | None  # MoE: the global array, laid out by its name; else None
    metrics: dict  # the step's metrics row so far (reward, length, rollout/*), in logged order
    stream: StreamState


class Source(Protocol):
    """What the loop calls on the rollout side: one step's scored groups, and the state to checkpoint."""

    def produce(self, params, stream: StreamState, rng, step: int) -> Produced: ...

    def checkpoint_state(self) -> dict: ...
