"""Many processes, one program: each process's rows of a global array, small host values shared
between processes, and joining the processes at start.

    init_distributed(coordinator, num_processes, process_id)     # before anything touches devices
    rows = process_rows(batch_sh, n_rows)                        # the rows this process's devices hold
    x = put_rows(batch_sh, my_rows, n_rows)                      # this process's rows -> the global array
    mine = local_rows(x)                                         # and back

After `init_distributed`, `jax.devices()` is the global device list and every jitted step is one SPMD
program over all of them; each process feeds and reads only the rows its own devices hold. In one
process every function here is a plain device_put / np.asarray (or returns its argument).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def process_rows(sharding: NamedSharding, n_rows: int, axis: int = 0) -> slice:
    """The contiguous range of rows (along `axis`) that this process's devices hold."""
    shape = [1] * max(len(sharding.spec), axis + 1)
    shape[axis] = n_rows
    starts, stops = [], []
    for index in sharding.addressable_devices_indices_map(tuple(shape)).values():
        s = slice(None) if index is None else index[axis]  # None: the whole array
        starts.append(s.start or 0)
        stops.append(n_rows if s.stop is None else s.stop)
    lo, hi = min(starts), max(stops)
    covered = sum(b - a for a, b in sorted(set(zip(starts, stops))))
    if covered != hi - lo:
        raise ValueError(f"this process's devices hold non-contiguous rows of a {n_rows}-row batch")
    return slice(lo, hi)


def put_rows(sharding: NamedSharding, local: Any, n_rows: int, axis: int = 0) -> jax.Array:
    """This process's rows (`process_rows`) of a global array -> the global jax.Array."""
    local = np.asarray(local)
    shape = local.shape[:axis] + (n_rows,) + local.shape[axis + 1 :]
    return jax.make_array_from_process_local_data(sharding, local, shape)


def put_global(sharding: NamedSharding, value: Any) -> jax.Array:
    """A host value every process holds in full -> a global array laid out by `sharding`."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def local_rows(x: jax.Array, axis: int = 0) -> np.ndarray:
    """This process's rows of a global array sharded (only) along `axis`, as numpy."""
    if x.is_fully_addressable:
        return np.asarray(x)
    shards = {}
    for s in x.addressable_shards:
        shards.setdefault(s.index[axis].start or 0, s.data)
    return np.concatenate([np.asarray(shards[k]) for k in sorted(shards)], axis)


def gather_rows(sharding: NamedSharding, local: np.ndarray, n_rows: int) -> np.ndarray:
    """Every process's rows, concatenated in global order, on every process (one process: `local`)."""
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(put_rows(sharding, local, n_rows), tiled=True))


def gather_objects(obj: Any) -> list:
    """Every process's `obj` (picklable: numpy arrays, JSON-able dicts), in process order, on every
    process; a collective every process must call in the same order. One process: [obj]."""
    if jax.process_count() == 1:
        return [obj]
    import pickle

    from jax.experimental import multihost_utils

    blob = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([blob.size], np.int64))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: blob.size] = blob
    blobs = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    return [pickle.loads(b[:n].tobytes()) for b, n in zip(blobs, sizes)]


def process_local(tree: Any, local_shardings: Any) -> Any:
    """Global arrays (laid out over every process's devices) -> the same values on this process's own
    devices, laid out by `local_shardings` (NamedShardings on a mesh of `jax.local_devices()`). A
    replicated leaf is taken from this process's copies (no transfer); any other leaf is first
    all-gathered to replicated, a collective every process must call in the same order."""
    leaves, treedef = jax.tree.flatten(tree)
    split = [i for i, x in enumerate(leaves) if not x.is_fully_replicated]
    if split:
        mesh = leaves[split[0]].sharding.mesh
        gathered = jax.jit(lambda xs: xs, out_shardings=NamedSharding(mesh, P()))([leaves[i] for i in split])
        for i, x in zip(split, gathered):
            leaves[i] = x
    out = []
    for x, sh in zip(leaves, jax.tree.leaves(local_shardings)):
        local_rep = NamedSharding(sh.mesh, P())
        by_device = {s.device: s.data for s in x.addressable_shards}
        copies = [by_device[d] for d in local_rep.addressable_devices_indices_map(x.shape)]
        local = jax.make_array_from_single_device_arrays(x.shape, local_rep, copies)
        out.append(local if sh.spec == P() else jax.device_put(local, sh))
    return jax.tree.unflatten(treedef, out)


