"""Decode loops: per-layer params and cache, and the read-only-cache window form of speculation.

The functions below run `decoder.run_decoder` on the per-layer layout: per-layer params
(`layer_params`, sliced once, outside the loop) and kv-head-major `LayerKV` buffers that attention
reads in place and `dynamic_update_slice` writes in place, so no decode step copies a weight or cache
slice out of a stacked array. Three ways to add tokens:

  decode_layers   writes T tokens of every row at the same cache slots (the sampler's step);
  decode_rows     writes one token per row at that row's own slot (the slot engine's step);
  window_layers   leaves the cache untouched: the tokens' keys/values go to a small per-call window
                  read after the cache; `commit_window` later writes each row's window at that row's
                  own fill level (speculative rollouts: rows keep different numbers of tokens).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl.config import ModelConfig
from jaxrl.models.cache_kinds import LayerKV, WindowKV
from jaxrl.models.decoder import MoEOut, layer_params, positions_from_mask, run_decoder
from jaxrl.models.kv_cache import Cache
from jaxrl.models.parallel import Parallel

__all__ = [
    "LayerCache",
    "commit_window",
    "decode_layers",
    "decode_rows",
    "empty_window",
    "fill_layers",
    "layer_params",
    "to_layer_cache",
    "window_layers",
]


class LayerCache(NamedTuple):
    """A `Cache` in decode-loop form: kv[i] is layer i's LayerKV (k_BxKxSxHd, v_BxKxSxHd)."""

    kv: tuple
    valid_BxS: jax.Array
    pos_B: jax.Array


def to_layer_cache(cache: Cache) -> LayerCache:
    """Split and transpose a stacked cache into per-layer buffers (one copy of the cache)."""
    L = cache.k_LxBxSxKxHd.shape[0]
    kv = tuple(LayerKV(cache.k_LxBxSxKxHd[i].swapaxes(1, 2), cache.v_LxBxSxKxHd[i].swapaxes(1, 2)) for i in range(L))
    return LayerCache(kv, cache.valid_BxS, cache.pos_B)


def _experts_BxTxLxK(moe: MoEOut | None):
    return None if moe is None else jnp.moveaxis(moe.experts_LxBxTxK, 0, 2)


def fill_layers(params, cfg: ModelConfig, seq_BxT, written_BxC, parallel: Parallel | None = None):
    """Whole histories prefilled on the decode layout: row b's token t fed at slot t of fresh
    per-layer buffers of C slots (C >= T; slots past T get padding), positions counted over the
    slots marked in written_BxC, which are also the only keys anyone sees. -> (kv: a LayerKV per
    layer, experts_BxCxLxK or None). The slot engine's re-prefill and episode placement."""
    B, C = written_BxC.shape
    seq_BxC = jnp.pad(seq_BxT.astype(jnp.int32), ((0, 0), (0, C - seq_BxT.shape[1])))
    buf = jnp.zeros((B, cfg.n_kv_heads, C, cfg.head_dim), jnp.dtype(cfg.dtype))
    fresh = tuple(LayerKV(buf, buf) for _ in range(cfg.n_layers))
    _, kv, moe = run_decoder(
        layer_params(params, cfg),
        cfg,
        seq_BxC,
        positions_from_mask(written_BxC),
        written_BxC,
        0,
        fresh,
        parallel=parallel,
    )
    return kv, _experts_BxTxLxK(moe)


def decode_layers(
    lparams,
    cfg: ModelConfig,
    tokens_BxT,
    cache: LayerCache,
    index,
    n_layers: int | None = None,
    parallel: Parallel | None = None,
):
    """Append T tokens per row at cache slots index..index+T-1 (positions pos_B, pos_B+1, ..) and
    return (logits_BxTxV, cache, experts_BxTxLxK or None). Each token sees the valid cache slots and
    the tokens before it in this call: the sampler's decode step (T = 1). `n_layers` < cfg.n_layers
    runs only the first n_layers blocks, then the policy's own final norm and head (an early-exit
    drafter); it reads and writes the first n_layers layers of the same cache. Only the layers run
    are returned in the cache."""
    B, T = tokens_BxT.shape
    n_layers = cfg.n_layers if n_layers is None else n_layers
    index = jnp.asarray(index, jnp.int32)
    valid_BxS = lax.dynamic_update_slice(cache.valid_BxS, jnp.ones((B, T), bool), (0, index))
    positions_BxT = cache.pos_B[:, None] + jnp.arange(T, dtype=jnp.int32)
    logits_BxTxV, kv, moe = run_decoder(
        lparams,
        cfg,
        tokens_BxT,
        positions_BxT,
        valid_BxS,
        index,
        cache.kv[:n_layers],
        n_layers=n_layers,
        parallel=parallel,
    )
    return logits_BxTxV, LayerCache(kv, valid_BxS, cache.pos_B + T), _experts_BxTxLxK(moe)


