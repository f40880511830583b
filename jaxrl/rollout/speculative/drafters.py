"""Self-drafters for speculative rollouts: cheaper views of the policy that never go stale.

  early_exit  the first `draft_layers` blocks of the policy, then its own final norm and head; it
              reads the policy's KV cache for those layers (no cache of its own).
  int8        the whole policy with every matmul weight quantised to int8 (weight-only, symmetric, one
              scale per output column), rebuilt from the current params at each rollout and kept
              int8 until the matmul (`models/int8.py`): a draft step reads 1 byte per weight.
(The third drafter, trajectory reuse, needs no model: see `sample.py` and `reuse.py`.)

A drafter is (draft params, number of layers run); both go through `decode.window_layers`.
"""

from __future__ import annotations

import jax

from jaxrl.config import ConfigError, ModelConfig, SpeculativeConfig
from jaxrl.models import int8

# The int8 drafter's weights by name: the dims each one's input runs over (counted from the end, so a
# stacked leading `layers` axis and an MoE `expert` axis keep their own scales), reduced by the scale.
_INPUT_DIMS = {"q": (-3,), "k": (-3,), "v": (-3,), "o": (-3, -2), "gate": (-2,), "up": (-2,), "down": (-2,)}
_INPUT_DIMS |= {"shared_gate": (-2,), "lm_head": (-2,), "embedding": (-1,)}  # embedding (V, D): one scale per row
# Kept float: norm scales, q/k/v biases (added, not multiplied), MoE routers (a flipped expert choice
# costs more than it saves).
_KEPT_FLOAT = frozenset({"scale", "q_bias", "k_bias", "v_bias", "router"})


def quantize_int8(tree):
    """The policy's params (stacked or per-layer) with every weight a matmul reads as an
    `int8.Int8Weight` (symmetric, one float32 scale per output column: per layer, expert, head and
    column; the embedding per row), the others kept as they are. An unknown leaf is an error."""

    def one(path, w):
        name = getattr(path[-1], "key", None)
        if name in _KEPT_FLOAT:
            return w
        if name not in _INPUT_DIMS:
            raise ValueError(f"quantize_int8: parameter {jax.tree_util.keystr(path)} has no known use; list it")
        return int8.quantize(w, tuple(w.ndim + d for d in _INPUT_DIMS[name]))

    return jax.tree_util.tree_map_with_path(one, tree)


def dequantize(qtree):
    """The float32 view of `quantize_int8`'s output (what the int8 drafter computed with before it
    kept its weights in int8; for tests and comparisons)."""
    return jax.tree.map(lambda x: int8.dequantize(x) if int8.is_int8(x) else x, qtree, is_leaf=int8.is_int8)


def draft_view(lparams, drafter: str, draft_layers: int, n_layers: int):
    """-> (params the drafter runs, how many layers it runs) for a self-drafter. int8: the quantised
    tree itself, so the drafter's programs hold and read int8 weights (`int8.matmul`)."""
    if drafter == "early_exit":
        return lparams, draft_layers
    if drafter == "int8":
        return quantize_int8(lparams), n_layers
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
