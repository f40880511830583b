"""Mixture-of-experts feed-forward: a router, load-balancing losses, the MoE layer and the MoE block
(`decoder.layer_plan` places MoE blocks among the dense ones).

Shape letters (this file): N tokens (B*T flattened), D model width, F expert mlp width, E experts,
K experts per token (the router's top-k; not the kv heads of layers.py), S = N*K token-slots.

Router: top-k of softmax (Qwen3-MoE) or sigmoid (DeepSeek-V3-style gates, without its bias balancing)
scores, renormalised to sum to 1 unless `MoESpec.norm_topk=False` (Qwen2-MoE); shared experts may be
gated per token (`MoESpec.shared_gate`). Dispatch is in moe_dispatch.py; `MoESpec.expert_parallel`
makes dropless dispatch expert-parallel where it applies, and no ambient mesh is read, so the layer
behaves the same in the rollout and the update. Routing replay: given `replay_NxK`, those experts are
used with the current router's (renormalised) gates there, so the router still gets gradients.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from jaxrl.models import int8
from jaxrl.models.layers import MLP, AttnOptions, RMSNorm, attention_residual, logical_param
from jaxrl.models.moe_dispatch import (
    ExpertParallel,
    dispatch_capacity,
    dispatch_dropless,
    dispatch_expert_parallel,
    dispatch_naive,
)

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
    # dropless only: the mesh and the mesh axis the experts are split over. Where it applies to a
    # call's shapes (`ExpertParallel.applies`), dispatch is `dispatch_expert_parallel` (all_to_all);
    # None keeps one-device dropless.
    expert_parallel: ExpertParallel | None = None
    norm_topk: bool = True  # renormalise the k chosen router scores to sum to 1
    shared_gate: bool = False  # shared experts' output scaled by sigmoid(x @ w_shared_gate_Dx1)
    attn_opts: AttnOptions = AttnOptions()  # the attention variant of every block of the MoE decoder


class MoEStats(NamedTuple):
    aux_loss: jax.Array  # scalar: E * sum_e f_e * P_e over live tokens (1.0 when perfectly balanced)
    z_loss: jax.Array  # scalar: mean over live tokens of logsumexp(router logits)^2
    dropped_frac: jax.Array  # scalar: share of live token-slots dropped for capacity (0 unless capacity)
    experts_NxK: jax.Array  # int32: the experts used (the replayed ones when replaying)
    topk_NxK: jax.Array  # int32: the router's own top-k (== experts_NxK without replay)


def route(logits_NxE: jax.Array, k: int, router: str, replay_NxK: jax.Array | None = None, norm_topk: bool = True):
    """-> (gates_NxK float32 (summing to 1 if norm_topk), experts_NxK int32 used, topk_NxK int32, scores_NxE)."""
    logits_NxE = logits_NxE.astype(jnp.float32)
    scores_NxE = jax.nn.softmax(logits_NxE, axis=-1) if router == "softmax" else jax.nn.sigmoid(logits_NxE)
    topk_NxK = lax.top_k(scores_NxE, k)[1].astype(jnp.int32)
    experts_NxK = topk_NxK  # replayed: the recorded experts; -1 where nothing was recorded (own top-k)
    if replay_NxK is not None:
        experts_NxK = jnp.where(replay_NxK >= 0, replay_NxK.astype(jnp.int32), topk_NxK)
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


def read_span(mask_BxT: jax.Array) -> jax.Array:
    """bool_BxT: each row's tokens from its first live token to its last (none in a row with none).
    The tokens outside (left padding, a row's tail after its last live token) are the ones no live
    token reads: they come after every live token of the row, or are padding keys that attention
    masks, and their own logits predict nothing scored. Tokens inside that are not live (an agent
    episode's observation tokens, masked from the losses) are read as keys by later tokens and must
    keep their expert outputs. Expert-parallel dispatch sends only the span."""
    live_BxT = mask_BxT.astype(bool)
    after_first_BxT = jnp.cumsum(live_BxT, axis=1) > 0
    before_last_BxT = jnp.flip(jnp.cumsum(jnp.flip(live_BxT, 1), axis=1), 1) > 0
    return after_first_BxT & before_last_BxT


class MoE(nn.Module):
    """x_BxTxD -> (y_BxTxD, MoEStats): routed SwiGLU experts plus optional always-on shared experts.

    `mask_BxT` marks live tokens: the losses average over them, capacity dispatch gives padding no
    slot, and expert-parallel dispatch sends only the tokens of `read_span(mask_BxT)` (the others'
    routed output is 0; nothing reads it). The router runs in float32 whatever `dtype` is (top-k
    choices must not flip with precision).
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
        ws = (int8.dense(w_gate, self.dtype), int8.dense(w_up, self.dtype), int8.dense(w_down, self.dtype))
        dropped = jnp.zeros((), jnp.float32)
        if s.dispatch == "dropless":
            gmm = s.grouped_matmul
            if gmm == "auto":
                gmm = "blocked" if jax.default_backend() == "cpu" else "ragged"
            ep = s.expert_parallel
            if ep is not None and ep.applies(E, B * T):
                y_NxD = dispatch_expert_parallel(
                    x_NxD, *ws, experts_NxK, gates_NxK, ep.mesh, ep.axis, gmm, ep.token_axes(B * T),
                    mask_N=read_span(mask_BxT).reshape(B * T),
                )  # fmt: skip
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
                shared_BxTxD = shared_BxTxD * jax.nn.sigmoid(x_BxTxD @ int8.dense(w_sg_Dx1, self.dtype))
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


def routing_mismatch(recorded_BxSxLxK, own_LxBxSxK, first_slot: int, n: int) -> jax.Array:
    """mismatch_BxN (float32): 1 where, at slots first_slot .. first_slot+n-1, any MoE layer's top-k SET
    differs between a recorded routing and a forward's own router top-k (order within k ignored)."""
    rec_BxNxLxK = lax.slice_in_dim(recorded_BxSxLxK, first_slot, first_slot + n, axis=1)
    own_BxNxLxK = jnp.transpose(lax.slice_in_dim(own_LxBxSxK, first_slot, first_slot + n, axis=2), (1, 2, 0, 3))
    differs_BxNxL = jnp.any(jnp.sort(rec_BxNxLxK, -1) != jnp.sort(own_BxNxLxK, -1), axis=-1)
    return jnp.any(differs_BxNxL, axis=-1).astype(jnp.float32)