def all_processes_sum(x: float) -> float:
    if jax.process_count() == 1:
        return x
    from jax.experimental import multihost_utils

    return float(np.sum(multihost_utils.process_allgather(np.asarray([x], np.float64))))


def any_process(flag: bool) -> bool:
    """True on every process if it is True on any (e.g. one of them got SIGTERM)."""
    return all_processes_sum(float(bool(flag))) > 0


def is_primary() -> bool:
    return jax.process_index() == 0


def from_primary(compute: Callable[[], Any]) -> Any:
    """`compute()` run by process 0 only, its result (JSON-able: e.g. a dict of floats, which survive
    the round trip exactly) returned on every process; in one process simply `compute()`. Every
    process must call it (two broadcasts: the length, then the bytes)."""
    if jax.process_count() == 1:
        return compute()
    import json

    from jax.experimental import multihost_utils

    payload = (
        np.frombuffer(json.dumps(compute(), default=float).encode(), np.uint8)
        if is_primary()
        else np.zeros(0, np.uint8)
    )
    n = int(multihost_utils.broadcast_one_to_all(np.asarray(len(payload), np.int64)))
    buf = np.zeros(n, np.uint8)
    buf[: len(payload)] = payload
    return json.loads(np.asarray(multihost_utils.broadcast_one_to_all(buf)).tobytes())


# ---------------------------------------------------------------------------------------------
# Several processes


@contextlib.contextmanager
def _join_deadline(timeout_s: int, why: str):
    """Around `jax.distributed.initialize`: if it has not returned just before its own timeout (when
    XLA would abort with a C++ check failure that blames "another task"), print `why` as one error
    line and exit with code 1. The wait inside initialize releases the GIL, so a timer thread runs."""
    import os
    import sys
    import threading

    def give_up():
        print(f"jaxrl: error: {why}", file=sys.stderr, flush=True)
        os._exit(1)  # the main thread is blocked inside XLA: no exception can reach it

    timer = threading.Timer(max(timeout_s - 1.0, 0.9 * timeout_s), give_up)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def init_distributed(coordinator: str, num_processes: int, process_id: int, timeout_s: int = 120) -> None:
    """Join `num_processes` processes through `coordinator` (host:port; process 0 serves it). Call
    before anything touches devices. On CPU the cross-process collectives run over gloo. A peer that
    never arrives makes every waiting process exit with code 1 and one line after `timeout_s` s."""
    import sys

    print(
        f"jaxrl: process {process_id} of {num_processes} joining {coordinator} (timeout {timeout_s} s)",
        file=sys.stderr,
        flush=True,
    )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    why = (
        f"process {process_id} of {num_processes}: not all {num_processes} processes joined {coordinator} within "
        f"--init-timeout {timeout_s} s; start each with the same --coordinator and --num-processes and its own "
        "--process-id (0 serves the coordinator), or raise --init-timeout"
    )
    with _join_deadline(timeout_s, why):
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=int(timeout_s),
        )


def detect_cluster() -> str | None:
    """The cluster environment `jax.distributed.initialize()` would pick up with no arguments ("slurm",
    "gcetpu", "gketpu", "ompi", "k8s"), or None. Uses JAX's own detectors (no public API lists them),
    in JAX's order, skipping the opt-in ones (mpi4py) as JAX does."""
    from jax._src import clusters

    for env in clusters.ClusterEnv._cluster_types:
        if not env.opt_in_only_method and env.is_env_present():
            return env.name
    return None


def init_distributed_auto(cluster: str, timeout_s: int = 300) -> None:
    """`init_distributed` with everything (coordinator, process count, this process) taken from the
    `cluster` environment by `jax.distributed.initialize()`; prints what it joined as."""
    import sys

    from jax._src.distributed import global_state

    print(f"jaxrl: {cluster} cluster detected; joining (timeout {timeout_s} s)", file=sys.stderr, flush=True)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    why = (
        f"the {cluster} cluster's processes did not all join within --init-timeout {timeout_s} s (is every "
        "task of the job running `jaxrl train --cluster auto`?), or raise --init-timeout"
    )
    with _join_deadline(timeout_s, why):
        jax.distributed.initialize(initialization_timeout=int(timeout_s))
    print(
        f"jaxrl: process {global_state.process_id} of {global_state.num_processes} joined "
        f"{global_state.coordinator_address} ({cluster})",
        file=sys.stderr,
        flush=True,
    )
