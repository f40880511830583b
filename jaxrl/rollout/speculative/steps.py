"""One step of the speculative loop (`sample.sample_speculative`, whose docstring describes the
method): the loop state, the verify forward with its accept/reject, the three step kinds (plain,
self-draft, reuse), the control that picks one, and the commit of the step's window into the cache.

Pure functions of a `SpecContext` (what one rollout fixes: static shapes and options, the weights,
the drafts, the acceptance priors and the step costs) and the loop state `SpecState`. The step kinds
are `lax.switch` branches: they never write the cache (a branch that did would make XLA copy the
whole cache every step); `loop_step` commits the chosen branch's window after the switch."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl.config import ModelConfig, SpeculativeConfig
from jaxrl.models.decode import LayerCache, commit_window, empty_window, window_layers
from jaxrl.models.parallel import Parallel
from jaxrl.rollout.sampler import SamplingParams, first_argmax, scaled_logits
from jaxrl.rollout.speculative import acceptance
from jaxrl.rollout.speculative.calibrate import StepCosts

PLAIN = 0
PRIOR_WEIGHT = 8.0  # pseudo-counts behind the acceptance prior


class SpecStats(NamedTuple):
    drafted: jax.Array  # int32: draft tokens offered to live rows (self and reuse steps)
    accepted: jax.Array  # int32: of those, accepted
    rejections: jax.Array  # int32: live rows whose draft was cut by a rejection
    row_verifications: jax.Array  # int32: live rows x speculative (self or reuse) steps
    self_steps: jax.Array  # int32
    reuse_steps: jax.Array  # int32
    plain_steps: jax.Array  # int32
    draft_len_sum: jax.Array  # int32: sum of k over self steps
    self_accepted: jax.Array  # float32: accepted / rejections of self steps (the estimate's data)
    self_rejected: jax.Array
    acceptance: jax.Array  # float32: the final self-draft acceptance estimate (next rollout's prior)
    reuse_accepted: jax.Array  # float32: accepted / rejections of reuse steps (the reuse estimate's data)
    reuse_rejected: jax.Array
    reuse_acceptance: jax.Array  # float32: the final reused-token acceptance estimate (next rollout's prior)


class SpecState(NamedTuple):
    step: jax.Array
    cache: LayerCache  # None inside a step's branches (they never write it)
    fill_N: jax.Array  # int32: each row's next cache slot
    last_N: jax.Array  # next token to feed
    col_N: jax.Array  # int32: output columns written per row
    tokens_NxU: jax.Array  # U = T + W_max: room for a whole verify window past column T-1
    logp_NxU: jax.Array
    mask_NxU: jax.Array
    done_N: jax.Array
    alive_N: jax.Array  # bool: the row's reused draft is still aligned with what it generated
    rng: jax.Array
    stats: SpecStats
    routing_NxSxLxK: jax.Array | None


class SpecContext(NamedTuple):
    """What one speculative rollout fixes. Static: shapes, options, the sampling settings' structure.
    Traced: the weights, temperature and eos_id, step costs, acceptance priors and (reuse) the drafts."""

    cfg: ModelConfig
    spec: SpeculativeConfig
    N: int  # rows (prompts x group_size)
    P: int  # prompt length
    W_max: int  # the widest verify window of the kinds this configuration runs
    self_drafter: str | None  # "early_exit" / "int8"; None: no self-drafted steps
    reuse: bool  # reuse steps (drafter "reuse")
    approx: bool  # reuse steps verify with the approximate spec_rl rule
    sampling: SamplingParams
    lparams: Any  # the policy's per-layer weights
    dparams: Any  # the self-drafter's weights (None without one)
    d_layers: int  # layers the self-drafter runs
    costs: StepCosts
    verify_self: Any  # cost of a self step's verify forward (its static width), in plain steps
    verify_reuse: Any  # the same for a reuse step's
    prior: jax.Array  # the self-draft acceptance prior
    reuse_prior: jax.Array  # the reused-token acceptance prior
    draft_NxT: jax.Array | None  # reuse: each row's previous completion
    draft_len_N: jax.Array | None  # reuse: its length (0: no draft)
    draft_logp_NxT: jax.Array | None  # spec_rl only: the log-probs it was sampled with
    parallel: Parallel | None = None  # MoE: the experts' mesh axis (None: one device)

    @property
    def T(self) -> int:
        return self.sampling.max_new_tokens

    @property
    def W_self(self) -> int:
        return self.spec.max_draft + 1

    @property
    def W_reuse(self) -> int:
        return self.spec.reuse_width + 1


def choose_draft_length(r, max_draft: int, draft_cost, adaptive: bool, verify_cost: float | jax.Array = 1.0):
    """-> (k, gain): the draft length with the most expected tokens per unit cost (verify_cost for
    the verify, a scalar or one per k = 1..max_draft; draft_cost per drafted token; both in plain
    decode steps) and that rate (a plain step's is 1)."""
    k_K = jnp.arange(1, max_draft + 1, dtype=jnp.float32)
    r = jnp.clip(r, 0.0, 0.999)
    rate_K = (1 - r ** (k_K + 1)) / (1 - r) / (verify_cost + k_K * draft_cost)
    best = jnp.argmax(rate_K) if adaptive else max_draft - 1
    return jnp.asarray(best + 1, jnp.int32), rate_K[best]


def _fresh_stats(prior: jax.Array, reuse_prior: jax.Array) -> SpecStats:
    """No steps or tokens counted yet; the acceptance estimates start at their priors."""
    i, f = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32)
    return SpecStats(
        drafted=i,
        accepted=i,
        rejections=i,
        row_verifications=i,
        self_steps=i,
        reuse_steps=i,
        plain_steps=i,
        draft_len_sum=i,
        self_accepted=f,
        self_rejected=f,
        acceptance=prior,
        reuse_accepted=f,
        reuse_rejected=f,
        reuse_acceptance=reuse_prior,
    )


