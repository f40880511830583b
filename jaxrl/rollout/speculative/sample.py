"""Speculative rollouts: the policy verifies cheap drafts, several tokens per forward, exactly.

`sample_speculative` returns what `sampler.sample` returns (tokens, masks, log-probs under
softmax(logits / temperature), routing for MoE) from the same distribution, plus `SpecStats`.
Each loop step is one of three kinds, chosen in the graph:
  plain   one policy decode step (as `sampler.sample`);
  self    a self-drafter (`drafters.py`: early exit or int8) drafts k tokens one by one, then ONE
          policy forward over [last token, k drafts] verifies them (`acceptance.py`);
  reuse   the previous completion of the row's prompt is the draft (no draft cost): up to
          `reuse_width` tokens verified per forward as point masses; a row's reused draft dies at
          its first rejection.
With `adaptive`, each step takes the kind with the most expected tokens per unit cost (costs in plain
steps from `calibrate.py` or the configured constants; the rates are in `steps.choose_draft_length`
and `steps._reuse_rate`), from acceptance estimates that start at the previous rollout's and follow
every step's counts; no speculation while more than `max_active_rows` rows decode. Each row's KV
cache fills at its own rate (P + T + W_max slots, no holes). The loop is in `steps.py`; this module
checks the arguments, prefills and runs it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl.config import ModelConfig, SpeculativeConfig
from jaxrl.models.parallel import Parallel
from jaxrl.rollout.sampler import SampleOutput, SamplingParams, prefill_groups, temperature_checked
from jaxrl.rollout.speculative.calibrate import StepCosts, constant_costs
from jaxrl.rollout.speculative.drafters import check_self_drafter, draft_view
from jaxrl.rollout.speculative.steps import (
    SpecContext,
    SpecState,
    choose_draft_length,
    initial_state,
    loop_step,
)


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


@temperature_checked
@functools.partial(
    jax.jit,
    static_argnames=("cfg", "spec", "group_size", "parallel"),
)
def sample_speculative(
    params,
    cfg: ModelConfig,
    prompt_BxP,
    prompt_mask_BxP,
    rng,
    *,
    spec: SpeculativeConfig,
    sampling: SamplingParams,
    group_size: int,
    acceptance_prior=None,
    reuse_acceptance_prior=None,
    draft_NxT: jax.Array | None = None,
    draft_len_N: jax.Array | None = None,
    draft_logp_NxT: jax.Array | None = None,
    costs: StepCosts | None = None,
    parallel: Parallel | None = None,
):
    """`sampler.sample` with speculation -> (SampleOutput, SpecStats).

    For `spec.drafter == "reuse"`: draft_NxT holds each output row's previous completion (pad after
    it), draft_len_N its length (0: no draft for that row) and, for the approximate `spec_rl` rule
    only, draft_logp_NxT the log-probs it was sampled with. `acceptance_prior` (float, default
    spec.initial_acceptance) seeds the self-draft acceptance estimate, `reuse_acceptance_prior` the
    reused-token one; pass the previous rollout's `stats.acceptance` / `stats.reuse_acceptance` to
    carry them over. `costs` (calibrate.StepCosts, e.g. measured by
    `calibrate.measure_step_costs`) replace spec.verify_cost / spec.draft_cost in the control.
    `parallel` (MoE): the experts' mesh axis, as `sampler.sample` and the update are given; the
    prefill, the verify forwards and the self-drafter's forwards all dispatch with it."""
    B, P = prompt_BxP.shape
    N, T = B * group_size, sampling.max_new_tokens
    self_drafter, reuse, approx = _check_drafters(cfg, spec, N, draft_NxT, draft_len_N, draft_logp_NxT)
    costs = constant_costs(spec) if costs is None else costs
    W_max = max(1, spec.max_draft + 1 if self_drafter else 1, spec.reuse_width + 1 if reuse else 1)
    cache, lparams, routing, last_N = prefill_groups(
        params, cfg, prompt_BxP, prompt_mask_BxP, group_size, P + T + W_max, P + T + W_max, parallel
    )
    # Slots from P-1 on are decoded tokens: what a row may see of them is bounded by its fill level.
    cache = cache._replace(valid_BxS=cache.valid_BxS.at[:, P - 1 :].set(True))
    dparams, d_layers = (
        draft_view(lparams, self_drafter, spec.draft_layers, cfg.n_layers) if self_drafter else (None, 0)
    )
    if reuse and draft_NxT is not None and draft_len_N is not None:  # both given with reuse (checked above)
        draft_NxT = draft_NxT.astype(jnp.int32)
        draft_len_N = jnp.minimum(draft_len_N.astype(jnp.int32), draft_NxT.shape[1])
    prior = jnp.asarray(spec.initial_acceptance if acceptance_prior is None else acceptance_prior, jnp.float32)
    reuse_prior = jnp.asarray(
        spec.initial_acceptance if reuse_acceptance_prior is None else reuse_acceptance_prior, jnp.float32
    )
    ctx = SpecContext(
        cfg=cfg,
        spec=spec,
        N=N,
        P=P,
        W_max=W_max,
        self_drafter=self_drafter,
        reuse=reuse,
        approx=approx,
        sampling=sampling,
        lparams=lparams,
        dparams=dparams,
        d_layers=d_layers,
        costs=costs,
        # A verify forward always runs its branch's full static width, whatever k the control picks.
        verify_self=costs.verify_K[spec.max_draft - 1],
        verify_reuse=costs.verify_K[spec.reuse_width - 1],
        prior=prior,
        reuse_prior=reuse_prior,
        draft_NxT=draft_NxT,
        draft_len_N=draft_len_N,
        draft_logp_NxT=draft_logp_NxT,
        parallel=parallel,
    )
    state = initial_state(ctx, cache, last_N, routing, rng)
    state = lax.while_loop(lambda s: ~jnp.all(s.done_N), functools.partial(loop_step, ctx), state)
    return _output(state, T, P, sampling.eos_id), state.stats


