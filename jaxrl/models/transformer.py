"""Llama/Qwen-style decoder and its pure functional API.

    params = init_params(cfg, rng)                       # plain pytree of float32 arrays
    logits_BxSxV = forward(params, cfg, tokens_BxS, mask_BxS)
    logp_BxT, entropy_BxT = token_logprobs(params, cfg, prompt_BxP, prompt_mask_BxP,
                                           tokens_BxT, completion_mask_BxT, temperature)
    # jaxrl.models.kv_cache: the stacked cache, prefill, one decode step
    cache = init_cache(cfg, batch, max_len)
    last_logits_BxV, cache = prefill(params, cfg, tokens_BxP, mask_BxP, cache)
    logits_BxV, cache = decode_step(params, cfg, token_B, cache, index)

    # The same decode step for long loops (what the sampler runs): layers unrolled over per-layer
    # params and per-layer cache buffers, so no step copies a weight slice or a cache slice.
    lparams, lcache = layer_params(params, cfg), to_layer_cache(cache)
    logits_BxV, lcache = decode_step_layers(lparams, cfg, token_B, lcache, index)

MoE (cfg.n_experts > 0, see models/moe.py): the scanned unit is a group of moe_every layers whose
last is MoE, then cfg.dense_tail_layers dense layers (scanned as `tail`); `token_logprobs` takes the
rollout's routing to replay, and `token_logprobs_moe`, `prefill_routed` and `decode_step_layers_routed`
also return the experts used / the MoE losses.

Sequences are LEFT-padded: `mask` is 1 on real tokens, a token's position id is the number of real
tokens before it, and padded keys are invisible, so a padded row's real-token logits equal those of
the unpadded row. Logits are float32 whatever `cfg.dtype` is. Every function takes `cfg` static.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from jaxrl.config import ModelConfig
from jaxrl.models.layers import KV, AttnOptions, Block, RMSNorm, ScaledParam, init_value, logical_param
from jaxrl.models.logprobs import chunked_token_logprobs, logprob_and_entropy
from jaxrl.models.moe import BlockGroup, MoESpec
from jaxrl.models.moe_dispatch import ExpertParallel
from jaxrl.models.remat import remat_block

LOGICAL_AXIS_NAMES = ("layers", "embed", "mlp", "heads", "kv_heads", "head_dim", "vocab", "expert")


class MoEOut(NamedTuple):
    """What the MoE layers of one forward report; L here counts MoE layers only."""

    aux_loss: jax.Array  # scalar, mean over MoE layers
    z_loss: jax.Array  # scalar, mean over MoE layers
    dropped_frac: jax.Array  # scalar, mean over MoE layers
    experts_LxBxTxK: jax.Array  # int32: experts used (replayed ones when replaying)
    topk_LxBxTxK: jax.Array  # int32: the router's own top-k


def moe_spec(cfg: ModelConfig, expert_parallel: ExpertParallel | None = None) -> MoESpec:
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
        attn_opts=attn_options(cfg),
        expert_parallel=expert_parallel,
    )


def attn_options(cfg: ModelConfig) -> AttnOptions:
    """The attention variant of `cfg`: every Block must be built with it (MoE blocks read it from moe_spec)."""
    llama3 = None
    if cfg.rope_scaling == "llama3":
        llama3 = (
            cfg.rope_scaling_factor,
            cfg.rope_low_freq_factor,
            cfg.rope_high_freq_factor,
            float(cfg.rope_original_max_len),
        )
    return AttnOptions(cfg.qkv_bias, cfg.qk_norm, llama3)


class Transformer(nn.Module):
    """tokens -> logits. With `kv` given, this call's keys/values are written into the cache at slot
    `index` and attention reads the whole cache; without it, attention reads this call's tokens."""

    cfg: ModelConfig
    remat: str = "none"  # rematerialisation of each scanned block in the backward: a key of REMAT_POLICIES
    expert_parallel: ExpertParallel | None = None  # MoE: the experts' mesh axis (`moe_spec`); None: one device

    @nn.compact
    def __call__(
        self,
        tokens_BxT,
        positions_BxT,
        key_valid_BxS,
        index=0,
        kv: KV | None = None,
        num_logits: int | None = None,
        replay_LxBxTxK=None,
        moe_mask_BxT=None,
        return_hidden=False,
    ):
        """-> (logits_BxTxV, kv, MoEOut or None). `moe_mask_BxT` (MoE only) marks the tokens the MoE
        losses average over; default: the valid key slots this call's tokens occupy. With
        `return_hidden`, the final-normed hidden states (in cfg.dtype) instead of the logits: the
        caller applies the head (`lm_head`, see `head_weights`), e.g. chunk by chunk."""
        cfg = self.cfg
        dtype = jnp.dtype(cfg.dtype)
        V, D = cfg.vocab_size, cfg.d_model
        # std D^-1/2 keeps tied-head logits O(1) at init (the normed hidden has entries O(1)).
        embed_VxD = logical_param(self, "embedding", (V, D), ("vocab", "embed"), D**-0.5)
        x_BxTxD = jnp.take(embed_VxD, tokens_BxT, axis=0).astype(dtype)
        index = jnp.asarray(index, jnp.int32)
        moe = None
        if cfg.n_experts:
            x_BxTxD, kv, moe = self._moe_blocks(
                x_BxTxD, kv, positions_BxT, key_valid_BxS, index, replay_LxBxTxK, moe_mask_BxT, dtype
            )
        else:
            x_BxTxD, kv = self._dense_blocks(x_BxTxD, kv, positions_BxT, key_valid_BxS, index, dtype)
        if num_logits is not None:  # skip the (large-V) head on positions nobody reads
            x_BxTxD = x_BxTxD[:, -num_logits:]
        x_BxTxD = RMSNorm(D, cfg.norm_eps, dtype, name="final_norm")(x_BxTxD)
        if return_hidden:
            return x_BxTxD, kv, moe
        if cfg.tie_embeddings:
            head_DxV = embed_VxD.T
        else:
            head_DxV = logical_param(self, "lm_head", (D, V), ("embed", "vocab"), D**-0.5)
        logits_BxTxV = jnp.einsum("btd,dv->btv", x_BxTxD, head_DxV.astype(dtype), preferred_element_type=jnp.float32)
        return logits_BxTxV, kv, moe

    def _dense_blocks(
        self, x_BxTxD, kv, positions_BxT, key_valid_BxS, index, dtype, n_layers=None, first=0, name="blocks"
    ):
        """n_layers (default all) scanned dense blocks, the first writing cache layer `first`."""
        cfg, D = self.cfg, self.cfg.d_model
        # Scanned layers: compile time and init cost do not grow with L; params get a leading
        # `layers` axis.
        blocks = nn.scan(
            remat_block(Block, self.remat),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),  # pyright: ignore[reportArgumentType]  (flax: in_axes unannotated, inferred int)
            length=n_layers or cfg.n_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )(
            D,
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.head_dim,
            cfg.mlp_dim,
            cfg.rope_theta,
            cfg.norm_eps,
            dtype,
            attn_options(cfg),
            name=name,
        )
        (x_BxTxD, kv, _), _ = blocks((x_BxTxD, kv, jnp.asarray(first, jnp.int32)), positions_BxT, key_valid_BxS, index)
        return x_BxTxD, kv

    def _moe_blocks(self, x_BxTxD, kv, positions_BxT, key_valid_BxS, index, replay_LxBxTxK, moe_mask_BxT, dtype):
        """Scan over n_layers/moe_every groups (moe_every-1 dense blocks, then an MoE block); the
        replayed experts are scanned in, each group's MoE stats scanned out."""
        cfg = self.cfg
        T = x_BxTxD.shape[1]
        if moe_mask_BxT is None:
            moe_mask_BxT = lax.dynamic_slice_in_dim(key_valid_BxS, index, T, axis=1)
        in_axes = (nn.broadcast if replay_LxBxTxK is None else 0,) + (nn.broadcast,) * 4
        groups = nn.scan(
            remat_block(BlockGroup, self.remat),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=in_axes,  # pyright: ignore[reportArgumentType]  (flax: in_axes unannotated, inferred int)
            length=cfg.n_moe_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )(
            cfg.d_model,
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.head_dim,
            cfg.mlp_dim,
            cfg.rope_theta,
            cfg.norm_eps,
            moe_spec(cfg, self.expert_parallel),
            cfg.moe_every - 1,
            dtype,
            name="blocks",
        )
        (x_BxTxD, kv, _), st = groups(
            (x_BxTxD, kv, jnp.zeros((), jnp.int32)), replay_LxBxTxK, positions_BxT, key_valid_BxS, index, moe_mask_BxT
        )
        if cfg.dense_tail_layers:  # dense layers after the last group (params `tail`, one per layer)
            x_BxTxD, kv = self._dense_blocks(
                x_BxTxD,
                kv,
                positions_BxT,
                key_valid_BxS,
                index,
                dtype,
                cfg.dense_tail_layers,
                cfg.n_layers - cfg.dense_tail_layers,
                "tail",
            )
        moe = MoEOut(jnp.mean(st.aux_loss), jnp.mean(st.z_loss), jnp.mean(st.dropped_frac), st.experts_NxK, st.topk_NxK)
        return x_BxTxD, kv, moe


