"""Device kernel of multi-turn episodes on the slot engine: place episodes, history and all, into slots.

    state = place(params, spec, state, slot_R, prompt_RxP, prompt_mask_RxP, tokens_RxT, logp_RxT,
                  loss_mask_RxT, version_RxT, n_R, key_R)

Row r, an episode with n_R[r] tokens of history (model and observation tokens) after its left-padded
prompt, goes to slot slot_R[r] (a slot of S or more drops the row). The slot gets the row's buffers,
its own noise key and the cache (and MoE routing) of prompt + history[:n-1] from one causal forward
over the R rows: the cache the plain sampler builds when it prefills prompt + history as a longer
prompt; decoding resumes from the last history token. Callers keep R fixed: XLA's matmul blocking
depends on the row count, so only a fixed R keeps a row's log-probs bit-identical whichever episodes
it is placed with. The buffers' mask is the LOSS mask: 1 on model tokens (EOS / end of turn
included), 0 on observation tokens (logp 0, version -1); fill levels and the budget count every token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl.models.cache_kinds import LayerKV
from jaxrl.models.decode import LayerCache, fill_layers
from jaxrl.rollout.engine.state import EngineSpec, EngineState, laid_out


def _history_cache(params, spec: EngineSpec, prompt_RxP, prompt_mask_RxP, tokens_RxT, n_R):
    """(kv per layer of R rows x C slots, valid_RxC, pos_R, last_R, experts_RxCxLxK or None): the cache
    of prompt + history[:n-1] per row, and the next decode input."""
    cfg, P, C = spec.cfg, spec.prompt_len, spec.cache_len
    R = prompt_RxP.shape[0]
    seq_RxC = jnp.concatenate([prompt_RxP.astype(jnp.int32), tokens_RxT.astype(jnp.int32)], axis=1)
    fill_R = P - 1 + n_R  # the slot `last` is fed at; everything before it is in the cache
    real_RxC = jnp.concatenate([prompt_mask_RxP.astype(bool), jnp.ones((R, C - P), bool)], axis=1)
    written_RxC = real_RxC & (jnp.arange(C) < fill_R[:, None])
    kv, experts_RxCxLxK = fill_layers(params, cfg, seq_RxC, written_RxC, spec.parallel)
    if experts_RxCxLxK is not None:
        experts_RxCxLxK = jnp.where(written_RxC[:, :, None, None], experts_RxCxLxK, 0)
    # As `admit` leaves a slot: the prompt's padding invalid, every slot from P-1 on readable up to the fill level.
    valid_RxC = jnp.concatenate([prompt_mask_RxP[:, : P - 1].astype(bool), jnp.ones((R, C - P + 1), bool)], axis=1)
    pos_R = jnp.sum(written_RxC, axis=1).astype(jnp.int32)  # real tokens fed so far = the next position id
    last_R = jnp.take_along_axis(seq_RxC, fill_R[:, None], axis=1)[:, 0]
    return kv, valid_RxC, pos_R, last_R, experts_RxCxLxK


@functools.partial(jax.jit, static_argnames="spec", donate_argnames="state")
def place(
    params,
    spec: EngineSpec,
    state: EngineState,
    slot_R,
    prompt_RxP,
    prompt_mask_RxP,
    tokens_RxT,
    logp_RxT,
    loss_mask_RxT,
    version_RxT,
    n_R,
    key_R,
) -> EngineState:
    """Put R episodes into slots slot_R with their histories prefilled (see the module docstring)."""
    if prompt_RxP.shape[1] != spec.prompt_len or tokens_RxT.shape[1] != spec.max_new_tokens:
        raise ValueError(
            f"place: prompt_RxP {prompt_RxP.shape} / tokens_RxT {tokens_RxT.shape}, expected "
            f"(R, prompt_len={spec.prompt_len}) / (R, max_new_tokens={spec.max_new_tokens})"
        )
    if state.key_S is None:
        raise ValueError("place: the engine state has no per-slot keys (EngineSpec.slot_keys=False)")
    n_R = jnp.asarray(n_R, jnp.int32)
    kv, valid_RxC, pos_R, last_R, experts = _history_cache(
        params, spec, jnp.asarray(prompt_RxP), jnp.asarray(prompt_mask_RxP), jnp.asarray(tokens_RxT), n_R
    )

    def put(old, new):
        return old.at[slot_R].set(jnp.asarray(new).astype(old.dtype), mode="drop")

    cache = LayerCache(
        tuple(LayerKV(put(k, nk), put(v, nv)) for (k, v), (nk, nv) in zip(state.cache.kv, kv)),
        put(state.cache.valid_BxS, valid_RxC),
        put(state.cache.pos_B, pos_R),
    )
    R = n_R.shape[0]
    routing = state.routing_SxCxLxK
    if experts is not None:
        assert routing is not None  # a MoE engine's state carries its routing
        routing = routing.at[slot_R, : experts.shape[1]].set(experts.astype(routing.dtype), mode="drop")
    new = state._replace(
        cache=cache,
        last_S=put(state.last_S, last_R),
        col_S=put(state.col_S, n_R),
        done_S=put(state.done_S, jnp.zeros((R,), bool)),
        eos_S=put(state.eos_S, jnp.zeros((R,), bool)),
        tokens_SxT=put(state.tokens_SxT, tokens_RxT),
        logp_SxT=put(state.logp_SxT, logp_RxT),
        mask_SxT=put(state.mask_SxT, loss_mask_RxT),
        version_SxT=put(state.version_SxT, version_RxT),
        routing_SxCxLxK=routing,
        key_S=put(state.key_S, key_R),
    )
    return laid_out(spec, new)
