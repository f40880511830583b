"""Self-speculative early-exit drafting on the decode engine: several tokens per slot per policy forward.

    spec  = speculative_spec(engine_spec, speculative, draft_ids)  # a SpeculativeEngineSpec (W - 1 more cache slots)
    chunk = ToggleChunk(tail_rows(speculative, slots))             # the engine's chunk strategy

Each speculative step drafts k = `max_draft` tokens per slot with the policy's first `draft_layers`
blocks (`drafters.draft_view`; with `draft_vocab`, a head over `draft_ids` only), verifies them with
ONE forward of the full policy over [last token, k drafts] (`acceptance.verify_sampled`, exact, or
`verify_greedy`) and commits the kept tokens at the slot's own fill level with their log-probs under
softmax(logits / temperature) and the chunk's version. Same `EngineState` and field meanings as the
plain engine; a step is one verify forward. `ToggleChunk` runs plain chunks while more than
`max_active_rows` slots decode, then speculative chunks on those slots' rows only. Samples keep the
plain engine's distribution but are not its draws for the same key. docs/engine.md has the details.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl.config import ConfigError, ModelConfig, SpeculativeConfig
from jaxrl.models.decode import commit_window, empty_window, layer_params, window_layers
from jaxrl.rollout.engine.state import EngineSpec, EngineState, decode_chunk, laid_out
from jaxrl.rollout.sampler import first_argmax, scaled_logits
from jaxrl.rollout.speculative import acceptance
from jaxrl.rollout.speculative.draft_vocab import check_draft_ids, subset_head
from jaxrl.rollout.speculative.drafters import check_self_drafter, draft_view


@dataclasses.dataclass(frozen=True)
class SpeculativeEngineSpec(EngineSpec):
    """An `EngineSpec` plus the drafter's shape (a static jit argument)."""

    draft_layers: int = 1  # blocks the early-exit drafter runs
    max_draft: int = 4  # k: tokens drafted per step (the verify window is k + 1 wide)
    draft_ids: tuple = ()  # the drafter's vocabulary (draft_vocab.py), () = the full one

    @property
    def cache_len(self) -> int:
        # A window of k + 1 written at fill level P-1+T (a finished slot's) ends at P+T+k-1.
        return self.prompt_len + self.max_new_tokens + self.max_draft

    def without_drafter(self) -> SpeculativeEngineSpec:
        """The cache length (max_draft) kept, the drafter's other fields dropped: engines that differ
        only in their drafter (e.g. full vs reduced draft head) share init_state, admit and the
        plain decode_chunk instead of compiling each again."""
        return dataclasses.replace(self, draft_layers=1, draft_ids=())


def check_engine_drafter(speculative: SpeculativeConfig, model_cfg: ModelConfig) -> None:
    """The engine drafts with early exit only, from fewer layers than the policy has."""
    if speculative.drafter != "early_exit":
        raise ConfigError(
            f"rollout.speculative.drafter: got {speculative.drafter!r}, expected 'early_exit' "
            f"with rollout.engine.enabled=true (the engine's only drafter)"
        )
    check_self_drafter(model_cfg, speculative)


def speculative_spec(spec: EngineSpec, speculative: SpeculativeConfig, draft_ids=None) -> SpeculativeEngineSpec:
    """`spec` with the drafter's shape and the room the verify window needs. draft_ids: token ids
    ranked by frequency (`draft_vocab.frequent_ids`), the first `draft_vocab` of which the drafter's
    head covers (unused with draft_vocab=0)."""
    speculative.validate()
    check_engine_drafter(speculative, spec.cfg)
    ids = check_draft_ids(speculative.draft_vocab, draft_ids, spec.cfg.vocab_size)
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(EngineSpec)}
    return SpeculativeEngineSpec(
        **fields, draft_layers=speculative.draft_layers, max_draft=speculative.max_draft, draft_ids=ids
    )


def tail_rows(speculative: SpeculativeConfig, slots: int) -> int:
    """The engine speculates once at most this many slots are decoding: `max_active_rows`, capped at S."""
    return min(speculative.max_active_rows, slots)


def chunk_kind(n_active: int, tail: int) -> str:
    """Which chunk the toggle runs next: "plain" while more than `tail` slots decode (compute-bound:
    a verify costs too many steps), "speculative" once `tail` or fewer do (the memory-bound tail)."""
    return "speculative" if n_active <= tail else "plain"


