"""Group rollouts with a shared-prefill KV cache: tokens in, tokens out (no tokenizer dependency).

    out = sample(params, cfg, prompt_BxP, prompt_mask_BxP, rng, sampling=SamplingParams(...), group_size=G)

Each left-padded prompt (at least one real token) is prefilled once and serves the G rows of its
group, rows i*G .. i*G+G-1; decoding stops as soon as every row has emitted EOS. Recorded log-probs
are under softmax(logits / temperature) WITHOUT top-k/top-p truncation (also for greedy): the
distribution `token_logprobs` recomputes, so the importance ratio is exactly 1 before the first
update. Temperature 0 is greedy decoding, the T -> 0 limit (`scaled_logits`): a uniform draw among
the maximal logits, recorded log-prob log(1 / #maximal), never NaN; a negative temperature is an
error. MoE models also return `routing_BxSxLxK`, the experts of each MoE layer at every slot
S = P + T (slot P-1+t fed the input that predicted completion token t; the last slot stays 0),
which `token_logprobs(..., replay_BxSxLxK=routing)` replays.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.core import Tracer

from jaxrl.config import ModelConfig, RolloutConfig
from jaxrl.models.decode import LayerCache, decode_layers, layer_params, to_layer_cache
from jaxrl.models.group_decode import (
    GroupCache,
    decode_group_layers,
    default_segments,
    group_cache,
    grow_own,
    segment_ends,
)
from jaxrl.models.kv_cache import init_cache, prefill
from jaxrl.models.parallel import Parallel


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["temperature", "eos_id"],
    meta_fields=["top_k", "top_p", "greedy", "max_new_tokens", "pad_id"],
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How a rollout draws its tokens: one bundle for the samplers, the engine and the episodes.

    A pytree: `temperature` and `eos_id` are its leaves (traced under jit: changing them does not
    recompile; eos_id is only compared with the drawn tokens), the other fields its static structure
    (they change the graph). Frozen and hashable while its leaves are Python numbers."""

    temperature: Any = 1.0  # >= 0; 0 = the T -> 0 limit (`scaled_logits`)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    greedy: bool = False  # first argmax; top_k / top_p ignored
    max_new_tokens: int  # T
    eos_id: Any
    pad_id: int

    @classmethod
    def of_rollout(cls, rc: RolloutConfig, *, eos_id: int, pad_id: int, greedy: bool = False) -> SamplingParams:
        """What a run's `rollout.*` configures (temperature, top_k, top_p, max_new_tokens)."""
        return cls(
            temperature=rc.temperature,
            top_k=rc.top_k,
            top_p=rc.top_p,
            greedy=greedy,
            max_new_tokens=rc.max_new_tokens,
            eos_id=eos_id,
            pad_id=pad_id,
        )


class SampleOutput(NamedTuple):
    tokens_BxT: jax.Array  # int32; pad_id after EOS
    completion_mask_BxT: jax.Array  # float32; 1 on real completion tokens including EOS, 0 after
    logp_BxT: jax.Array  # float32; log-prob under softmax(logits/temperature), 0 where masked
    finished_B: jax.Array  # bool; the row emitted EOS
    length_B: jax.Array  # int32; number of real completion tokens (EOS included)
    num_steps: jax.Array  # int32 scalar; decode steps run = columns generated (< T on early exit)
    routing_BxSxLxK: jax.Array | None = None  # int32, MoE only: experts used per slot and MoE layer


class _Loop(NamedTuple):
    step: jax.Array  # columns emitted so far
    cache: GroupCache | LayerCache  # GroupCache with share_prefix
    last_N: jax.Array  # the next decode input: the last prompt token, then the last drawn token
    tokens_NxT: jax.Array
    logp_NxT: jax.Array
    mask_NxT: jax.Array
    done_N: jax.Array
    rng: jax.Array
    routing_NxSxLxK: jax.Array | None  # None for a dense model


