"""The decode engine's device side: S slots, each one sample with its own cache fill level.

Pure jitted functions over an explicit `EngineState` (static shapes; `EngineSpec` is static):

    state = init_state(spec, rng)                                    # every slot free
    state = admit(params, spec, state, prompt_AxP, mask_AxP, dest_N) # A prompts x G samples -> slots dest_N
    state = decode_chunk(params, spec, state, n_steps, version, temperature, stop_at=None)
    state = place_sampling(spec, state, dest_N, sampling_N, seed_key_Nx2, seeded_N, stream_N, choice_N)  # per_slot
    out   = read_slots(spec, state, slot_R)                          # tokens, masks, log-probs, versions
    out   = read_host_slots(spec, host_slots(state), slot_R)         # the same from one host copy
    shardings = state_shardings(spec, state)                         # where every program leaves the state

Under a mesh (`spec.parallel`), every program that returns a state lays it out by `state_shardings`:
the per-slot fields split by slot over the batch axes (replicated when the slots do not divide), the
RNG replicated. A state's layout never depends on the call that produced it, so each program compiles
once per spec, not once more when its own output comes back as its input.

Completion token t of a slot is fed at cache slot P-1+t, so each slot decodes at its own fill level; a
slot that is not decoding runs through the forward but records nothing and does not advance. Tokens
record their log-probs under softmax(logits / temperature), untruncated (as `sampler.sample`), and the
chunk's `version`. No two (decode step, slot) pairs share noise, so every sample is an independent
draw of the plain sampler's distribution whatever the admission pattern; with `spec.slot_keys` a
slot's tokens depend only on its sample's key, the params and its history. `spec.stop_ids` end a
slot's decoding like EOS, with eos_S left False. With `spec.per_slot` (the serving engine,
jaxrl/serve/engine.py) each slot carries its own temperature, top_p, token limit and stop ids
(`SlotSampling`, set by `place_sampling` when a request is admitted), so one compiled chunk decodes
any mix of requests. docs/engine.md has the details.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.config import ModelConfig
from jaxrl.models.cache_kinds import LayerKV
from jaxrl.models.decode import LayerCache, decode_rows, layer_params
from jaxrl.models.parallel import Parallel
from jaxrl.models.transformer import rollout_params
from jaxrl.rollout.engine.draws import SlotSampling, choose_tokens_per_row, choose_tokens_per_slot
from jaxrl.rollout.sampler import (
    SamplingParams,
    choose_tokens,
    prefill_groups,
    scaled_logits,
)


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """Everything that fixes the engine's shapes and graph (a static jit argument)."""

    cfg: ModelConfig
    slots: int  # S
    prompt_len: int  # P: prompts are left-padded to it
    max_new_tokens: int  # T
    group_size: int  # G: samples per admitted prompt
    eos_id: int
    pad_id: int
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    # End-of-turn token ids (multi-turn episodes): a slot that draws one is done, like EOS, but its
    # eos_S stays False. () = none (single-turn rollouts).
    stop_ids: tuple = ()
    # Per-slot noise: slot s draws its token at column c with noise from fold_in(key_S[s], c) (key_S
    # set when the row is placed) instead of the engine's shared per-step key, so a sample's tokens
    # depend only on its own key, the params and its history, not on its slot or when it ran.
    slot_keys: bool = False
    # MoE: the experts' mesh axis (`sharding.parallel`), the same the update is given; every
    # forward (admission's prefill, decode steps, re-prefill, placement, drafts) dispatches with it.
    parallel: Parallel | None = None
    # Serving: each slot draws with its own temperature, top_p, token limit and stop ids
    # (`EngineState.sampling_S`, written by `place_sampling`); `decode_chunk`'s temperature, top_k,
    # top_p and greedy are then unused. Requires slot_keys (a request's own noise).
    per_slot: bool = False
    max_stop_ids: int = 0  # K: per_slot stop ids per slot (padded with -1)

    @classmethod
    def of_sampling(
        cls, cfg: ModelConfig, sampling: SamplingParams, *, slots: int, prompt_len: int, group_size: int, **kw
    ) -> EngineSpec:
        """The spec of an engine drawing as `sampling` says; its temperature stays out (a traced
        argument of `decode_chunk`, so engines that differ only in it share their programs)."""
        return cls(
            cfg,
            slots,
            prompt_len,
            sampling.max_new_tokens,
            group_size,
            sampling.eos_id,
            sampling.pad_id,
            sampling.top_k,
            sampling.top_p,
            sampling.greedy,
            **kw,
        )

    @property
    def cache_len(self) -> int:
        # Fill levels reach P-1+T; a finished slot's (unread) window write lands at that slot.
        return self.prompt_len + self.max_new_tokens

    def without_drafter(self) -> EngineSpec:
        """The spec the programs that never draft (`init_state`, `admit`, the plain `decode_chunk`)
        compile under: this one; a speculative spec overrides it (see speculative/engine.py)."""
        return self


