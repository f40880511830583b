"""The stacked KV cache of the scanned decoder: its layout and the prefill of a left-padded prompt
(`decode` splits it into per-layer buffers for the decode loops)."""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl.config import ModelConfig
from jaxrl.models.cache_kinds import StackedKV
from jaxrl.models.decoder import positions_from_mask, run_decoder
from jaxrl.models.parallel import Parallel


class Cache(NamedTuple):
    """Preallocated per-layer keys/values. A slot index means the same step for every row: prefill
    fills slots 0..P-1 (left padding marked invalid) and each later step writes the slots its
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


@functools.partial(jax.jit, static_argnames=("cfg", "parallel"))
def prefill(params, cfg: ModelConfig, tokens_BxP, mask_BxP, cache: Cache, parallel: Parallel | None = None):
    """Fill slots 0..P-1 of an empty cache with a left-padded prompt -> (the last slot's logits_BxV
    (the next-token distribution: with left padding the last slot is every row's last real token),
    the cache, and for an MoE model the experts every prompt slot used, experts_LxBxPxK, else None).
    `parallel` (MoE): the experts' mesh axis, as the update is given (None: one device)."""
    mask_BxP = mask_BxP.astype(bool)
    valid_BxS = lax.dynamic_update_slice(cache.valid_BxS, mask_BxP, (0, 0))
    logits_Bx1xV, kv, moe = run_decoder(
        params,
        cfg,
        tokens_BxP,
        positions_from_mask(mask_BxP),
        valid_BxS,
        0,
        StackedKV(cache.k_LxBxSxKxHd, cache.v_LxBxSxKxHd),
        num_logits=1,
        parallel=parallel,
    )
    pos_B = jnp.sum(mask_BxP, axis=-1, dtype=jnp.int32)
    experts = None if moe is None else moe.experts_LxBxTxK
    return logits_Bx1xV[:, 0], Cache(kv.k_LxBxSxKxHd, kv.v_LxBxSxKxHd, valid_BxS, pos_B), experts
