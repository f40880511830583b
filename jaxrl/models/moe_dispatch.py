"""MoE dispatch: how the routed token-slots reach their experts and come back, given the router's
choices (`moe.route`). Shape letters as in moe.py: N tokens, D model width, F expert mlp width, E
experts, K experts per token, C expert capacity, S = N*K token-slots.

  dropless  sort the token-slots by expert and run grouped matmuls (`lax.ragged_dot`, or on CPU
            expert groups padded to blocks, see `grouped_mlp`); nothing is dropped.
  capacity  each expert takes at most C = ceil(capacity_factor * N * K / E) slots, first choices of
            every token before any second choice, then token order; one-hot dispatch/combine einsums.
            Slots over capacity are dropped (their share of the output is 0) and counted.
  naive     every expert on every token, weighted by the gates: the oracle for tests and benchmarks.
  expert parallel  dropless with the experts split over one axis of a mesh and all_to_all exchanges
            (`dispatch_expert_parallel`). The MoE layer uses it when its spec carries an
            `ExpertParallel` (the mesh and the axis) that applies to the call's shapes: the spec is
            given explicitly, the same to the rollout and the update; no ambient mesh is read.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as PS

from jaxrl.models import grouped_mlp


def capacity(n_tokens: int, k: int, n_experts: int, capacity_factor: float) -> int:
    return max(1, math.ceil(capacity_factor * n_tokens * k / n_experts))


def _swiglu(x_NxD, w_gate_DxF, w_up_DxF, w_down_FxD):
    return (jax.nn.silu(x_NxD @ w_gate_DxF) * (x_NxD @ w_up_DxF)) @ w_down_FxD


def dispatch_naive(x_NxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, experts_NxK, gates_NxK):
    """Every expert on every token, each output weighted by the token's gate for it (0 if unchosen)."""
    E = w_gate_ExDxF.shape[0]
    weight_NxE = jnp.einsum("nke,nk->ne", jax.nn.one_hot(experts_NxK, E, dtype=jnp.float32), gates_NxK)
    out_NxD = jnp.zeros_like(x_NxD)
    for e in range(E):
        y_NxD = _swiglu(x_NxD, w_gate_ExDxF[e], w_up_ExDxF[e], w_down_ExFxD[e])
        out_NxD = out_NxD + weight_NxE[:, e : e + 1].astype(x_NxD.dtype) * y_NxD
    return out_NxD


BLOCK = 128  # the most rows per block of the blocked (CPU) grouped expert MLP


