"""Llama/Qwen-style decoder: its parameters and full-sequence scoring, as pure functions.

    params = init_params(cfg, rng)                       # plain pytree of float32 arrays
    logits_BxSxV = forward(params, cfg, tokens_BxS, mask_BxS)
    logp_BxT, entropy_BxT = token_logprobs(params, cfg, prompt_BxP, prompt_mask_BxP,
                                           tokens_BxT, completion_mask_BxT, temperature)

All of them run `decoder.run_decoder`, the one forward that prefill (`kv_cache`) and the decode
loops (`decode`, `group_decode`) run too. MoE (cfg.n_experts > 0, see models/moe.py): the scanned
unit is a group of moe_every layers whose last is MoE, then cfg.dense_tail_layers dense layers
(`tail`); `token_logprobs` takes the rollout's routing to replay and, with `return_moe`, also
returns the forward's `MoEOut` (experts used, MoE losses).

Sequences are LEFT-padded: `mask` is 1 on real tokens and padded keys are invisible. Logits are
float32 whatever `cfg.dtype` is. Every function takes `cfg` static.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrl.config import ModelConfig
from jaxrl.models.decoder import (
    MoEOut,
    head_weights,
    layer_module,
    positions_from_mask,
    run_decoder,
    stack_units,
)
from jaxrl.models.layers import ScaledParam, init_value
from jaxrl.models.logprobs import chunked_token_logprobs, logprob_and_entropy
from jaxrl.models.parallel import Parallel

__all__ = [
    "MoEOut",
    "abstract_params",
    "forward",
    "head_weights",
    "init_params",
    "param_logical_axes",
    "positions_from_mask",
    "rollout_params",
]

LOGICAL_AXIS_NAMES = ("layers", "embed", "mlp", "heads", "kv_heads", "head_dim", "vocab", "expert")


# ---------------------------------------------------------------------------------------------
# Parameters


def _is_box(x) -> bool:
    return isinstance(x, ScaledParam)


def _box(shape, axes, std: float | None) -> ScaledParam:
    return ScaledParam(jax.ShapeDtypeStruct(tuple(shape), jnp.float32), tuple(axes), std=std)


def _layer_boxes(cfg: ModelConfig, moe: bool):
    """One layer's abstract boxed params (shapes, logical axes, init std), from its module."""
    D = cfg.d_model
    carry = (jnp.zeros((1, 1, D)), None, jnp.zeros((), jnp.int32))
    pos_1x1, live_1x1 = jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), bool)
    args = (None, pos_1x1, live_1x1, 0, live_1x1) if moe else (pos_1x1, live_1x1, 0)
    init = functools.partial(layer_module(cfg, moe).init, jax.random.PRNGKey(0), carry, *args)
    return jax.eval_shape(init)["params"]


def _abstract_boxed(cfg: ModelConfig):
    """The params tree of `cfg` as boxes: each stack's unit (a layer, or an MoE group of them) with
    a leading `layers` axis of its number of units, plus the embedding, final norm and head."""
    D, V = cfg.d_model, cfg.vocab_size
    # std D^-1/2 keeps tied-head logits O(1) at init (the normed hidden has entries O(1)).
    tree = {
        "embedding": _box((V, D), ("vocab", "embed"), D**-0.5),
        "final_norm": {"scale": _box((D,), ("embed",), None)},
    }
    if not cfg.tie_embeddings:
        tree["lm_head"] = _box((D, V), ("embed", "vocab"), D**-0.5)
    for stack, slots, n_units in stack_units(cfg):
        unit = {}
        for slot in slots:
            boxes = _layer_boxes(cfg, slot.moe)
            unit = boxes if slot.sub is None else {**unit, slot.sub: boxes}

        def stacked(box: ScaledParam, n=n_units) -> ScaledParam:
            value = jax.ShapeDtypeStruct((n,) + box.value.shape, box.value.dtype)
            return box.replace(value=value, names=("layers",) + tuple(box.names))

        tree[stack] = jax.tree.map(stacked, unit, is_leaf=_is_box)
    return tree


@functools.partial(jax.jit, static_argnames="cfg")
def init_params(cfg: ModelConfig, rng: jax.Array):
    """A plain nested dict of float32 arrays.

    Draws all noise in ONE truncated-normal call and scales each parameter by its recorded std
    (the distributions each layer module's own init would draw, different values): on CPU, compiling one
    generator per parameter would make init slow to compile.
    """

    boxes, treedef = jax.tree.flatten(_abstract_boxed(cfg), is_leaf=_is_box)
    sizes = [math.prod(b.value.shape) for b in boxes]
    noise = init_value(rng, (sum(sizes),), 1.0)
    leaves, offset = [], 0
    for box, size in zip(boxes, sizes):
        shape = box.value.shape
        leaves.append(
            jnp.ones(shape, jnp.float32) if box.std is None else box.std * noise[offset : offset + size].reshape(shape)
        )
        offset += size
    return jax.tree.unflatten(treedef, leaves)


def abstract_params(cfg: ModelConfig, shardings=None):
    """The pytree of `init_params(cfg, ...)` as jax.ShapeDtypeStructs (nothing computed), laid out by
    `shardings` (a matching pytree of shardings) if given: what a checkpoint restores into."""
    abstract = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    if shardings is None:
        return abstract
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def param_logical_axes(cfg: ModelConfig):
    """The pytree matching `init_params` whose leaves are PartitionSpecs of logical axis names."""
    return nn.get_partition_spec(_abstract_boxed(cfg))