def initial_state(ctx: SpecContext, cache: LayerCache, last_N, routing_NxSxLxK, rng) -> SpecState:
    """Before the first step: every row at fill level P-1 (its last prompt token not yet fed), nothing
    emitted, a row's reused draft alive iff it has one."""
    N, U = ctx.N, ctx.T + ctx.W_max
    zero_i = jnp.zeros((), jnp.int32)
    return SpecState(
        step=zero_i,
        cache=cache,
        fill_N=jnp.full((N,), ctx.P - 1, jnp.int32),
        last_N=last_N,
        col_N=jnp.zeros((N,), jnp.int32),
        tokens_NxU=jnp.full((N, U), ctx.sampling.pad_id, jnp.int32),
        logp_NxU=jnp.zeros((N, U), jnp.float32),
        mask_NxU=jnp.zeros((N, U), jnp.float32),
        done_N=jnp.zeros((N,), bool),
        alive_N=(ctx.draft_len_N > 0) if ctx.draft_len_N is not None and ctx.reuse else jnp.zeros((N,), bool),
        rng=rng,
        stats=_fresh_stats(ctx.prior, ctx.reuse_prior),
        routing_NxSxLxK=routing_NxSxLxK,
    )


def _estimate(ctx: SpecContext, st: SpecStats):
    """The self-draft acceptance estimate: the prior's pseudo-counts plus the observed counts."""
    return (st.self_accepted + ctx.prior * PRIOR_WEIGHT) / (st.self_accepted + st.self_rejected + PRIOR_WEIGHT)


def _reuse_estimate(ctx: SpecContext, st: SpecStats):
    """The reused-token acceptance estimate, as `_estimate`."""
    return (st.reuse_accepted + ctx.reuse_prior * PRIOR_WEIGHT) / (st.reuse_accepted + st.reuse_rejected + PRIOR_WEIGHT)


def _row_write(buf_NxU, vals_NxW, col_N):
    return jax.vmap(lambda b, v, c: lax.dynamic_update_slice(b, v.astype(b.dtype), (c,)))(buf_NxU, vals_NxW, col_N)


def _row_window(buf_NxT, col_N, width: int, fill):
    """buf[n, col_n : col_n + width], past the end filled with `fill`."""
    padded = jnp.pad(buf_NxT, ((0, 0), (0, width)), constant_values=fill)
    return jax.vmap(lambda b, c: lax.dynamic_slice(b, (c,), (width,)))(padded, col_N)


