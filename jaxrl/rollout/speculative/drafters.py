"""Self-drafters for speculative rollouts: cheaper views of the policy that never go stale.

  early_exit  the first `draft_layers` blocks of the policy, then its own final norm and head; it
              reads the policy's KV cache for those layers (no cache of its own).
  int8        the whole policy with every matrix weight-only quantised to int8 (symmetric, one scale
              per output column), rebuilt from the current params at each rollout.
(The third drafter, trajectory reuse, needs no model: see `sample.py` and `reuse.py`.)

A drafter is (draft params, number of layers run); both go through `decode.window_layers`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.config import ConfigError, ModelConfig, SpeculativeConfig


def quantize_int8(tree):
    """Every leaf with >= 2 dims (except MoE routers: a flipped expert choice costs more than it
    saves) -> (int8 values, float32 scale per last-axis column): w ~= q * scale."""

    def one(path, w):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if w.ndim < 2 or "router" in name:
            return w
        w = w.astype(jnp.float32)  # rollout params may hold it in the compute dtype: quantise in float32
        scale = jnp.max(jnp.abs(w), axis=tuple(range(w.ndim - 1)), keepdims=True) / 127.0
        scale = jnp.where(scale > 0, scale, 1.0)
        return (jnp.round(w / scale).astype(jnp.int8), scale.astype(jnp.float32))

    return jax.tree_util.tree_map_with_path(one, tree)


def dequantize(qtree):
    """The float32 view of `quantize_int8`'s output (what the int8 drafter computes with)."""

    def is_q(x):
        return isinstance(x, tuple) and len(x) == 2 and getattr(x[0], "dtype", None) == jnp.int8

    return jax.tree.map(lambda x: x[0].astype(jnp.float32) * x[1] if is_q(x) else x, qtree, is_leaf=is_q)


def draft_view(lparams, drafter: str, draft_layers: int, n_layers: int):
    """-> (params the drafter runs, how many layers it runs) for a self-drafter."""
    if drafter == "early_exit":
        return lparams, draft_layers
    if drafter == "int8":
        return dequantize(quantize_int8(lparams)), n_layers
    raise ValueError(f"rollout.speculative.drafter {drafter!r} is not a self-drafter (expected early_exit or int8)")


def check_self_drafter(cfg: ModelConfig, spec: SpeculativeConfig) -> str | None:
    """The self-drafter `spec` asks of this model (None: reuse drafts alone); one the model cannot serve is
    a ConfigError naming the field (checked on the host, before anything is traced or measured)."""
    self_drafter = spec.fallback if spec.drafter == "reuse" else spec.drafter
    if self_drafter == "early_exit" and not 0 < spec.draft_layers < cfg.n_layers:
        n = cfg.n_layers
        allowed = (
            f"1..{n - 1} (fewer than model.n_layers={n})"
            if n > 1
            else "fewer than model.n_layers=1: early exit needs a policy of 2 or more layers"
        )
        raise ConfigError(f"rollout.speculative.draft_layers: got {spec.draft_layers}, expected {allowed}")
    return None if self_drafter == "none" else self_drafter
