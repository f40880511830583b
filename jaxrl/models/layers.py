"""Decoder building blocks: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP.

Shape letters: B batch, T query tokens in this call, S key slots (the cache length, or T when there
is no cache), D model width, H query heads, K kv heads, R query heads per kv head (H = K*R),
Hd head dim, F mlp width, L layers (stacked parameters carry a leading `layers` axis).

Every layer takes small typed arguments, never the whole config. Parameters are float32 and carry
logical axis names; activations run in `dtype`, with softmax and norms accumulated in float32.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from jaxrl.models.prefix_attention import MASKED_SCORE, GroupKV, attend_group, write_own

# (k_LxBxSxKxHd, v_LxBxSxKxHd): the whole stacked cache travels through every block so each layer
# updates its slice of the one buffer in place instead of the model restacking L copies per step.
# Or (k_BxKxSxHd, v_BxKxSxHd): ONE layer's own buffers, kv-head-major, for decode loops that unroll
# the layers (`decode.decode_step_layers`): attention then reads the cache where it lies, with
# no per-layer slice or transpose copy (on CPU those copies cost as much as the decode matmuls).
KV = tuple[jax.Array, jax.Array]


class WindowKV(NamedTuple):
    """One layer's cache, read only, plus a small window that this call's keys/values are written
    to (`decode.window_layers`): the cache slots marked by `key_valid_BxS` come first, then the
    window slots up to each query's own (`index` is the window slot of the first query)."""

    k_BxKxSxHd: jax.Array
    v_BxKxSxHd: jax.Array
    win_k: jax.Array  # k_BxKxWxHd
    win_v: jax.Array


# Finite, so a fully masked query row (a left-padding slot) gets a uniform softmax instead of NaN;
# such rows are padding whose outputs nobody reads, but NaN would poison gradients.
_MASKED = MASKED_SCORE


# Std of a standard normal truncated to [-2, 2]; dividing by it makes the truncated draw unit-std.
_TRUNC_STD = 0.87962566103423978


class ScaledParam(nn.LogicallyPartitioned):
    """A logically partitioned parameter that also records its init rule: `std=None` means ones,
    otherwise a [-2, 2]-truncated normal with that std. `init_params` reads the rule to draw every
    parameter from ONE random call: one compiled generator per parameter dominates CPU compile time."""

    std: float | None = struct.field(default=None, pytree_node=False)


def init_value(key, shape, std: float | None, dtype=jnp.float32) -> jax.Array:
    if std is None:
        return jnp.ones(shape, dtype)
    return jax.random.truncated_normal(key, -2.0, 2.0, shape, dtype) * (std / _TRUNC_STD)


def logical_param(
    module: nn.Module, name: str, shape: Sequence[int], axes: Sequence[str | None], std: float | None
) -> jax.Array:
    """A float32 parameter named by logical `axes`; std=None -> ones, else truncated normal * std."""

    def init(key, shape, dtype):
        return ScaledParam(init_value(key, shape, std, dtype), tuple(axes), std=std)

    return module.param(name, init, tuple(shape), jnp.float32, unbox=True)


class RMSNorm(nn.Module):
    dim: int
    eps: float
    dtype: Any = jnp.float32
    axis: str = "embed"  # the logical name of the normalised (last) axis

    @nn.compact
    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        scale_D = logical_param(self, "scale", (self.dim,), (self.axis,), None)
        x = x_BxTxD.astype(jnp.float32)
        x = x * lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
        return (x * scale_D).astype(self.dtype)


@dataclasses.dataclass(frozen=True)
class AttnOptions:
    """What some checkpoints' attention adds to the plain decoder; the defaults are the plain one.

    qkv_bias: q/k/v projections have a bias (Qwen2). qk_norm: RMSNorm over head_dim of each query and
    key head before RoPE (Qwen3). rope_llama3: (factor, low_freq_factor, high_freq_factor,
    original_max_len) of Llama 3's RoPE frequency rescale, or None.
    """

    qkv_bias: bool = False
    qk_norm: bool = False
    rope_llama3: tuple[float, float, float, float] | None = None


def rope_inv_freq(head_dim: int, theta: float, llama3: tuple[float, float, float, float] | None = None):
    """inv_freq_Hd2: the rotation speed of each pair. With `llama3` = (factor, low, high, L0): pairs
    whose wavelength 2pi/f is longer than L0/low are slowed by `factor`, those shorter than L0/high
    kept, and those in between blended linearly in L0/wavelength (Llama 3.1's long-context rescale)."""
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if llama3 is None:
        return inv_freq
    factor, low, high, original_len = llama3
    periods = original_len * inv_freq / (2 * math.pi)  # = L0 / wavelength
    blend = jnp.clip((periods - low) / (high - low), 0.0, 1.0)  # 0: slow pair, 1: fast pair
    return (1 - blend) * inv_freq / factor + blend * inv_freq


