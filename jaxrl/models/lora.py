"""Low-rank adapters (LoRA) as a transformation of the parameter tree: the model never knows.

A run with `model.lora.rank > 0` trains a small `adapters` tree and keeps the base weights frozen
(`store_base`: float32, bfloat16 or int8). Every forward uses `merge(base, adapters)`: each target
weight W becomes W + (alpha / rank) * A @ B, by the same function in the rollout, the evaluation and the
update, so the sampler's log-probs are the trainer's; `merge(base, None)` is the base policy (the KL
reference). A has (stack..., in..., r), B has (stack..., r, out...) and keeps the weight's logical axes
on the dims it shares with it, so a mesh preset shards adapters by the weights' rules (rank replicated).
A weight's input dims are its first non-stack dim when that is `embed` (q, k, v, gate, up), else all but
the last (o, down); `store_base` picks an int8 weight's scale columns the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxrl.config.lora import LoraConfig
from jaxrl.models.int8 import Int8Weight, dequantize, is_int8, quantize

STACK_AXES = ("layers", "expert")  # leading dims of stacked weights: one independent matrix per entry


def _name(path) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in path)


def _split_dims(axes: tuple) -> tuple[int, int]:
    """Logical axes of a weight -> (number of leading stack dims, number of input dims)."""
    n_stack = 0
    while n_stack < len(axes) and axes[n_stack] in STACK_AXES:
        n_stack += 1
    rest = axes[n_stack:]
    return n_stack, 1 if rest[:1] == ("embed",) else len(rest) - 1


def is_target(path, axes: tuple, cfg: LoraConfig) -> bool:
    """Whether the weight at `path` (logical `axes`) carries an adapter: its name is one of
    cfg.targets; a routed expert's weight (an `expert` axis) only with cfg.experts; never a router."""
    name = _name(path)
    leaf = name.rsplit("/", 1)[-1]
    if leaf not in cfg.targets or "router" in name or len(axes) - _split_dims(axes)[0] < 2:
        return False
    return cfg.experts or "expert" not in axes


def _with_axes(fn: Callable, params: Any, logical: Any) -> Any:
    """tree_map over (path, param, its logical axes); `logical` is `param_logical_axes(cfg)`."""
    axes_by_path = {
        _name(path): tuple(ax)
        for path, ax in jax.tree_util.tree_flatten_with_path(logical, is_leaf=lambda x: isinstance(x, P))[0]
    }
    return jax.tree_util.tree_map_with_path(lambda path, w: fn(path, w, axes_by_path[_name(path)]), params)


def _adapter_shapes(shape: tuple, axes: tuple, rank: int) -> tuple[tuple, tuple]:
    n_stack, n_in = _split_dims(axes)
    stack, ins, outs = shape[:n_stack], shape[n_stack : n_stack + n_in], shape[n_stack + n_in :]
    return (*stack, *ins, rank), (*stack, rank, *outs)


def init_adapters(params: Any, logical: Any, cfg: LoraConfig, rng: jax.Array) -> dict:
    """The adapters for `params` (only the shapes are read): a nested dict with {"a": A, "b": B} where
    `params` has a target weight and nothing elsewhere. A ~ N(0, 1 / fan_in) per target, B = 0, so
    `merge(base, adapters)` equals the base policy exactly at step 0."""
    flat = {}

    def visit(path, w, axes):
        if is_target(path, axes, cfg):
            flat[_name(path)] = (w.shape, axes)
        return None

    _with_axes(visit, params, logical)
    keys = jax.random.split(rng, max(len(flat), 1))
    out: dict = {}
    for key, (name, (shape, axes)) in zip(keys, sorted(flat.items())):
        a_shape, b_shape = _adapter_shapes(shape, axes, cfg.rank)
        n_stack, n_in = _split_dims(axes)
        fan_in = 1
        for d in shape[n_stack : n_stack + n_in]:
            fan_in *= d
        node = out
        for part in name.split("/")[:-1]:
            node = node.setdefault(part, {})
        node[name.rsplit("/", 1)[-1]] = {
            "a": jax.random.normal(key, a_shape, jnp.float32) * fan_in**-0.5,
            "b": jnp.zeros(b_shape, jnp.float32),
        }
    return out


