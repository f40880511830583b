"""The engine's state for a checkpoint, and back: everything a resumed run needs to continue the
samples in flight exactly as an uninterrupted run would.

    host, arrays = engine_to_state(engine)      # JSON-able bookkeeping, {name: numpy array}
    load_engine_state(engine, host, arrays)     # into a freshly built engine of the same shapes

`arrays` holds host copies (never views of device buffers): `admit`/`decode_chunk` donate the
device state, and on CPU a numpy view of a donated buffer would change under an asynchronous save.
It has two parts: "state", the device `EngineState` leaf by leaf (the KV cache of every slot, the
tokens / log-probs / versions / masks so far, fill levels, routing, and the RNG key as its raw
key data), and "parked", the rows the host has already read out: finished members of groups still
in flight and the complete groups not yet returned (one row per sample, stacked; absent when
there are none, as orbax refuses empty arrays). `host` holds the slot owners, the groups in flight
(tag, prompt, slots, the version that admitted them, which parked row is which member), the ready
groups, the groups queued for a restart (bounded staleness), the latest collect's version, the next
group id, the counters and the shapes. Tags are stored as given: the caller's tags must be JSON-able (the
training loop's are the data records, dicts of strings).
"""

from __future__ import annotations

import jax
import numpy as np

from jaxrl.config import ConfigError
from jaxrl.rollout.engine.groups import Flight, flight_group
from jaxrl.rollout.engine.state import EngineState, SlotReadout, init_state

# host["shape"] key -> the config field that sets it (named by the error when a resume changes it).
_SHAPE_FIELDS = {
    "slots": "rollout.engine.slots",
    "prompt_len": "data.max_prompt_len",
    "max_new_tokens": "rollout.max_new_tokens",
    "group_size": "rollout.group_size",
    "cache_len": "rollout.speculative.enabled/max_draft",
}  # speculation lengthens the cache


def _is_key(x) -> bool:
    return jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key)


def _host_copy(x) -> np.ndarray:
    """A numpy copy that owns its memory (np.asarray of a CPU jax array may alias the device buffer)."""
    return np.array(jax.random.key_data(x) if _is_key(x) else x, copy=True)


def _leaf_name(i: int) -> str:
    return f"{i:03d}"


def engine_to_state(engine) -> tuple[dict, dict]:
    """(host: JSON-able, arrays: {"state": {...}, "parked": {...}} of numpy copies) of `engine`."""
    leaves = jax.tree.leaves(engine.state)
    state = {_leaf_name(i): _host_copy(x) for i, x in enumerate(leaves)}
    parked: list[SlotReadout] = []

    def park(rows: list) -> list[int]:
        parked.extend(rows)
        return list(range(len(parked) - len(rows), len(parked)))

    flights = []
    for gid, f in engine._flight.items():
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
        for g in engine._ready
    ]
    spec = engine.spec
    host = {
        "shape": {k: getattr(spec, k) for k in _SHAPE_FIELDS},
        "owner_S": engine._owner_S.tolist(),
        "next_id": int(engine._next_id),
        "counts": dict(engine.counts),
        "flights": flights,
        "ready": ready,
        "version": engine._version,  # the latest collect's: a re-prefill runs when the next one differs
        "restart": [{"tag": t, "prompt_P": p.tolist(), "mask_P": m.tolist()} for t, p, m in engine._restart],
    }
    arrays = {"state": state}
    if parked:
        arrays["parked"] = {
            name: np.stack([np.asarray(getattr(r, name)) for r in parked])
            for name in SlotReadout._fields
            if getattr(parked[0], name) is not None
        }
    return host, arrays


def _group_rows(g) -> list[SlotReadout]:
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