class EngineState(NamedTuple):
    cache: LayerCache  # S rows of cache_len slots; pos_B = each slot's next position id
    last_S: jax.Array  # int32: the next decode input (the last prompt token, then the last drawn token)
    col_S: jax.Array  # int32: completion tokens generated so far
    done_S: jax.Array  # bool: not decoding (finished, or free since init)
    eos_S: jax.Array  # bool: the sample ended with EOS (else, once done, it hit max_new_tokens)
    tokens_SxT: jax.Array  # int32; pad after the sample's last token
    logp_SxT: jax.Array  # float32; 0 where masked
    mask_SxT: jax.Array  # float32; 1 on generated tokens (EOS included)
    version_SxT: jax.Array  # int32: the version passed to the chunk that drew each token; -1 where masked
    rng: jax.Array
    routing_SxCxLxK: jax.Array | None  # MoE: experts per cache slot (C = P + T) and MoE layer; else None
    key_S: jax.Array | None = None  # spec.slot_keys: each slot's own noise key (S x key shape); else None
    sampling_S: SlotSampling | None = None  # spec.per_slot: how each slot draws; else None


# A readout is taken on the device (`read_slots`: jax arrays) or from a host copy (numpy).
DeviceOrHost = jax.Array | np.ndarray


class SlotReadout(NamedTuple):
    tokens_RxT: DeviceOrHost
    completion_mask_RxT: DeviceOrHost
    logp_RxT: DeviceOrHost
    version_RxT: DeviceOrHost
    finished_R: DeviceOrHost  # emitted EOS
    truncated_R: DeviceOrHost  # done without EOS (max_new_tokens reached)
    length_R: DeviceOrHost
    routing_RxCxLxK: DeviceOrHost | None


def _blank_rows(spec: EngineSpec, n: int, done: bool):
    """Per-row fields of n freshly reset slots (not the cache): (last, col, done, eos, tokens, logp, mask, version)."""
    T = spec.max_new_tokens
    return (
        jnp.zeros((n,), jnp.int32),
        jnp.zeros((n,), jnp.int32),
        jnp.full((n,), done),
        jnp.zeros((n,), bool),
        jnp.full((n, T), spec.pad_id, jnp.int32),
        jnp.zeros((n, T), jnp.float32),
        jnp.zeros((n, T), jnp.float32),
        jnp.full((n, T), -1, jnp.int32),
    )


def state_shardings(spec: EngineSpec, state: EngineState) -> EngineState | None:
    """The state's layout on `spec.parallel`'s mesh (an EngineState of NamedShardings, None fields
    kept), or None on one device (no mesh): slot-leading fields split over the batch axes when
    spec.slots divides over them, else replicated; the RNG replicated."""
    par = spec.parallel
    if par is None:
        return None
    n = par.n_rows_devices
    replicated = NamedSharding(par.mesh, P())
    by_slot = NamedSharding(par.mesh, P(par.batch)) if n > 1 and spec.slots % n == 0 else replicated
    laid = jax.tree.map(lambda _: by_slot, state._replace(rng=None))
    return laid._replace(rng=replicated)


def laid_out(spec: EngineSpec, state: EngineState) -> EngineState:
    """`state` constrained to `state_shardings(spec, state)` (inside a jitted program; unchanged on
    one device)."""
    shardings = state_shardings(spec, state)
    if shardings is None:
        return state
    return jax.tree.map(jax.lax.with_sharding_constraint, state, shardings)