def _verify(ctx: SpecContext, s: SpecState, fed_NxW, drafted_NxW, q_NxWxV=None, old_logp_NxW=None):
    """One policy forward over fed_NxW (window slots 0..W-1), accept/reject, emit the kept tokens.
    -> (state, window, n_accepted_N, new_token_N, live_N); the window is committed by `loop_step`."""
    N, T, W, pad_id, eos_id = ctx.N, ctx.T, fed_NxW.shape[1], ctx.sampling.pad_id, ctx.sampling.eos_id
    window = empty_window(s.cache, ctx.W_max, ctx.cfg.n_layers)
    logits_NxWxV, window, experts = window_layers(
        ctx.lparams, ctx.cfg, fed_NxW, s.cache, s.fill_N, window, 0, parallel=ctx.parallel
    )
    rng, key = jax.random.split(s.rng)
    if ctx.sampling.greedy:
        a_N, new_N = acceptance.verify_greedy(logits_NxWxV, fed_NxW, drafted_NxW)
    else:
        p_NxWxV = acceptance.target_probs(
            logits_NxWxV, ctx.sampling.temperature, ctx.sampling.top_k, ctx.sampling.top_p
        )
        a_N, new_N = acceptance.verify_sampled(key, p_NxWxV, fed_NxW, drafted_NxW, q_NxWxV, old_logp_NxW)
    iota_W = jnp.arange(W)
    next_NxW = jnp.concatenate([fed_NxW[:, 1:], jnp.zeros((N, 1), fed_NxW.dtype)], axis=1)
    e_NxW = jnp.where(iota_W < a_N[:, None], next_NxW, jnp.where(iota_W == a_N[:, None], new_N[:, None], pad_id))
    logp_all = jax.nn.log_softmax(scaled_logits(logits_NxWxV, ctx.sampling.temperature), axis=-1)
    logp_NxW = jnp.take_along_axis(logp_all, e_NxW[..., None].astype(jnp.int32), axis=-1)[..., 0]
    live_N = ~s.done_N
    is_eos_NxW = e_NxW == eos_id
    eos_before_NxW = (jnp.cumsum(is_eos_NxW, axis=1) - is_eos_NxW) > 0
    emit_NxW = live_N[:, None] & (iota_W <= a_N[:, None]) & ~eos_before_NxW & (s.col_N[:, None] + iota_W < T)
    col_N = s.col_N + jnp.sum(emit_NxW, axis=1, dtype=jnp.int32)
    if experts is not None:  # fed token i sits at completion slot P-1+col+i
        routing = jax.vmap(lambda r, e, c: lax.dynamic_update_slice(r, e, (c, 0, 0)))(
            s.routing_NxSxLxK, experts, ctx.P - 1 + s.col_N
        )
        s = s._replace(routing_NxSxLxK=routing)
    s = s._replace(
        last_N=new_N,
        col_N=col_N,
        tokens_NxU=_row_write(s.tokens_NxU, jnp.where(emit_NxW, e_NxW, pad_id), s.col_N),
        logp_NxU=_row_write(s.logp_NxU, jnp.where(emit_NxW, logp_NxW, 0.0), s.col_N),
        mask_NxU=_row_write(s.mask_NxU, emit_NxW, s.col_N),
        done_N=s.done_N | jnp.any(emit_NxW & is_eos_NxW, axis=1) | (col_N >= T),
        rng=rng,
    )
    return s, window, a_N, new_N, live_N


def _step_result(s: SpecState, window, a_N, live_N):
    """What a branch returns: the state without its cache, the window, each row's kept tokens."""
    return s._replace(cache=None), window, jnp.where(live_N, a_N + 1, 0)


def _count(st: SpecStats, live_N, n_drafted_N, a_N):
    """Add a speculative step's draft / accept / reject counts -> (stats, each row's rejection 0/1)."""
    live_i = live_N.astype(jnp.int32)
    rejected_N = live_i * (a_N < n_drafted_N)
    return st._replace(
        drafted=st.drafted + jnp.sum(live_i * n_drafted_N),
        accepted=st.accepted + jnp.sum(live_i * a_N),
        rejections=st.rejections + jnp.sum(rejected_N),
        row_verifications=st.row_verifications + jnp.sum(live_i),
    ), rejected_N


def plain_step(ctx: SpecContext, s: SpecState):
    """One policy decode step: a verify forward over the last token with nothing drafted."""
    s, window, a_N, _, live_N = _verify(ctx, s, s.last_N[:, None], jnp.zeros((ctx.N, 1), bool))
    return _step_result(s._replace(stats=s.stats._replace(plain_steps=s.stats.plain_steps + 1)), window, a_N, live_N)


