"""Mixture-of-experts feed-forward: a router, three dispatch paths, load-balancing losses, MoE blocks.

Shape letters (this file): N tokens (B*T flattened), D model width, F expert mlp width, E experts,
K experts per token (the router's top-k; not the kv heads of layers.py), C expert capacity,
S = N*K token-slots (one per (token, chosen expert) pair).

Router: `softmax` takes the top-k of softmax(logits) and renormalises the k gates to sum to 1 (the
Qwen3-MoE convention); `sigmoid` takes the top-k of sigmoid(logits) and renormalises likewise
(DeepSeek-V3 style gates, without its bias-based balancing). `MoESpec.norm_topk=False` keeps the k
scores as they are (Qwen2-MoE). Shared experts may be scaled per token by sigmoid(x @ w_Dx1)
(`MoESpec.shared_gate`, Qwen2-MoE's shared_expert_gate). Dispatch:
  dropless  sort the token-slots by expert and run grouped matmuls (`lax.ragged_dot`, or on CPU
            expert groups padded to blocks, see `grouped_mlp`); nothing is dropped.
  capacity  each expert takes at most C = ceil(capacity_factor * N * K / E) slots, first choices of
            every token before any second choice, then token order; one-hot dispatch/combine einsums.
            Slots over capacity are dropped (their share of the output is 0) and counted.
  naive     every expert on every token, weighted by the gates: the oracle for tests and benchmarks.
Expert parallelism: `dispatch_expert_parallel` is dropless dispatch with the experts split over a
mesh axis and all_to_all exchanges; the MoE layer uses it for `dropless` when traced under a context
mesh (`jax.set_mesh`, as the train loop's update step is) whose `MoESpec.expert_axis` axis is > 1.
Routing replay: given `replay_NxK`, those experts are used instead of the router's top-k; the gates
are still the current router's scores at those experts (renormalised), so the router gets gradients.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from jaxrl.models import grouped_mlp
from jaxrl.models.layers import MLP, AttnOptions, Block, RMSNorm, attention_residual, logical_param

ROUTERS = ("softmax", "sigmoid")
DISPATCHES = ("dropless", "capacity", "naive")


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """The MoE layer's hyperparameters (hashable: a static module field)."""

    n_experts: int
    experts_per_token: int
    mlp_dim: int
    n_shared_experts: int = 0
    router: str = "softmax"
    dispatch: str = "dropless"
    capacity_factor: float = 1.25
    grouped_matmul: str = "auto"  # dropless only: ragged | blocked | auto (blocked on CPU, else ragged)
    # dropless only: the mesh axis experts are split over. When the layer is traced under a mesh
    # (`jax.set_mesh`) whose axis of this name has size > 1 and the tokens divide over it, dispatch is
    # `dispatch_expert_parallel` (all_to_all); None, or no such mesh axis, keeps one-device dropless.
    expert_axis: str | None = "expert"
    norm_topk: bool = True  # renormalise the k chosen router scores to sum to 1
    shared_gate: bool = False  # shared experts' output scaled by sigmoid(x @ w_shared_gate_Dx1)
    attn_opts: AttnOptions = AttnOptions()  # the attention variant of every block of the MoE decoder


class MoEStats(NamedTuple):
    aux_loss: jax.Array  # scalar: E * sum_e f_e * P_e over live tokens (1.0 when perfectly balanced)
    z_loss: jax.Array  # scalar: mean over live tokens of logsumexp(router logits)^2
    dropped_frac: jax.Array  # scalar: share of live token-slots dropped for capacity (0 unless capacity)
    experts_NxK: jax.Array  # int32: the experts used (the replayed ones when replaying)
    topk_NxK: jax.Array  # int32: the router's own top-k (== experts_NxK without replay)


def capacity(n_tokens: int, k: int, n_experts: int, capacity_factor: float) -> int:
    return max(1, math.ceil(capacity_factor * n_tokens * k / n_experts))


def route(logits_NxE: jax.Array, k: int, router: str, replay_NxK: jax.Array | None = None, norm_topk: bool = True):
    """-> (gates_NxK float32 (summing to 1 if norm_topk), experts_NxK int32 used, topk_NxK int32, scores_NxE)."""
    logits_NxE = logits_NxE.astype(jnp.float32)
    scores_NxE = jax.nn.softmax(logits_NxE, axis=-1) if router == "softmax" else jax.nn.sigmoid(logits_NxE)
    topk_NxK = lax.top_k(scores_NxE, k)[1].astype(jnp.int32)
    experts_NxK = topk_NxK if replay_NxK is None else replay_NxK.astype(jnp.int32)
    chosen_NxK = jnp.take_along_axis(scores_NxE, experts_NxK, axis=-1)
    if not norm_topk:
        return chosen_NxK, experts_NxK, topk_NxK, scores_NxE
    gates_NxK = chosen_NxK / jnp.maximum(jnp.sum(chosen_NxK, axis=-1, keepdims=True), 1e-20)
    return gates_NxK, experts_NxK, topk_NxK, scores_NxE