@functools.partial(jax.jit, static_argnames="spec")
def init_state(spec: EngineSpec, rng) -> EngineState:
    """Every slot free (done, nothing recorded); an empty cache."""
    cfg, S, C = spec.cfg, spec.slots, spec.cache_len
    dtype = jnp.dtype(cfg.dtype)

    def buf():
        return jnp.zeros((S, cfg.n_kv_heads, C, cfg.head_dim), dtype)

    cache = LayerCache(
        tuple(LayerKV(buf(), buf()) for _ in range(cfg.n_layers)), jnp.zeros((S, C), bool), jnp.zeros((S,), jnp.int32)
    )
    routing = None
    if cfg.n_experts:
        routing = jnp.zeros((S, C, cfg.n_moe_layers, cfg.experts_per_token), jnp.int32)
    key_S = jnp.broadcast_to(rng, (S,) + rng.shape) if spec.slot_keys else None  # placement overwrites them
    sampling_S = None
    if spec.per_slot:
        if not spec.slot_keys:
            raise ValueError("EngineSpec.per_slot requires slot_keys=True (each request draws its own noise)")
        sampling_S = SlotSampling(
            jnp.ones((S,), jnp.float32),
            jnp.ones((S,), jnp.float32),
            jnp.full((S,), spec.max_new_tokens, jnp.int32),
            jnp.full((S, spec.max_stop_ids), -1, jnp.int32),
        )
    return laid_out(spec, EngineState(cache, *_blank_rows(spec, S, True), rng, routing, key_S, sampling_S))


def admit(params, spec: EngineSpec, state: EngineState, prompt_AxP, prompt_mask_AxP, dest_N) -> EngineState:
    """Prefill A left-padded prompts once each and copy each prompt's cache to G slots: prompt a's
    samples go to slots dest_N[a*G .. a*G+G-1]. A dest of S (or more) drops that row, so a caller
    with fewer than A prompts pads the batch (any prompt, e.g. a copy) and points it at S. The
    admitted slots are reset and start decoding; every other slot is left as it was. Donates `state`."""
    # Admission reads the shapes and pad_id, never how tokens are drawn or end: one compiled program
    # serves engines that differ only in those (a greedy and a sampled engine of one model).
    drawless = dataclasses.replace(spec.without_drafter(), eos_id=-1, top_k=0, top_p=1.0, greedy=False, stop_ids=())
    return _admit(params, drawless, state, prompt_AxP, prompt_mask_AxP, dest_N)


@functools.partial(jax.jit, static_argnames="spec", donate_argnames="state")
def _admit(params, spec: EngineSpec, state: EngineState, prompt_AxP, prompt_mask_AxP, dest_N) -> EngineState:
    cfg, P = spec.cfg, spec.prompt_len
    if prompt_AxP.shape[1] != P:
        raise ValueError(f"prompt_AxP has {prompt_AxP.shape[1]} columns, expected the engine's prompt_len={P}")
    cache, _, routing_NxCxLxK, last_N = prefill_groups(
        params, cfg, prompt_AxP, prompt_mask_AxP, spec.group_size, spec.cache_len, spec.cache_len, spec.parallel
    )
    # Slots from P-1 on hold decoded tokens: what a row reads of them is bounded by its fill level.
    cache = cache._replace(valid_BxS=cache.valid_BxS.at[:, P - 1 :].set(True))
    N = last_N.shape[0]

    def put(old, new):
        return old.at[dest_N].set(new.astype(old.dtype), mode="drop")

    kv = tuple(LayerKV(put(k, nk), put(v, nv)) for (k, v), (nk, nv) in zip(state.cache.kv, cache.kv))
    new_cache = LayerCache(kv, put(state.cache.valid_BxS, cache.valid_BxS), put(state.cache.pos_B, cache.pos_B))
    last, col, done, eos, tokens, logp, mask, version = _blank_rows(spec, N, False)
    new = state._replace(
        cache=new_cache,
        last_S=put(state.last_S, last_N),
        col_S=put(state.col_S, col),
        done_S=put(state.done_S, done),
        eos_S=put(state.eos_S, eos),
        tokens_SxT=put(state.tokens_SxT, tokens),
        logp_SxT=put(state.logp_SxT, logp),
        mask_SxT=put(state.mask_SxT, mask),
        version_SxT=put(state.version_SxT, version),
        routing_SxCxLxK=None if routing_NxCxLxK is None else put(state.routing_SxCxLxK, routing_NxCxLxK),
    )
    return laid_out(spec, new)


