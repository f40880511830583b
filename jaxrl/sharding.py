"""Mesh presets as small logical-axis rules tables, the shardings jitted steps use, multi-host glue.

Parameters carry logical axis names (`layers`, `embed`, `mlp`, `heads`, `kv_heads`, `head_dim`,
`vocab`, `expert`); batch arrays carry `batch` on the axis their name marks `B` (`tokens_BxT`: axis
0, `routing_LxBxTxk`: axis 1). A preset is a tuple of mesh axis names plus a table mapping logical
names to mesh axes; a name missing from the table (or a model lacking a name the table has) is
replicated, and so is a parameter dimension that does not divide over its mesh axis.

    mesh, preset = make_mesh(cfg.mesh)                       # sizes checked against jax.devices()
    param_sh = param_shardings(mesh, preset, param_logical_axes(model_cfg), abstract_params)
    batch = {k: put_rows(named_sharding(mesh, preset, k), my_rows, n_rows) ...}  # each process: its rows

Multi-host: `init_distributed` (before anything touches devices) joins the processes; from then on
`jax.devices()` is the global device list, every jitted step is one SPMD program over all of them,
and each process feeds and reads only the rows its own devices hold (`process_rows`, `local_rows`).
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.config import Config, ConfigError, MeshConfig
from jaxrl.models.parallel import Parallel, rows_axis

Rule = tuple  # (logical name, mesh axis | tuple of mesh axes)
AnyMesh = Mesh | AbstractMesh  # the layout functions read only the axis sizes


class MeshPreset(NamedTuple):
    axis_names: tuple[str, ...]
    rules: tuple[Rule, ...]  # logical name -> mesh axis (or axes)
    # `mesh.allow_replicated`: patterns (fnmatch) of parameter paths ("blocks/attn/k") whose dimensions
    # that do not divide over their mesh axis are replicated instead of an error; make_mesh sets it.
    allow_replicated: tuple[str, ...] = ()


PRESETS = {
    # One device; every rule maps to nothing.
    "single": MeshPreset(("data",), ()),
    # Pure data parallelism: parameters replicated, the batch split over every device.
    "data": MeshPreset(("data",), (("batch", "data"),)),
    # ZeRO-3 style: the batch and every parameter's `embed` dimension split over all devices.
    "fsdp": MeshPreset(("fsdp",), (("batch", "fsdp"), ("embed", "fsdp"))),
    # fsdp x Megatron tensor parallelism: mlp / heads / vocab split over `tensor` (mesh.tensor).
    "fsdp_tensor": MeshPreset(
        ("fsdp", "tensor"),
        (
            ("batch", "fsdp"),
            ("embed", "fsdp"),
            ("mlp", "tensor"),
            ("heads", "tensor"),
            ("kv_heads", "tensor"),
            ("vocab", "tensor"),
            ("sequence", "tensor"),  # the residual stream between layers, split by position (`models.parallel`)
        ),
    ),
    # fsdp x expert parallelism: experts split over `expert` (mesh.expert), the batch over both axes.
    "fsdp_expert": MeshPreset(
        ("fsdp", "expert"), (("batch", ("fsdp", "expert")), ("embed", "fsdp"), ("expert", "expert"))
    ),
}


def mesh_shape(cfg: MeshConfig, n_devices: int, prefix: str = "mesh") -> tuple[int, ...]:
    """The preset's mesh shape on `n_devices`; ConfigError naming the field (under `prefix`: "mesh",
    or "rollout.mesh" for the rollout's own layout) if it does not fit."""
    if cfg.preset == "single":
        return (1,)
    if cfg.preset in ("data", "fsdp"):
        return (n_devices,)
    field = "tensor" if cfg.preset == "fsdp_tensor" else "expert"
    size = getattr(cfg, field)
    if n_devices % size:
        raise ConfigError(
            f"{prefix}.{field}={size} does not divide the {n_devices} devices "
            f"({prefix}.preset={cfg.preset!r} needs devices = fsdp * {field})"
        )
    return (n_devices // size, size)


def make_mesh(cfg: MeshConfig, devices: list | None = None, prefix: str = "mesh") -> tuple[Mesh, MeshPreset]:
    """The mesh of `cfg` on `devices` (default `jax.devices()`), in their order; errors name `prefix`'s fields."""
    devices = list(devices if devices is not None else jax.devices())
    preset = PRESETS[cfg.preset]._replace(allow_replicated=tuple(cfg.allow_replicated))
    shape = mesh_shape(cfg, len(devices), prefix)
    if cfg.preset == "single" and jax.process_count() > 1:
        raise ConfigError(
            f"mesh.preset='single' uses one device, but this run has {jax.process_count()} "
            "processes; choose 'data', 'fsdp', 'fsdp_tensor' or 'fsdp_expert'"
        )
    n = int(np.prod(shape))
    mesh = Mesh(
        np.asarray(devices[:n]).reshape(shape),
        preset.axis_names,
        axis_types=(jax.sharding.AxisType.Auto,) * len(preset.axis_names),
    )
    return mesh, preset


def rollout_mesh_config(cfg: Config) -> MeshConfig:
    """The mesh config the rollout decodes under: training's (`cfg.mesh`, the same object) unless
    `rollout.mesh.preset` names another layout, which keeps training's `mesh.allow_replicated`."""
    rm = cfg.rollout.mesh
    if not rm.preset or (rm.preset == cfg.mesh.preset and rm.tensor == cfg.mesh.tensor):
        return cfg.mesh
    return MeshConfig(rm.preset, tensor=rm.tensor, allow_replicated=cfg.mesh.allow_replicated)


def rollout_mesh_prefix(cfg: Config) -> str:
    """The config fields the rollout's mesh comes from: "mesh", or "rollout.mesh" for a layout of its own."""
    return "mesh" if rollout_mesh_config(cfg) is cfg.mesh else "rollout.mesh"


def rollout_mesh(cfg: Config, mesh: Mesh) -> tuple[Mesh, MeshPreset] | None:
    """The rollout's own mesh over training's `mesh`'s devices (in the same order), or None when the
    rollout decodes under training's layout (`rollout.mesh.preset` "" or training's own)."""
    rollout_cfg = rollout_mesh_config(cfg)
    if rollout_cfg is cfg.mesh:
        return None
    own_mesh, preset = make_mesh(rollout_cfg, list(mesh.devices.flat), prefix="rollout.mesh")
    rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    check_batch_divides(own_mesh, preset, rows, f"rollout.mesh.preset={rollout_cfg.preset!r}")
    return own_mesh, preset


def resharder(shardings: Any) -> Callable[[Any], Any]:
    """params -> a copy laid out by `shardings` (NamedShardings on a mesh of the same devices as the
    params'): one jitted program, called once per policy version."""
    return jax.jit(lambda params: params, out_shardings=shardings)


def layout_line(mesh: Mesh, preset_name: str, shardings, params, field: str = "mesh.preset") -> str:
    """One line on how a run (or, field="rollout.mesh.preset", its rollout) is laid out: the mesh's axes,
    and the parameters' bytes in all and on the most loaded device under `shardings` (a pytree of
    NamedSharding matching `params`)."""
    leaves, shards = jax.tree.leaves(params), jax.tree.leaves(shardings)
    total = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in leaves)
    per_device = sum(int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize for x, s in zip(leaves, shards))
    split = sum(s.shard_shape(x.shape) != tuple(x.shape) for x, s in zip(leaves, shards))
    axes = ", ".join(f"{name}={size}" for name, size in mesh.shape.items())
    return (
        f"jaxrl: {field}={preset_name} on {mesh.size} devices ({axes}); params {total / 2**20:.2f} MiB, "
        f"{per_device / 2**20:.2f} MiB per device ({split} of {len(leaves)} arrays split); each step's "
        f"rows split over {_axis_size(mesh, dict(PRESETS[preset_name].rules).get('batch'))} devices"
    )


