"""The engine's state for a checkpoint, and back: everything a resumed run needs to continue the
samples in flight exactly as an uninterrupted run would.

    host, arrays = engine_to_state(pool, host_state)  # JSON-able bookkeeping, {name: numpy array}
    host_state = load_engine_state(pool, host, arrays, counts)  # into a fresh engine's pool, same shapes

`arrays` holds host copies, never views of the (donated) device buffers: "state", the device
`EngineState` leaf by leaf (the RNG key as raw key data), and "parked", the rows already read out
(finished members of groups in flight, complete groups not yet returned; absent when there are none,
as orbax refuses empty arrays). `host` holds the shapes, the pool's slot owners and
`EngineHostState.to_json()`. The caller's tags must be JSON-able.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxrl.config import ConfigError
from jaxrl.rollout.engine.host import EngineHostState
from jaxrl.rollout.engine.slots import SlotPool
from jaxrl.rollout.engine.state import EngineSpec, EngineState, SlotReadout, init_state, state_shardings

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


def engine_to_state(pool: SlotPool, host: EngineHostState) -> tuple[dict, dict]:
    """(host: JSON-able, arrays: {"state": {...}, "parked": {...}} of numpy copies) of an engine."""
    leaves = jax.tree.leaves(pool.state)
    saved = {_leaf_name(i): _host_copy(x) for i, x in enumerate(leaves)}
    host_json, parked = host.to_json()
    arrays = {"state": saved}
    if parked:
        arrays["parked"] = {
            name: np.stack([np.asarray(getattr(r, name)) for r in parked])
            for name in SlotReadout._fields
            if getattr(parked[0], name) is not None
        }
    shape = {k: getattr(pool.spec, k) for k in _SHAPE_FIELDS}
    return {"shape": shape, "owner_S": pool.owner_S.tolist(), **host_json}, arrays


def load_engine_state(pool: SlotPool, host: dict, arrays: dict | None, counts: dict[str, int]) -> EngineHostState:
    """Put a saved state into `pool` (a fresh engine's, built from the run's config; `counts` its fresh
    counters) -> the host state. A ConfigError naming the field when the engine's shapes changed since
    the save; the in-flight samples cannot be carried over."""
    if arrays is None or "state" not in arrays:
        raise ConfigError(
            "rollout.engine: the checkpoint holds the engine's bookkeeping but not its arrays "
            "(the checkpoint's rollout_arrays item is missing); use a new --workdir"
        )
    _check_shapes(pool.spec, host)
    pool.state = _device_state(pool.spec, arrays["state"])
    pool.owner_S = np.asarray(host["owner_S"], np.int64)
    parked = arrays.get("parked", {})

    def row(i) -> SlotReadout:
        routing = parked.get("routing_RxCxLxK")  # saved for MoE models only
        fields = {n: parked[n][i] for n in SlotReadout._fields if n != "routing_RxCxLxK"}
        return SlotReadout(**fields, routing_RxCxLxK=None if routing is None else routing[i])

    return EngineHostState.from_json(host, row, counts)


def _check_shapes(spec: EngineSpec, host: dict) -> None:
    for key, field in _SHAPE_FIELDS.items():
        saved, now = host["shape"].get(key, getattr(spec, key)), getattr(spec, key)
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


def _device_state(spec: EngineSpec, saved: dict) -> EngineState:
    """The saved leaves, checked against a fresh state's, as the device `EngineState`."""
    fresh = jax.eval_shape(init_state, spec, jax.random.key(0))
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
    state = jax.tree.unflatten(treedef, out)
    shardings = state_shardings(spec, state)  # laid out as the engine's programs leave it: no recompile
    return state if shardings is None else jax.device_put(state, shardings)