def head_weights(params, cfg: ModelConfig) -> jax.Array:
    """The LM head head_DxV (float32, as stored): `lm_head`, or the embedding's transpose when tied."""
    return params["embedding"].T if cfg.tie_embeddings else params["lm_head"]


def _apply(
    params,
    cfg,
    tokens_BxT,
    positions_BxT,
    key_valid_BxS,
    index: int | jax.Array = 0,
    kv=None,
    num_logits: int | None = None,
    replay_LxBxTxK=None,
    moe_mask_BxT=None,
    return_hidden=False,
    remat="none",
    expert_parallel: ExpertParallel | None = None,
) -> tuple[jax.Array, Any, MoEOut | None]:
    """-> (logits_BxTxV, or with return_hidden the normed hidden states, kv (as passed in: the
    stacked (k, v) or None), MoEOut or None)."""
    return Transformer(cfg, remat, expert_parallel).apply(  # pyright: ignore[reportReturnType]  (flax: apply has no mutable=False overload)
        {"params": params},
        tokens_BxT,
        positions_BxT,
        key_valid_BxS,
        index,
        kv,
        num_logits,
        replay_LxBxTxK,
        moe_mask_BxT,
        return_hidden,
    )


def positions_from_mask(mask_BxS: jax.Array) -> jax.Array:
    """Position id = number of real tokens before this one (left padding gets 0; it is masked anyway)."""
    return jnp.maximum(jnp.cumsum(mask_BxS.astype(jnp.int32), axis=-1) - 1, 0)


