"""Asynchronous Orbax checkpoints of the whole run: train state, data position and host counters.

One `CheckpointManager` holds, per step, the `TrainState` pytree (params, optimizer state, step, RNG,
reference params) and a JSON item with the data-stream position. A save returns after the device
arrays are copied; writing continues in the background. A kill mid-save leaves a temporary folder
that the manager ignores, so the last finished step is always restorable.
"""

from __future__ import annotations

import pathlib
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from jaxrl.config import CheckpointConfig


def make_manager(workdir: pathlib.Path, cfg: CheckpointConfig) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save,
                                           create=True)
    return ocp.CheckpointManager(pathlib.Path(workdir).absolute() / "checkpoints", options=options)


def save(manager: ocp.CheckpointManager, step: int, state: Any, host: dict, *, force: bool = False) -> bool:
    """Start saving `state` and the JSON-able `host` dict at `step`; returns whether a save started."""
    return manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                      host=ocp.args.JsonSave(host)), force=force)


def restore_latest(manager: ocp.CheckpointManager, abstract_state: Any) -> Optional[tuple[int, Any, dict]]:
    """(step, state, host) of the newest finished checkpoint, placed like `abstract_state`; None if none."""
    step = manager.latest_step()
    if step is None:
        return None
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                             host=ocp.args.JsonRestore()))
    return step, restored["state"], dict(restored["host"])


def abstract_like(state: Any) -> Any:
    """ShapeDtypeStructs (with shardings) that tell Orbax how to place the restored arrays."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                        state)