def load_balance_loss(scores_NxE, experts_NxK, mask_N, router: str) -> jax.Array:
    """Switch/Qwen auxiliary loss E * sum_e f_e * P_e over live tokens: f_e = share of token-slots
    routed to e (no gradient), P_e = mean router probability of e (sigmoid scores normalised over E).
    Padding must not count: a batch of left-padded prompts would otherwise balance the pads."""
    E, K = scores_NxE.shape[-1], experts_NxK.shape[-1]
    m_N = mask_N.astype(jnp.float32)
    n_live = jnp.maximum(jnp.sum(m_N), 1.0)
    counts_E = jnp.einsum("nke,n->e", jax.nn.one_hot(experts_NxK, E, dtype=jnp.float32), m_N)
    f_E = counts_E / (n_live * K)
    probs_NxE = scores_NxE if router == "softmax" else scores_NxE / jnp.sum(scores_NxE, -1, keepdims=True)
    p_E = jnp.einsum("ne,n->e", probs_NxE, m_N) / n_live
    return E * jnp.sum(f_E * p_E)


def router_z_loss(logits_NxE, mask_N) -> jax.Array:
    """ST-MoE z-loss: mean over live tokens of logsumexp(logits)^2 (keeps router logits small)."""
    m_N = mask_N.astype(jnp.float32)
    z_N = jax.nn.logsumexp(logits_NxE.astype(jnp.float32), axis=-1)
    return jnp.sum(m_N * jnp.square(z_N)) / jnp.maximum(jnp.sum(m_N), 1.0)


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
    x_NxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, experts_NxK, gates_NxK, grouped_matmul: str = "ragged"
):
    """Sort the N*K token-slots by expert, run each expert on its contiguous group, combine by gates.

    grouped_matmul `ragged`: `lax.ragged_dot` (a real grouped GEMM on GPU/TPU; XLA:CPU computes every
    group densely, E times the work). `blocked`: the groups padded to blocks of at most BLOCK rows and
    a loop over the blocks in use (`grouped_mlp.blocked_swiglu`): the fast CPU form. Tokens are
    gathered straight into their padded rows and the outputs read straight back per slot."""
    N, K = experts_NxK.shape
    E = w_gate_ExDxF.shape[0]
    S = N * K
    expert_S = experts_NxK.reshape(-1)
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


def expert_mesh(axis: str | None, n_experts: int, n_tokens: int):
    """The context mesh (`jax.set_mesh`) if its `axis` has size P > 1 and both the experts and the
    tokens divide over P (else None: one-device dropless dispatch, e.g. a decode step's few tokens)."""
    if axis is None:
        return None
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axis not in mesh.axis_names:
        return None
    n_dev = mesh.shape[axis]
    if n_dev <= 1 or n_experts % n_dev or n_tokens % n_dev:
        return None
    return mesh


