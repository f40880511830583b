"""The decoder's one forward: embed, the layers in plan order, final norm, head.

    out, kv, moe = run_decoder(params, cfg, tokens_BxT, positions_BxT, key_valid_BxS, index, kv, ...)

`params` is stacked (`transformer.init_params`: a `lax.scan` over a leading layers axis; cache None or
a `StackedKV`) or per-layer (`layer_params`: the layers unrolled, `kv` a sequence of LayerKV, WindowKV
or GroupKV, and `n_layers` may run only the first layers, an early-exit drafter). Both walk the same
`layer_plan`; attention picks its code from the cache kind. MoE routing replay is an input
(`replay_LxBxTxK`) and the routing used an output (`MoEOut`). Sequences are LEFT-padded (a position id
counts the real tokens before it, padded keys are invisible, so a padded row's logits equal the
unpadded row's); logits are float32 whatever `cfg.dtype` is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from jaxrl.config import ModelConfig
from jaxrl.models import int8
from jaxrl.models.layers import AttnOptions, Block, RMSNorm
from jaxrl.models.moe import MoEBlock, MoESpec
from jaxrl.models.parallel import Parallel, residual, rows
from jaxrl.models.remat import remat_fn
from jaxrl.models.splash import KernelLayout


class MoEOut(NamedTuple):
    """What the MoE layers of one forward report; L here counts MoE layers only."""

    aux_loss: jax.Array  # scalar, mean over MoE layers
    z_loss: jax.Array  # scalar, mean over MoE layers
    dropped_frac: jax.Array  # scalar, mean over MoE layers
    experts_LxBxTxK: jax.Array  # int32: experts used (replayed ones when replaying)
    topk_LxBxTxK: jax.Array  # int32: the router's own top-k


class LayerSlot(NamedTuple):
    """Where one layer lives in the params tree, and what it is."""

    stack: str  # the params entry holding it: "blocks", or "tail" (MoE: dense layers after the last group)
    unit: int  # its index along that stack: a scanned unit is one layer, or one MoE group
    sub: str | None  # within an MoE group: "dense_j" or "moe"; None when the unit is the layer itself
    moe: bool


def layer_plan(cfg: ModelConfig) -> tuple[LayerSlot, ...]:
    """The decoder's layers in order. MoE: groups of moe_every layers whose last is MoE, then
    cfg.dense_tail_layers dense layers."""
    if not cfg.n_experts:
        return tuple(LayerSlot("blocks", i, None, False) for i in range(cfg.n_layers))
    plan = []
    for g in range(cfg.n_moe_layers):
        plan += [LayerSlot("blocks", g, f"dense_{j}", False) for j in range(cfg.moe_every - 1)]
        plan.append(LayerSlot("blocks", g, "moe", True))
    plan += [LayerSlot("tail", t, None, False) for t in range(cfg.dense_tail_layers)]
    return tuple(plan)


def stack_units(cfg: ModelConfig) -> tuple[tuple[str, tuple[LayerSlot, ...], int], ...]:
    """(stack, the layers of its first unit, number of units) for each params stack, in plan order:
    what one scan step over that stack runs."""
    plan = layer_plan(cfg)
    out = []
    for stack in dict.fromkeys(s.stack for s in plan):
        slots = [s for s in plan if s.stack == stack]
        out.append((stack, tuple(s for s in slots if s.unit == 0), slots[-1].unit + 1))
    return tuple(out)


def attn_options(cfg: ModelConfig, parallel: Parallel | None = None) -> AttnOptions:
    """The attention variant of `cfg`: every Block is built with it (MoE blocks read it from moe_spec).
    `parallel`: the run's split, which a Mosaic attention kernel (splash) runs under shard_map by."""
    llama3 = None
    if cfg.rope_scaling == "llama3":
        llama3 = (
            cfg.rope_scaling_factor,
            cfg.rope_low_freq_factor,
            cfg.rope_high_freq_factor,
            float(cfg.rope_original_max_len),
        )
    layout = None if parallel is None else KernelLayout(parallel.mesh, parallel.batch, parallel.sequence)
    return AttnOptions(cfg.qkv_bias, cfg.qk_norm, llama3, cfg.attention, cfg.decode_attention, cfg.decode_block, layout)


def moe_spec(cfg: ModelConfig, parallel: Parallel | None = None) -> MoESpec:
    """The MoE layers' spec: `cfg`'s MoE fields, plus the run's expert parallelism (None: one device)."""
    return MoESpec(
        cfg.n_experts,
        cfg.experts_per_token,
        cfg.expert_mlp_dim or cfg.mlp_dim,
        cfg.n_shared_experts,
        cfg.router,
        cfg.moe_dispatch,
        cfg.capacity_factor,
        norm_topk=cfg.router_norm_topk,
        shared_gate=cfg.shared_expert_gate,
        attn_opts=attn_options(cfg, parallel),
        expert_parallel=None if parallel is None else parallel.experts,
    )