@dataclasses.dataclass(frozen=True)
class ToggleChunk:
    """The speculative engine's chunk strategy, `state.decode_chunk` over a
    `SpeculativeEngineSpec`: the plain chunk while more than `tail` slots are decoding (it stops as
    soon as `tail` or fewer are), the speculative chunk on those slots' rows only, gathered into
    `tail` rows, once `tail` or fewer are (with tail == S: over all slots, no gather).
    -> (state, counts to add to the engine's: drafted / accepted tokens and speculative_chunks)."""

    tail: int  # slots decoding at or below which chunks speculate
    COUNTS = ("drafted", "accepted", "speculative_chunks")

    def __call__(
        self, params, spec, state, n_steps, version, temperature, decoding_S: np.ndarray, stop_at=None
    ) -> tuple[EngineState, dict[str, int]]:
        """decoding_S: bool[S], the slots that hold a sample still decoding (retired ones are freed)."""
        S, tail = spec.slots, self.tail
        decoding = np.flatnonzero(decoding_S)
        if chunk_kind(len(decoding), tail) == "plain":
            stop_at = min(S if stop_at is None else stop_at, S - tail)
            return decode_chunk(params, spec.without_drafter(), state, n_steps, version, temperature, stop_at), {}
        if tail == S:  # a speculative chunk runs until n_steps or no slot decodes
            state, drafted, accepted = speculative_chunk(params, spec, state, n_steps, version, temperature)
        else:
            rows_R = np.full(tail, S, np.int32)  # S: a padding row (done, dropped on the way back)
            rows_R[: len(decoding)] = decoding
            state, drafted, accepted = speculative_rows_chunk(
                params, spec, state, rows_R, n_steps, version, temperature
            )
        # A host sync, but the driver reads done_S right after every chunk anyway.
        return state, {"drafted": int(drafted), "accepted": int(accepted), "speculative_chunks": 1}


def _put_window(buf_SxT, col_S, vals_SxW, write_SxW):
    """buf[s, col_s + i] = vals[s, i] where write[s, i] (written columns must lie inside T)."""
    W = vals_SxW.shape[1]
    i_SxT = jnp.arange(buf_SxT.shape[1])[None, :] - col_S[:, None]
    inside_SxT = (i_SxT >= 0) & (i_SxT < W)
    i_SxT = jnp.clip(i_SxT, 0, W - 1)
    write_SxT = inside_SxT & jnp.take_along_axis(write_SxW, i_SxT, axis=1)
    return jnp.where(write_SxT, jnp.take_along_axis(vals_SxW, i_SxT, axis=1).astype(buf_SxT.dtype), buf_SxT)


def _drafter(lparams, spec: SpeculativeEngineSpec):
    """-> (weights, config) the drafter runs: the policy's (its first draft_layers blocks), with the
    head cut to spec.draft_ids when set. Called once per chunk, outside the step loop."""
    dparams, _ = draft_view(lparams, "early_exit", spec.draft_layers, spec.cfg.n_layers)
    if not spec.draft_ids:
        return dparams, spec.cfg
    return subset_head(dparams, spec.cfg, jnp.asarray(spec.draft_ids, jnp.int32))