def _self_draft(ctx: SpecContext, s: SpecState, k):
    """The self-drafter drafts k tokens one by one after the last one -> (fed_NxW: last token then the
    drafts, q_NxWxV: their draft distributions (None when greedy), rng). The drafter's window is
    dropped: the verify forward computes the policy's own keys/values."""
    N, W_self, greedy = ctx.N, ctx.W_self, ctx.sampling.greedy
    fed0_NxW = jnp.zeros((N, W_self), jnp.int32).at[:, 0].set(s.last_N)
    q0_NxWxV = None if greedy else jnp.zeros((N, W_self, ctx.cfg.vocab_size), jnp.float32)

    def draft_one(i, c):
        window, tok_N, fed_NxW, q_NxWxV, rng = c
        logits_Nx1xV, window, _ = window_layers(
            ctx.dparams, ctx.cfg, tok_N[:, None], s.cache, s.fill_N, window, i, ctx.d_layers, ctx.parallel
        )
        rng, key = jax.random.split(rng)
        if greedy:
            d_N = first_argmax(logits_Nx1xV[:, 0])
        else:
            q_NxV = acceptance.target_probs(
                logits_Nx1xV, ctx.sampling.temperature, ctx.sampling.top_k, ctx.sampling.top_p
            )[:, 0]
            d_N = acceptance.categorical(key, q_NxV)
            q_NxWxV = lax.dynamic_update_slice(q_NxWxV, q_NxV[:, None], (0, i + 1, 0))
        fed_NxW = lax.dynamic_update_slice(fed_NxW, d_N[:, None].astype(jnp.int32), (0, i + 1))
        return window, d_N, fed_NxW, q_NxWxV, rng

    _, _, fed_NxW, q_NxWxV, rng = lax.fori_loop(
        0, k, draft_one, (empty_window(s.cache, W_self, ctx.d_layers), s.last_N, fed0_NxW, q0_NxWxV, s.rng)
    )
    return fed_NxW, q_NxWxV, rng


def self_step(ctx: SpecContext, s: SpecState):
    """Draft k tokens with the self-drafter (k chosen by the control), verify them in one forward."""
    spec, N, W_self = ctx.spec, ctx.N, ctx.W_self
    k, _ = choose_draft_length(_estimate(ctx, s.stats), spec.max_draft, ctx.costs.draft, spec.adaptive, ctx.verify_self)
    fed_NxW, q_NxWxV, rng = _self_draft(ctx, s, k)
    s = s._replace(rng=rng)
    drafted_NxW = (jnp.arange(W_self) >= 1) & (jnp.arange(W_self) <= k)
    drafted_NxW = jnp.broadcast_to(drafted_NxW, (N, W_self))
    s, window, a_N, _, live_N = _verify(ctx, s, fed_NxW, drafted_NxW, q_NxWxV)
    st, rejected_N = _count(s.stats, live_N, jnp.full((N,), k), a_N)
    st = st._replace(
        self_steps=st.self_steps + 1,
        draft_len_sum=st.draft_len_sum + k,
        self_accepted=st.self_accepted + jnp.sum(live_N * a_N).astype(jnp.float32),
        self_rejected=st.self_rejected + jnp.sum(rejected_N).astype(jnp.float32),
    )
    return _step_result(s._replace(stats=st._replace(acceptance=_estimate(ctx, st))), window, a_N, live_N)


