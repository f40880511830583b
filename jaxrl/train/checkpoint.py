"""Asynchronous Orbax checkpoints of the whole run: train state, data position and host counters.

One `CheckpointManager` holds, per step, the `TrainState` pytree (params, optimizer state, step, RNG,
reference params with a KL term), a JSON item with the data-stream position and the rollout source's
host state, and, when the source has device state (the slot engine's samples in flight), an item of
numpy arrays (`ARRAYS`). A save returns after
the device arrays are copied; writing continues in the background. A kill mid-save leaves a temporary folder
that the manager ignores, so the last finished step is always restorable. A finished checkpoint that
no longer restores (a file truncated or lost later) is moved to `checkpoints.unreadable/` and the run
resumes from the newest one that does; NaN/inf parameters are never saved.
"""

from __future__ import annotations

import concurrent.futures
import copy
import logging
import pathlib
import shutil
import sys
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxrl.config import CheckpointConfig
from jaxrl.config.errors import CheckpointError, ConfigError, NonFiniteError, first_line
from jaxrl.multihost import any_process, is_primary
from jaxrl.sources.base import ARRAYS


def make_manager(workdir: pathlib.Path, cfg: CheckpointConfig) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save, create=True)
    return ocp.CheckpointManager(pathlib.Path(workdir).absolute() / "checkpoints", options=options)


def save(manager: ocp.CheckpointManager, step: int, state: Any, host: dict, *, force: bool = False) -> bool:
    """Start saving `state` and the JSON-able `host` dict at `step`; returns whether a save started.
    `host[ARRAYS]`, if any, is saved as the arrays item: numpy only, since a device array could be
    donated and overwritten while the asynchronous save still writes it. Non-finite parameters are
    never saved (NonFiniteError): they would rotate the good checkpoints out."""
    check_finite(state, step)
    host = dict(host)
    items = {"state": ocp.args.StandardSave(state)}
    arrays = host.pop(ARRAYS, None)
    if arrays:
        bad = [
            jax.tree_util.keystr(p)
            for p, x in jax.tree_util.tree_flatten_with_path(arrays)[0]
            if not isinstance(x, np.ndarray)
        ]
        if bad:
            raise TypeError(
                f"checkpoint item {ARRAYS}: {bad[0]} is not a numpy array (copy device arrays to the host "
                "before saving)"
            )
        items[ARRAYS] = ocp.args.StandardSave(arrays)
    return manager.save(step, args=ocp.args.Composite(host=ocp.args.JsonSave(host), **items), force=force)


class BackgroundSaver:
    """The training loop's `save`: the step blocks only while the state is copied (to host memory, where
    the next step's donated update cannot overwrite it); one background thread then runs the orbax save
    of that copy (orbax writes the files in its own background thread). Saves run one at a time, in
    order; at most one copy waits (a second `save` first waits for the previous one to start), and an
    error in a save is raised by the next `save` or by `wait`. This takes orbax's synchronous part
    (threads, directories, per-array bookkeeping) off the step (benchmarks/checkpoint.py). With several
    processes saves run on the calling thread: they synchronise the processes, which must happen in step
    order on every process."""

    def __init__(self, manager: ocp.CheckpointManager):
        self.manager = manager
        self.background = jax.process_count() == 1 and bool(manager._options.enable_async_checkpointing)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxrl-checkpoint")
        self._started: concurrent.futures.Future | None = None

    def save(self, step: int, state: Any, host: dict, *, force: bool = False) -> None:
        check_finite(state, step)
        self._join()
        if not self.background:
            save(self.manager, step, state, host, force=force)
            return
        state_copy = jax.device_put(state, jax.devices("cpu")[0], may_alias=False)
        self._started = self._pool.submit(save, self.manager, step, state_copy, copy.deepcopy(host), force=force)

    def _join(self) -> None:
        started, self._started = self._started, None
        if started is not None:
            started.result()  # re-raises the background save's error here, on the loop's thread

    def wait(self) -> None:
        """Every save started and finished on disk (errors raised)."""
        self._join()
        self.manager.wait_until_finished()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            self.manager.close()


UNREADABLE = "checkpoints.unreadable"  # next to checkpoints/: orbax neither lists nor rotates it


def _restore(manager: ocp.CheckpointManager, step: int, abstract_state: Any) -> tuple[int, Any, dict]:
    items = {"state": ocp.args.StandardRestore(abstract_state), "host": ocp.args.JsonRestore()}
    with_arrays = (pathlib.Path(manager.directory) / str(step) / ARRAYS).is_dir()
    if with_arrays:  # restored as saved (numpy); its owner checks the shapes
        items[ARRAYS] = ocp.args.StandardRestore()
    restored = manager.restore(step, args=ocp.args.Composite(**items))
    host = dict(restored["host"])
    if with_arrays:
        host[ARRAYS] = restored[ARRAYS]
    return step, restored["state"], host


def restore_latest(manager: ocp.CheckpointManager, abstract_state: Any) -> tuple[int, Any, dict] | None:
    """(step, state, host) of the newest checkpoint that restores, placed like `abstract_state`; None if
    there is none. A newer one that fails (a truncated file) is moved aside to `checkpoints.unreadable/`
    (never deleted), with a line on stderr, and the next older one is tried. If none restores, nothing
    is moved (a config that does not fit the checkpoints fails on all of them): a CheckpointError."""
    failed: list[tuple[int, str]] = []
    for step in sorted(manager.all_steps(), reverse=True):
        try:
            result, error = _restore(manager, step, abstract_state), None
        except Exception as e:  # tensorstore, orbax and JSON errors alike
            result, error = None, first_line(e)
            _drop_failed_read_noise()
        if any_process(error is not None):  # every process restores the same step, or none does
            failed.append((step, error or "failed on another process"))
            continue
        if failed:
            _set_aside(manager, failed, step)
        return result
    if failed:
        step, error = failed[0]
        raise CheckpointError(
            f"no checkpoint in {manager.directory} could be restored; the newest, step {step}: {error}"
        )
    return None