# ---------------------------------------------------------------------------------------------
# Parameters


def _boxed_init(cfg: ModelConfig, rng: jax.Array):
    tokens_1x1 = jnp.zeros((1, 1), jnp.int32)
    return Transformer(cfg).init(rng, tokens_1x1, tokens_1x1, jnp.ones((1, 1), bool))["params"]


def _abstract_boxed(cfg: ModelConfig):
    return jax.eval_shape(functools.partial(_boxed_init, cfg), jax.random.PRNGKey(0))


@functools.partial(jax.jit, static_argnames="cfg")
def init_params(cfg: ModelConfig, rng: jax.Array):
    """A plain nested dict of float32 arrays.

    Draws all noise in ONE truncated-normal call and scales each parameter by its recorded std
    (same distributions as `Transformer(cfg).init`, different values): on CPU, compiling one
    generator per parameter costs ~1-2 s each and made init the slowest thing in the test suite.
    """

    def is_box(x):
        return isinstance(x, ScaledParam)

    boxes, treedef = jax.tree.flatten(_abstract_boxed(cfg), is_leaf=is_box)
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


def param_logical_axes(cfg: ModelConfig):
    """The pytree matching `init_params` whose leaves are PartitionSpecs of logical axis names."""
    return nn.get_partition_spec(_abstract_boxed(cfg))