def adapter_logical_axes(params: Any, logical: Any, cfg: LoraConfig) -> dict:
    """The logical axes of `init_adapters`' tree: A keeps the weight's stack and input axes, B its stack
    and output axes; the rank dim is None (replicated)."""
    out: dict = {}

    def visit(path, w, axes):
        if is_target(path, axes, cfg):
            n_stack, n_in = _split_dims(axes)
            node = out
            names = _name(path).split("/")
            for part in names[:-1]:
                node = node.setdefault(part, {})
            node[names[-1]] = {
                "a": P(*axes[: n_stack + n_in], None),
                "b": P(*axes[:n_stack], None, *axes[n_stack + n_in :]),
            }
        return None

    _with_axes(visit, params, logical)
    return out


def store_base(params: Any, logical: Any, cfg: LoraConfig) -> Any:
    """The frozen base in cfg.base_dtype: float32 as is; bfloat16 for every floating leaf; int8
    (`Int8Weight`) for every matrix but MoE routers (a flipped expert choice costs more than it saves),
    vectors (norm scales, biases) and routers staying float32."""
    if cfg.base_dtype == "float32":
        return params
    if cfg.base_dtype == "bfloat16":
        return jax.tree.map(lambda w: w.astype(jnp.bfloat16), params)

    def one(path, w, axes):
        n_stack, n_in = _split_dims(axes)
        if len(axes) - n_stack < 2 or "router" in _name(path):
            return w
        return quantize(w, tuple(range(n_stack, n_stack + n_in)))

    return _with_axes(one, params, logical)


def base_logical_axes(logical: Any, cfg: LoraConfig, params: Any) -> Any:
    """The logical axes of `store_base`'s tree (for shardings): an int8 weight's values keep the
    weight's axes; its scale keeps them too except on the reduced input dims (None)."""
    if cfg.base_dtype != "int8":
        return logical

    def axes_of(path, w, axes):
        n_stack, n_in = _split_dims(axes)
        if len(axes) - n_stack < 2 or "router" in _name(path):
            return P(*axes)
        scale_axes = (*axes[:n_stack], *([None] * n_in), *axes[n_stack + n_in :])
        return Int8Weight(P(*axes), P(*scale_axes))

    return _with_axes(axes_of, params, logical)


def dense_base(base: Any) -> Any:
    """The base policy's float32 params (what the reference forward uses)."""
    return jax.tree.map(
        lambda w: dequantize(w) if is_int8(w) else w.astype(jnp.float32),
        base,
        is_leaf=is_int8,
    )


def merge(base: Any, adapters: dict | None, cfg: LoraConfig, logical: Any) -> Any:
    """The policy's float32 params: dense_base(base) with scale * A @ B added to every adapted weight.
    `adapters=None` gives the base policy (the KL reference)."""
    dense = dense_base(base)
    if adapters is None:
        return dense

    def add(path, w, axes):
        node = adapters
        for part in _name(path).split("/"):
            if not isinstance(node, dict) or part not in node:
                return w
            node = node[part]
        n_stack, n_in = _split_dims(axes)
        a, b = node["a"], node["b"]
        stack, ins, outs = w.shape[:n_stack], w.shape[n_stack : n_stack + n_in], w.shape[n_stack + n_in :]
        a_SxIxR = a.reshape(*stack, -1, cfg.rank)
        b_SxRxO = b.reshape(*stack, cfg.rank, -1)
        d_SxIxO = jnp.matmul(a_SxIxR * cfg.scale, b_SxRxO, precision=jax.lax.Precision.HIGHEST)
        return w + d_SxIxO.reshape(*stack, *ins, *outs)

    return _with_axes(add, dense, logical)


@jax.jit
def _leaf_sums(base: Any) -> list[jax.Array]:
    """Per leaf of dense_base(base), in path order: the sum and the sum of squares of its float32 values."""
    return [s for w in jax.tree.leaves(dense_base(base)) for s in (jnp.sum(w), jnp.sum(w * w))]


def fingerprint(base: Any) -> list[float]:
    """A cheap identity of the base weights, stored with LoRA checkpoints (which hold only adapters) so
    that a resume or an export on a different base is refused: per leaf, the sum and the sum of squares
    of its float32 values (in path order). One jitted program and one transfer (leaf by leaf, eager
    sums would compile a reduction per leaf shape and wait on each)."""
    return [float(x) for x in jax.device_get(_leaf_sums(base))]


def same_fingerprint(a: list[float], b: list[float], rtol: float = 1e-5) -> bool:
    """Equal up to float32 summation order (another device count or platform reduces differently)."""
    return len(a) == len(b) and all(abs(x - y) <= rtol * max(abs(x), abs(y), 1e-6) for x, y in zip(a, b))