class MoE(nn.Module):
    """x_BxTxD -> (y_BxTxD, MoEStats): routed SwiGLU experts plus optional always-on shared experts.

    `mask_BxT` marks live tokens: the losses average over them, and capacity dispatch gives padding no
    slot. The router runs in float32 whatever `dtype` is (top-k choices must not flip with precision).
    """

    d_model: int
    spec: MoESpec
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_BxTxD, mask_BxT, replay_BxTxK=None):
        s, D = self.spec, self.d_model
        E, F, K = s.n_experts, s.mlp_dim, s.experts_per_token
        B, T, _ = x_BxTxD.shape
        w_router_DxE = logical_param(self, "router", (D, E), ("embed", None), D**-0.5)
        w_gate = logical_param(self, "gate", (E, D, F), ("expert", "embed", "mlp"), D**-0.5)
        w_up = logical_param(self, "up", (E, D, F), ("expert", "embed", "mlp"), D**-0.5)
        w_down = logical_param(self, "down", (E, F, D), ("expert", "mlp", "embed"), F**-0.5)
        x_NxD = x_BxTxD.reshape(B * T, D)
        mask_N = mask_BxT.reshape(B * T)
        replay_NxK = None if replay_BxTxK is None else replay_BxTxK.reshape(B * T, K)
        logits_NxE = x_NxD.astype(jnp.float32) @ w_router_DxE
        gates_NxK, experts_NxK, topk_NxK, scores_NxE = route(logits_NxE, K, s.router, replay_NxK, s.norm_topk)
        ws = (w_gate.astype(self.dtype), w_up.astype(self.dtype), w_down.astype(self.dtype))
        dropped = jnp.zeros((), jnp.float32)
        if s.dispatch == "dropless":
            gmm = s.grouped_matmul
            if gmm == "auto":
                gmm = "blocked" if jax.default_backend() == "cpu" else "ragged"
            mesh = expert_mesh(s.expert_axis, E, B * T)
            if mesh is not None:
                assert s.expert_axis is not None  # expert_mesh is None without an expert axis
                # Tokens over every mesh axis when they divide (the batch is split that way already).
                token_axes = mesh.axis_names if (B * T) % mesh.size == 0 else (s.expert_axis,)
                y_NxD = dispatch_expert_parallel(
                    x_NxD, *ws, experts_NxK, gates_NxK, mesh, s.expert_axis, gmm, token_axes
                )
            else:
                y_NxD = dispatch_dropless(x_NxD, *ws, experts_NxK, gates_NxK, gmm)
        elif s.dispatch == "capacity":
            y_NxD, dropped = dispatch_capacity(x_NxD, *ws, experts_NxK, gates_NxK, mask_N, s.capacity_factor)
        elif s.dispatch == "naive":
            y_NxD = dispatch_naive(x_NxD, *ws, experts_NxK, gates_NxK)
        else:
            raise ValueError(f"moe dispatch {s.dispatch!r}: expected one of {DISPATCHES}")
        y_BxTxD = y_NxD.reshape(B, T, D)
        if s.n_shared_experts:
            shared_BxTxD = MLP(D, s.n_shared_experts * F, self.dtype, name="shared")(x_BxTxD)
            if s.shared_gate:
                w_sg_Dx1 = logical_param(self, "shared_gate", (D, 1), ("embed", None), D**-0.5)
                shared_BxTxD = shared_BxTxD * jax.nn.sigmoid(x_BxTxD @ w_sg_Dx1.astype(self.dtype))
            y_BxTxD = y_BxTxD + shared_BxTxD
        stats = MoEStats(
            load_balance_loss(scores_NxE, experts_NxK, mask_N, s.router),
            router_z_loss(logits_NxE, mask_N),
            dropped,
            experts_NxK,
            topk_NxK,
        )
        return y_BxTxD, stats


class MoEBlock(nn.Module):
    """`layers.Block` with the MLP replaced by `MoE`; returns the layer's MoEStats (experts as BxTxK)."""

    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float
    eps: float
    spec: MoESpec
    dtype: Any = jnp.float32

    @property
    def attn_opts(self) -> AttnOptions:
        return self.spec.attn_opts

    @nn.compact
    def __call__(self, carry, replay_BxTxK, positions_BxT, key_valid_BxS, index, mask_BxT):
        x_BxTxD, kv, layer = carry
        B, T, _ = x_BxTxD.shape
        x_BxTxD, kv = attention_residual(self, x_BxTxD, positions_BxT, key_valid_BxS, index, kv, layer)
        h_BxTxD = RMSNorm(self.d_model, self.eps, self.dtype, name="mlp_norm")(x_BxTxD)
        y_BxTxD, st = MoE(self.d_model, self.spec, self.dtype, name="moe")(h_BxTxD, mask_BxT, replay_BxTxK)
        K = self.spec.experts_per_token
        st = st._replace(experts_NxK=st.experts_NxK.reshape(B, T, K), topk_NxK=st.topk_NxK.reshape(B, T, K))
        return (x_BxTxD + y_BxTxD, kv, layer + 1), st


class BlockGroup(nn.Module):
    """`n_dense` dense blocks then one MoE block: the scan body of an MoE decoder (every
    (n_dense+1)-th layer is MoE). Params: `dense_0`.. and `moe`."""

    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mlp_dim: int
    rope_theta: float
    eps: float
    spec: MoESpec
    n_dense: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, carry, replay_BxTxK, positions_BxT, key_valid_BxS, index, mask_BxT):
        for j in range(self.n_dense):
            carry, _ = Block(
                self.d_model,
                self.n_heads,
                self.n_kv_heads,
                self.head_dim,
                self.mlp_dim,
                self.rope_theta,
                self.eps,
                self.dtype,
                self.spec.attn_opts,
                name=f"dense_{j}",
            )(carry, positions_BxT, key_valid_BxS, index)
        block = MoEBlock(
            self.d_model,
            self.n_heads,
            self.n_kv_heads,
            self.head_dim,
            self.rope_theta,
            self.eps,
            self.spec,
            self.dtype,
            name="moe",
        )
        return block(carry, replay_BxTxK, positions_BxT, key_valid_BxS, index, mask_BxT)