# A failed orbax restore leaves reads in flight. When their coroutines are closed later (by the garbage
# collector, or the event loop of orbax's thread closing), each one prints a traceback with a whole
# TensorStore spec (~60 lines) through sys.unraisablehook, and asyncio may report "Event loop is
# closed": ~1,000 lines, at a time no one controls. restore_latest's one line says what failed; from the
# first failed restore on, these (and nothing else) are dropped, wherever they surface.
_FAILED_READ_NOISE = ("Encountered error while reading array index", "Event loop is closed")
_noise_dropped = False


def _is_failed_read_noise(exc: BaseException | None) -> bool:
    return exc is not None and str(exc).startswith(_FAILED_READ_NOISE)


def _drop_failed_read_noise() -> None:
    """Wrap sys.unraisablehook and threading.excepthook, and filter the asyncio logger, once per process."""
    global _noise_dropped
    if _noise_dropped:
        return
    _noise_dropped = True
    unraisable_hook, thread_hook = sys.unraisablehook, threading.excepthook

    def on_unraisable(unraisable) -> None:
        if not _is_failed_read_noise(unraisable.exc_value):
            unraisable_hook(unraisable)

    def on_thread_exception(args) -> None:
        if not _is_failed_read_noise(args.exc_value):
            thread_hook(args)

    sys.unraisablehook, threading.excepthook = on_unraisable, on_thread_exception
    logging.getLogger("asyncio").addFilter(
        lambda record: not (record.exc_info and _is_failed_read_noise(record.exc_info[1]))
    )


def _set_aside(manager: ocp.CheckpointManager, failed: list[tuple[int, str]], good: int) -> None:
    """Move the unreadable steps out of the manager's directory, so that the run's next save of that
    step number does not collide and checkpoint rotation never deletes them."""
    directory = pathlib.Path(manager.directory)
    aside = directory.parent / UNREADABLE
    if is_primary():
        aside.mkdir(exist_ok=True)
        for step, error in failed:
            target = aside / str(step)
            n = 1
            while target.exists():
                target, n = aside / f"{step}-{n}", n + 1
            shutil.move(str(directory / str(step)), target)
            print(
                f"jaxrl: checkpoint step {step} could not be restored ({error}); moved to {target}; "
                f"resuming from step {good}",
                file=sys.stderr,
            )
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("jaxrl: unreadable checkpoints set aside")
    manager.reload()


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def check_finite(state: Any, step: int) -> None:
    """NonFiniteError unless every parameter is finite: a checkpoint never holds NaN/inf weights."""
    if not bool(np.asarray(_all_finite(state.params).addressable_data(0))):  # replicated: any process reads it
        raise NonFiniteError(
            f"step {step}: the parameters hold NaN/inf values; stopped without saving them "
            "(the newest checkpoint is the last finite one). Lower optim.learning_rate, or "
            "check the rewards"
        )


def abstract_like(state: Any) -> Any:
    """ShapeDtypeStructs (with shardings) that tell Orbax how to place the restored arrays."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), state)


def _match_critic(abstract_state: Any, has_critic: bool, step: int) -> None:
    """ConfigError naming critic.enabled when the run has a critic (`SavedCriticState`) and the
    checkpoint none, or the other way round."""
    wants = getattr(abstract_state, "critic", None) is not None
    if wants != has_critic:
        raise ConfigError(
            f"critic.enabled: the run's is {wants}, but checkpoint {step} holds "
            f"{'a' if has_critic else 'no'} critic (value model); resume with the critic setting it "
            "was trained with, or use a new --workdir"
        )


def match_reference(manager: ocp.CheckpointManager, abstract_state: Any) -> Any:
    """`abstract_state` with `ref_params` laid out as the newest checkpoint holds them (a critic on one
    side only is a ConfigError naming critic.enabled).

    A run keeps reference params only when its loss has a KL term; a checkpoint that holds a copy
    restores into a state without a reference by restoring the copy too (its caller then drops it). A
    checkpoint without one, restored for a loss that needs one, is a ConfigError: the run was trained
    without a KL term. An unreadable newest checkpoint returns `abstract_state` unchanged, for the restore to report."""
    step = manager.latest_step()
    if step is None:
        return abstract_state
    try:
        saved = ocp.StandardCheckpointHandler().metadata(manager.directory / str(step) / "state")
        saved_ref = saved.get("ref_params") is not None
        _match_critic(abstract_state, saved.get("critic") is not None, step)
    except ConfigError:
        raise
    except Exception:  # a damaged checkpoint is the restore's to report
        return abstract_state
    if saved_ref and abstract_state.ref_params is None:
        return abstract_state._replace(ref_params=abstract_state.params)
    if abstract_state.ref_params is not None and not saved_ref:
        raise ConfigError(
            f"checkpoint {step} in {manager.directory} holds no reference params, but the loss needs "
            "them (loss.kl_beta or kl_reward_beta > 0): this run was trained without a KL term; "
            "use a new --workdir"
        )
    return abstract_state