# ---------------------------------------------------------------------------------------------
# Full-sequence scoring


@functools.partial(jax.jit, static_argnames=("cfg", "expert_parallel"))
def forward(
    params, cfg: ModelConfig, tokens_BxS: jax.Array, mask_BxS: jax.Array, expert_parallel: ExpertParallel | None = None
) -> jax.Array:
    """Causal logits_BxSxV (float32) over a left-padded batch; padded keys are invisible."""
    positions_BxS = positions_from_mask(mask_BxS)
    logits_BxSxV, _, _ = _apply(
        params, cfg, tokens_BxS, positions_BxS, mask_BxS.astype(bool), expert_parallel=expert_parallel
    )
    return logits_BxSxV


@functools.partial(jax.jit, static_argnames=("cfg", "logits_chunk", "remat", "expert_parallel"))
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
    expert_parallel: ExpertParallel | None = None,
):
    """Log-prob and entropy of softmax(logits / temperature) at each completion position.

    One forward over concat(prompt, completion). Completion tokens are all treated as real keys:
    tokens after EOS only influence positions after themselves, which the caller masks with
    `completion_mask_BxT` (used here only as the MoE losses' token mask). Requires P >= 1.
    `replay_BxSxLxK` (MoE; S = P + T): route every slot to these experts (the sampler's
    `routing_BxSxLxK`) instead of the router's top-k. `logits_chunk` > 0: the head and log-softmax
    run on that many (row, position) pairs at a time (`models.logprobs`: same values, far less memory in the
    backward); `remat`: the blocks' rematerialisation (`models.remat`). `expert_parallel` (MoE): the
    experts' mesh axis (`moe_dispatch.ExpertParallel`), the same the rollout is given; None: one device.
    """
    logp_BxT, entropy_BxT, _ = token_logprobs_moe(
        params,
        cfg,
        prompt_BxP,
        prompt_mask_BxP,
        tokens_BxT,
        completion_mask_BxT,
        temperature,
        replay_BxSxLxK,
        logits_chunk,
        remat,
        expert_parallel,
    )
    return logp_BxT, entropy_BxT


@functools.partial(jax.jit, static_argnames=("cfg", "logits_chunk", "remat", "expert_parallel"))
def token_logprobs_moe(
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
    expert_parallel: ExpertParallel | None = None,
):
    """`token_logprobs` plus the forward's MoEOut (None for a dense model); routing is over S = P + T."""
    T = tokens_BxT.shape[1]
    tokens_BxS = jnp.concatenate([prompt_BxP, tokens_BxT], axis=1).astype(jnp.int32)
    mask_BxS = jnp.concatenate([prompt_mask_BxP.astype(bool), jnp.ones(tokens_BxT.shape, bool)], axis=1)
    replay_LxBxSxK, live_BxS = None, None  # MoE only
    if cfg.n_experts:
        live_BxS = jnp.concatenate([prompt_mask_BxP.astype(bool), completion_mask_BxT > 0], axis=1)
        replay_LxBxSxK = None if replay_BxSxLxK is None else jnp.transpose(replay_BxSxLxK, (2, 0, 1, 3))
    # The logits predicting completion token t sit at slot P-1+t: the last T+1 slots minus the final one.
    out_BxTxX, _, moe = _apply(
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
        expert_parallel=expert_parallel,
    )
    if logits_chunk > 0:  # out = final hidden states; the head runs chunk by chunk
        logp_BxT, entropy_BxT = chunked_token_logprobs(
            out_BxTxX[:, :-1], head_weights(params, cfg), tokens_BxT, temperature, logits_chunk
        )
    else:
        logp_BxT, entropy_BxT = logprob_and_entropy(out_BxTxX[:, :-1], tokens_BxT, temperature)
    return logp_BxT, entropy_BxT, moe