def layer_module(cfg: ModelConfig, moe: bool, parallel: Parallel | None = None) -> nn.Module:
    """The Flax module of one layer (applied with that layer's params)."""
    dims = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
    dtype = jnp.dtype(cfg.dtype)
    if moe:
        return MoEBlock(*dims, cfg.rope_theta, cfg.norm_eps, moe_spec(cfg, parallel), dtype)
    return Block(*dims, cfg.mlp_dim, cfg.rope_theta, cfg.norm_eps, dtype, attn_options(cfg, parallel))


class _Call(NamedTuple):
    """What every layer of one forward reads."""

    positions_BxT: jax.Array
    key_valid_BxS: jax.Array
    index: jax.Array
    moe_mask_BxT: jax.Array | None


def _apply_layer(module: nn.Module, moe: bool, p, carry, replay_BxTxK, call: _Call):
    """One layer: carry (x_BxTxD, kv, layer) -> (carry, MoEStats or None)."""
    if moe:
        args = (replay_BxTxK, call.positions_BxT, call.key_valid_BxS, call.index, call.moe_mask_BxT)
    else:
        args = (call.positions_BxT, call.key_valid_BxS, call.index)
    return module.apply({"params": p}, carry, *args)


def _scanned(params, cfg: ModelConfig, x_BxTxD, kv, call: _Call, replay_LxBxTxK, remat: str, ep):
    """Every stack as one `lax.scan` over its units; the stacked cache (or None) rides in the carry
    with the layer counter, so each layer writes its slice of the one buffer in place."""
    carry, stats = (x_BxTxD, kv, jnp.zeros((), jnp.int32)), None
    for stack, slots, _ in stack_units(cfg):
        modules = tuple((s.sub, s.moe, layer_module(cfg, s.moe, ep)) for s in slots)

        def unit(carry, xs, modules=modules):
            p_unit, replay_BxTxK = xs
            moe_stats = None
            for sub, moe, module in modules:
                carry, st = _apply_layer(module, moe, p_unit if sub is None else p_unit[sub], carry, replay_BxTxK, call)
                carry = (residual(ep, carry[0]), *carry[1:])  # each device keeps its own rows (`models.parallel`)
                moe_stats = st if moe else moe_stats
            return carry, moe_stats

        replay = replay_LxBxTxK if stack == "blocks" else None
        carry, unit_stats = lax.scan(remat_fn(unit, remat), carry, (params[stack], replay))
        stats = unit_stats if unit_stats is not None else stats
    x_BxTxD, kv, _ = carry
    return x_BxTxD, kv, stats


def _unrolled(
    lparams, cfg: ModelConfig, x_BxTxD, kv_layers: Sequence[Any] | None, call: _Call, replay_LxBxTxK, n_layers, ep
):
    """The first n_layers layers one by one, layer i on its own params and kv_layers[i] (None: no cache)."""
    kv_out, stats = [None] * n_layers if kv_layers is None else list(kv_layers), []
    if len(kv_out) < n_layers:
        raise ValueError(f"run_decoder: kv has {len(kv_out)} per-layer entries, {n_layers} layers run")
    no_layer = jnp.zeros((), jnp.int32)  # each layer has its own cache entry: no stacked slice to pick
    for i, s in enumerate(layer_plan(cfg)[:n_layers]):
        p = lparams[s.stack][s.unit]
        replay_BxTxK = None if replay_LxBxTxK is None or not s.moe else replay_LxBxTxK[len(stats)]
        carry = (x_BxTxD, kv_out[i], no_layer)
        module = layer_module(cfg, s.moe, ep)
        (x_BxTxD, kv_out[i], _), st = _apply_layer(
            module, s.moe, p if s.sub is None else p[s.sub], carry, replay_BxTxK, call
        )
        if s.moe:
            stats.append(st)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *stats) if stats else None
    return x_BxTxD, tuple(kv_out), stacked


