"""The stacked KV cache of the scanned decoder: its layout, prefill of a left-padded prompt, and one
decode step (`jaxrl.models.decode` runs the per-layer loops the sampler uses)."""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl.config import ModelConfig
from jaxrl.models.moe_dispatch import ExpertParallel
from jaxrl.models.transformer import _apply, positions_from_mask


class Cache(NamedTuple):
    """Preallocated per-layer keys/values. A slot index means the same step for every row: prefill
    fills slots 0..P-1 (left padding marked invalid) and each decode_step writes the one slot its
    caller names, for all rows at once. Slot order is attention order; position ids live in pos_B."""

    k_LxBxSxKxHd: jax.Array
    v_LxBxSxKxHd: jax.Array
    valid_BxS: jax.Array  # bool: slot holds a real (non-padding) token
    pos_B: jax.Array  # int32: position id the row's next token gets


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> Cache:
    shape = (cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.head_dim)
    return Cache(
        k_LxBxSxKxHd=jnp.zeros(shape, jnp.dtype(cfg.dtype)),
        v_LxBxSxKxHd=jnp.zeros(shape, jnp.dtype(cfg.dtype)),
        valid_BxS=jnp.zeros((batch, max_len), bool),
        pos_B=jnp.zeros((batch,), jnp.int32),
    )


@functools.partial(jax.jit, static_argnames="cfg")
def prefill(params, cfg: ModelConfig, tokens_BxP, mask_BxP, cache: Cache):
    """Fill slots 0..P-1 of an empty cache with a left-padded prompt; return the last slot's logits
    (the next-token distribution: with left padding the last slot is every row's last real token)."""
    logits_BxV, cache, _ = prefill_routed(params, cfg, tokens_BxP, mask_BxP, cache)
    return logits_BxV, cache


@functools.partial(jax.jit, static_argnames=("cfg", "expert_parallel"))
def prefill_routed(
    params, cfg: ModelConfig, tokens_BxP, mask_BxP, cache: Cache, expert_parallel: ExpertParallel | None = None
):
    """`prefill` plus the experts every prompt slot used, experts_LxBxPxK (None for a dense model).
    `expert_parallel` (MoE): the experts' mesh axis, as the update is given (None: one device)."""
    mask_BxP = mask_BxP.astype(bool)
    valid_BxS = lax.dynamic_update_slice(cache.valid_BxS, mask_BxP, (0, 0))
    logits_Bx1xV, (k, v), moe = _apply(
        params,
        cfg,
        tokens_BxP.astype(jnp.int32),
        positions_from_mask(mask_BxP),
        valid_BxS,
        0,
        (cache.k_LxBxSxKxHd, cache.v_LxBxSxKxHd),
        num_logits=1,
        expert_parallel=expert_parallel,
    )
    pos_B = jnp.sum(mask_BxP, axis=-1, dtype=jnp.int32)
    return logits_Bx1xV[:, 0], Cache(k, v, valid_BxS, pos_B), None if moe is None else moe.experts_LxBxTxK


@functools.partial(jax.jit, static_argnames="cfg")
def decode_step(params, cfg: ModelConfig, token_B, cache: Cache, index):
    """Append one token per row at cache slot `index` (a traced scalar) and return its logits_BxV."""
    B = token_B.shape[0]
    valid_BxS = lax.dynamic_update_slice(cache.valid_BxS, jnp.ones((B, 1), bool), (0, index))
    logits_Bx1xV, (k, v), _ = _apply(
        params,
        cfg,
        token_B[:, None].astype(jnp.int32),
        cache.pos_B[:, None],
        valid_BxS,
        index,
        (cache.k_LxBxSxKxHd, cache.v_LxBxSxKxHd),
    )
    return logits_Bx1xV[:, 0], Cache(k, v, valid_BxS, cache.pos_B + 1)
