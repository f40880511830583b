"""Weight-only int8: a weight as a pytree of int8 values and a float32 scale per output column, and the
ONE way the model's layers read a weight (`matmul`, `embed`, `dense`), float or int8 alike.

A plain array weight goes through exactly the code the layers always ran (`w.astype(dtype)` then the
einsum), so every float path is bitwise unchanged. An `Int8Weight` is read as int8 and converted to
the compute dtype inside the dot: (x @ values) * scale, the scale applied to the float32 product per
output column, so a program holding int8 weights reads 1 byte per weight (XLA fuses the convert into
the dot on GPU/TPU, and on XLA:CPU too, see benchmarks/README.md). That needs a scale that is constant
along the contracted dims: `quantize` reduces exactly those.

Who holds int8 weights: the int8 self-drafter (`rollout/speculative/drafters.py`) and the LoRA
int8 base (`lora.store_base`; its forward still dequantises in `lora.merge`).

  embedding  one scale per row (a token's vector), so the lookup gathers int8 rows and their scales,
             and a tied head (the transpose) has one scale per vocabulary column.
  experts    MoE expert matrices are dequantised at use inside the layer (`dense`): the grouped
             dispatches (ragged / blocked / capacity / expert-parallel) take plain arrays. They are
             still int8 in the program's arguments and loop state; the convert is not fused into
             the grouped matmul.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class Int8Weight(NamedTuple):
    """A weight held as int8 values and a float32 scale per output column (per layer / expert):
    w ~= values * scale. `scale` has the weight's rank with singleton dims where the input (contracted)
    dims were reduced. (Layout trees hold the same structure with PartitionSpecs or shardings in
    place of the arrays.)"""

    values: Any
    scale: Any


def is_int8(x) -> bool:
    return isinstance(x, Int8Weight)


def quantize(w: jax.Array, reduce: tuple[int, ...]) -> Int8Weight:
    """Symmetric int8 with one float32 scale per slice over the dims `reduce` (the weight's input
    dims): |w - values * scale| <= scale / 2. An all-zero column gets scale 1."""
    w = w.astype(jnp.float32)  # rollout params may hold it in the compute dtype: quantise in float32
    scale = jnp.max(jnp.abs(w), axis=reduce, keepdims=True) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0).astype(jnp.float32)
    return Int8Weight(jnp.round(w / scale).astype(jnp.int8), scale)


def dequantize(w: Int8Weight) -> jax.Array:
    """values * scale in float32."""
    return w.values.astype(jnp.float32) * w.scale


def dense(w, dtype) -> jax.Array:
    """The weight as a `dtype` array: `w.astype(dtype)` for a plain array (today's code), the float32
    dequantisation cast to `dtype` for an int8 one (for uses that are not one `matmul`)."""
    return dequantize(w).astype(dtype) if is_int8(w) else w.astype(dtype)


def transpose(w):
    """w.T for a 2-D weight, plain or int8 (a tied head: the embedding's rows become columns)."""
    return Int8Weight(w.values.T, w.scale.T) if is_int8(w) else w.T


def _output_scale(spec: str, scale: jax.Array) -> jax.Array:
    """The scale (the weight operand's shape, 1 on contracted dims) laid out to broadcast over the
    einsum's output."""
    ins, out = spec.replace(" ", "").split("->")
    w_sub = ins.split(",")[1]
    if scale.ndim != len(w_sub):
        raise ValueError(f"int8.matmul: scale of shape {scale.shape} does not match weight subscripts {w_sub!r}")
    kept = [c for c in w_sub if c in out]
    for c, n in zip(w_sub, scale.shape):
        if c not in out and n != 1:
            raise ValueError(
                f"int8.matmul {spec!r}: the scale varies along the contracted dim {c!r} (shape {scale.shape}); "
                "quantize with that dim reduced"
            )
    s = scale.reshape([n for c, n in zip(w_sub, scale.shape) if c in out])
    s = jnp.transpose(s, [kept.index(c) for c in out if c in kept])
    return s.reshape([scale.shape[w_sub.index(c)] if c in kept else 1 for c in out])


def matmul(spec: str, x: jax.Array, w, dtype, preferred_element_type=None) -> jax.Array:
    """einsum(spec, x, w) in compute dtype `dtype`, the weight second. Plain array: exactly
    `jnp.einsum(spec, x, w.astype(dtype), preferred_element_type=...)`. Int8Weight: the int8 values
    converted to `dtype` inside the dot, accumulated in float32, times the per-output-column scale,
    then cast to what the float path returns (`preferred_element_type`, else `dtype`)."""
    if not is_int8(w):
        return jnp.einsum(spec, x, w.astype(dtype), preferred_element_type=preferred_element_type)
    y = jnp.einsum(spec, x, w.values.astype(dtype), preferred_element_type=jnp.float32)
    y = y * _output_scale(spec, w.scale)
    return y.astype(preferred_element_type or dtype)


def embed(table, tokens: jax.Array, dtype) -> jax.Array:
    """Rows `tokens` of the embedding table in `dtype`: plain, `take(table).astype(dtype)` (today's);
    int8 (one scale per row), the int8 rows gathered and scaled in float32."""
    tokens = tokens.astype(jnp.int32)
    if not is_int8(table):
        return jnp.take(table, tokens, axis=0).astype(dtype)
    rows = jnp.take(table.values, tokens, axis=0).astype(jnp.float32)
    return (rows * jnp.take(table.scale, tokens, axis=0)).astype(dtype)