def apply_rope(
    x_BxTxNxHd: jax.Array,
    positions_BxT: jax.Array,
    theta: float,
    llama3: tuple[float, float, float, float] | None = None,
) -> jax.Array:
    """Rotate-half RoPE (the Llama/Qwen HF convention, so converted checkpoints line up)."""
    hd = x_BxTxNxHd.shape[-1]
    inv_freq = rope_inv_freq(hd, theta, llama3)
    angle_BxTx1xHd2 = (positions_BxT.astype(jnp.float32)[..., None] * inv_freq)[:, :, None, :]
    sin, cos = jnp.sin(angle_BxTx1xHd2), jnp.cos(angle_BxTx1xHd2)
    x1, x2 = jnp.split(x_BxTxNxHd.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxNxHd.dtype)


class Attention(nn.Module):
    """Grouped-query attention; the one code path for full forward, prefill and decode.

    Queries occupy key slots `index .. index+T-1`. Without a cache the keys are this call's own
    tokens (S = T, index = 0); with a cache, this call's K/V are first written at slot `index` of
    layer `layer`, then the queries attend over all S cache slots. Either way a key is visible iff
    its slot is not after the query's slot (causal) and `key_valid_BxS` marks it real (not padding).
    `layer` is traced: blocks run under `nn.scan`. With a `GroupKV` (prompt prefix stored once per
    group, `prefix_attention`), `index` is the slot in each row's own completion buffer and
    `key_valid_BxS` marks the valid prefix slots of each group, [B/G, P].
    """

    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_model: int
    rope_theta: float
    dtype: Any = jnp.float32
    opts: AttnOptions = AttnOptions()
    eps: float = 1e-6  # of the q/k norms (opts.qk_norm)

    @nn.compact
    def __call__(self, x_BxTxD, positions_BxT, key_valid_BxS, index, kv: KV | None, layer):
        D, H, K, Hd = self.d_model, self.n_heads, self.n_kv_heads, self.head_dim
        B, T, _ = x_BxTxD.shape
        # std = fan_in^-1/2 keeps activations O(1) at init.
        w_q_DxHxHd = logical_param(self, "q", (D, H, Hd), ("embed", "heads", "head_dim"), D**-0.5)
        w_k_DxKxHd = logical_param(self, "k", (D, K, Hd), ("embed", "kv_heads", "head_dim"), D**-0.5)
        w_v_DxKxHd = logical_param(self, "v", (D, K, Hd), ("embed", "kv_heads", "head_dim"), D**-0.5)
        w_o_HxHdxD = logical_param(self, "o", (H, Hd, D), ("heads", "head_dim", "embed"), (H * Hd) ** -0.5)

        def cast(w):
            return w.astype(self.dtype)

        q_BxTxHxHd = jnp.einsum("btd,dhk->bthk", x_BxTxD, cast(w_q_DxHxHd))
        k_BxTxKxHd = jnp.einsum("btd,dhk->bthk", x_BxTxD, cast(w_k_DxKxHd))
        v_BxTxKxHd = jnp.einsum("btd,dhk->bthk", x_BxTxD, cast(w_v_DxKxHd))
        if self.opts.qkv_bias:  # zeros at init
            q_BxTxHxHd = q_BxTxHxHd + cast(logical_param(self, "q_bias", (H, Hd), ("heads", "head_dim"), 0.0))
            k_BxTxKxHd = k_BxTxKxHd + cast(logical_param(self, "k_bias", (K, Hd), ("kv_heads", "head_dim"), 0.0))
            v_BxTxKxHd = v_BxTxKxHd + cast(logical_param(self, "v_bias", (K, Hd), ("kv_heads", "head_dim"), 0.0))
        if self.opts.qk_norm:
            q_BxTxHxHd = RMSNorm(Hd, self.eps, self.dtype, "head_dim", name="q_norm")(q_BxTxHxHd)
            k_BxTxKxHd = RMSNorm(Hd, self.eps, self.dtype, "head_dim", name="k_norm")(k_BxTxKxHd)
        llama3 = self.opts.rope_llama3
        q_BxTxHxHd = apply_rope(q_BxTxHxHd, positions_BxT, self.rope_theta, llama3) * jnp.asarray(Hd**-0.5, self.dtype)
        k_BxTxKxHd = apply_rope(k_BxTxKxHd, positions_BxT, self.rope_theta, llama3)

        if isinstance(kv, WindowKV):
            win = tuple(
                lax.dynamic_update_slice(buf, new.swapaxes(1, 2).astype(buf.dtype), (0, 0, index, 0))
                for buf, new in zip((kv.win_k, kv.win_v), (k_BxTxKxHd, v_BxTxKxHd))
            )
            o_BxTxHxHd = _attend_window(
                q_BxTxHxHd,
                kv.k_BxKxSxHd.astype(self.dtype),
                kv.v_BxKxSxHd.astype(self.dtype),
                key_valid_BxS,
                win[0].astype(self.dtype),
                win[1].astype(self.dtype),
                index,
                self.dtype,
            )
            return jnp.einsum("bthk,hkd->btd", o_BxTxHxHd, cast(w_o_HxHdxD)), kv._replace(win_k=win[0], win_v=win[1])
        if isinstance(kv, GroupKV):  # the sampler's shared-prefix cache; key_valid marks the prefix
            own = tuple(write_own(buf, new, index) for buf, new in zip((kv.own_k, kv.own_v), (k_BxTxKxHd, v_BxTxKxHd)))
            kv = kv._replace(own_k=own[0], own_v=own[1])
            o_BxTxHxHd = attend_group(q_BxTxHxHd, kv, key_valid_BxS, index, self.dtype)
            return jnp.einsum("bthk,hkd->btd", o_BxTxHxHd, cast(w_o_HxHdxD)), kv
        if kv is not None and kv[0].ndim == 4:  # LayerKV: this layer's own kv-head-major buffers
            k_buf, v_buf = kv
            k_buf = _write_layer_kv(k_buf, k_BxTxKxHd.swapaxes(1, 2).astype(k_buf.dtype), index)
            v_buf = _write_layer_kv(v_buf, v_BxTxKxHd.swapaxes(1, 2).astype(v_buf.dtype), index)
            o_BxTxHxHd = _attend_kv_head_major(
                q_BxTxHxHd, k_buf.astype(self.dtype), v_buf.astype(self.dtype), key_valid_BxS, index, self.dtype
            )
            return jnp.einsum("bthk,hkd->btd", o_BxTxHxHd, cast(w_o_HxHdxD)), (k_buf, v_buf)
        if kv is None:
            k_BxSxKxHd, v_BxSxKxHd = k_BxTxKxHd, v_BxTxKxHd
        else:
            k_all, v_all = kv
            start = (layer, 0, index, 0, 0)
            k_all = lax.dynamic_update_slice(k_all, k_BxTxKxHd[None].astype(k_all.dtype), start)
            v_all = lax.dynamic_update_slice(v_all, v_BxTxKxHd[None].astype(v_all.dtype), start)
            kv = (k_all, v_all)
            k_BxSxKxHd = lax.dynamic_index_in_dim(k_all, layer, 0, keepdims=False).astype(self.dtype)
            v_BxSxKxHd = lax.dynamic_index_in_dim(v_all, layer, 0, keepdims=False).astype(self.dtype)
        S = k_BxSxKxHd.shape[1]

        # Group query heads by the kv head they share: head h reads kv head h // R.
        q_BxTxKxRxHd = q_BxTxHxHd.reshape(B, T, K, H // K, Hd)
        s_BxKxRxTxS = jnp.einsum("btkrd,bskd->bkrts", q_BxTxKxRxHd, k_BxSxKxHd, preferred_element_type=jnp.float32)
        q_slot_T = index + jnp.arange(T)
        causal_TxS = jnp.arange(S)[None, :] <= q_slot_T[:, None]
        allowed_BxTxS = causal_TxS[None] & key_valid_BxS.astype(bool)[:, None, :]
        s_BxKxRxTxS = jnp.where(allowed_BxTxS[:, None, None], s_BxKxRxTxS, _MASKED)
        p_BxKxRxTxS = jax.nn.softmax(s_BxKxRxTxS, axis=-1).astype(self.dtype)
        o_BxTxKxRxHd = jnp.einsum("bkrts,bskd->btkrd", p_BxKxRxTxS, v_BxSxKxHd)
        o_BxTxHxHd = o_BxTxKxRxHd.reshape(B, T, H, Hd)
        return jnp.einsum("bthk,hkd->btd", o_BxTxHxHd, cast(w_o_HxHdxD)), kv


def _write_layer_kv(buf_BxKxSxHd, new_BxKxTxHd, index):
    """Write T new keys (or values) of every row at cache slots index..index+T-1: `index` a scalar
    (every row at the same slots) or index_B (each row at its own, as the slot engine decodes).
    Either way an in-place update that attention then reads, so XLA copies no cache buffer."""
    if jnp.ndim(index) == 0:
        return lax.dynamic_update_slice(buf_BxKxSxHd, new_BxKxTxHd, (0, 0, index, 0))
    write = jax.vmap(lambda buf_KxSxHd, new_KxTxHd, i: lax.dynamic_update_slice(buf_KxSxHd, new_KxTxHd, (0, i, 0)))
    return write(buf_BxKxSxHd, new_BxKxTxHd, index)


def _attend_kv_head_major(q_BxTxHxHd, k_BxKxSxHd, v_BxKxSxHd, key_valid_BxS, index, dtype):
    """Attention of queries at slots index.. (a scalar, or index_B: each row's own) over a
    kv-head-major cache; same math as the einsum
    path in `Attention`, laid out for XLA:CPU decode: the scores are computed keys-major (S x TR per
    (b, k), softmax over S) and both contractions are explicit `dot_general`s, so XLA neither
    transposes the cache nor picks a strided GEMM. Measured ~1.5x faster than the einsum form at
    B=64, S=192 (the cache is read twice per layer per step; nothing else in decode grows with S)."""
    B, T, H, Hd = q_BxTxHxHd.shape
    K, S = k_BxKxSxHd.shape[1], k_BxKxSxHd.shape[2]
    R = H // K
    q_BxKxQxHd = q_BxTxHxHd.reshape(B, T, K, R, Hd).transpose(0, 2, 1, 3, 4).reshape(B, K, T * R, Hd)
    batch = ((0, 1), (0, 1))
    s_BxKxSxQ = lax.dot_general(k_BxKxSxHd, q_BxKxQxHd, (((3,), (3,)), batch), preferred_element_type=jnp.float32)
    q_slot_T = jnp.asarray(index)[..., None] + jnp.arange(T)  # (T,) or, per row, (B, T)
    causal_SxT = jnp.arange(S)[:, None] <= q_slot_T[..., None, :]  # (S, T) or (B, S, T)
    allowed_BxSxT = causal_SxT & key_valid_BxS.astype(bool)[:, :, None]
    s_BxKxSxTxR = jnp.where(allowed_BxSxT[:, None, :, :, None], s_BxKxSxQ.reshape(B, K, S, T, R), _MASKED)
    s_BxKxSxQ = s_BxKxSxTxR.reshape(B, K, S, T * R)
    # Softmax over S, normalised after the value contraction (on the small output): the max and the
    # sum reduce a transposed view, since XLA:CPU reduces a minor axis far faster than axis 2.
    max_BxKxQ = jnp.max(s_BxKxSxQ.swapaxes(2, 3), axis=-1)
    e_BxKxSxQ = jnp.exp(s_BxKxSxQ - max_BxKxQ[:, :, None, :])
    sum_BxKxQ = jnp.sum(e_BxKxSxQ.swapaxes(2, 3), axis=-1)
    o_BxKxQxHd = lax.dot_general(
        e_BxKxSxQ.astype(dtype), v_BxKxSxHd, (((2,), (2,)), batch), preferred_element_type=jnp.float32
    )
    o_BxKxQxHd = (o_BxKxQxHd / sum_BxKxQ[..., None]).astype(dtype)
    return o_BxKxQxHd.reshape(B, K, T, R, Hd).transpose(0, 2, 1, 3, 4).reshape(B, T, H, Hd)


def _attend_window(q_BxTxHxHd, k_BxKxSxHd, v_BxKxSxHd, cache_seen_BxS, wk_BxKxWxHd, wv_BxKxWxHd, index, dtype):
    """Attention over the cache slots marked in cache_seen_BxS, then window slots 0..index+t for
    the query t (one softmax over both parts, laid out as `_attend_kv_head_major`)."""
    B, T, H, Hd = q_BxTxHxHd.shape
    K, W = k_BxKxSxHd.shape[1], wk_BxKxWxHd.shape[2]
    R = H // K
    q_BxKxQxHd = q_BxTxHxHd.reshape(B, T, K, R, Hd).transpose(0, 2, 1, 3, 4).reshape(B, K, T * R, Hd)
    batch = ((0, 1), (0, 1))
    cache_scores = lax.dot_general(k_BxKxSxHd, q_BxKxQxHd, (((3,), (3,)), batch), preferred_element_type=jnp.float32)
    s_BxKxSxQ = jnp.where(cache_seen_BxS[:, None, :, None], cache_scores, _MASKED)
    causal_WxT = jnp.arange(W)[:, None] <= index + jnp.arange(T)[None, :]
    # The window is a few slots: a fused multiply-reduce beats B*K tiny GEMMs on XLA:CPU.
    window_scores = jnp.sum(wk_BxKxWxHd[:, :, :, None, :].astype(jnp.float32) * q_BxKxQxHd[:, :, None], axis=-1)
    s_BxKxWxQ = jnp.where(jnp.repeat(causal_WxT, R, axis=1)[None, None], window_scores, _MASKED)
    max_BxKxQ = jnp.maximum(jnp.max(s_BxKxSxQ.swapaxes(2, 3), axis=-1), jnp.max(s_BxKxWxQ.swapaxes(2, 3), axis=-1))
    e_BxKxSxQ = jnp.exp(s_BxKxSxQ - max_BxKxQ[:, :, None, :])
    e_BxKxWxQ = jnp.exp(s_BxKxWxQ - max_BxKxQ[:, :, None, :])
    sum_BxKxQ = jnp.sum(e_BxKxSxQ.swapaxes(2, 3), axis=-1) + jnp.sum(e_BxKxWxQ.swapaxes(2, 3), axis=-1)
    cache_mix = lax.dot_general(
        e_BxKxSxQ.astype(dtype), v_BxKxSxHd, (((2,), (2,)), batch), preferred_element_type=jnp.float32
    )
    window_mix = jnp.sum(e_BxKxWxQ[..., None] * wv_BxKxWxHd[:, :, :, None, :].astype(jnp.float32), axis=2)
    o_BxKxQxHd = ((cache_mix + window_mix) / sum_BxKxQ[..., None]).astype(dtype)
    return o_BxKxQxHd.reshape(B, K, T, R, Hd).transpose(0, 2, 1, 3, 4).reshape(B, T, H, Hd)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    d_model: int
    mlp_dim: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_BxTxD):
        D, F = self.d_model, self.mlp_dim
        w_gate_DxF = logical_param(self, "gate", (D, F), ("embed", "mlp"), D**-0.5)
        w_up_DxF = logical_param(self, "up", (D, F), ("embed", "mlp"), D**-0.5)
        w_down_FxD = logical_param(self, "down", (F, D), ("mlp", "embed"), F**-0.5)
        gate_BxTxF = jnp.einsum("btd,df->btf", x_BxTxD, w_gate_DxF.astype(self.dtype))
        up_BxTxF = jnp.einsum("btd,df->btf", x_BxTxD, w_up_DxF.astype(self.dtype))
        return jnp.einsum("btf,fd->btd", jax.nn.silu(gate_BxTxF) * up_BxTxF, w_down_FxD.astype(self.dtype))


