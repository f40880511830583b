"""The prompt stream: a deterministic walk over shuffled epochs whose position is two ints.

Because the permutation of an epoch is a pure function of (seed, epoch, len(source)), the state
(epoch, index) is all a checkpoint needs to resume the exact same sequence of prompts.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Protocol

import numpy as np

from jaxrl.config import ConfigError


class Source(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> dict: ...


class StreamState(NamedTuple):
    epoch: int = 0
    index: int = 0  # position inside the epoch's permutation


@functools.lru_cache(maxsize=8)
def epoch_permutation(num_records: int, seed: int, epoch: int) -> np.ndarray:
    order = np.random.default_rng([seed, epoch]).permutation(num_records)
    order.setflags(write=False)  # shared through the cache
    return order


def next_batch(source: Source, state: StreamState, batch_size: int, seed: int) -> tuple[list[dict], StreamState]:
    """The next `batch_size` records and the state after them; rolls into the next epoch (and its new
    permutation) mid-batch if needed. Pure: the same (source, state, seed) gives the same batch."""
    num_records = len(source)
    if num_records == 0:
        name = getattr(source, "name", type(source).__name__)
        raise ConfigError(f"dataset {name} is empty; check data.num_train / data.num_test")
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    epoch, index = int(state.epoch), int(state.index)
    if not 0 <= index < num_records or epoch < 0:
        raise ConfigError(
            f"stream position (epoch={epoch}, index={index}) does not fit a dataset of {num_records} records; "
            "the data config changed since this checkpoint was written"
        )
    records = []
    while len(records) < batch_size:
        order = epoch_permutation(num_records, seed, epoch)
        take = min(batch_size - len(records), num_records - index)
        records.extend(source[int(i)] for i in order[index : index + take])
        index += take
        if index == num_records:
            epoch, index = epoch + 1, 0
    return records, StreamState(epoch, index)


def as_arrays(state: StreamState) -> dict[str, np.ndarray]:
    """For orbax: a dict of int64 scalars."""
    return {"epoch": np.asarray(state.epoch, np.int64), "index": np.asarray(state.index, np.int64)}


def from_arrays(arrays: dict[str, Any]) -> StreamState:
    return StreamState(epoch=int(arrays["epoch"]), index=int(arrays["index"]))
