"""Mesh presets as small logical-axis rules tables and the shardings jitted steps use.

Parameters carry logical axis names (`layers`, `embed`, `mlp`, `heads`, `kv_heads`, `head_dim`,
`vocab`, `expert`); batch arrays carry `batch` on the axis their name marks `B` (`tokens_BxT`: axis
0, `routing_LxBxTxk`: axis 1). A preset is a tuple of mesh axis names plus a table mapping logical
names to mesh axes; a name missing from the table (or a model lacking a name the table has) is
replicated; a parameter dimension that does not divide over its mesh axis is an error naming it,
unless `mesh.allow_replicated` lets that parameter be replicated instead.

    mesh, preset = make_mesh(cfg.mesh)                       # sizes checked against jax.devices()
    param_sh = param_shardings(mesh, preset, param_logical_axes(model_cfg), abstract_params)
    batch_sh = {k: named_sharding(mesh, preset, k) for k in batch}  # by shape letters: `B` split

Several processes (`jaxrl.multihost`) run the same program; each feeds the rows its devices hold.
"""

from __future__ import annotations

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
