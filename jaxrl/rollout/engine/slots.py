"""The slot scheduler both drivers run (`Engine`: groups of one prompt; `EpisodeEngine`: episodes):
the device `EngineState` of S slots, who holds each slot, one chunk of decoding, and the readout of
the slots that finished.

    pool = SlotPool(spec, init_state(spec, rng))
    slots = pool.free()[:n]; pool.state = admit(...) or place(...); pool.hold(slots, owner)
    counts = pool.decode(lparams, n_steps, version, temperature, stop_at)
    host, retired = pool.retire()  # host_slots copy, [(slot, owner)] of the finished slots (now free)

An owner is an id >= 0 the driver chooses (a group id, an episode index); -1 marks a free slot. A
slot is decoding iff it is held: a finished slot is freed by the `retire` that reads it out.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxrl.rollout.engine.state import EngineSpec, EngineState, decode_chunk, host_slots


class SlotPool:
    def __init__(self, spec: EngineSpec, state: EngineState, chunk: Callable | None = None):
        """chunk: a chunk strategy (`speculative.engine.ToggleChunk`) run instead of the plain
        `decode_chunk`; it is told which slots decode and returns the counts it adds."""
        self.spec, self.state, self.chunk = spec, state, chunk
        self.owner_S = np.full(spec.slots, -1, np.int64)

    def free(self) -> np.ndarray:
        """The free slots, in slot order."""
        return np.flatnonzero(self.owner_S < 0)

    def hold(self, slots, owner: int) -> None:
        self.owner_S[slots] = owner

    def decode(self, lparams, n_steps: int, version: int, temperature, stop_at=None) -> dict[str, int]:
        """One chunk of at most n_steps decode steps over all slots, ending early once stop_at slots
        are done (`decode_chunk`) -> the counts the chunk strategy adds ({} for the plain chunk)."""
        if self.chunk is None:
            self.state = decode_chunk(lparams, self.spec, self.state, n_steps, version, temperature, stop_at)
            return {}
        decoding_S = self.owner_S >= 0
        self.state, counted = self.chunk(
            lparams, self.spec, self.state, n_steps, version, temperature, decoding_S, stop_at
        )
        return counted

    def retire(self) -> tuple[EngineState, list[tuple[int, int]]]:
        """-> (the `host_slots` copy, [(slot, owner)] of the held slots that are done, in slot order);
        those slots are free afterwards. One device round trip."""
        host = host_slots(self.state)
        slots = np.flatnonzero(host.done_S & (self.owner_S >= 0))
        retired = [(int(s), int(self.owner_S[s])) for s in slots]
        self.owner_S[slots] = -1
        return host, retired
