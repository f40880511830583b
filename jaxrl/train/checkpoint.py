"""Asynchronous Orbax checkpoints of the whole run: train state, data position and host counters.

One `CheckpointManager` holds, per step, the `TrainState` pytree (params, optimizer state, step, RNG,
reference params with a KL term) and a JSON item with the data-stream position. A save returns after the device
arrays are copied; writing continues in the background. A kill mid-save leaves a temporary folder
that the manager ignores, so the last finished step is always restorable.
"""

from __future__ import annotations

import pathlib
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from jaxrl.config import CheckpointConfig, ConfigError


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


def match_reference(manager: ocp.CheckpointManager, abstract_state: Any) -> Any:
    """`abstract_state` with `ref_params` laid out as the newest checkpoint holds them.

    A run keeps reference params only when its loss has a KL term; checkpoints written before that
    rule always hold a copy. Such a checkpoint restores into a state without a reference by restoring
    the copy too (its caller then drops it). A checkpoint without one, restored for a loss that needs
    one, is a ConfigError: the run was trained without a KL term. An unreadable newest checkpoint
    returns `abstract_state` unchanged, for the restore to report."""
    step = manager.latest_step()
    if step is None:
        return abstract_state
    try:
        saved = ocp.StandardCheckpointHandler().metadata(pathlib.Path(manager.directory) / str(step) / "state")
        saved_ref = saved.get("ref_params") is not None
    except Exception:  # noqa: BLE001  (a damaged checkpoint is the restore's to report)
        return abstract_state
    if saved_ref and abstract_state.ref_params is None:
        return abstract_state._replace(ref_params=abstract_state.params)
    if abstract_state.ref_params is not None and not saved_ref:
        raise ConfigError(f"checkpoint {step} in {manager.directory} holds no reference params, but the loss needs "
                          "them (loss.kl_beta or kl_reward_beta > 0): this run was trained without a KL term; "
                          "use a new --workdir")
    return abstract_state