def _put_column(buf_SxT, col_S, value_S, write_S):
    """buf[s, col_s] = value_s where write_s: a scatter of S elements (a row that does not write
    aims past the last column and is dropped), not a select over the whole S x T buffer."""
    S, T = buf_SxT.shape[:2]
    return buf_SxT.at[jnp.arange(S), jnp.where(write_S, col_S, T)].set(value_S.astype(buf_SxT.dtype), mode="drop")


def _decode_step(lparams, spec: EngineSpec, s: EngineState, version, temperature) -> EngineState:
    """One decode step of every slot; only the decoding ones (not done) record and advance."""
    cfg, P, T = spec.cfg, spec.prompt_len, spec.max_new_tokens
    fill_S = P - 1 + s.col_S
    active_S = ~s.done_S
    logits_SxV, cache, experts_SxLxK = decode_rows(
        lparams, cfg, s.last_S, s.cache, fill_S, active_S.astype(jnp.int32), spec.parallel
    )
    logits_SxV = logits_SxV.astype(jnp.float32)
    rng, key = jax.random.split(s.rng)
    limit_S = T
    if s.sampling_S is not None:  # spec.per_slot: each slot's own temperature, top_p, limit and stops
        temperature = s.sampling_S.temperature_S[:, None]
        tok_S = choose_tokens_per_slot(s.key_S, s.col_S, logits_SxV, s.sampling_S).astype(jnp.int32)
        limit_S = s.sampling_S.max_tokens_S
    elif spec.slot_keys:
        tok_S = choose_tokens_per_row(s.key_S, s.col_S, logits_SxV, temperature, spec).astype(jnp.int32)
    else:
        tok_S = choose_tokens(key, logits_SxV, temperature, spec.top_k, spec.top_p, spec.greedy).astype(jnp.int32)
    logp_all_SxV = jax.nn.log_softmax(scaled_logits(logits_SxV, temperature), axis=-1)
    logp_S = jnp.take_along_axis(logp_all_SxV, tok_S[:, None], axis=-1)[:, 0]
    routing = s.routing_SxCxLxK
    if experts_SxLxK is not None:  # the input fed at cache slot fill_S used these experts
        routing = _put_column(routing, fill_S, experts_SxLxK, active_S)
    eos_S = active_S & (tok_S == spec.eos_id)
    stop_S = eos_S
    for stop_id in spec.stop_ids:  # end of turn: done, not EOS
        stop_S = stop_S | (active_S & (tok_S == stop_id))
    if s.sampling_S is not None:  # a request's stop ids (-1 pads match no token)
        stop_S = stop_S | (active_S & jnp.any(tok_S[:, None] == s.sampling_S.stop_SxK, axis=-1))
    col_S = s.col_S + active_S
    return s._replace(
        cache=cache,
        last_S=jnp.where(active_S, tok_S, s.last_S),
        col_S=col_S,
        done_S=s.done_S | stop_S | (col_S >= limit_S),
        eos_S=s.eos_S | eos_S,
        tokens_SxT=_put_column(s.tokens_SxT, s.col_S, tok_S, active_S),
        logp_SxT=_put_column(s.logp_SxT, s.col_S, logp_S, active_S),
        mask_SxT=_put_column(s.mask_SxT, s.col_S, jnp.ones_like(logp_S), active_S),
        version_SxT=_put_column(s.version_SxT, s.col_S, jnp.broadcast_to(version, col_S.shape), active_S),
        rng=rng,
        routing_SxCxLxK=routing,
    )


