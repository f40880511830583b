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
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from jaxrl.models import int8
from jaxrl.models.attention import attend, resolve_kernel
from jaxrl.models.decode_attention import resolve_decode_kernel
from jaxrl.models.splash import KernelLayout

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
    original_max_len) of Llama 3's RoPE frequency rescale, or None. attention: the kernel of the
    no-cache and stacked-cache attention (`attention.KERNELS`; "auto" is resolved when the layer is
    traced, from the backend it is traced for). decode_attention, decode_block: the kernel of the
    decode loops' LayerKV / WindowKV read (`decode_attention.DECODE_KERNELS`, resolved likewise).
    layout: how a Mosaic kernel (splash) splits over the run's mesh (`splash.KernelLayout`; None:
    one device).
    """

    qkv_bias: bool = False
    qk_norm: bool = False
    rope_llama3: tuple[float, float, float, float] | None = None
    attention: str = "auto"
    decode_attention: str = "auto"
    decode_block: int = 128
    layout: KernelLayout | None = None


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
    """Grouped-query attention: projections, optional q/k norms and biases, RoPE, then `attention.attend`
    over whatever cache kind `kv` is (`cache_kinds`: None, StackedKV, LayerKV, WindowKV, GroupKV).
    Queries occupy key slots `index .. index+T-1`; `layer` (traced under the scan) picks a StackedKV's
    layer. Returns (out_BxTxD, kv updated)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_model: int
    rope_theta: float
    dtype: Any = jnp.float32
    opts: AttnOptions = AttnOptions()
    eps: float = 1e-6  # of the q/k norms (opts.qk_norm)

    @nn.compact
    def __call__(self, x_BxTxD, positions_BxT, key_valid_BxS, index, kv, layer):
        D, H, K, Hd = self.d_model, self.n_heads, self.n_kv_heads, self.head_dim
        B, T, _ = x_BxTxD.shape
        # std = fan_in^-1/2 keeps activations O(1) at init.
        w_q_DxHxHd = logical_param(self, "q", (D, H, Hd), ("embed", "heads", "head_dim"), D**-0.5)
        w_k_DxKxHd = logical_param(self, "k", (D, K, Hd), ("embed", "kv_heads", "head_dim"), D**-0.5)
        w_v_DxKxHd = logical_param(self, "v", (D, K, Hd), ("embed", "kv_heads", "head_dim"), D**-0.5)
        w_o_HxHdxD = logical_param(self, "o", (H, Hd, D), ("heads", "head_dim", "embed"), (H * Hd) ** -0.5)

        def cast(w):
            return int8.dense(w, self.dtype)

        q_BxTxHxHd = int8.matmul("btd,dhk->bthk", x_BxTxD, w_q_DxHxHd, self.dtype)
        k_BxTxKxHd = int8.matmul("btd,dhk->bthk", x_BxTxD, w_k_DxKxHd, self.dtype)
        v_BxTxKxHd = int8.matmul("btd,dhk->bthk", x_BxTxD, w_v_DxKxHd, self.dtype)
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

        kernel = resolve_kernel(self.opts.attention, self.dtype, Hd)
        decode = resolve_decode_kernel(self.opts.decode_attention, self.opts.decode_block)
        qkv = (q_BxTxHxHd, k_BxTxKxHd, v_BxTxKxHd)
        o_BxTxHxHd, kv = attend(*qkv, kv, key_valid_BxS, index, layer, self.dtype, kernel, self.opts.layout, decode)
        return int8.matmul("bthk,hkd->btd", o_BxTxHxHd, w_o_HxHdxD, self.dtype), kv


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
        gate_BxTxF = int8.matmul("btd,df->btf", x_BxTxD, w_gate_DxF, self.dtype)
        up_BxTxF = int8.matmul("btd,df->btf", x_BxTxD, w_up_DxF, self.dtype)
        return int8.matmul("btf,fd->btd", jax.nn.silu(gate_BxTxF) * up_BxTxF, w_down_FxD, self.dtype)


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
