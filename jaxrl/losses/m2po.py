"""M2PO second-moment trust masking: a BATCH-level token mask, computed once before microbatching.

M2PO ("Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?") drops the
tokens with the largest (log rho)^2 until M2 = mean (log rho)^2 over the kept tokens is <= tau:

    m2po_keep_mask(log_ratio_BxT, mask_BxT, tau, candidates) -> keep_BxT   the exact batch-level rule
    m2po_prepare(tau, token_set, ...) -> prepare(batch) -> batch   ONCE on the whole batch: adds keep_BxT
    masks.apply_keep_mask(token_loss, key) -> token_loss           per microbatch: drops those tokens
    rollout_behaviour(token_loss) -> token_loss                    ratio against the rollout policy
    m2po_part(tau, token_set) -> LossPart                          all of it, for `compose(parts=...)`

`token_set`: "trust_region" (default, Algorithm 1: only A > 0 with r > 1 and A < 0 with r < 1 count and
can be masked) or "all" (every live token). The behaviour policy is the sampler's (`rollout_logp_BxT`,
else the old policy); log r = old_logp - rollout_logp, so the mask is exact for the first optimizer
step on a batch and frozen at that value for later PPO epochs. The batch must hold `old_logp_BxT`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxrl.losses.masks import token_mask
from jaxrl.losses.parts import LossPart, named
from jaxrl.losses.prepare import on_batch
from jaxrl.losses.ratios import token_log_ratio


def m2po_keep_mask(
    log_ratio_BxT: jax.Array, mask_BxT: jax.Array, tau: float, candidates_BxT: jax.Array | None = None
) -> jax.Array:
    """keep_BxT (float 0/1): 0 on the live tokens M2PO drops, 1 everywhere else (masked tokens too).

    `candidates_BxT` (bool, optional): the token set the budget covers; only live candidates count
    in M2 and only they can be dropped (None: every live token). "Live" below means live candidate.
    Rule (exact and deterministic): sort the live tokens' q = (log rho)^2 ascending; the kept set is
    the largest prefix j* of that order whose mean sum_{i<=j} q_(i) / j is <= tau (prefix means of an
    ascending sort never decrease, so this is "drop the largest until the mean is <= tau", and the
    fewest tokens are dropped). Ties: every token whose q equals the smallest dropped value is
    dropped too (threshold rule q < q_(j*+1)), so the result depends only on the VALUES, never on
    token order: permuting rows or splitting the batch differently cannot change it, and the kept
    mean only gets smaller. If no token is over tau, nothing is dropped; if even the smallest q
    exceeds tau, every live token is dropped (M2 of the empty set is taken as 0). All-masked: all 1.
    `tau` may be a traced scalar (e.g. a schedule kept in the train state: no recompile).
    """
    if isinstance(tau, (int, float)) and not tau >= 0:
        raise ValueError(f"m2po: tau={tau!r}; expected a non-negative number")
    live_BxT = mask_BxT > 0
    if candidates_BxT is not None:
        live_BxT = live_BxT & candidates_BxT
    q_BxT = jnp.square(jnp.where(live_BxT, log_ratio_BxT, 0.0).astype(jnp.float32))
    q_sorted = jnp.sort(jnp.where(live_BxT, q_BxT, jnp.inf).reshape(-1))  # live first, ascending
    n_live = jnp.sum(live_BxT)
    j = jnp.arange(1, q_sorted.shape[0] + 1)
    prefix = jnp.cumsum(jnp.where(j <= n_live, q_sorted, 0.0))
    ok = (j <= n_live) & (prefix <= tau * j.astype(jnp.float32))
    # Count the leading run of ok (robust even if float rounding broke monotonicity by an ulp).
    j_star = jnp.sum(jnp.cumprod(ok.astype(jnp.int32)))
    threshold = jnp.where(j_star < n_live, q_sorted[jnp.minimum(j_star, q_sorted.shape[0] - 1)], jnp.inf)
    dropped_BxT = live_BxT & (q_BxT >= threshold)
    return (~dropped_BxT).astype(jnp.float32)


TOKEN_SETS = ("trust_region", "all")


def trust_region_tokens(log_ratio_BxT: jax.Array, adv_BxT: jax.Array) -> jax.Array:
    """bool_BxT: the tokens M2PO's Algorithm 1 budgets, A > 0 with r > 1 or A < 0 with r < 1
    (log r = log_ratio; strict inequalities: r = 1 or A = 0 is outside the set)."""
    return ((adv_BxT > 0) & (log_ratio_BxT > 0)) | ((adv_BxT < 0) & (log_ratio_BxT < 0))


def _behaviour_logp(batch: dict) -> jax.Array:
    return batch["rollout_logp_BxT"] if "rollout_logp_BxT" in batch else batch["old_logp_BxT"]


def _adv_BxT(batch: dict, shape: tuple) -> jax.Array:
    if "advantages_BxT" in batch:
        return batch["advantages_BxT"]
    return jnp.broadcast_to(batch["advantages_B"][:, None], shape)


def m2po_prepare(
    tau: float = 0.04, token_set: str = "trust_region", logp_key: str = "old_logp_BxT", out_key: str = "m2po_keep_BxT"
) -> Callable[[dict], dict]:
    """prepare(batch) -> batch with batch[out_key] = m2po_keep_mask(log r, mask, tau, candidates).

    log r = batch[logp_key] - behaviour log-probs (rollout_logp_BxT when present, else old_logp_BxT);
    candidates = `trust_region_tokens(log r, A)` for token_set "trust_region" (needs the batch's
    advantages), every live token for "all". Call it on the WHOLE update batch, before
    `split_microbatches`; the result is a B-leading BxT array, so it splits with the rest. `logp_key`
    is a parameter so a caller with the current policy's full-batch log-probs can point it at them.
    """
    if not tau >= 0:
        raise ValueError(f"m2po: tau={tau!r}; expected a non-negative number")
    if token_set not in TOKEN_SETS:
        raise ValueError(f"m2po: token_set={token_set!r}; expected one of {TOKEN_SETS}")

    def prepare(batch: dict) -> dict:
        mask_BxT = batch["completion_mask_BxT"]
        log_ratio_BxT = jax.lax.stop_gradient(token_log_ratio(batch[logp_key], _behaviour_logp(batch), mask_BxT))
        candidates_BxT = None
        if token_set == "trust_region":
            candidates_BxT = trust_region_tokens(log_ratio_BxT, _adv_BxT(batch, mask_BxT.shape))
        return dict(batch, **{out_key: m2po_keep_mask(log_ratio_BxT, mask_BxT, tau, candidates_BxT)})

    return prepare


def rollout_behaviour(token_loss: Callable) -> Callable:
    """Wrap `token_loss(logp_BxT, batch)` so its ratio's behaviour policy is the ROLLOUT policy:
    the inner loss sees old_logp_BxT := rollout_logp_BxT (when the batch has it), so its ratio is
    pi_theta / pi_rollout, M2PO's importance weight on data sampled by a stale or mismatched sampler
    ("Prosperity before Collapse", arXiv:2510.01161: r = pi_theta / pi_behav). Without rollout
    log-probs, or when they equal the old ones, nothing changes. Inside the wrapped loss, rollout-mismatch
    corrections (TIS / MIS on pi_old / pi_rollout) then see a ratio of 1: the M2PO ratio already
    carries that factor."""

    def wrapped(logp_BxT: jax.Array, batch: dict):
        if "rollout_logp_BxT" in batch:
            batch = dict(batch, old_logp_BxT=batch["rollout_logp_BxT"])
        return token_loss(logp_BxT, batch)

    return wrapped


def _rollout_behaviour_labelled(token_loss: Callable) -> Callable:
    return named("behaviour = rollout policy (ratio pi_theta / pi_rollout)", rollout_behaviour(token_loss))


def m2po_part(tau: float = 0.04, token_set: str = "trust_region") -> LossPart:
    """M2PO as one `LossPart`: the batch mask (`m2po_prepare`, on the whole batch, from the recorded
    old log-probs: needs_old_logp), applied to the whole token loss (`masks.apply_keep_mask`, stat
    m2po_masked_BxT), then the rollout policy as the ratio's behaviour policy (`rollout_behaviour`)."""
    prepare = named(f"m2po_mask(tau={tau:g}, {token_set})", on_batch(m2po_prepare(tau, token_set)))
    mask = token_mask(prepare, "m2po_keep_BxT", "m2po_masked_BxT", needs_old_logp=True)
    return mask._replace(masks=(*mask.masks, _rollout_behaviour_labelled))