def attention_residual(block: nn.Module, x_BxTxD, positions_BxT, key_valid_BxS, index, kv, layer):
    """x + attn(norm(x)) with the submodules `attn_norm` and `attn` created in `block`'s scope: the
    shared first half of every decoder block (call it from a compact `__call__`)."""
    h_BxTxD = RMSNorm(block.d_model, block.eps, block.dtype, name="attn_norm")(x_BxTxD)
    attn = Attention(
        block.n_heads,
        block.n_kv_heads,
        block.head_dim,
        block.d_model,
        block.rope_theta,
        block.dtype,
        block.attn_opts,
        block.eps,
        name="attn",
    )
    a_BxTxD, kv = attn(h_BxTxD, positions_BxT, key_valid_BxS, index, kv, layer)
    return x_BxTxD + a_BxTxD, kv


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x)).

    Written as a scan body: the carry is (x_BxTxD, kv, layer) so one compiled block serves all L
    layers and each layer writes its own slice of the stacked cache.
    """

    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mlp_dim: int
    rope_theta: float
    eps: float
    dtype: Any = jnp.float32
    attn_opts: AttnOptions = AttnOptions()

    @nn.compact
    def __call__(self, carry, positions_BxT, key_valid_BxS, index):
        x_BxTxD, kv, layer = carry
        x_BxTxD, kv = attention_residual(self, x_BxTxD, positions_BxT, key_valid_BxS, index, kv, layer)
        h_BxTxD = RMSNorm(self.d_model, self.eps, self.dtype, name="mlp_norm")(x_BxTxD)
        x_BxTxD = x_BxTxD + MLP(self.d_model, self.mlp_dim, self.dtype, name="mlp")(h_BxTxD)
        return (x_BxTxD, kv, layer + 1), None