def decode_rows(
    lparams,
    cfg: ModelConfig,
    token_B,
    cache: LayerCache,
    fill_B,
    advance_B,
    parallel: Parallel | None = None,
):
    """One token per row, each fed at its own cache slot fill_B (position pos_B): the slot engine's
    step, whose rows fill at different rates. Like `decode_layers` (T = 1) the keys/values are
    written in place first and attention then reads slots 0..fill_B of the row, so a row at fill
    level f gets the sampler's logits for a step at index f, and XLA copies no cache buffer.
    Positions advance by advance_B; a row with advance 0 still writes at fill_B (its caller never
    reads that slot). -> (logits_BxV, cache, experts_BxLxK or None)."""
    B = token_B.shape[0]
    fill_B = jnp.asarray(fill_B, jnp.int32)
    valid_BxS = cache.valid_BxS.at[jnp.arange(B), fill_B].set(True)
    logits_Bx1xV, kv, moe = run_decoder(
        lparams,
        cfg,
        token_B[:, None],
        cache.pos_B[:, None],
        valid_BxS,
        fill_B,
        cache.kv,
        parallel=parallel,
    )
    experts_BxLxK = None if moe is None else jnp.moveaxis(moe.experts_LxBxTxK[:, :, 0], 0, 1)
    return logits_Bx1xV[:, 0], LayerCache(kv, valid_BxS, cache.pos_B + advance_B), experts_BxLxK


def empty_window(cache: LayerCache, width: int, n_layers: int):
    """Zeroed window buffers, (k_BxKxWxHd, v_BxKxWxHd) for each of the first n_layers layers."""

    def zeros(buf):
        B, K, _, Hd = buf.shape
        return jnp.zeros((B, K, width, Hd), buf.dtype)

    return tuple((zeros(k), zeros(v)) for k, v in cache.kv[:n_layers])


def window_layers(
    lparams,
    cfg: ModelConfig,
    tokens_BxT,
    cache: LayerCache,
    fill_B,
    window,
    index,
    n_layers: int | None = None,
    parallel: Parallel | None = None,
):
    """Run T tokens per row at window slots index..index+T-1 (positions pos_B + index + t) without
    writing the cache -> (logits_BxTxV, window, experts_BxTxLxK or None).

    Each token sees the row's cache slots below fill_B that are valid, then the window slots up to
    its own (earlier calls' tokens and this call's). `window` is `empty_window(...)` or a previous
    call's result, for the first n_layers layers (default all)."""
    T = tokens_BxT.shape[1]
    n_layers = cfg.n_layers if n_layers is None else n_layers
    index = jnp.asarray(index, jnp.int32)
    S = cache.valid_BxS.shape[1]
    seen_BxS = cache.valid_BxS & (jnp.arange(S) < fill_B[:, None])
    positions_BxT = cache.pos_B[:, None] + index + jnp.arange(T, dtype=jnp.int32)
    kv_layers = [WindowKV(k, v, wk, wv) for (k, v), (wk, wv) in zip(cache.kv[:n_layers], window)]
    logits_BxTxV, kv_out, moe = run_decoder(
        lparams,
        cfg,
        tokens_BxT,
        positions_BxT,
        seen_BxS,
        index,
        kv_layers,
        n_layers=n_layers,
        parallel=parallel,
    )
    return logits_BxTxV, tuple((kv.win_k, kv.win_v) for kv in kv_out), _experts_BxTxLxK(moe)


def commit_window(cache: LayerCache, window, fill_B, advance_B) -> LayerCache:
    """Write every row's window at its cache slots fill_B .. fill_B + W - 1 and advance its position
    by advance_B. Only the first advance_B slots count: `window_layers` never reads past fill_B, and
    later windows overwrite the rest. The cache needs W slots of room past the last fill level."""
    write = jax.vmap(lambda buf_KxSxHd, w_KxWxHd, f: lax.dynamic_update_slice(buf_KxSxHd, w_KxWxHd, (0, f, 0)))
    kv = tuple(
        LayerKV(write(k, wk.astype(k.dtype), fill_B), write(v, wv.astype(v.dtype), fill_B))
        for (k, v), (wk, wv) in zip(cache.kv, window)
    )
    return LayerCache(kv, cache.valid_BxS, cache.pos_B + advance_B)