@functools.partial(jax.jit, static_argnames="spec", donate_argnames="state")
def place_sampling(
    spec: EngineSpec, state: EngineState, dest_N, sampling_N: SlotSampling, seed_key_Nx2, seeded_N, stream_N, choice_N
) -> EngineState:
    """`spec.per_slot`: slots dest_N (a dest of S or more is dropped) draw as sampling_N says, row n
    with the noise key fold_in(base_n, choice_N[n]), base_n = seed_key_Nx2[n] (a raw uint32 key,
    `jax.random.PRNGKey(seed)`'s form) where seeded_N[n], else fold_in(state.rng, stream_N[n]) (the
    engine's key stream). So a seeded request's choice i draws the same tokens whatever its slot,
    its admission time and the other requests. Call it right after `admit` placed the rows."""
    if not spec.per_slot:
        raise ValueError("place_sampling: the engine's spec has per_slot=False (no per-slot sampling state)")
    assert state.sampling_S is not None and state.key_S is not None  # init_state of a per_slot spec
    if jnp.issubdtype(state.rng.dtype, jax.dtypes.prng_key):
        raise ValueError("place_sampling: the engine's rng is a typed key; pass raw keys (jax.random.PRNGKey)")
    stream_keys = jax.vmap(lambda i: jax.random.fold_in(state.rng, i))(jnp.asarray(stream_N, jnp.int32))
    seeded_Nx1 = jnp.asarray(seeded_N, bool)[:, None]
    base = jnp.where(seeded_Nx1, jnp.asarray(seed_key_Nx2, jnp.uint32), stream_keys)
    key_N = jax.vmap(jax.random.fold_in)(base, jnp.asarray(choice_N, jnp.int32))

    def put(old, new):
        return old.at[dest_N].set(jnp.asarray(new).astype(old.dtype), mode="drop")

    placed = SlotSampling(*(put(o, n) for o, n in zip(state.sampling_S, sampling_N)))
    return laid_out(spec, state._replace(sampling_S=placed, key_S=put(state.key_S, key_N)))


@functools.partial(jax.jit, static_argnames="cfg")
def split_params(params, cfg):
    """The per-layer form of params that `decode_chunk` runs on, its weights in the compute dtype
    (`transformer.rollout_params`; a no-op on params already cast): splitting copies every weight."""
    return layer_params(rollout_params(params, cfg), cfg)


@functools.partial(jax.jit, static_argnames="spec", donate_argnames="state")
def decode_chunk(
    params, spec: EngineSpec, state: EngineState, n_steps, version, temperature, stop_at=None
) -> EngineState:
    """Up to n_steps decode steps (traced: any chunk length, one compile) over all slots, stopping
    early once no slot is decoding or, with `stop_at` (traced), once at least stop_at slots are done
    (finished or free: the host can then admit a group). `version` (int32 scalar) is recorded on
    every token drawn. `params` are the model's, or `split_params(params, cfg)`: a host that runs
    many chunks on the same params splits them once instead of once per chunk."""
    lparams = params if isinstance(params["blocks"], tuple) else layer_params(params, spec.cfg)
    version = jnp.asarray(version, jnp.int32)
    stop_at = jnp.asarray(spec.slots if stop_at is None else stop_at, jnp.int32)

    def body(carry):
        i, s = carry
        return i + 1, _decode_step(lparams, spec, s, version, temperature)

    def cond(carry):
        n_done = jnp.sum(carry[1].done_S.astype(jnp.int32))
        return (carry[0] < n_steps) & (n_done < jnp.minimum(stop_at, spec.slots))

    _, state = lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state))
    return laid_out(spec, state)


def _readout(spec: EngineSpec, state: EngineState, slot_R, xp) -> SlotReadout:
    """What the slots slot_R hold, with array module xp (jnp on device, np on a host copy)."""

    def take(x):
        return xp.take(x, slot_R, axis=0)

    mask = take(state.mask_SxT)
    done, eos = take(state.done_S), take(state.eos_S)
    routing = None  # C = P + T slots (a speculative engine's cache has more)
    if state.routing_SxCxLxK is not None:
        routing = take(state.routing_SxCxLxK)[:, : spec.prompt_len + spec.max_new_tokens]
    return SlotReadout(
        take(state.tokens_SxT),
        mask,
        take(state.logp_SxT),
        take(state.version_SxT),
        eos,
        done & ~eos,
        xp.sum(mask, axis=-1).astype(xp.int32),
        routing,
    )


@functools.partial(jax.jit, static_argnames="spec")
def read_slots(spec: EngineSpec, state: EngineState, slot_R) -> SlotReadout:
    """What the slots slot_R hold (meaningful once they are done)."""
    return _readout(spec, state, slot_R, jnp)


def host_slots(state: EngineState) -> EngineState:
    """A host (numpy) copy of every per-slot field, without the cache and the key: one round trip,
    after which `read_host_slots` reads any slots with no further device call. Copies, not views:
    the next chunk donates (reuses) the device buffers."""
    return jax.tree.map(np.array, jax.device_get(state._replace(cache=None, rng=None, key_S=None)))


def read_host_slots(spec: EngineSpec, host: EngineState, slot_R) -> SlotReadout:
    """`read_slots` on `host_slots(state)`: the same readout, in numpy."""
    return _readout(spec, host, np.asarray(slot_R), np)
