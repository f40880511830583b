"""The engine's host-side bookkeeping (`EngineHostState`), owned by `Engine`, and its JSON form.

Everything the driver knows beyond its `SlotPool` (the device state and which group holds each
slot, slots.py): the groups in flight and their retired rows, the complete groups not yet returned,
the groups queued for a restart, the latest collect's version, the next group id and the counters.
`to_json()` -> (JSON-able dict, readout rows it refers to by index); `from_json` is its inverse.
The rows (arrays) are stacked and saved beside the JSON by checkpoint.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxrl.rollout.engine.groups import Flight, Group, flight_group
from jaxrl.rollout.engine.state import SlotReadout

COUNTS = ("chunks", "prefill_calls", "admitted_groups", "restarted_groups", "restarted_samples", "reprefilled_samples")


@dataclasses.dataclass
class EngineHostState:
    flight: dict[int, Flight] = dataclasses.field(default_factory=dict)  # group id -> group still decoding
    ready: list[Group] = dataclasses.field(default_factory=list)  # complete, not yet returned
    next_id: int = 0
    restart: list = dataclasses.field(default_factory=list)  # (tag, prompt_P, mask_P) to re-admit first
    version: int | None = None  # the latest collect's (None before the first)
    counts: dict[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def fresh(cls, extra_counts: tuple = ()) -> EngineHostState:
        """Nothing in flight, nothing counted yet (`extra_counts`: counters beyond `COUNTS`, at 0)."""
        return cls(counts=dict.fromkeys(COUNTS + tuple(extra_counts), 0))

    def to_json(self) -> tuple[dict[str, Any], list[SlotReadout]]:
        """(JSON-able dict, the readout rows its "rows" entries index): retired members of groups in
        flight, then every sample of the ready groups. Tags are stored as given (they must be JSON-able)."""
        parked: list[SlotReadout] = []

        def park(rows: list) -> list[int]:
            parked.extend(rows)
            return list(range(len(parked) - len(rows), len(parked)))

        flights = []
        for gid, f in self.flight.items():
            if f.sink is not None:  # `Engine.sample` runs its flights to the end inside one call
                raise RuntimeError("engine_to_state: an `Engine.sample` call is still in progress")
            members = sorted(f.rows)
            flights.append(
                {
                    "id": int(gid),
                    "tag": f.tag,
                    "prompt_P": f.prompt_P.tolist(),
                    "mask_P": f.mask_P.tolist(),
                    "slots_G": f.slots_G.tolist(),
                    "members": members,
                    "born": int(f.born),
                    "rows": park([f.rows[m] for m in members]),
                }
            )
        ready = [
            {
                "tag": g.tag,
                "prompt_P": g.prompt_P.tolist(),
                "mask_P": g.prompt_mask_P.tolist(),
                "rows": park(_group_rows(g)),
            }
            for g in self.ready
        ]
        host = {
            "next_id": int(self.next_id),
            "counts": dict(self.counts),
            "flights": flights,
            "ready": ready,
            "version": self.version,  # the latest collect's: a re-prefill runs when the next one differs
            "restart": [{"tag": t, "prompt_P": p.tolist(), "mask_P": m.tolist()} for t, p, m in self.restart],
        }
        return host, parked

    @classmethod
    def from_json(cls, host: dict, row, counts: dict[str, int]) -> EngineHostState:
        """Inverse of `to_json`: `row(i)` gives back parked row i; `counts` (a fresh engine's) are
        overlaid with the saved ones (a counter the save lacks stays as given)."""
        flight = {}
        for f in host["flights"]:
            rows = {int(m): row(i) for m, i in zip(f["members"], f["rows"])}
            flight[int(f["id"])] = Flight(
                f["tag"],
                np.asarray(f["prompt_P"], np.int32),
                np.asarray(f["mask_P"], np.int32),
                np.asarray(f["slots_G"], np.int64),
                rows,
                None,
                int(f.get("born", 0)),
            )
        ready = []
        for g in host["ready"]:
            rows = {m: row(i) for m, i in enumerate(g["rows"])}
            prompt_P, mask_P = np.asarray(g["prompt_P"], np.int32), np.asarray(g["mask_P"], np.int32)
            ready.append(flight_group(Flight(g["tag"], prompt_P, mask_P, np.arange(len(rows)), rows, None)))
        return cls(
            flight=flight,
            ready=ready,
            next_id=int(host["next_id"]),
            restart=[
                (r["tag"], np.asarray(r["prompt_P"], np.int32), np.asarray(r["mask_P"], np.int32))
                for r in host.get("restart", [])
            ],
            version=host.get("version"),
            counts={**counts, **{k: int(v) for k, v in host["counts"].items()}},
        )


def _group_rows(g: Group) -> list[SlotReadout]:
    """A complete Group back into its per-sample readout rows."""
    return [
        SlotReadout(
            g.tokens_GxT[r],
            g.completion_mask_GxT[r],
            g.logp_GxT[r],
            g.version_GxT[r],
            g.finished_G[r],
            g.truncated_G[r],
            np.asarray(g.completion_mask_GxT[r].sum(), np.int32),
            None if g.routing_GxSxLxK is None else g.routing_GxSxLxK[r],
        )
        for r in range(len(g.tokens_GxT))
    ]