def _draft(drafter, spec: SpeculativeEngineSpec, s: EngineState, fill_S, key, temperature):
    """k early-exit drafts per slot -> (fed_SxW: [last, d_1..d_k], q_SxWxV: each draft's distribution
    at column i over the whole vocabulary (column 0 unused; 0 outside spec.draft_ids), None for greedy).
    With draft_ids the logits cover those N ids only: a draw j is token draft_ids[j]."""
    cfg, S, K = spec.cfg, spec.slots, spec.max_draft
    W = K + 1
    (dparams, dcfg), d_layers = drafter, spec.draft_layers
    ids_N = jnp.asarray(spec.draft_ids, jnp.int32) if spec.draft_ids else None
    to_token = (lambda j_S: j_S) if ids_N is None else (lambda j_S: ids_N[j_S])
    top_k = spec.top_k if ids_N is None or spec.top_k < len(spec.draft_ids) else 0
    fed0_SxW = jnp.zeros((S, W), jnp.int32).at[:, 0].set(s.last_S)
    q0_SxWxV = None if spec.greedy else jnp.zeros((S, W, cfg.vocab_size), jnp.float32)

    def one(i, c):
        window, fed_SxW, q_SxWxV = c
        tok_S = lax.dynamic_index_in_dim(fed_SxW, i, axis=1, keepdims=False)
        logits_Sx1xN, window, _ = window_layers(
            dparams, dcfg, tok_S[:, None], s.cache, fill_S, window, i, d_layers, spec.parallel
        )
        if spec.greedy:
            d_S = to_token(first_argmax(logits_Sx1xN[:, 0]))
        else:  # N = V without draft_ids
            q_SxN = acceptance.target_probs(logits_Sx1xN, temperature, top_k, spec.top_p)[:, 0]
            d_S = to_token(acceptance.categorical(jax.random.fold_in(key, i), q_SxN))
            q_SxV = q_SxN if ids_N is None else jnp.zeros((S, cfg.vocab_size), jnp.float32).at[:, ids_N].set(q_SxN)
            q_SxWxV = lax.dynamic_update_slice(q_SxWxV, q_SxV[:, None], (0, i + 1, 0))
        fed_SxW = lax.dynamic_update_slice(fed_SxW, d_S[:, None].astype(jnp.int32), (0, i + 1))
        return window, fed_SxW, q_SxWxV

    # The drafter's window is dropped afterwards: the verify forward computes the policy's own keys/values.
    _, fed_SxW, q_SxWxV = lax.fori_loop(0, K, one, (empty_window(s.cache, W, d_layers), fed0_SxW, q0_SxWxV))
    return fed_SxW, q_SxWxV


def _speculative_step(lparams, drafter, spec: SpeculativeEngineSpec, s: EngineState, version, temperature):
    """Draft, verify, accept and commit for every slot; only decoding slots record and advance.
    -> (state, drafted, accepted) with the step's token counts over decoding slots."""
    cfg, P, T, S, K = spec.cfg, spec.prompt_len, spec.max_new_tokens, spec.slots, spec.max_draft
    W = K + 1
    fill_S = P - 1 + s.col_S
    active_S = ~s.done_S
    rng, key = jax.random.split(s.rng)
    key_draft, key_verify = jax.random.split(key)
    fed_SxW, q_SxWxV = _draft(drafter, spec, s, fill_S, key_draft, temperature)
    window = empty_window(s.cache, W, cfg.n_layers)
    logits_SxWxV, window, experts_SxWxLxK = window_layers(
        lparams, cfg, fed_SxW, s.cache, fill_S, window, 0, parallel=spec.parallel
    )
    drafted_SxW = jnp.broadcast_to(jnp.arange(W) >= 1, (S, W))
    if spec.greedy:
        a_S, new_S = acceptance.verify_greedy(logits_SxWxV, fed_SxW, drafted_SxW)
    else:
        p_SxWxV = acceptance.target_probs(logits_SxWxV, temperature, spec.top_k, spec.top_p)
        a_S, new_S = acceptance.verify_sampled(key_verify, p_SxWxV, fed_SxW, drafted_SxW, q_SxWxV)
    # Emitted column i: the accepted draft fed at i + 1 (i < a), the new token (i == a), nothing after.
    iota_W = jnp.arange(W)
    next_SxW = jnp.concatenate([fed_SxW[:, 1:], jnp.zeros((S, 1), jnp.int32)], axis=1)
    e_SxW = jnp.where(iota_W < a_S[:, None], next_SxW, new_S[:, None].astype(jnp.int32))
    logp_all_SxWxV = jax.nn.log_softmax(scaled_logits(logits_SxWxV, temperature), axis=-1)
    logp_SxW = jnp.take_along_axis(logp_all_SxWxV, e_SxW[..., None], axis=-1)[..., 0]
    is_eos_SxW = e_SxW == spec.eos_id
    eos_before_SxW = (jnp.cumsum(is_eos_SxW, axis=1) - is_eos_SxW) > 0
    emit_SxW = active_S[:, None] & (iota_W <= a_S[:, None]) & ~eos_before_SxW & (s.col_S[:, None] + iota_W < T)
    kept_S = jnp.sum(emit_SxW, axis=1, dtype=jnp.int32)  # fed tokens 0..kept-1 enter the cache
    cache = commit_window(s.cache, window, fill_S, kept_S)
    routing = s.routing_SxCxLxK
    if experts_SxWxLxK is not None:  # fed token i sits at cache slot fill + i
        assert routing is not None  # a MoE engine's state carries its routing
        i_SxC = jnp.arange(routing.shape[1])[None, :] - fill_S[:, None]
        at_SxC = (i_SxC >= 0) & (i_SxC < kept_S[:, None])
        new_SxCxLxK = jnp.take_along_axis(experts_SxWxLxK, jnp.clip(i_SxC, 0, W - 1)[:, :, None, None], axis=1)
        routing = jnp.where(at_SxC[:, :, None, None], new_SxCxLxK.astype(routing.dtype), routing)
    eos_S = jnp.any(emit_SxW & is_eos_SxW, axis=1)
    col_S = s.col_S + kept_S
    state = s._replace(
        cache=cache,
        last_S=jnp.where(active_S, new_S.astype(jnp.int32), s.last_S),
        col_S=col_S,
        done_S=s.done_S | eos_S | (col_S >= T),
        eos_S=s.eos_S | eos_S,
        tokens_SxT=_put_window(s.tokens_SxT, s.col_S, e_SxW, emit_SxW),
        logp_SxT=_put_window(s.logp_SxT, s.col_S, logp_SxW, emit_SxW),
        mask_SxT=_put_window(s.mask_SxT, s.col_S, jnp.ones((S, W), jnp.float32), emit_SxW),
        version_SxT=_put_window(s.version_SxT, s.col_S, jnp.broadcast_to(version, (S, W)), emit_SxW),
        rng=rng,
        routing_SxCxLxK=routing,
    )
    live_i = active_S.astype(jnp.int32)
    return state, K * jnp.sum(live_i), jnp.sum(live_i * a_S)