# Leaves every forward reads only as `w.astype(cfg.dtype)` (projections, their biases, MLP and expert
# matrices, the shared-expert gate, the embedding taken then cast, the head): casting them once ahead
# changes no value. Norm scales multiply float32 activations and the MoE router runs in float32.
_CAST_AT_USE = frozenset({"q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "gate", "up", "down", "shared_gate"})
_CAST_AT_USE |= {"embedding", "lm_head"}
_FLOAT32_AT_USE = frozenset({"scale", "router"})


def rollout_params(params, cfg: ModelConfig):
    """`params` (stacked or per-layer) with every leaf that a forward reads only after
    `.astype(cfg.dtype)` stored in cfg.dtype, the float32-read ones (norm scales, MoE routers) kept:
    the same numbers at half the bytes a bfloat16 decode step reads. Do it once per policy version
    (the update keeps its float32 masters). float32 models: `params` itself, untouched."""
    dtype = jnp.dtype(cfg.dtype)
    if dtype == jnp.float32:
        return params

    def one(path, w):
        name = getattr(path[-1], "key", None)
        if name in _CAST_AT_USE:
            return w.astype(dtype)
        if name in _FLOAT32_AT_USE:
            return w
        raise ValueError(f"rollout_params: parameter {jax.tree_util.keystr(path)} has no known use; list it")

    return jax.tree_util.tree_map_with_path(one, params)


# ---------------------------------------------------------------------------------------------
# Full-sequence scoring


@functools.partial(jax.jit, static_argnames=("cfg", "parallel"))
def forward(
    params, cfg: ModelConfig, tokens_BxS: jax.Array, mask_BxS: jax.Array, parallel: Parallel | None = None
) -> jax.Array:
    """Causal logits_BxSxV (float32) over a left-padded batch; padded keys are invisible."""
    mask_BxS = mask_BxS.astype(bool)
    logits_BxSxV, _, _ = run_decoder(
        params, cfg, tokens_BxS, positions_from_mask(mask_BxS), mask_BxS, parallel=parallel
    )
    return logits_BxSxV


@functools.partial(jax.jit, static_argnames=("cfg", "logits_chunk", "remat", "parallel", "return_moe"))
def token_logprobs(
    params,
    cfg: ModelConfig,
    prompt_BxP,
    prompt_mask_BxP,
    tokens_BxT,
    completion_mask_BxT,
    temperature,
    replay_BxSxLxK=None,
    logits_chunk: int = 0,
    remat: str = "none",
    parallel: Parallel | None = None,
    return_moe: bool = False,
):
    """(logp_BxT, entropy_BxT) of softmax(logits / temperature) at each completion position, and
    with `return_moe` the forward's MoEOut as a third value (None for a dense model; routing over
    S = P + T).

    One forward over concat(prompt, completion). Completion tokens are all treated as real keys:
    tokens after EOS only influence positions after themselves, which the caller masks with
    `completion_mask_BxT` (used here only as the MoE losses' token mask). Requires P >= 1.
    `replay_BxSxLxK` (MoE): route every slot to these experts (the sampler's `routing_BxSxLxK`)
    instead of the router's top-k. `logits_chunk` > 0: the head and log-softmax run on that many
    (row, position) pairs at a time (`models.logprobs`: same values, far less memory in the
    backward); `remat`: the blocks' rematerialisation (`models.remat`). `parallel` (MoE): the
    experts' mesh axis (`moe_dispatch.Parallel`), the same the rollout is given; None: one device.
    """
    T = tokens_BxT.shape[1]
    tokens_BxS = jnp.concatenate([prompt_BxP, tokens_BxT], axis=1).astype(jnp.int32)
    mask_BxS = jnp.concatenate([prompt_mask_BxP.astype(bool), jnp.ones(tokens_BxT.shape, bool)], axis=1)
    replay_LxBxSxK, live_BxS = None, None  # MoE only
    if cfg.n_experts:
        live_BxS = jnp.concatenate([prompt_mask_BxP.astype(bool), completion_mask_BxT > 0], axis=1)
        if replay_BxSxLxK is not None:
            # A row's last live token was never fed to the rollout's model (no token follows it), so
            # nothing recorded its experts: -1 there lets the update's router choose, as without replay.
            live_BxT = (completion_mask_BxT > 0).astype(jnp.int32)
            later_BxT = jnp.flip(jnp.cumsum(jnp.flip(live_BxT, 1), 1), 1) - live_BxT > 0  # a live token after t
            fed_BxS = jnp.concatenate([jnp.ones(prompt_mask_BxP.shape, bool), later_BxT], axis=1)
            replay_BxSxLxK = jnp.where(fed_BxS[:, :, None, None], replay_BxSxLxK, -1)
            replay_LxBxSxK = jnp.transpose(replay_BxSxLxK, (2, 0, 1, 3))
    # The logits predicting completion token t sit at slot P-1+t: the last T+1 slots minus the final one.
    out_BxTxX, _, moe = run_decoder(
        params,
        cfg,
        tokens_BxS,
        positions_from_mask(mask_BxS),
        mask_BxS,
        num_logits=T + 1,
        replay_LxBxTxK=replay_LxBxSxK,
        moe_mask_BxT=live_BxS,
        return_hidden=logits_chunk > 0,
        remat=remat,
        parallel=parallel,
    )
    if logits_chunk > 0:  # out = final hidden states; the head runs chunk by chunk
        logp_BxT, entropy_BxT = chunked_token_logprobs(
            out_BxTxX[:, :-1], head_weights(params, cfg), tokens_BxT, temperature, logits_chunk, parallel
        )
    else:
        logp_BxT, entropy_BxT = logprob_and_entropy(out_BxTxX[:, :-1], tokens_BxT, temperature)
    return (logp_BxT, entropy_BxT, moe) if return_moe else (logp_BxT, entropy_BxT)
