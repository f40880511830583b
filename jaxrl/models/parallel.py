"""How one forward is split over a mesh: the batch's rows for activations, the experts for MoE.

    par = Parallel(mesh, batch="fsdp")                  # `sharding.parallel_for(mesh, preset)` builds it
    x_BxTxD = par.residual(x_BxTxD)                     # each device keeps its own rows (and positions)
    batch = par.rows_of(batch, leading=1)               # (n, B/n, ...) microbatches: rows split per microbatch

Every forward (the update's, the rollout's, evaluation's) is given the run's one `Parallel` explicitly,
a static argument like the config; no ambient mesh is read. The constraints are what keeps data
parallelism data parallel: without them XLA's partitioner follows the weights, so under fsdp every
device would run every row with the contraction split, and a contiguous microbatch split would put
whole microbatches on a few devices. A dimension that does not divide over the batch devices is left
to XLA (e.g. a decode step of 1 row on 8 devices). Under tensor parallelism the residual stream
between layers is also split by position over the tensor axis (Megatron's sequence parallelism):
otherwise every tensor-parallel device would hold its fsdp group's whole hidden states.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.models.moe_dispatch import ExpertParallel


def rows_axis(name: str) -> int | None:
    """Which axis of an array named with shape letters is the batch: `tokens_BxT` -> 0,
    `routing_LxBxTxk` -> 1, `num_steps` -> None."""
    letters = name.rsplit("_", 1)[-1].split("x") if "_" in name else []
    return letters.index("B") if "B" in letters else None


class Parallel(NamedTuple):
    """The mesh, the axes the batch's rows split over (a name, a tuple of names, or None: not split),
    the axis the MoE experts split over (None: every device holds every expert) and the axis the
    residual stream's positions split over between layers (None: not split). Hashable (a Mesh is),
    so jitted functions take it as a static argument."""

    mesh: Mesh
    batch: str | tuple[str, ...] | None
    expert: str | None = None
    sequence: str | None = None

    @property
    def n_rows_devices(self) -> int:
        axes = () if self.batch is None else (self.batch,) if isinstance(self.batch, str) else self.batch
        n = 1
        for a in axes:
            n *= self.mesh.shape[a]
        return n

    @property
    def n_sequence_devices(self) -> int:
        return 1 if self.sequence is None else self.mesh.shape[self.sequence]

    @property
    def experts(self) -> ExpertParallel | None:
        """The MoE layers' expert parallelism (`moe_dispatch.ExpertParallel`), or None."""
        return None if self.expert is None else ExpertParallel(self.mesh, self.expert)

    def rows(self, x: jax.Array, axis: int = 0) -> jax.Array:
        """`x` constrained to rows (its `axis`) split over the batch devices, the rest left to XLA
        (unchanged when the rows do not divide, or the batch is not split)."""
        n = self.n_rows_devices
        if n <= 1 or x.ndim <= axis or x.shape[axis] % n:
            return x
        spec = P(*([P.UNCONSTRAINED] * axis), self.batch, *([P.UNCONSTRAINED] * (x.ndim - axis - 1)))
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def residual(self, x_BxTxD: jax.Array) -> jax.Array:
        """The hidden states between layers: rows split as `rows` does, and positions over the
        `sequence` axis when there is one and T divides over it (a decode step's T = 1 does not)."""
        n_seq = self.n_sequence_devices
        if n_seq <= 1 or x_BxTxD.shape[1] % n_seq or x_BxTxD.shape[0] % self.n_rows_devices:
            return self.rows(x_BxTxD)
        return jax.lax.with_sharding_constraint(x_BxTxD, NamedSharding(self.mesh, P(self.batch, self.sequence, None)))

    def rows_of(self, tree: dict, leading: int = 0) -> dict:
        """A dict of arrays named with shape letters (`tokens_BxT`, `routing_LxBxTxk`), each
        constrained on its `B` axis (after `leading` extra leading axes, e.g. 1 for stacked microbatches)."""
        out: dict[str, Any] = {}
        for k, v in tree.items():
            axis = rows_axis(k)
            out[k] = v if v is None or axis is None else self.rows(v, leading + axis)
        return out


def rows(parallel: Parallel | None, x: jax.Array, axis: int = 0) -> jax.Array:
    """`parallel.rows(x, axis)`, or `x` itself without a Parallel (one device)."""
    return x if parallel is None else parallel.rows(x, axis)


def residual(parallel: Parallel | None, x_BxTxD: jax.Array) -> jax.Array:
    """`parallel.residual(x_BxTxD)`, or `x_BxTxD` itself without a Parallel (one device)."""
    return x_BxTxD if parallel is None else parallel.residual(x_BxTxD)