def reuse_step(ctx: SpecContext, s: SpecState):
    """Verify the next reuse_width tokens of each row's previous completion (point masses) in one
    forward; a row's reused draft dies at its first rejection."""
    draft_NxT, draft_len_N, N, W_reuse, pad_id = ctx.draft_NxT, ctx.draft_len_N, ctx.N, ctx.W_reuse, ctx.sampling.pad_id
    assert draft_NxT is not None and draft_len_N is not None  # a reuse step runs only with reuse drafts
    window_NxW1 = _row_window(draft_NxT, s.col_N, W_reuse - 1, pad_id)
    fed_NxW = jnp.concatenate([s.last_N[:, None], window_NxW1], axis=1)
    offset_W = jnp.arange(W_reuse) - 1  # fed token i >= 1 is draft column col + i - 1
    drafted_NxW = (offset_W >= 0) & s.alive_N[:, None] & (s.col_N[:, None] + offset_W < draft_len_N[:, None])
    old_logp = None
    if ctx.approx:
        assert ctx.draft_logp_NxT is not None  # checked on entry
        old_logp = jnp.concatenate(
            [jnp.zeros((N, 1)), _row_window(ctx.draft_logp_NxT, s.col_N, W_reuse - 1, 0.0)], axis=1
        )
    col_before_N = s.col_N
    s, window, a_N, new_N, live_N = _verify(ctx, s, fed_NxW, drafted_NxW, None, old_logp)
    n_drafted_N = jnp.sum(drafted_NxW, axis=1, dtype=jnp.int32)
    st, rejected_N = _count(s.stats, live_N, n_drafted_N, a_N)
    st = st._replace(
        reuse_accepted=st.reuse_accepted + jnp.sum(live_N * a_N).astype(jnp.float32),
        reuse_rejected=st.reuse_rejected + jnp.sum(rejected_N).astype(jnp.float32),
    )
    st = st._replace(reuse_acceptance=_reuse_estimate(ctx, st))
    # Still aligned iff nothing was rejected and the new token is the draft's next one too.
    nxt = col_before_N + a_N
    next_draft_N = jnp.take_along_axis(
        jnp.pad(draft_NxT, ((0, 0), (0, 1)), constant_values=pad_id),
        jnp.minimum(nxt, draft_NxT.shape[1])[:, None],
        axis=1,
    )[:, 0]
    alive_N = s.alive_N & (a_N == n_drafted_N) & (nxt < draft_len_N) & (new_N == next_draft_N)
    s = s._replace(alive_N=alive_N, stats=st._replace(reuse_steps=st.reuse_steps + 1))
    return _step_result(s, window, a_N, live_N)


def _reuse_rate(ctx: SpecContext, s: SpecState, live_N):
    """Expected tokens per live row per unit cost of a reuse step: a row with m drafted tokens
    left in the window gets (1 - r^(m+1)) / (1 - r), the others one token."""
    assert ctx.draft_len_N is not None  # only called with reuse drafts
    r = jnp.clip(_reuse_estimate(ctx, s.stats), 0.0, 0.999)
    m_N = jnp.clip(ctx.draft_len_N - s.col_N, 0, ctx.W_reuse - 1)
    tokens_N = jnp.where(s.alive_N, (1 - r ** (m_N + 1)) / (1 - r), 1.0)
    return jnp.sum(live_N * tokens_N) / jnp.maximum(jnp.sum(live_N), 1) / ctx.verify_reuse


def _choose_kind(ctx: SpecContext, s: SpecState, self_kind: int, reuse_kind: int):
    """The control: the branch index of the step kind with the most expected tokens per unit cost
    (a plain step's rate is 1); no speculation while more than max_active_rows rows decode."""
    spec = ctx.spec
    live_N = ~s.done_N
    mode, best_rate = PLAIN, jnp.float32(1.0)
    if ctx.self_drafter:
        _, gain = choose_draft_length(
            _estimate(ctx, s.stats), spec.max_draft, ctx.costs.draft, spec.adaptive, ctx.verify_self
        )
        pays = (jnp.sum(live_N) <= spec.max_active_rows) & ((gain > 1.0) | (not spec.adaptive))
        mode = jnp.where(pays, self_kind, PLAIN)
        best_rate = jnp.where(pays, gain, best_rate)
    if ctx.reuse:
        use = jnp.any(s.alive_N & live_N)
        if spec.adaptive:
            use = use & (jnp.sum(live_N) <= spec.max_active_rows) & (_reuse_rate(ctx, s, live_N) > best_rate)
        mode = jnp.where(use, reuse_kind, mode)
    return mode


def loop_step(ctx: SpecContext, s: SpecState) -> SpecState:
    """The while loop's body: pick a step kind, run it, commit its window at each row's fill level
    and advance the fill levels by the tokens each row kept."""
    # Only the kinds this configuration can run are compiled (each branch unrolls the layers again).
    kinds = [plain_step] + ([self_step] if ctx.self_drafter else []) + ([reuse_step] if ctx.reuse else [])
    mode = _choose_kind(ctx, s, 1, len(kinds) - 1)
    if len(kinds) > 1:
        branches = [functools.partial(kind, ctx) for kind in kinds]
        out, window, advance_N = lax.switch(jnp.asarray(mode, jnp.int32), branches, s)
    else:
        out, window, advance_N = plain_step(ctx, s)
    return out._replace(
        step=s.step + 1, cache=commit_window(s.cache, window, s.fill_N, advance_N), fill_N=s.fill_N + advance_N
    )