def run_decoder(
    params,
    cfg: ModelConfig,
    tokens_BxT,
    positions_BxT,
    key_valid_BxS,
    index: int | jax.Array = 0,
    kv: Any = None,
    *,
    n_layers: int | None = None,
    num_logits: int | None = None,
    replay_LxBxTxK=None,
    moe_mask_BxT=None,
    return_hidden: bool = False,
    remat: str = "none",
    parallel: Parallel | None = None,
) -> tuple[jax.Array, Any, MoEOut | None]:
    """tokens -> (logits_BxTxV float32, or with `return_hidden` the final-normed hidden states in
    cfg.dtype; kv updated; MoEOut or None for a dense model).

    The tokens occupy key slots index..index+T-1 of `kv` (this call's own tokens when kv is None);
    `key_valid_BxS` marks the real key slots. `num_logits`: only the last that many positions get
    the head. MoE: `replay_LxBxTxK` routes each MoE layer's tokens to these experts instead of the
    router's top-k; `moe_mask_BxT` marks the tokens the MoE losses average over and capacity
    dispatch serves (default: with stacked params the validity of the key slots the tokens occupy,
    with per-layer params every token); `parallel`: the experts' mesh axis (None: one device).
    `remat` (stacked only): the scanned units' rematerialisation (`models.remat`)."""
    index = jnp.asarray(index, jnp.int32)
    x_BxTxD = int8.embed(params["embedding"], tokens_BxT, jnp.dtype(cfg.dtype))
    per_layer = isinstance(params["blocks"], tuple)
    # Stacked params (scoring, training, prefill): the rows stay where the batch is, whatever splits the
    # weights, so fsdp gathers one layer's weights at a time inside the scan. Per-layer params (the decode
    # loops): the layout is left to XLA, which keeps split weights in place and reduces the few rows'
    # activations instead of holding a gathered copy of every layer for the whole loop.
    layout = None if per_layer else parallel
    x_BxTxD = residual(layout, x_BxTxD)
    if moe_mask_BxT is None and cfg.n_experts:
        T = tokens_BxT.shape[1]
        moe_mask_BxT = (
            jnp.ones(tokens_BxT.shape, bool) if per_layer else lax.dynamic_slice_in_dim(key_valid_BxS, index, T, axis=1)
        )
    call = _Call(positions_BxT, key_valid_BxS, index, moe_mask_BxT)
    if per_layer:
        n = cfg.n_layers if n_layers is None else n_layers
        x_BxTxD, kv, stats = _unrolled(params, cfg, x_BxTxD, kv, call, replay_LxBxTxK, n, parallel)
    else:
        if n_layers not in (None, cfg.n_layers):
            raise ValueError(f"run_decoder: n_layers={n_layers} needs per-layer params (`layer_params`)")
        x_BxTxD, kv, stats = _scanned(params, cfg, x_BxTxD, kv, call, replay_LxBxTxK, remat, parallel)
    return rows(layout, _head(params, cfg, x_BxTxD, num_logits, return_hidden)), kv, _moe_out(stats)


def _head(params, cfg: ModelConfig, x_BxTxD, num_logits: int | None, return_hidden: bool) -> jax.Array:
    if num_logits is not None:  # skip the (large-V) head on positions nobody reads
        x_BxTxD = x_BxTxD[:, -num_logits:]
    dtype = jnp.dtype(cfg.dtype)
    x_BxTxD = RMSNorm(cfg.d_model, cfg.norm_eps, dtype).apply({"params": params["final_norm"]}, x_BxTxD)
    assert isinstance(x_BxTxD, jax.Array)  # flax types apply's result as Any | (out, variables)
    if return_hidden:
        return x_BxTxD
    return int8.matmul("btd,dv->btv", x_BxTxD, head_weights(params, cfg), dtype, preferred_element_type=jnp.float32)


def _moe_out(stats: Any) -> MoEOut | None:
    """The stacked MoEStats of the MoE layers (or None) -> MoEOut."""
    if stats is None:
        return None
    means = (jnp.mean(stats.aux_loss), jnp.mean(stats.z_loss), jnp.mean(stats.dropped_frac))
    return MoEOut(*means, stats.experts_NxK, stats.topk_NxK)


def head_weights(params, cfg: ModelConfig) -> jax.Array | int8.Int8Weight:
    """The LM head head_DxV as stored (an array, or an `int8.Int8Weight`): `lm_head`, or the embedding's
    transpose when tied."""
    return int8.transpose(params["embedding"]) if cfg.tie_embeddings else params["lm_head"]


def layer_params(params, cfg: ModelConfig):
    """`params` with each stack (`blocks`, MoE `tail`) split into a tuple of per-unit trees: the
    per-layer layout `run_decoder` unrolls (one copy; do it outside the decode loop)."""
    out = dict(params)
    for stack, _, n in stack_units(cfg):
        out[stack] = tuple(jax.tree.map(lambda p, i=i: p[i], params[stack]) for i in range(n))
    return out


def positions_from_mask(mask_BxS: jax.Array) -> jax.Array:
    """Position id = number of real tokens before this one (left padding gets 0; it is masked anyway)."""
    return jnp.maximum(jnp.cumsum(mask_BxS.astype(jnp.int32), axis=-1) - 1, 0)
