"""Mesh presets as small logical-axis rules tables, and the shardings that jitted steps use.

Parameters carry logical axis names (`embed`, `mlp`, `heads`, `kv_heads`, `head_dim`, `vocab`);
batches carry `batch`. A preset is a mesh shape plus a table mapping logical names to mesh axes;
a name missing from the table is replicated.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl.config import ConfigError, MeshConfig


class MeshPreset(NamedTuple):
    axis_names: tuple[str, ...]
    rules: tuple[tuple[str, str | None], ...]  # logical name -> mesh axis


PRESETS = {
    # One device; every rule maps to nothing.
    "single": MeshPreset(("data",), ()),
    # Pure data parallelism: parameters replicated, the batch split over every device.
    "data": MeshPreset(("data",), (("batch", "data"),)),
}


def make_mesh(cfg: MeshConfig, devices: list | None = None) -> tuple[Mesh, MeshPreset]:
    devices = list(devices if devices is not None else jax.devices())
    preset = PRESETS[cfg.preset]
    n = 1 if cfg.preset == "single" else len(devices)
    mesh = Mesh(np.asarray(devices[:n]).reshape((n,)), preset.axis_names,
                axis_types=(jax.sharding.AxisType.Auto,) * len(preset.axis_names))
    return mesh, preset


def _spec(logical: tuple, rules: dict) -> P:
    return P(*(rules.get(name) if name is not None else None for name in logical))


def logical_shardings(mesh: Mesh, preset: MeshPreset, logical_tree: Any) -> Any:
    """A pytree of logical-axis tuples -> the matching pytree of NamedShardings."""
    rules = dict(preset.rules)
    return jax.tree.map(lambda axes: NamedSharding(mesh, _spec(axes, rules)), logical_tree,
                        is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, preset: MeshPreset) -> NamedSharding:
    return NamedSharding(mesh, P(dict(preset.rules).get("batch")))


def check_batch_divides(mesh: Mesh, preset: MeshPreset, batch_size: int, field: str) -> None:
    axis = dict(preset.rules).get("batch")
    n = mesh.shape[axis] if axis else 1
    if batch_size % n:
        raise ConfigError(f"{field}: batch of {batch_size} rows does not divide over the {n} devices "
                          f"of mesh axis {axis!r}")