def dispatch_dropless(
    x_NxD,
    w_gate_ExDxF,
    w_up_ExDxF,
    w_down_ExFxD,
    experts_NxK,
    gates_NxK,
    grouped_matmul: str = "ragged",
    live_NxK=None,
):
    """Sort the N*K token-slots by expert, run each expert on its contiguous group, combine by gates.

    grouped_matmul `ragged`: `lax.ragged_dot` (a real grouped GEMM on GPU/TPU; XLA:CPU computes every
    group densely, E times the work). `blocked`: the groups padded to blocks of at most BLOCK rows and
    a loop over the blocks in use (`grouped_mlp.blocked_swiglu`): the fast CPU form. Tokens are
    gathered straight into their padded rows and the outputs read straight back per slot.

    live_NxK (bool, optional): the slots to run; the others are sorted after every expert group, no
    expert computes them (ragged: past the groups; blocked: in no block) and their output is 0."""
    N, K = experts_NxK.shape
    E = w_gate_ExDxF.shape[0]
    S = N * K
    expert_S = experts_NxK.reshape(-1)
    if live_NxK is not None:  # a dead slot's key E sorts it last and bincount(length=E) leaves it out
        expert_S = jnp.where(live_NxK.reshape(-1), expert_S, E)
    order_S = jnp.argsort(expert_S, stable=True)  # sorted slot s is flat slot order_S[s] = (n, k) = divmod(., K)
    sizes_E = jnp.bincount(expert_S, length=E).astype(jnp.int32)
    if grouped_matmul == "blocked":
        # Blocks no larger than an even share of the slots: few slots (decode) waste little padding.
        block = min(BLOCK, max(8, -(-S // E)))
        row_M, row_of_slot_S, expert_J, n_used = grouped_mlp.block_layout(sizes_E, S, block)
        flat_M = jnp.where(row_M < S, order_S[jnp.minimum(row_M, S - 1)], S)  # S: a pad row
        row_of_flat_S = jnp.zeros((S,), jnp.int32).at[order_S].set(row_of_slot_S)
        # Both row maps are invertible, so both gathers differentiate as gathers (no scatter-add).
        x_MxD = grouped_mlp.gather_rows(x_NxD, jnp.where(row_M < S, flat_M // K, N), row_of_flat_S.reshape(N, K))
        y_MxD = grouped_mlp.blocked_swiglu(x_MxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, expert_J, n_used, block)
        y_SxD = grouped_mlp.gather_rows(y_MxD, row_of_flat_S, flat_M[:, None])
    else:
        x_SxD = jnp.take(x_NxD, order_S // K, axis=0)
        y_sorted_SxD = grouped_mlp.ragged_swiglu(x_SxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, sizes_E)
        y_SxD = jnp.take(
            y_sorted_SxD, jnp.argsort(order_S), axis=0
        )  # a gather: cheaper to differentiate than a scatter
    return jnp.einsum("nkd,nk->nd", y_SxD.reshape(N, K, -1), gates_NxK.astype(x_NxD.dtype))


def dispatch_capacity(
    x_NxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, experts_NxK, gates_NxK, mask_N, capacity_factor: float
):
    """-> (out_NxD, dropped_frac). Padding tokens (mask 0) take no capacity and get no expert output."""
    N, K = experts_NxK.shape
    E = w_gate_ExDxF.shape[0]
    C = capacity(N, K, E, capacity_factor)
    live_KxN = jnp.broadcast_to(mask_N.astype(bool)[None], (K, N))
    # Priority: every token's first choice, then every second choice, ... (k-major), token order within.
    onehot_KxNxE = jax.nn.one_hot(experts_NxK.T, E, dtype=jnp.int32) * live_KxN[..., None]
    pos_KxNxE = jnp.cumsum(onehot_KxNxE.reshape(K * N, E), axis=0).reshape(K, N, E) - 1
    pos_KxN = jnp.sum(pos_KxNxE * onehot_KxNxE, axis=-1)
    kept_KxN = live_KxN & (pos_KxN < C)
    # One flat index e*C + c per kept slot; a dropped slot points past the end and one-hots to zeros.
    flat_KxN = jnp.where(kept_KxN, experts_NxK.T * C + pos_KxN, E * C)
    slot_KxNxEC = jax.nn.one_hot(flat_KxN, E * C, dtype=x_NxD.dtype)
    dispatch_NxExC = jnp.sum(slot_KxNxEC, axis=0).reshape(N, E, C)
    combine_NxExC = jnp.einsum("knc,kn->nc", slot_KxNxEC, gates_NxK.T.astype(x_NxD.dtype)).reshape(N, E, C)
    x_ExCxD = jnp.einsum("nec,nd->ecd", dispatch_NxExC, x_NxD)
    h_ExCxF = jax.nn.silu(jnp.einsum("ecd,edf->ecf", x_ExCxD, w_gate_ExDxF)) * jnp.einsum(
        "ecd,edf->ecf", x_ExCxD, w_up_ExDxF
    )
    y_ExCxD = jnp.einsum("ecf,efd->ecd", h_ExCxF, w_down_ExFxD)
    out_NxD = jnp.einsum("nec,ecd->nd", combine_NxExC, y_ExCxD)
    n_live = jnp.sum(live_KxN.astype(jnp.float32))
    dropped = n_live - jnp.sum(kept_KxN.astype(jnp.float32))
    return out_NxD, dropped / jnp.maximum(n_live, 1.0)


class ExpertParallel(NamedTuple):
    """Expert parallelism for dropless dispatch: the experts split over mesh axis `axis` of `mesh`
    (P devices, E/P experts each), the tokens over the mesh's devices. A field of `MoESpec` (hashable,
    as a Mesh is), so a layer is built with it; `sharding.expert_parallel(mesh, preset)` makes the
    one a run gives both its rollout and its update."""

    mesh: Mesh
    axis: str = "expert"

    def applies(self, n_experts: int, n_tokens: int) -> bool:
        """Whether a call goes expert-parallel: the axis has P > 1 devices and both the experts and
        the tokens divide over them (else one-device dropless, e.g. a decode step's few tokens)."""
        if self.axis not in self.mesh.axis_names:
            raise ValueError(
                f"MoESpec.expert_parallel.axis: {self.axis!r} is not an axis of the mesh {self.mesh.axis_names}"
            )
        n_dev = self.mesh.shape[self.axis]
        return n_dev > 1 and n_experts % n_dev == 0 and n_tokens % n_dev == 0

    def token_axes(self, n_tokens: int) -> tuple[str, ...]:
        """The mesh axes the tokens are split over: all of them when the tokens divide (the batch is
        split that way already), else the expert axis alone."""
        return tuple(self.mesh.axis_names) if n_tokens % self.mesh.size == 0 else (self.axis,)


def dispatch_expert_parallel(
    x_NxD,
    w_gate_ExDxF,
    w_up_ExDxF,
    w_down_ExFxD,
    experts_NxK,
    gates_NxK,
    mesh,
    axis: str = "expert",
    grouped_matmul: str = "ragged",
    token_axes=None,
    mask_N=None,
):
    """Dropless dispatch with experts sharded over mesh axis `axis` (P devices, E/P experts each) and
    tokens split over the same devices. Per device: sort its token-slots by destination device, one
    `all_to_all` sends them (in fixed buffers of S_local rows per destination, so nothing is ever
    dropped), the device runs its local experts (dropless, grouped) on the rows it received, a second
    `all_to_all` returns the outputs, and the gates combine them. Same outputs as `dispatch_dropless`
    on one device, on the live tokens.

    `mask_N` (bool, optional; None: every token live): only live tokens' slots take a buffer row; a
    token that is not live (left padding, a finished row's tail, whatever experts routing replay
    gives it) is sent nowhere, no expert computes it, and its output is 0. The rows of a buffer that
    no slot fills are not computed either (`dispatch_expert_parallel_counted` also says how many rows
    each device computed).

    N must divide by P. The buffers cost P x the local slots in memory: dropless at any imbalance.
    `token_axes` (default `(axis,)`): the mesh axes the tokens are split over; with more axes than
    `axis` (e.g. ("fsdp", "expert")), each group of devices along `axis` exchanges only its own
    tokens, instead of every such group repeating the whole batch. N must divide over all of them."""
    args = (x_NxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, experts_NxK, gates_NxK, mesh, axis, grouped_matmul)
    return dispatch_expert_parallel_counted(*args, token_axes, mask_N)[0]


def dispatch_expert_parallel_counted(
    x_NxD,
    w_gate_ExDxF,
    w_up_ExDxF,
    w_down_ExFxD,
    experts_NxK,
    gates_NxK,
    mesh,
    axis: str = "expert",
    grouped_matmul: str = "ragged",
    token_axes=None,
    mask_N=None,
):
    """`dispatch_expert_parallel` -> (out_NxD, received_Q): received_Q[q], the rows token device q
    received and ran through its experts (Q devices: those of `token_axes`). Their sum is the number
    of live token-slots, mask_N.sum() * K: no padding token and no empty buffer row is computed."""
    E, K = w_gate_ExDxF.shape[0], experts_NxK.shape[1]
    n_dev = mesh.shape[axis]
    E_local = E // n_dev
    if mask_N is None:
        mask_N = jnp.ones(experts_NxK.shape[:1], bool)

    def local(x_nxD, wg, wu, wd, experts_nxK, gates_nxK, mask_n):
        n = x_nxD.shape[0]
        S = n * K
        expert_S = experts_nxK.reshape(-1)
        live_S = jnp.repeat(mask_n.astype(bool), K)
        dest_S = jnp.where(live_S, expert_S // E_local, n_dev)  # n_dev: no device (the scatters drop it)
        # Rank of each live slot among the slots going to the same device: its row in that device's buffer.
        onehot_SxP = jax.nn.one_hot(dest_S, n_dev, dtype=jnp.int32)
        row_S = jnp.sum((jnp.cumsum(onehot_SxP, axis=0) - 1) * onehot_SxP, axis=-1)
        x_SxD = jnp.take(x_nxD, jnp.arange(S) // K, axis=0)
        send_PxSxD = jnp.zeros((n_dev, S, x_nxD.shape[1]), x_nxD.dtype).at[dest_S, row_S].set(x_SxD)
        send_ids_PxS = jnp.full((n_dev, S), -1, jnp.int32).at[dest_S, row_S].set(expert_S % E_local)
        recv_PxSxD = lax.all_to_all(send_PxSxD, axis, 0, 0)
        recv_ids_PxS = lax.all_to_all(send_ids_PxS, axis, 0, 0)
        valid_Rx1 = recv_ids_PxS.reshape(-1, 1) >= 0
        ids_Rx1 = jnp.maximum(recv_ids_PxS.reshape(-1, 1), 0)
        y_RxD = dispatch_dropless(
            recv_PxSxD.reshape(n_dev * S, -1),
            wg,
            wu,
            wd,
            ids_Rx1,
            jnp.ones(ids_Rx1.shape, jnp.float32),
            grouped_matmul,
            live_NxK=valid_Rx1,
        )
        back_PxSxD = lax.all_to_all(y_RxD.reshape(n_dev, S, -1), axis, 0, 0)
        y_SxD = jnp.where(live_S[:, None], back_PxSxD[jnp.minimum(dest_S, n_dev - 1), row_S], 0)
        y_nxD = jnp.einsum("nkd,nk->nd", y_SxD.reshape(n, K, -1), gates_nxK.astype(x_nxD.dtype))
        return y_nxD, jnp.sum(valid_Rx1, dtype=jnp.int32)[None]

    rows, experts = PS(tuple(token_axes) if token_axes else axis), PS(axis)
    y_NxD, received_Q = jax.shard_map(
        local, mesh=mesh, in_specs=(rows, experts, experts, experts, rows, rows, rows), out_specs=(rows, rows)
    )(x_NxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, experts_NxK, gates_NxK, mask_N)
    return y_NxD, received_Q
