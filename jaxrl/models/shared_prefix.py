"""Scoring a GRPO batch whose rows come in groups sharing one prompt: each prompt forwarded once.

    logp_BxT, entropy_BxT = token_logprobs_shared(params, cfg, prompt_BxP, prompt_mask_BxP, tokens_BxT,
                                                  temperature, group_size=G)

Rows g*G .. g*G+G-1 must hold the SAME left-padded prompt (tokens and mask): the caller guarantees it
(the static sampler's batches, `jaxrl.sources.scoring.score_groups`); nothing here checks it. Same
results as `transformer.token_logprobs` (float32 reordering aside) at 1/G of the prompt's layer work:
the B/G prompts are prefilled once into a P-slot cache, which is repeated to the B rows and extended by
the completion tokens as a multi-token decode step; gradients reach the prompt's keys/values through the
repeat. Dense models only: MoE routing with capacity limits depends on which tokens share a forward, so
MoE callers use the one-pass forward (`jaxrl.train.steps.make_logp_fn`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl.config import ModelConfig
from jaxrl.models.cache_kinds import StackedKV
from jaxrl.models.decoder import head_weights, positions_from_mask, run_decoder
from jaxrl.models.logprobs import chunked_token_logprobs, logprob_and_entropy
from jaxrl.models.parallel import Parallel, rows


def group_prompts(prompt_BxP: jax.Array, group_size: int) -> jax.Array:
    """The first row of each group of `group_size` adjacent rows: prompt_NxP, N = B / group_size."""
    B, P = prompt_BxP.shape
    return prompt_BxP.reshape(B // group_size, group_size, P)[:, 0]


@functools.partial(jax.jit, static_argnames=("cfg", "group_size", "logits_chunk", "remat", "parallel"))
def token_logprobs_shared(
    params,
    cfg: ModelConfig,
    prompt_BxP,
    prompt_mask_BxP,
    tokens_BxT,
    temperature,
    *,
    group_size: int,
    logits_chunk: int = 0,
    remat: str = "none",
    parallel: Parallel | None = None,
):
    """`token_logprobs` (dense) of a batch of contiguous groups of `group_size` rows with identical prompts;
    `logits_chunk` and `remat` as there."""
    if cfg.n_experts:
        raise ValueError(
            "token_logprobs_shared: dense models only (MoE routing depends on the batch); "
            "use transformer.token_logprobs"
        )
    B, P = prompt_BxP.shape
    T, G = tokens_BxT.shape[1], group_size
    if B % G:
        raise ValueError(f"token_logprobs_shared: batch of {B} rows is not a whole number of groups of {G}")
    N = B // G
    prompt_NxP = group_prompts(prompt_BxP, G).astype(jnp.int32)
    pmask_NxP = group_prompts(prompt_mask_BxP, G).astype(bool)
    cache_shape = (cfg.n_layers, N, P, cfg.n_kv_heads, cfg.head_dim)
    empty = jnp.zeros(cache_shape, jnp.dtype(cfg.dtype))
    # 1. Each distinct prompt once: its K/V for every layer, and the logits predicting completion token 0.
    # (With logits_chunk, `out` is the final normed hidden states and the head runs chunk by chunk.)
    hidden = logits_chunk > 0
    first_Nx1xX, (k_LxNxPxKxHd, v_LxNxPxKxHd), _ = run_decoder(
        params,
        cfg,
        prompt_NxP,
        positions_from_mask(pmask_NxP),
        pmask_NxP,
        0,
        StackedKV(empty, empty),
        num_logits=1,
        return_hidden=hidden,
        remat=remat,
        parallel=parallel,
    )
    out_BxTxX = jnp.repeat(first_Nx1xX, G, axis=0)
    if T > 1:
        # 2. The completions of all B rows over [the group's prompt keys, their own causal keys]: tokens
        # 0..T-2 predict 1..T-1. Under sequence parallelism one more (the last token, its output unused)
        # when that makes the positions divide over the sequence axis (T - 1 rarely does).
        n_seq = 1 if parallel is None else parallel.n_sequence_devices
        R = T if n_seq > 1 and (T - 1) % n_seq and T % n_seq == 0 else T - 1

        def per_row(x_LxNxPxKxHd):  # repeat to the group's rows, then room for the R completion slots
            x_LxBxPxKxHd = jnp.repeat(x_LxNxPxKxHd, G, axis=1)
            return rows(parallel, jnp.pad(x_LxBxPxKxHd, ((0, 0), (0, 0), (0, R), (0, 0), (0, 0))), axis=1)

        n_real_B = jnp.repeat(jnp.sum(pmask_NxP, axis=1, dtype=jnp.int32), G)
        positions_BxR = n_real_B[:, None] + jnp.arange(R, dtype=jnp.int32)
        key_valid_BxS = jnp.concatenate([jnp.repeat(pmask_NxP, G, axis=0), jnp.ones((B, R), bool)], axis=1)
        rest_BxRxX, _, _ = run_decoder(
            params,
            cfg,
            tokens_BxT[:, :R],
            positions_BxR,
            key_valid_BxS,
            P,
            StackedKV(per_row(k_LxNxPxKxHd), per_row(v_LxNxPxKxHd)),
            return_hidden=hidden,
            remat=remat,
            parallel=parallel,
        )
        out_BxTxX = jnp.concatenate([out_BxTxX, rest_BxRxX[:, : T - 1]], axis=1)
    if hidden:
        return chunked_token_logprobs(
            out_BxTxX, head_weights(params, cfg), tokens_BxT, temperature, logits_chunk, parallel
        )
    return logprob_and_entropy(out_BxTxX, tokens_BxT, temperature)
