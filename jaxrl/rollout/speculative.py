"""Speculative rollouts: the policy verifies cheap drafts, several tokens per forward, exactly.

`sample_speculative` returns what `sampler.sample` returns (tokens, masks, log-probs under
softmax(logits / temperature), routing for MoE) from the same distribution, plus `SpecStats`.

Each loop step is one of three kinds, chosen in the graph:
  plain   one policy decode step (as `sampler.sample`);
  self    a self-drafter (`drafters.py`: early exit or int8) drafts k tokens one by one, then ONE
          policy forward over [last token, k drafts] verifies them (`acceptance.py`);
  reuse   the previous completion of the row's prompt is the draft (no draft cost): up to
          `reuse_width` tokens verified per forward as point masses; a row's reused draft dies at
          its first rejection (what follows was conditioned on another prefix).
With `adaptive`, each step takes the kind with the most expected tokens per unit cost (costs in
plain steps, measured on this machine by `calibrate.py` or the configured constants; a verify
forward costs v, its branch's static width, whatever k is). Self: the best draft length k for
acceptance estimate r and draft cost c, rate (1 - r^(k+1)) / (1 - r) / (v + k c). Reuse (only while
some live row still has a live reused draft): a row with m drafted tokens left in the window gets
(1 - r'^(m+1)) / (1 - r') tokens, the others one, over v'. Plain: 1. Both estimates start at their
priors (the previous rollout's final estimates) and are updated from every step's accept/reject
counts. No speculation while more than `max_active_rows` rows are still decoding.

Rows accept different numbers of tokens with static shapes: a step's forwards leave the KV cache
untouched and write their keys/values to a small window (`decode.window_layers`); after the step
each row's window is written at the row's own fill level and the fill level advances by the tokens
the row kept (`decode.commit_window`). Rejected drafts leave no holes, so the cache needs only
P + T + W_max slots, and the branches of the step (`lax.switch`) never write the cache: a branch
that updated it would make XLA copy the whole cache every step."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl.config import ModelConfig, SpeculativeConfig
from jaxrl.models.decode import LayerCache, commit_window, empty_window, window_layers
from jaxrl.rollout import acceptance
from jaxrl.rollout.calibrate import StepCosts, constant_costs
from jaxrl.rollout.drafters import draft_view
from jaxrl.rollout.sampler import SampleOutput, first_argmax, prefill_groups, scaled_logits, temperature_checked

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


class _State(NamedTuple):
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


def choose_draft_length(r, max_draft: int, draft_cost, adaptive: bool, verify_cost: float | jax.Array = 1.0):
    """-> (k, gain): the draft length with the most expected tokens per unit cost (verify_cost for
    the verify, a scalar or one per k = 1..max_draft; draft_cost per drafted token; both in plain
    decode steps) and that rate (a plain step's is 1)."""
    k_K = jnp.arange(1, max_draft + 1, dtype=jnp.float32)
    r = jnp.clip(r, 0.0, 0.999)
    rate_K = (1 - r ** (k_K + 1)) / (1 - r) / (verify_cost + k_K * draft_cost)
    best = jnp.argmax(rate_K) if adaptive else max_draft - 1
    return jnp.asarray(best + 1, jnp.int32), rate_K[best]


def worth_speculating(
    costs: StepCosts, spec: SpeculativeConfig, acceptance: float, reuse_acceptance: float, draft_len_N=None
) -> bool:
    """Host-side, before a rollout: can any speculative step beat a plain one at these acceptance
    estimates? Reuse (draft_len_N: each row's reused draft length, 0 for none) is judged on its first
    step, where every draft is whole: a row with m drafted tokens in the window expects
    (1 - r^(m+1)) / (1 - r) tokens, one without a draft 1. When nothing can gain, the caller runs
    the plain sampler and saves the speculative loop's bookkeeping (the loop itself would only run
    plain steps). Always True when `spec.adaptive` is off."""
    if not spec.adaptive:
        return True
    verify_K = np.asarray(costs.verify_K, np.float64)
    rates = []
    self_drafter = spec.fallback if spec.drafter == "reuse" else spec.drafter
    if self_drafter != "none":
        rates.append(
            float(
                choose_draft_length(
                    jnp.float32(acceptance),
                    spec.max_draft,
                    float(costs.draft),
                    True,
                    float(verify_K[spec.max_draft - 1]),
                )[1]
            )
        )
    if spec.drafter == "reuse" and draft_len_N is not None and np.any(np.asarray(draft_len_N) > 0):
        r = min(max(float(reuse_acceptance), 0.0), 0.999)
        m_N = np.minimum(np.asarray(draft_len_N, np.float64), spec.reuse_width)
        rates.append(float(np.mean((1 - r ** (m_N + 1)) / (1 - r))) / verify_K[spec.reuse_width - 1])
    return max(rates, default=0.0) > 1.0


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


def _row_write(buf_NxU, vals_NxW, col_N):
    return jax.vmap(lambda b, v, c: lax.dynamic_update_slice(b, v.astype(b.dtype), (c,)))(buf_NxU, vals_NxW, col_N)


def _row_window(buf_NxT, col_N, width: int, fill):
    """buf[n, col_n : col_n + width], past the end filled with `fill`."""
    padded = jnp.pad(buf_NxT, ((0, 0), (0, width)), constant_values=fill)
    return jax.vmap(lambda b, c: lax.dynamic_slice(b, (c,), (width,)))(padded, col_N)


@temperature_checked
@functools.partial(
    jax.jit,
    static_argnames=("cfg", "spec", "group_size", "max_new_tokens", "top_k", "top_p", "eos_id", "pad_id", "greedy"),
)
def sample_speculative(
    params,
    cfg: ModelConfig,
    prompt_BxP,
    prompt_mask_BxP,
    rng,
    *,
    spec: SpeculativeConfig,
    group_size: int,
    max_new_tokens: int,
    temperature,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int,
    pad_id: int,
    greedy: bool = False,
    acceptance_prior=None,
    reuse_acceptance_prior=None,
    draft_NxT: jax.Array | None = None,
    draft_len_N: jax.Array | None = None,
    draft_logp_NxT: jax.Array | None = None,
    costs: StepCosts | None = None,
):
    """`sampler.sample` with speculation -> (SampleOutput, SpecStats).

    For `spec.drafter == "reuse"`: draft_NxT holds each output row's previous completion (pad after
    it), draft_len_N its length (0: no draft for that row) and, for the approximate `spec_rl` rule
    only, draft_logp_NxT the log-probs it was sampled with. `acceptance_prior` (float, default
    spec.initial_acceptance) seeds the self-draft acceptance estimate, `reuse_acceptance_prior` the
    reused-token one; pass the previous rollout's `stats.acceptance` / `stats.reuse_acceptance` to
    carry them over. `costs` (calibrate.StepCosts, e.g. measured by
    `calibrate.measure_step_costs`) replace spec.verify_cost / spec.draft_cost in the control."""
    B, P = prompt_BxP.shape
    G, T = group_size, max_new_tokens
    N = B * G
    reuse = spec.drafter == "reuse"
    self_drafter = spec.fallback if reuse else spec.drafter
    if self_drafter == "none":
        self_drafter = None
    if self_drafter == "early_exit" and not 0 < spec.draft_layers < cfg.n_layers:
        raise ValueError(
            f"rollout.speculative.draft_layers: got {spec.draft_layers}, expected 1..{cfg.n_layers - 1} "
            f"(fewer than model.n_layers={cfg.n_layers})"
        )
    if reuse and (draft_NxT is None or draft_len_N is None):
        raise ValueError(
            "rollout.speculative.drafter='reuse' needs draft_NxT and draft_len_N (the previous completions)"
        )
    if reuse and draft_NxT is not None and draft_NxT.shape[0] != N:
        raise ValueError(f"draft_NxT has {draft_NxT.shape[0]} rows, expected prompts x group_size = {N}")
    approx = reuse and spec.reuse_rule == "spec_rl"
    if approx and draft_logp_NxT is None:
        raise ValueError("rollout.speculative.reuse_rule='spec_rl' needs draft_logp_NxT (the drafts' old log-probs)")
    costs = constant_costs(spec) if costs is None else costs
    W_self, W_reuse = spec.max_draft + 1, spec.reuse_width + 1
    W_max = max(1, W_self if self_drafter else 1, W_reuse if reuse else 1)
    U = T + W_max

    cache, lparams, routing, last_N = prefill_groups(
        params, cfg, prompt_BxP, prompt_mask_BxP, G, P + T + W_max, P + T + W_max
    )
    # Slots from P-1 on are decoded tokens: what a row may see of them is bounded by its fill level.
    cache = cache._replace(valid_BxS=cache.valid_BxS.at[:, P - 1 :].set(True))
    if self_drafter:
        dparams, d_layers = draft_view(lparams, self_drafter, spec.draft_layers, cfg.n_layers)
    if reuse and draft_NxT is not None and draft_len_N is not None:  # both given with reuse (checked above)
        draft_NxT = draft_NxT.astype(jnp.int32)
        draft_len_N = jnp.minimum(draft_len_N.astype(jnp.int32), draft_NxT.shape[1])
    prior = jnp.asarray(spec.initial_acceptance if acceptance_prior is None else acceptance_prior, jnp.float32)
    reuse_prior = jnp.asarray(
        spec.initial_acceptance if reuse_acceptance_prior is None else reuse_acceptance_prior, jnp.float32
    )
    # A verify forward always runs its branch's full static width, whatever k the control picks.
    verify_self, verify_reuse = costs.verify_K[spec.max_draft - 1], costs.verify_K[spec.reuse_width - 1]
    zero_i = jnp.zeros((), jnp.int32)
    state = _State(
        step=zero_i,
        cache=cache,
        fill_N=jnp.full((N,), P - 1, jnp.int32),
        last_N=last_N,
        col_N=jnp.zeros((N,), jnp.int32),
        tokens_NxU=jnp.full((N, U), pad_id, jnp.int32),
        logp_NxU=jnp.zeros((N, U), jnp.float32),
        mask_NxU=jnp.zeros((N, U), jnp.float32),
        done_N=jnp.zeros((N,), bool),
        alive_N=(draft_len_N > 0) if draft_len_N is not None and reuse else jnp.zeros((N,), bool),
        rng=rng,
        stats=_fresh_stats(prior, reuse_prior),
        routing_NxSxLxK=routing,
    )

    def estimate(st: SpecStats):
        return (st.self_accepted + prior * PRIOR_WEIGHT) / (st.self_accepted + st.self_rejected + PRIOR_WEIGHT)

    def reuse_estimate(st: SpecStats):
        return (st.reuse_accepted + reuse_prior * PRIOR_WEIGHT) / (st.reuse_accepted + st.reuse_rejected + PRIOR_WEIGHT)

    def verify(s: _State, fed_NxW, drafted_NxW, q_NxWxV=None, old_logp_NxW=None):
        """One policy forward over fed_NxW (window slots 0..W-1), accept/reject, emit the kept tokens.
        -> (state, window, n_accepted_N, new_token_N, live_N); the window is committed by `body`."""
        W = fed_NxW.shape[1]
        window = empty_window(s.cache, W_max, cfg.n_layers)
        logits_NxWxV, window, experts = window_layers(lparams, cfg, fed_NxW, s.cache, s.fill_N, window, 0)
        rng, key = jax.random.split(s.rng)
        if greedy:
            a_N, new_N = acceptance.verify_greedy(logits_NxWxV, fed_NxW, drafted_NxW)
        else:
            p_NxWxV = acceptance.target_probs(logits_NxWxV, temperature, top_k, top_p)
            a_N, new_N = acceptance.verify_sampled(key, p_NxWxV, fed_NxW, drafted_NxW, q_NxWxV, old_logp_NxW)
        iota_W = jnp.arange(W)
        next_NxW = jnp.concatenate([fed_NxW[:, 1:], jnp.zeros((N, 1), fed_NxW.dtype)], axis=1)
        e_NxW = jnp.where(iota_W < a_N[:, None], next_NxW, jnp.where(iota_W == a_N[:, None], new_N[:, None], pad_id))
        logp_all = jax.nn.log_softmax(scaled_logits(logits_NxWxV, temperature), axis=-1)
        logp_NxW = jnp.take_along_axis(logp_all, e_NxW[..., None].astype(jnp.int32), axis=-1)[..., 0]
        live_N = ~s.done_N
        is_eos_NxW = e_NxW == eos_id
        eos_before_NxW = (jnp.cumsum(is_eos_NxW, axis=1) - is_eos_NxW) > 0
        emit_NxW = live_N[:, None] & (iota_W <= a_N[:, None]) & ~eos_before_NxW & (s.col_N[:, None] + iota_W < T)
        col_N = s.col_N + jnp.sum(emit_NxW, axis=1, dtype=jnp.int32)
        if experts is not None:  # fed token i sits at completion slot P-1+col+i
            routing = jax.vmap(lambda r, e, c: lax.dynamic_update_slice(r, e, (c, 0, 0)))(
                s.routing_NxSxLxK, experts, P - 1 + s.col_N
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

    def step_result(s: _State, window, a_N, live_N):
        """What a branch returns: the state without its cache, the window, each row's kept tokens."""
        return s._replace(cache=None), window, jnp.where(live_N, a_N + 1, 0)

    def plain_step(s: _State):
        s, window, a_N, _, live_N = verify(s, s.last_N[:, None], jnp.zeros((N, 1), bool))
        return step_result(s._replace(stats=s.stats._replace(plain_steps=s.stats.plain_steps + 1)), window, a_N, live_N)

    def count(st: SpecStats, live_N, n_drafted_N, a_N):
        live_i = live_N.astype(jnp.int32)
        rejected_N = live_i * (a_N < n_drafted_N)
        return st._replace(
            drafted=st.drafted + jnp.sum(live_i * n_drafted_N),
            accepted=st.accepted + jnp.sum(live_i * a_N),
            rejections=st.rejections + jnp.sum(rejected_N),
            row_verifications=st.row_verifications + jnp.sum(live_i),
        ), rejected_N

    def self_step(s: _State):
        k, _ = choose_draft_length(estimate(s.stats), spec.max_draft, costs.draft, spec.adaptive, verify_self)
        V = cfg.vocab_size
        fed0_NxW = jnp.zeros((N, W_self), jnp.int32).at[:, 0].set(s.last_N)
        q0_NxWxV = None if greedy else jnp.zeros((N, W_self, V), jnp.float32)

        def draft_one(i, c):
            window, tok_N, fed_NxW, q_NxWxV, rng = c
            logits_Nx1xV, window, _ = window_layers(
                dparams, cfg, tok_N[:, None], s.cache, s.fill_N, window, i, d_layers
            )
            rng, key = jax.random.split(rng)
            if greedy:
                d_N = first_argmax(logits_Nx1xV[:, 0])
            else:
                q_NxV = acceptance.target_probs(logits_Nx1xV, temperature, top_k, top_p)[:, 0]
                d_N = acceptance.categorical(key, q_NxV)
                q_NxWxV = lax.dynamic_update_slice(q_NxWxV, q_NxV[:, None], (0, i + 1, 0))
            fed_NxW = lax.dynamic_update_slice(fed_NxW, d_N[:, None].astype(jnp.int32), (0, i + 1))
            return window, d_N, fed_NxW, q_NxWxV, rng

        _, _, fed_NxW, q_NxWxV, rng = lax.fori_loop(
            0, k, draft_one, (empty_window(s.cache, W_self, d_layers), s.last_N, fed0_NxW, q0_NxWxV, s.rng)
        )
        # The drafter's window is dropped: the verify forward computes the policy's own keys/values.
        s = s._replace(rng=rng)
        drafted_NxW = (jnp.arange(W_self) >= 1) & (jnp.arange(W_self) <= k)
        drafted_NxW = jnp.broadcast_to(drafted_NxW, (N, W_self))
        s, window, a_N, _, live_N = verify(s, fed_NxW, drafted_NxW, q_NxWxV)
        st, rejected_N = count(s.stats, live_N, jnp.full((N,), k), a_N)
        st = st._replace(
            self_steps=st.self_steps + 1,
            draft_len_sum=st.draft_len_sum + k,
            self_accepted=st.self_accepted + jnp.sum(live_N * a_N).astype(jnp.float32),
            self_rejected=st.self_rejected + jnp.sum(rejected_N).astype(jnp.float32),
        )
        return step_result(s._replace(stats=st._replace(acceptance=estimate(st))), window, a_N, live_N)

    def reuse_step(s: _State):
        assert draft_NxT is not None and draft_len_N is not None  # a reuse step runs only with reuse drafts
        window_NxW1 = _row_window(draft_NxT, s.col_N, W_reuse - 1, pad_id)
        fed_NxW = jnp.concatenate([s.last_N[:, None], window_NxW1], axis=1)
        offset_W = jnp.arange(W_reuse) - 1  # fed token i >= 1 is draft column col + i - 1
        drafted_NxW = (offset_W >= 0) & s.alive_N[:, None] & (s.col_N[:, None] + offset_W < draft_len_N[:, None])
        old_logp = None
        if approx:
            assert draft_logp_NxT is not None  # checked on entry
            old_logp = jnp.concatenate(
                [jnp.zeros((N, 1)), _row_window(draft_logp_NxT, s.col_N, W_reuse - 1, 0.0)], axis=1
            )
        col_before_N = s.col_N
        s, window, a_N, new_N, live_N = verify(s, fed_NxW, drafted_NxW, None, old_logp)
        n_drafted_N = jnp.sum(drafted_NxW, axis=1, dtype=jnp.int32)
        st, rejected_N = count(s.stats, live_N, n_drafted_N, a_N)
        st = st._replace(
            reuse_accepted=st.reuse_accepted + jnp.sum(live_N * a_N).astype(jnp.float32),
            reuse_rejected=st.reuse_rejected + jnp.sum(rejected_N).astype(jnp.float32),
        )
        st = st._replace(reuse_acceptance=reuse_estimate(st))
        # Still aligned iff nothing was rejected and the new token is the draft's next one too.
        nxt = col_before_N + a_N
        next_draft_N = jnp.take_along_axis(
            jnp.pad(draft_NxT, ((0, 0), (0, 1)), constant_values=pad_id),
            jnp.minimum(nxt, draft_NxT.shape[1])[:, None],
            axis=1,
        )[:, 0]
        alive_N = s.alive_N & (a_N == n_drafted_N) & (nxt < draft_len_N) & (new_N == next_draft_N)
        s = s._replace(alive_N=alive_N, stats=st._replace(reuse_steps=st.reuse_steps + 1))
        return step_result(s, window, a_N, live_N)

    # Only the kinds this configuration can run are compiled (each branch unrolls the layers again).
    branches = [plain_step] + ([self_step] if self_drafter else []) + ([reuse_step] if reuse else [])
    SELF, REUSE = 1, len(branches) - 1

    def reuse_rate(s: _State, live_N):
        """Expected tokens per live row per unit cost of a reuse step: a row with m drafted tokens
        left in the window gets (1 - r^(m+1)) / (1 - r), the others one token."""
        assert draft_len_N is not None  # only called with reuse drafts
        r = jnp.clip(reuse_estimate(s.stats), 0.0, 0.999)
        m_N = jnp.clip(draft_len_N - s.col_N, 0, W_reuse - 1)
        tokens_N = jnp.where(s.alive_N, (1 - r ** (m_N + 1)) / (1 - r), 1.0)
        return jnp.sum(live_N * tokens_N) / jnp.maximum(jnp.sum(live_N), 1) / verify_reuse

    def body(s: _State) -> _State:
        live_N = ~s.done_N
        mode, best_rate = PLAIN, jnp.float32(1.0)
        if self_drafter:
            _, gain = choose_draft_length(estimate(s.stats), spec.max_draft, costs.draft, spec.adaptive, verify_self)
            pays = (jnp.sum(live_N) <= spec.max_active_rows) & ((gain > 1.0) | (not spec.adaptive))
            mode = jnp.where(pays, SELF, PLAIN)
            best_rate = jnp.where(pays, gain, best_rate)
        if reuse:
            use = jnp.any(s.alive_N & live_N)
            if spec.adaptive:
                use = use & (jnp.sum(live_N) <= spec.max_active_rows) & (reuse_rate(s, live_N) > best_rate)
            mode = jnp.where(use, REUSE, mode)
        if len(branches) > 1:
            out, window, advance_N = lax.switch(jnp.asarray(mode, jnp.int32), branches, s)
        else:
            out, window, advance_N = plain_step(s)
        return out._replace(
            step=s.step + 1, cache=commit_window(s.cache, window, s.fill_N, advance_N), fill_N=s.fill_N + advance_N
        )

    state = lax.while_loop(lambda s: ~jnp.all(s.done_N), body, state)
    mask_NxT = state.mask_NxU[:, :T]
    out = SampleOutput(
        tokens_BxT=state.tokens_NxU[:, :T],
        completion_mask_BxT=mask_NxT,
        logp_BxT=state.logp_NxU[:, :T],
        finished_B=jnp.any((state.tokens_NxU[:, :T] == eos_id) & (mask_NxT > 0), axis=1),
        length_B=jnp.sum(mask_NxT, axis=-1).astype(jnp.int32),
        num_steps=state.step,
        routing_BxSxLxK=None if state.routing_NxSxLxK is None else state.routing_NxSxLxK[:, : P + T],
    )
    return out, state.stats