def _check_drafters(cfg: ModelConfig, spec: SpeculativeConfig, N: int, draft_NxT, draft_len_N, draft_logp_NxT):
    """-> (the self-drafter or None, whether reuse steps run, whether they use the approximate spec_rl
    rule); a drafter this model or these arguments cannot serve is a ValueError naming the field."""
    reuse = spec.drafter == "reuse"
    self_drafter = check_self_drafter(cfg, spec)
    if reuse and (draft_NxT is None or draft_len_N is None):
        raise ValueError(
            "rollout.speculative.drafter='reuse' needs draft_NxT and draft_len_N (the previous completions)"
        )
    if reuse and draft_NxT is not None and draft_NxT.shape[0] != N:
        raise ValueError(f"draft_NxT has {draft_NxT.shape[0]} rows, expected prompts x group_size = {N}")
    approx = reuse and spec.reuse_rule == "spec_rl"
    if approx and draft_logp_NxT is None:
        raise ValueError("rollout.speculative.reuse_rule='spec_rl' needs draft_logp_NxT (the drafts' old log-probs)")
    return self_drafter, reuse, approx


def _output(state: SpecState, T: int, P: int, eos_id) -> SampleOutput:
    """The loop's final state -> what `sampler.sample` returns (the first T columns)."""
    mask_NxT = state.mask_NxU[:, :T]
    return SampleOutput(
        tokens_BxT=state.tokens_NxU[:, :T],
        completion_mask_BxT=mask_NxT,
        logp_BxT=state.logp_NxU[:, :T],
        finished_B=jnp.any((state.tokens_NxU[:, :T] == eos_id) & (mask_NxT > 0), axis=1),
        length_B=jnp.sum(mask_NxT, axis=-1).astype(jnp.int32),
        num_steps=state.step,
        routing_BxSxLxK=None if state.routing_NxSxLxK is None else state.routing_NxSxLxK[:, : P + T],
    )
