"""Device kernels of partial rollouts (the engine's samples carried across policy versions):

    state = release_slots(spec, state, free_S)                                 # stop slots decoding
    state = reprefill(params, spec, state, prompt_SxP, prompt_mask_SxP, redo_S) # caches under new params

`release_slots` ends the samples in the marked slots without recording anything more. `reprefill`
recomputes, in one causal forward over all S slots under `params`, the keys/values of everything each
slot marked in redo_S has fed so far (its prompt and its completion but the last token): the cache a
fresh engine would build by prefilling prompt + completion-so-far. Fill levels, positions, the next
input and the drawn tokens with their recorded log-probs and versions are unchanged. MoE: the redone
slots' routing is the re-prefill's (the experts the new keys/values were computed with, which the rest
of the sample attends to), so the update replays what the cache holds. Static shapes: one compile per
EngineSpec, whichever slots are redone.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl.models.cache_kinds import LayerKV
from jaxrl.models.decode import LayerCache, fill_layers
from jaxrl.rollout.engine.state import EngineSpec, EngineState, laid_out


@functools.partial(jax.jit, static_argnames="spec", donate_argnames="state")
def release_slots(spec: EngineSpec, state: EngineState, free_S) -> EngineState:
    """Slots marked in free_S stop decoding (done, not EOS); their records stay until re-admitted."""
    free_S = jnp.asarray(free_S, bool)
    return laid_out(spec, state._replace(done_S=state.done_S | free_S, eos_S=state.eos_S & ~free_S))


def fed_mask(spec: EngineSpec, state: EngineState, prompt_mask_SxP):
    """written_SxC: the cache slots each slot has fed real tokens into (prompt padding excluded)."""
    P, C = spec.prompt_len, spec.cache_len
    fill_S = P - 1 + state.col_S
    real_SxC = jnp.concatenate([jnp.asarray(prompt_mask_SxP, bool), jnp.ones((spec.slots, C - P), bool)], axis=1)
    return real_SxC & (jnp.arange(C) < fill_S[:, None])


@functools.partial(jax.jit, static_argnames="spec", donate_argnames="state")
def reprefill(params, spec: EngineSpec, state: EngineState, prompt_SxP, prompt_mask_SxP, redo_S) -> EngineState:
    """The caches of the slots in redo_S recomputed under `params` (see the module docstring).
    prompt_SxP / prompt_mask_SxP: each slot's left-padded prompt (anything for slots not redone)."""
    cfg, S = spec.cfg, spec.slots
    if prompt_SxP.shape != (S, spec.prompt_len):
        raise ValueError(f"prompt_SxP: shape {prompt_SxP.shape}, expected (slots, prompt_len)={(S, spec.prompt_len)}")
    # Cache slot j holds the input fed there: prompt token j (j < P), completion token j - P after.
    # (A speculative engine's cache has room past P + T for the verify window: slots no input reaches.)
    seq_SxT = jnp.concatenate([jnp.asarray(prompt_SxP, jnp.int32), state.tokens_SxT], axis=1)
    written_SxC = fed_mask(spec, state, prompt_mask_SxP)
    kv_new, experts_SxCxLxK = fill_layers(params, cfg, seq_SxT, written_SxC, spec.parallel)
    take_SxC = written_SxC & jnp.asarray(redo_S, bool)[:, None]

    def pick(new, old):
        return jnp.where(take_SxC[:, None, :, None], new.astype(old.dtype), old)

    kv = tuple(LayerKV(pick(nk, k), pick(nv, v)) for (nk, nv), (k, v) in zip(kv_new, state.cache.kv))
    routing = state.routing_SxCxLxK
    if experts_SxCxLxK is not None:
        assert routing is not None  # a MoE engine's state carries its routing
        routing = jnp.where(take_SxC[:, :, None, None], experts_SxCxLxK.astype(routing.dtype), routing)
    new = state._replace(cache=LayerCache(kv, state.cache.valid_BxS, state.cache.pos_B), routing_SxCxLxK=routing)
    return laid_out(spec, new)