def _axis_size(mesh: AnyMesh, axis) -> int:
    if axis is None:
        return 1
    return int(np.prod([mesh.shape[a] for a in (axis if isinstance(axis, tuple) else (axis,))]))


def _is_axes(x) -> bool:
    return isinstance(x, P) or (isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x))


def param_path(path) -> str:
    """A pytree key path as the parameter name errors and `mesh.allow_replicated` use: "blocks/attn/k"."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def replication_allowed(preset: MeshPreset, name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in preset.allow_replicated)


class NotDividing(NamedTuple):
    """A parameter dimension that does not divide over the mesh axis its logical name maps to."""

    dim: int  # index into the shape
    size: int
    logical: str
    axis: Any  # mesh axis name or tuple of names
    devices: int  # the axis's size

    def describe(self, name: str) -> str:
        return (
            f"parameter {name}: dimension {self.dim} ({self.logical!r}, size {self.size}) does not divide over "
            f"mesh axis {self.axis!r} of {self.devices} devices"
        )


def _dims(mesh: AnyMesh, preset: MeshPreset, logical: tuple, shape: tuple) -> list[tuple[Any, NotDividing | None]]:
    """Per dimension: (its mesh axis or None, the NotDividing when its axis does not divide it)."""
    rules = dict(preset.rules)
    out = []
    for i, (name, dim) in enumerate(zip(logical, shape)):
        axis = rules.get(name) if name is not None else None
        n = _axis_size(mesh, axis)
        out.append((axis, None) if axis is None or dim % n == 0 else (axis, NotDividing(i, dim, str(name), axis, n)))
    return out


def spec_for(mesh: AnyMesh, preset: MeshPreset, logical: tuple, shape: tuple | None = None, name: str = "") -> P:
    """Logical axis names -> PartitionSpec. With `shape` (of the parameter `name`), a dimension that
    does not divide over its mesh axis (e.g. 1 kv head over tensor=2) is a ConfigError naming the
    parameter, the dimension and the axis, or replicated when `preset.allow_replicated` matches `name`."""
    if shape is None:
        rules = dict(preset.rules)
        return P(*(rules.get(n) if n is not None else None for n in logical))
    axes = []
    for axis, bad in _dims(mesh, preset, logical, shape):
        if bad is not None and not replication_allowed(preset, name):
            raise ConfigError(
                f"{bad.describe(name or '?')}: choose a device count or mesh size that divides it, or replicate "
                f"that dimension with mesh.allow_replicated (e.g. --set mesh.allow_replicated={name or '*'})"
            )
        axes.append(None if bad is not None else axis)
    return P(*axes)


def param_shardings(mesh: Mesh, preset: MeshPreset, logical_tree: Any, abstract_tree: Any = None) -> Any:
    """A pytree of logical-axis specs (e.g. `param_logical_axes(cfg)`) -> NamedShardings. With the
    matching abstract (or concrete) params, a dimension that does not divide over its mesh axis is a
    ConfigError (`spec_for`) unless `preset.allow_replicated` names the parameter."""
    if abstract_tree is None:
        return jax.tree.map(
            lambda ax: NamedSharding(mesh, spec_for(mesh, preset, tuple(ax))), logical_tree, is_leaf=_is_axes
        )
    return jax.tree_util.tree_map_with_path(
        lambda path, ax, a: NamedSharding(mesh, spec_for(mesh, preset, tuple(ax), a.shape, param_path(path))),
        logical_tree,
        abstract_tree,
        is_leaf=_is_axes,
    )


def layout_of(mesh: AnyMesh, preset: MeshPreset, logical_tree: Any, abstract_tree: Any) -> dict:
    """Which parameters `param_shardings` splits and which it replicates, and why:
    {"split": [{name, shape, spec, and `why` when a dimension was replicated by mesh.allow_replicated}],
    "replicated": [{name, shape, why}]}."""
    split, kept = [], []
    rules = dict(preset.rules)

    def visit(path, ax, a):
        name, logical, shape = param_path(path), tuple(ax), tuple(a.shape)
        dims = _dims(mesh, preset, logical, shape)
        spec = spec_for(mesh, preset, logical, shape, name)
        bad = [b for _, b in dims if b is not None]
        allowed = "; ".join(b.describe(name) for b in bad) + " (replicated: mesh.allow_replicated)"
        if any(s is not None for s in spec):
            split.append({"name": name, "shape": list(shape), "spec": str(spec), **({"why": allowed} if bad else {})})
            return
        if bad:
            why = allowed
        elif mesh.size == 1:
            why = "one device"
        elif any(axis is not None for axis, _ in dims):
            why = "its mesh axes have one device"
        else:
            named = [n for n in logical if n is not None]
            why = f"mesh.preset maps none of its logical axes {named} to a mesh axis" + (
                "" if rules else " (the preset replicates every parameter)"
            )
        kept.append({"name": name, "shape": list(shape), "why": why})

    jax.tree_util.tree_map_with_path(visit, logical_tree, abstract_tree, is_leaf=_is_axes)
    return {"split": split, "replicated": kept}


def parallel_for(mesh: Mesh, preset: MeshPreset) -> Parallel | None:
    """How every forward of a run splits over `mesh` under `preset` (`models.parallel.Parallel`): the
    batch's mesh axes, the axis the residual stream's positions split over (`sequence`, tensor
    parallelism's), and for MoE the one axis the `expert` parameter axis splits over when that axis
    has more than one device. None on one device. A run gives the same one to its rollout, its update
    and its evaluation, so all split (and MoE layers dispatch) alike."""
    if mesh.size <= 1:
        return None
    rules = dict(preset.rules)
    axis = rules.get("expert")
    expert = axis if isinstance(axis, str) and mesh.shape[axis] > 1 else None
    seq = rules.get("sequence")
    return Parallel(mesh, rules.get("batch"), expert, seq if isinstance(seq, str) and mesh.shape[seq] > 1 else None)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, preset: MeshPreset, axis: int = 0) -> NamedSharding:
    """Rows split over the preset's batch axes (at position `axis`), everything else replicated."""
    return NamedSharding(mesh, P(*([None] * axis), dict(preset.rules).get("batch")))


def named_sharding(mesh: Mesh, preset: MeshPreset, name: str) -> NamedSharding:
    axis = rows_axis(name)
    return replicated(mesh) if axis is None else batch_sharding(mesh, preset, axis)


def named_shardings(mesh: Mesh, preset: MeshPreset, tree: Any) -> Any:
    """Shardings for a dict or NamedTuple of (abstract) arrays, chosen by each field's shape-letter
    name; a None field (e.g. a dense model's routing) stays None."""

    def pick(name, v):
        return None if v is None else named_sharding(mesh, preset, name)

    if hasattr(tree, "_fields"):
        return type(tree)(*(pick(f, getattr(tree, f)) for f in tree._fields))
    return {k: pick(k, v) for k, v in tree.items()}


def batch_devices(mesh: Mesh, preset: MeshPreset) -> int:
    return _axis_size(mesh, dict(preset.rules).get("batch"))


def check_batch_divides(mesh: Mesh, preset: MeshPreset, batch_size: int, field: str) -> None:
    axis = dict(preset.rules).get("batch")
    n = _axis_size(mesh, axis)
    if batch_size % n:
        raise ConfigError(
            f"{field}: batch of {batch_size} rows does not divide over the {n} devices of mesh axis {axis!r}"
        )


# ---------------------------------------------------------------------------------------------
# Host <-> global arrays. In one process these are plain device_put / np.asarray.


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
        gathered = jax.jit(lambda xs: xs, out_shardings=replicated(mesh))([leaves[i] for i in split])
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