@functools.partial(jax.jit, static_argnames="spec", donate_argnames="state")
def speculative_chunk(params, spec: SpeculativeEngineSpec, state: EngineState, n_steps, version, temperature):
    """Up to n_steps speculative steps (traced: one compile) over all slots, stopping early once no
    slot is decoding -> (state, drafted, accepted): draft tokens offered to decoding slots and how
    many of them were accepted (int32 scalars). `params`: the model's, or `split_params`'s."""
    lparams = params if isinstance(params["blocks"], tuple) else layer_params(params, spec.cfg)
    version = jnp.asarray(version, jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    drafter = _drafter(lparams, spec)  # a reduced head is gathered here, once per chunk

    def body(carry):
        i, s, drafted, accepted = carry
        s, d, a = _speculative_step(lparams, drafter, spec, s, version, temperature)
        return i + 1, s, drafted + d, accepted + a

    def cond(carry):
        return (carry[0] < n_steps) & ~jnp.all(carry[1].done_S)

    _, state, drafted, accepted = lax.while_loop(cond, body, (zero, state, zero, zero))
    return laid_out(spec, state), drafted, accepted


def _take_rows(state: EngineState, rows_R) -> EngineState:
    """The R slots rows_R of `state` as an R-slot state (an index of S or more: a done padding row)."""
    S = state.done_S.shape[0]

    def take(x):
        return None if x is None else jnp.take(x, jnp.minimum(rows_R, S - 1), axis=0)

    sub = jax.tree.map(take, state._replace(rng=None))
    return sub._replace(rng=state.rng, done_S=sub.done_S | (rows_R >= S))


def _put_rows(state: EngineState, sub: EngineState, rows_R) -> EngineState:
    """`state` with its slots rows_R replaced by the R-slot `sub` (padding rows dropped); sub's RNG."""

    def put(old, new):
        return None if old is None else old.at[rows_R].set(new, mode="drop")

    out = jax.tree.map(put, state._replace(rng=None), sub._replace(rng=None))
    return out._replace(rng=sub.rng)


@functools.partial(jax.jit, static_argnames="spec", donate_argnames="state")
def speculative_rows_chunk(
    params, spec: SpeculativeEngineSpec, state: EngineState, rows_R, n_steps, version, temperature
):
    """`speculative_chunk` over the slots rows_R only (int32[R], static R; entries >= S pad): their
    rows are gathered into an R-slot state, decoded, and written back, so a verify forward costs R
    rows, not S. Every other slot is left as it was; the state's RNG advances as the chunk's steps."""
    sub_spec = dataclasses.replace(spec, slots=rows_R.shape[0])
    sub = _take_rows(state, rows_R)
    sub, drafted, accepted = speculative_chunk(params, sub_spec, sub, n_steps, version, temperature)
    return laid_out(spec, _put_rows(state, sub, rows_R)), drafted, accepted