def load_engine_state(engine, host: dict, arrays: dict | None) -> None:
    """Put a saved state into `engine` (built from the run's config). A ConfigError naming the field
    when the engine's shapes changed since the save; the in-flight samples cannot be carried over."""
    if arrays is None or "state" not in arrays:
        raise ConfigError(
            "rollout.engine: the checkpoint holds the engine's bookkeeping but not its arrays "
            "(the checkpoint's rollout_arrays item is missing); use a new --workdir"
        )
    _check_shapes(engine, host)
    engine.state = _device_state(engine, arrays["state"])
    parked = arrays.get("parked", {})

    def row(i) -> SlotReadout:
        routing = parked.get("routing_RxCxLxK")  # saved for MoE models only
        fields = {n: parked[n][i] for n in SlotReadout._fields if n != "routing_RxCxLxK"}
        return SlotReadout(**fields, routing_RxCxLxK=None if routing is None else routing[i])

    engine._owner_S = np.asarray(host["owner_S"], np.int64)
    engine._next_id = int(host["next_id"])
    engine.counts = {**engine.counts, **{k: int(v) for k, v in host["counts"].items()}}
    engine._version = host.get("version")
    engine._restart = [
        (r["tag"], np.asarray(r["prompt_P"], np.int32), np.asarray(r["mask_P"], np.int32))
        for r in host.get("restart", [])
    ]
    engine._flight = {}
    for f in host["flights"]:
        rows = {int(m): row(i) for m, i in zip(f["members"], f["rows"])}
        engine._flight[int(f["id"])] = Flight(
            f["tag"],
            np.asarray(f["prompt_P"], np.int32),
            np.asarray(f["mask_P"], np.int32),
            np.asarray(f["slots_G"], np.int64),
            rows,
            None,
            int(f.get("born", 0)),
        )
    engine._ready = []
    for g in host["ready"]:
        rows = {m: row(i) for m, i in enumerate(g["rows"])}
        engine._ready.append(
            flight_group(
                Flight(
                    g["tag"],
                    np.asarray(g["prompt_P"], np.int32),
                    np.asarray(g["mask_P"], np.int32),
                    np.arange(len(rows)),
                    rows,
                    None,
                )
            )
        )


def _check_shapes(engine, host: dict) -> None:
    for key, field in _SHAPE_FIELDS.items():
        saved, now = host["shape"].get(key, getattr(engine.spec, key)), getattr(engine.spec, key)
        if saved != now and key == "cache_len":
            raise ConfigError(
                f"{field}: the checkpoint's engine caches hold {saved} positions per sample, this "
                f"run's {now} (speculative drafting adds max_draft); resume with the saved "
                "rollout.speculative settings, or use a new --workdir"
            )
        if saved != now:
            raise ConfigError(
                f"{field}: the checkpoint's engine state has {key}={saved}, this run {now}; samples "
                f"in flight cannot move to another shape (resume with {field}={saved}, or use a new "
                "--workdir)"
            )


def _device_state(engine, saved: dict) -> EngineState:
    """The saved leaves, checked against a fresh state's, as the device `EngineState`."""
    fresh = jax.eval_shape(init_state, engine.spec, jax.random.key(0))
    leaves, treedef = jax.tree.flatten(fresh)
    if len(saved) != len(leaves):
        raise ConfigError(
            f"model: the checkpoint's engine state has {len(saved)} arrays, this run's engine "
            f"{len(leaves)}; the model changed since the save (use a new --workdir)"
        )
    out = []
    for i, like in enumerate(leaves):
        x = np.asarray(saved[_leaf_name(i)])
        want = jax.eval_shape(jax.random.key_data, like) if _is_key(like) else like
        if x.shape != want.shape or x.dtype != want.dtype:
            raise ConfigError(
                f"model: the checkpoint's engine state array {i} is {x.dtype}{list(x.shape)}, this "
                f"run's engine needs {want.dtype}{list(want.shape)}; the model changed since the save "
                "(use a new --workdir)"
            )
        out.append(jax.random.wrap_key_data(jax.numpy.asarray(x)) if _is_key(like) else jax.numpy.array(x))  # a copy
    return jax.tree.unflatten(treedef, out)
