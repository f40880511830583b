"""Decode loops: per-layer params and cache, and the read-only-cache window form of speculation.

`kv_cache.decode_step` runs the scanned layers over the stacked cache: each step, every layer
slices its weights out of the stacked params and its keys/values out of the stacked cache (and
XLA:CPU then transposes them for the attention dots). Inside a long decode loop those copies cost as
much as the matmuls themselves. The functions below do the same math with the layers unrolled over
per-layer params (sliced once, outside the loop) and per-layer kv-head-major cache buffers that
attention reads in place and `dynamic_update_slice` writes in place.

Three ways to add tokens:
  decode_layers   writes T tokens of every row at the same cache slots (the sampler's step);
  decode_rows     writes one token per row at that row's own slot (the slot engine's step);
  window_layers   leaves the cache untouched: the tokens' keys/values go to a small per-call window
                  that attention reads after the cache, and `commit_window` later writes each row's
                  window at that row's own fill level. Speculative rollouts use it: rows keep
                  different numbers of tokens, so their caches fill at different rates with no
                  holes, and the loop's branches never write (and so never copy) the cache.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl.config import ModelConfig
from jaxrl.models.kv_cache import Cache
from jaxrl.models.layers import Block, RMSNorm, WindowKV
from jaxrl.models.moe import MoEBlock
from jaxrl.models.moe_dispatch import ExpertParallel
from jaxrl.models.transformer import attn_options, moe_spec


class LayerCache(NamedTuple):
    """A `Cache` in decode-loop form: kv[i] = (k_BxKxSxHd, v_BxKxSxHd) of layer i."""

    kv: tuple
    valid_BxS: jax.Array
    pos_B: jax.Array


def layer_params(params, cfg: ModelConfig):
    """`params` with the stacked `blocks` split into a tuple of per-layer trees (one copy; do it
    outside the decode loop)."""

    def split(stacked, n):
        return tuple(jax.tree.map(lambda p, i=i: p[i], stacked) for i in range(n))

    if not cfg.n_experts:
        return dict(params, blocks=split(params["blocks"], cfg.n_layers))
    out = dict(params, blocks=split(params["blocks"], cfg.n_moe_layers))  # per group of moe_every layers
    if cfg.dense_tail_layers:
        out["tail"] = split(params["tail"], cfg.dense_tail_layers)
    return out


def to_layer_cache(cache: Cache) -> LayerCache:
    """Split and transpose a stacked cache into per-layer buffers (one copy of the cache)."""
    L = cache.k_LxBxSxKxHd.shape[0]
    kv = tuple((cache.k_LxBxSxKxHd[i].swapaxes(1, 2), cache.v_LxBxSxKxHd[i].swapaxes(1, 2)) for i in range(L))
    return LayerCache(kv, cache.valid_BxS, cache.pos_B)


def decode_step_layers(lparams, cfg: ModelConfig, token_B, cache: LayerCache, index):
    """`decode_step` on per-layer params (`layer_params`) and a `LayerCache`: same logits."""
    logits_BxV, cache, _ = decode_step_layers_routed(lparams, cfg, token_B, cache, index)
    return logits_BxV, cache


def decode_step_layers_routed(
    lparams, cfg: ModelConfig, token_B, cache: LayerCache, index, expert_parallel: ExpertParallel | None = None
):
    """`decode_step_layers` plus the experts this token used, experts_BxLxK (None for a dense model)."""
    logits_Bx1xV, cache, experts_Bx1xLxK = decode_layers(
        lparams, cfg, token_B[:, None], cache, index, expert_parallel=expert_parallel
    )
    return logits_Bx1xV[:, 0], cache, None if experts_Bx1xLxK is None else experts_Bx1xLxK[:, 0]


def _run_layers(
    lparams,
    cfg: ModelConfig,
    tokens_BxT,
    kv_layers,
    positions_BxT,
    key_valid_BxS,
    index,
    n_layers: int,
    expert_parallel: ExpertParallel | None = None,
):
    """Embed, the first n_layers blocks (each with its own kv entry), final norm, head ->
    (logits_BxTxV, kv entries, experts_BxTxLxK or None). `expert_parallel` (MoE): the experts' mesh
    axis (`transformer.moe_spec`); every function below passes it on (None: one device)."""
    dtype = jnp.dtype(cfg.dtype)
    D, (B, T) = cfg.d_model, tokens_BxT.shape
    x_BxTxD = jnp.take(lparams["embedding"], tokens_BxT.astype(jnp.int32), axis=0).astype(dtype)
    block = Block(D, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim, cfg.rope_theta, cfg.norm_eps, dtype)
    block = block.clone(attn_opts=attn_options(cfg))  # MoEBlock gets its attention options from moe_spec(cfg)
    layer = jnp.zeros((), jnp.int32)  # unused: each layer gets its own buffers
    kv_out, experts = list(kv_layers), []
    if cfg.n_experts:  # groups of moe_every-1 dense layers then an MoE layer (then the tail), as scanned
        spec = moe_spec(cfg, expert_parallel)
        moe_block = MoEBlock(D, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_theta, cfg.norm_eps, spec, dtype)
        live_BxT = jnp.ones((B, T), bool)
        grouped = cfg.n_layers - cfg.dense_tail_layers  # layers in groups; the tail's dense layers follow
        for i in range(n_layers):
            g, j = divmod(i, cfg.moe_every)
            if i >= grouped or j < cfg.moe_every - 1:
                p_l = lparams["tail"][i - grouped] if i >= grouped else lparams["blocks"][g][f"dense_{j}"]
                (x_BxTxD, kv_out[i], _), _ = block.apply(
                    {"params": p_l}, (x_BxTxD, kv_out[i], layer), positions_BxT, key_valid_BxS, index
                )
            else:
                p_g = lparams["blocks"][g]
                (x_BxTxD, kv_out[i], _), st = moe_block.apply(
                    {"params": p_g["moe"]},
                    (x_BxTxD, kv_out[i], layer),
                    None,
                    positions_BxT,
                    key_valid_BxS,
                    index,
                    live_BxT,
                )
                experts.append(st.experts_NxK)  # pyright: ignore[reportAttributeAccessIssue]  (flax: apply's result typed Any | (Any, variables))
    else:
        for i in range(n_layers):
            (x_BxTxD, kv_out[i], _), _ = block.apply(
                {"params": lparams["blocks"][i]}, (x_BxTxD, kv_out[i], layer), positions_BxT, key_valid_BxS, index
            )
    x_BxTxD = RMSNorm(D, cfg.norm_eps, dtype).apply({"params": lparams["final_norm"]}, x_BxTxD)
    head_DxV = lparams["embedding"].T if cfg.tie_embeddings else lparams["lm_head"]
    logits_BxTxV = jnp.einsum("btd,dv->btv", x_BxTxD, head_DxV.astype(dtype), preferred_element_type=jnp.float32)
    return logits_BxTxV, kv_out, jnp.stack(experts, axis=2) if experts else None


def decode_layers(
    lparams,
    cfg: ModelConfig,
    tokens_BxT,
    cache: LayerCache,
    index,
    n_layers: int | None = None,
    expert_parallel: ExpertParallel | None = None,
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
    logits_BxTxV, kv_out, experts = _run_layers(
        lparams, cfg, tokens_BxT, cache.kv[:n_layers], positions_BxT, valid_BxS, index, n_layers, expert_parallel
    )
    return logits_BxTxV, LayerCache(tuple(kv_out), valid_BxS, cache.pos_B + T), experts


def decode_rows(
    lparams,
    cfg: ModelConfig,
    token_B,
    cache: LayerCache,
    fill_B,
    advance_B,
    expert_parallel: ExpertParallel | None = None,
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
    logits_Bx1xV, kv_out, experts_Bx1xLxK = _run_layers(
        lparams, cfg, token_B[:, None], cache.kv, cache.pos_B[:, None], valid_BxS, fill_B, cfg.n_layers, expert_parallel
    )
    experts_BxLxK = None if experts_Bx1xLxK is None else experts_Bx1xLxK[:, 0]
    return logits_Bx1xV[:, 0], LayerCache(tuple(kv_out), valid_BxS, cache.pos_B + advance_B), experts_BxLxK


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
    expert_parallel: ExpertParallel | None = None,
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
    logits_BxTxV, kv_out, experts = _run_layers(
        lparams, cfg, tokens_BxT, kv_layers, positions_BxT, seen_BxS, index, n_layers, expert_parallel
    )
    return logits_BxTxV, tuple((kv.win_k, kv.win_v) for kv in kv_out), experts


def commit_window(cache: LayerCache, window, fill_B, advance_B) -> LayerCache:
    """Write every row's window at its cache slots fill_B .. fill_B + W - 1 and advance its position
    by advance_B. Only the first advance_B slots count: `window_layers` never reads past fill_B, and
    later windows overwrite the rest. The cache needs W slots of room past the last fill level."""
    write = jax.vmap(lambda buf_KxSxHd, w_KxWxHd, f: lax.dynamic_update_slice(buf_KxSxHd, w_KxWxHd, (0, f, 0)))
    kv = tuple(
        (write(k, wk.astype(k.dtype), fill_B), write(v, wv.astype(v.dtype), fill_B))
        for (k, v), (wk, wv) in zip(cache.kv, window)
    )
    return LayerCache(kv, cache.valid_BxS, cache.pos_B + advance_B)