def truncate_logits(logits_NxV: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Set logits outside the top-k, then outside the top-p nucleus of what is left, to -inf.

    Ties at the k-th value are all kept. The nucleus is the smallest prefix (by descending prob) whose
    mass reaches top_p: a token is kept iff the mass strictly before it is < top_p.
    """
    if top_k > 0 and top_k < logits_NxV.shape[-1]:
        kth_Nx1 = lax.top_k(logits_NxV, top_k)[0][:, -1:]
        logits_NxV = jnp.where(logits_NxV < kth_Nx1, -jnp.inf, logits_NxV)
    if top_p < 1.0:
        logits_NxV = nucleus_logits(logits_NxV, top_p)
    return logits_NxV


def nucleus_logits(logits_NxV: jax.Array, top_p) -> jax.Array:
    """The top-p step of `truncate_logits`: logits outside each row's nucleus set to -inf. `top_p` is
    a number or an (N, 1) array (one nucleus mass per row, traced: the serving engine's per-slot
    top_p); a row with top_p = 1 may still lose tokens whose mass float rounding puts past 1, so a
    caller that means "off" for some rows selects their untruncated logits itself."""
    sorted_NxV = -jnp.sort(-logits_NxV, axis=-1)
    probs_NxV = jax.nn.softmax(sorted_NxV, axis=-1)
    mass_before_NxV = jnp.cumsum(probs_NxV, axis=-1) - probs_NxV
    keep_NxV = mass_before_NxV < top_p  # the top token always survives since 0 < top_p
    thresh_Nx1 = jnp.min(jnp.where(keep_NxV, sorted_NxV, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits_NxV < thresh_Nx1, -jnp.inf, logits_NxV)


def scaled_logits(logits_NxV: jax.Array, temperature) -> jax.Array:
    """logits / temperature, with temperature 0 as the limit T -> 0 of softmax(logits / T): the
    maximal logits become 0 and all others -inf, so a softmax gives the uniform distribution over the
    maxima (a point mass without ties) and every derived log-prob of a drawn token is finite.
    `temperature` may be traced (a scalar >= 0); both forms are computed and one is selected."""
    t = jnp.asarray(temperature, logits_NxV.dtype)
    positive = t > 0
    divided = logits_NxV / jnp.where(positive, t, 1.0)
    is_max = logits_NxV == jnp.max(logits_NxV, axis=-1, keepdims=True)
    return jnp.where(positive, divided, jnp.where(is_max, 0.0, -jnp.inf))


def check_temperature(temperature) -> None:
    """A concrete negative (or NaN) temperature is a ValueError; a traced one cannot be checked here."""
    if isinstance(temperature, Tracer):
        return
    if not float(temperature) >= 0:
        raise ValueError(f"temperature: got {temperature!r}, expected a number >= 0 (0 = greedy)")


def temperature_checked(sampler):
    """Wrap a jitted sampler (keyword `sampling`) so a concrete bad temperature fails before tracing."""

    @functools.wraps(sampler)
    def call(*args, **kwargs):
        if "sampling" in kwargs:  # else the sampler's own TypeError names the missing argument
            check_temperature(kwargs["sampling"].temperature)
        return sampler(*args, **kwargs)

    return call


def first_argmax(x_NxV: jax.Array) -> jax.Array:
    """`jnp.argmax(x, -1)` (the first maximal index) as two plain reductions: XLA:CPU lowers argmax
    to a variadic (value, index) reduce that costs far more than a max over the same (N, V)."""
    max_Nx1 = jnp.max(x_NxV, axis=-1, keepdims=True)
    iota_NxV = lax.broadcasted_iota(jnp.int32, x_NxV.shape, 1)
    first_N = jnp.min(jnp.where(x_NxV == max_Nx1, iota_NxV, x_NxV.shape[-1]), axis=-1)
    return jnp.minimum(first_N, x_NxV.shape[-1] - 1)  # an all-NaN row would match nowhere


def choose_tokens(rng, logits_NxV, temperature, top_k: int, top_p: float, greedy: bool) -> jax.Array:
    if greedy:
        return first_argmax(logits_NxV)
    scaled_NxV = truncate_logits(scaled_logits(logits_NxV, temperature), top_k, top_p)
    # Gumbel-max, as jax.random.categorical draws it, with the cheaper argmax.
    return first_argmax(scaled_NxV + jax.random.gumbel(rng, scaled_NxV.shape, scaled_NxV.dtype))


def _emit(s: _Loop, logits_NxV, sp: SamplingParams) -> _Loop:
    """Draw column `step` for every row; rows already done write pad with mask 0."""
    rng, key = jax.random.split(s.rng)
    logits_NxV = logits_NxV.astype(jnp.float32)
    tok_N = choose_tokens(key, logits_NxV, sp.temperature, sp.top_k, sp.top_p, sp.greedy)
    logp_all_NxV = jax.nn.log_softmax(scaled_logits(logits_NxV, sp.temperature), axis=-1)
    logp_N = jnp.take_along_axis(logp_all_NxV, tok_N[:, None], axis=-1)[:, 0]
    live_N = ~s.done_N
    tok_N = jnp.where(live_N, tok_N, sp.pad_id)
    logp_N = jnp.where(live_N, logp_N, 0.0)

    def col(buf, x):
        return lax.dynamic_update_slice(buf, x[:, None].astype(buf.dtype), (0, s.step))

    return s._replace(
        step=s.step + 1,
        last_N=tok_N,
        tokens_NxT=col(s.tokens_NxT, tok_N),
        logp_NxT=col(s.logp_NxT, logp_N),
        mask_NxT=col(s.mask_NxT, live_N),
        done_N=s.done_N | (live_N & (tok_N == sp.eos_id)),
        rng=rng,
    )


def _prefill_prompts(
    params,
    cfg: ModelConfig,
    prompt_BxP,
    prompt_mask_BxP,
    group_size: int,
    cache_len: int,
    routing_len: int,
    parallel: Parallel | None = None,
):
    """Prefill each prompt once (all but its last token) into a cache of cache_len slots, one row
    per prompt -> (LayerCache, routing_NxSxLxK of the G rows of every prompt or None, last_N)."""
    B, P = prompt_BxP.shape
    G = group_size
    cache = init_cache(cfg, B, cache_len)
    routing_NxSxLxK = None
    if cfg.n_experts:
        routing_NxSxLxK = jnp.zeros((B * G, routing_len, cfg.n_moe_layers, cfg.experts_per_token), jnp.int32)
    if P > 1:
        prefix_BxP1, prefix_mask_BxP1 = prompt_BxP[:, :-1], prompt_mask_BxP[:, :-1]
        _, cache, experts_LxBxPxK = prefill(params, cfg, prefix_BxP1, prefix_mask_BxP1, cache, parallel)
        if routing_NxSxLxK is not None:  # cfg.n_experts
            experts_NxPxLxK = jnp.repeat(jnp.transpose(experts_LxBxPxK, (1, 2, 0, 3)), G, axis=0)
            routing_NxSxLxK = lax.dynamic_update_slice(routing_NxSxLxK, experts_NxPxLxK, (0, 0, 0, 0))
    # The loop runs on per-layer params and cache buffers (`decode`):
    # both are split once here instead of sliced out of the stacked arrays at every step.
    return to_layer_cache(cache), routing_NxSxLxK, jnp.repeat(prompt_BxP[:, -1].astype(jnp.int32), G, axis=0)


def prefill_groups(
    params,
    cfg: ModelConfig,
    prompt_BxP,
    prompt_mask_BxP,
    group_size: int,
    cache_len: int,
    routing_len: int,
    parallel: Parallel | None = None,
):
    """Shared prefill: each prompt is encoded once, then its cache is copied to its G rows (rows
    i*G .. i*G+G-1). The last prompt token is left out and returned as every row's first decode
    input, so every column is drawn by the one in-loop sampler and no decode step is wasted; left
    padding makes that last slot a real token in every row.

    -> (LayerCache of cache_len slots, per-layer params, routing_NxSxLxK (MoE, S = routing_len;
    else None), last_N)."""
    cache, routing_NxSxLxK, last_N = _prefill_prompts(
        params, cfg, prompt_BxP, prompt_mask_BxP, group_size, cache_len, routing_len, parallel
    )

    def rep(x):
        return jnp.repeat(x, group_size, axis=0)

    cache = LayerCache(jax.tree.map(rep, cache.kv), rep(cache.valid_BxS), rep(cache.pos_B))
    return cache, layer_params(params, cfg), routing_NxSxLxK, last_N


def prefill_shared(
    params,
    cfg: ModelConfig,
    prompt_BxP,
    prompt_mask_BxP,
    group_size: int,
    own_len: int,
    routing_len: int,
    parallel: Parallel | None = None,
):
    """`prefill_groups` with the prompt prefix kept once per group: a `GroupCache` whose prefix is the
    P-1 prefilled slots of each prompt and whose rows get own_len zeroed completion slots (slot t
    holds the token fed at decode step t: the last prompt token, then each drawn token)."""
    P1 = prompt_BxP.shape[1] - 1
    prefix, routing_NxSxLxK, last_N = _prefill_prompts(
        params, cfg, prompt_BxP, prompt_mask_BxP, group_size, P1, routing_len, parallel
    )
    return group_cache(prefix, group_size, own_len), layer_params(params, cfg), routing_NxSxLxK, last_N


def _prefill_for_decode(
    params, cfg: ModelConfig, prompt_BxP, prompt_mask_BxP, G: int, T: int, share_prefix: bool, decode_segments, ep
):
    """`sample`'s prefill and its decode step over the cache kind `share_prefix` picks -> (segment
    ends, cache, routing_NxSxLxK or None, last_N, step_fn(tok_N, cache, step) -> (logits_Nx1xV, cache,
    experts_Nx1xLxK or None)). ep: the MoE layers' `Parallel` (or None)."""
    P = prompt_BxP.shape[1]
    if share_prefix:
        ends = segment_ends(T, decode_segments or default_segments(T))
        cache, lparams, routing_NxSxLxK, last_N = prefill_shared(
            params, cfg, prompt_BxP, prompt_mask_BxP, G, ends[0], P + T, ep
        )

        def shared_step(tok_N, cache, step):
            return decode_group_layers(lparams, cfg, tok_N[:, None], cache, step, ep)

        return ends, cache, routing_NxSxLxK, last_N, shared_step
    cache, lparams, routing_NxSxLxK, last_N = prefill_groups(
        params, cfg, prompt_BxP, prompt_mask_BxP, G, P + T, P + T, ep
    )

    def own_step(tok_N, cache, step):
        return decode_layers(lparams, cfg, tok_N[:, None], cache, P - 1 + step, parallel=ep)

    return (T,), cache, routing_NxSxLxK, last_N, own_step