def routing_mismatch(recorded_BxSxLxK, own_LxBxSxK, first_slot: int, n: int) -> jax.Array:
    """mismatch_BxN (float32): 1 where, at slots first_slot .. first_slot+n-1, any MoE layer's top-k SET
    differs between a recorded routing and a forward's own router top-k (order within k ignored)."""
    rec_BxNxLxK = lax.slice_in_dim(recorded_BxSxLxK, first_slot, first_slot + n, axis=1)
    own_BxNxLxK = jnp.transpose(lax.slice_in_dim(own_LxBxSxK, first_slot, first_slot + n, axis=2), (1, 2, 0, 3))
    differs_BxNxL = jnp.any(jnp.sort(rec_BxNxLxK, -1) != jnp.sort(own_BxNxLxK, -1), axis=-1)
    return jnp.any(differs_BxNxL, axis=-1).astype(jnp.float32)


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
):
    """Dropless dispatch with experts sharded over mesh axis `axis` (P devices, E/P experts each) and
    tokens split over the same devices. Per device: sort its token-slots by destination device, one
    `all_to_all` sends them (in fixed buffers of S_local rows per destination, so nothing is ever
    dropped), the device runs its local experts (dropless, grouped), a second `all_to_all` returns the
    outputs, and the gates combine them. Same outputs as `dispatch_dropless` on one device.

    N must divide by P. The buffers cost P x the local slots in memory: dropless at any imbalance.
    `token_axes` (default `(axis,)`): the mesh axes the tokens are split over; with more axes than
    `axis` (e.g. ("fsdp", "expert")), each group of devices along `axis` exchanges only its own
    tokens, instead of every such group repeating the whole batch. N must divide over all of them."""
    from jax.sharding import PartitionSpec as PS

    E, K = w_gate_ExDxF.shape[0], experts_NxK.shape[1]
    n_dev = mesh.shape[axis]
    E_local = E // n_dev

    def local(x_nxD, wg, wu, wd, experts_nxK, gates_nxK):
        n = x_nxD.shape[0]
        S = n * K
        expert_S = experts_nxK.reshape(-1)
        dest_S = expert_S // E_local
        # Rank of each slot among the slots going to the same device: its row in that device's buffer.
        onehot_SxP = jax.nn.one_hot(dest_S, n_dev, dtype=jnp.int32)
        row_S = jnp.sum((jnp.cumsum(onehot_SxP, axis=0) - 1) * onehot_SxP, axis=-1)
        x_SxD = jnp.take(x_nxD, jnp.arange(S) // K, axis=0)
        send_PxSxD = jnp.zeros((n_dev, S, x_nxD.shape[1]), x_nxD.dtype).at[dest_S, row_S].set(x_SxD)
        send_ids_PxS = jnp.full((n_dev, S), -1, jnp.int32).at[dest_S, row_S].set(expert_S % E_local)
        recv_PxSxD = lax.all_to_all(send_PxSxD, axis, 0, 0)
        recv_ids_PxS = lax.all_to_all(send_ids_PxS, axis, 0, 0)
        valid_R = recv_ids_PxS.reshape(-1) >= 0
        ids_Rx1 = jnp.maximum(recv_ids_PxS.reshape(-1, 1), 0)
        y_RxD = dispatch_dropless(
            recv_PxSxD.reshape(n_dev * S, -1), wg, wu, wd, ids_Rx1, valid_R[:, None].astype(jnp.float32), grouped_matmul
        )
        back_PxSxD = lax.all_to_all(y_RxD.reshape(n_dev, S, -1), axis, 0, 0)
        y_SxD = back_PxSxD[dest_S, row_S]
        return jnp.einsum("nkd,nk->nd", y_SxD.reshape(n, K, -1), gates_nxK.astype(x_nxD.dtype))

    rows, experts = PS(tuple(token_axes) if token_axes else axis), PS(axis)
    return jax.shard_map(local, mesh=mesh, in_specs=(rows, experts, experts, experts, rows, rows), out_specs=rows)(
        x_NxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, experts_NxK, gates_NxK
    )