@temperature_checked
@functools.partial(
    jax.jit,
    static_argnames=("cfg", "group_size", "share_prefix", "decode_segments", "parallel"),
)
def sample(
    params,
    cfg: ModelConfig,
    prompt_BxP,
    prompt_mask_BxP,
    rng,
    *,
    sampling: SamplingParams,
    group_size: int,
    share_prefix: bool = True,
    decode_segments: int | None = None,
    parallel: Parallel | None = None,
) -> SampleOutput:
    """G completions per left-padded prompt; output rows i*G .. i*G+G-1 belong to prompt i.

    `sampling`: temperature and eos_id traced, the rest static (see `SamplingParams`).
    share_prefix (default) decodes over a `GroupCache`: the prompt prefix stored once per group and
    the loop run in `decode_segments` segments (default `default_segments`) whose completion buffers
    grow, so early steps skip the never-written slots; False keeps one P+T-slot cache per row (the
    same tokens and log-probs up to float32 summation order).
    parallel (MoE): the experts' mesh axis (`moe_dispatch.Parallel`), the one the update
    is given; None: one-device dispatch.
    """
    B, P = prompt_BxP.shape
    G, T, pad_id = group_size, sampling.max_new_tokens, sampling.pad_id
    N = B * G
    ends, cache, routing_NxSxLxK, last_N, step_fn = _prefill_for_decode(
        params, cfg, prompt_BxP, prompt_mask_BxP, G, T, share_prefix, decode_segments, parallel
    )
    state = _Loop(
        step=jnp.zeros((), jnp.int32),
        cache=cache,
        last_N=last_N,
        tokens_NxT=jnp.full((N, T), pad_id, jnp.int32),
        logp_NxT=jnp.zeros((N, T), jnp.float32),
        mask_NxT=jnp.zeros((N, T), jnp.float32),
        done_N=jnp.zeros((N,), bool),
        rng=rng,
        routing_NxSxLxK=routing_NxSxLxK,
    )

    def body(s: _Loop):
        # Step t feeds the last prompt token, then each drawn token, at prompt slot P-1+t.
        logits_Nx1xV, cache, experts_Nx1xLxK = step_fn(s.last_N, s.cache, s.step)
        if experts_Nx1xLxK is not None:
            assert s.routing_NxSxLxK is not None  # a MoE model's loop carries its routing
            s = s._replace(
                routing_NxSxLxK=lax.dynamic_update_slice(s.routing_NxSxLxK, experts_Nx1xLxK, (0, P - 1 + s.step, 0, 0))
            )
        return _emit(s._replace(cache=cache), logits_Nx1xV[:, 0], sampling)

    for end in ends:  # one loop per segment; a segment's steps write completion slots < end
        if share_prefix:
            assert isinstance(state.cache, GroupCache)
            state = state._replace(cache=grow_own(state.cache, end))
        state = lax.while_loop(lambda s, end=end: (s.step < end) & ~jnp.all(s.done_N), body, state)
    return SampleOutput(
        tokens_BxT=state.tokens_NxT,
        completion_mask_BxT=state.mask_NxT,
        logp_BxT=state.logp_NxT,
        finished_B=state.done_N,
        length_B=jnp.sum(state.mask_NxT, axis=-1).astype(jnp.int32),
        num_steps=state.step,
        routing_BxSxLxK=state.routing_NxSxLxK,
    )
