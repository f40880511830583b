"""Exact verification of drafted tokens: speculative rejection sampling as pure functions.

Shape letters: N rows, W verified positions (the fed last token plus up to W-1 drafted ones), V vocab.
Position i of a verify forward gives the target distribution p_i of the token after the i-th fed
token; drafted token d_{i+1} (fed at position i+1) is checked against p_i.

Rule (Leviathan et al. / Chen et al.): accept d ~ q with probability min(1, p(d) / q(d)); at the first
rejection draw from normalise(max(0, p - q)); if every drafted token is accepted, draw a bonus token
from the next p. The result is distributed exactly as sampling from p token by token. A draft with no
distribution (a reused completion) is a point mass q = one-hot(d): accept with probability p(d), and a
rejection draws from p with d excluded -- the same rule, so `q_NxWxV=None` means point masses.

`approx_old_logp_NxW` switches to SPEC-RL's rule for reused drafts, accept with min(1, p(d) / q_old(d))
where q_old is the probability the previous policy gave d, then draw from p at a rejection: NOT
exact (labelled approximate everywhere it is exposed).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.rollout.sampler import first_argmax, scaled_logits, truncate_logits


class Verdict(NamedTuple):
    n_accepted_N: jax.Array  # int32: leading drafted tokens accepted (0..W-1)
    new_token_N: jax.Array  # int32: the token drawn at position n_accepted (correction or bonus)


def target_probs(logits_NxWxV, temperature, top_k: int, top_p: float) -> jax.Array:
    """The distribution plain sampling draws from: softmax of truncated logits / temperature (at
    temperature 0 the uniform distribution over the maximal logits, see `sampler.scaled_logits`)."""
    N, W, V = logits_NxWxV.shape
    scaled = truncate_logits(scaled_logits(logits_NxWxV.reshape(N * W, V), temperature), top_k, top_p)
    return jax.nn.softmax(scaled, axis=-1).reshape(N, W, V)


def _leading_true(x_NxW) -> jax.Array:
    """Number of leading True entries per row."""
    return jnp.sum(jnp.cumprod(x_NxW.astype(jnp.int32), axis=-1), axis=-1)


def verify_greedy(logits_NxWxV, draft_NxW, drafted_NxW) -> Verdict:
    """Temperature 0: a drafted token is accepted iff it is the target's argmax; the new token is the
    argmax at the first mismatch (or after the last draft). Gives exactly the plain greedy tokens.
    draft_NxW[:, i] is the token drafted for position i (column 0 unused); drafted_NxW marks real ones."""
    best_NxW = first_argmax(logits_NxWxV.reshape(-1, logits_NxWxV.shape[-1])).reshape(draft_NxW.shape)
    ok_NxW = drafted_NxW[:, 1:] & (draft_NxW[:, 1:] == best_NxW[:, :-1])
    a_N = _leading_true(ok_NxW)
    return Verdict(a_N, jnp.take_along_axis(best_NxW, a_N[:, None], axis=1)[:, 0])


def verify_sampled(
    rng,
    p_NxWxV,
    draft_NxW,
    drafted_NxW,
    q_NxWxV: jax.Array | None = None,
    approx_old_logp_NxW: jax.Array | None = None,
) -> Verdict:
    """Rejection-sample drafted tokens against target probabilities p_NxWxV (see module docstring).

    draft_NxW[:, i] (i >= 1) is the token drafted after fed position i-1, drafted_NxW[:, i] whether
    there is one (drafted positions are a prefix of 1..W-1); q_NxWxV[:, i] the distribution it was
    drawn from (None: point masses). Column 0 of draft/drafted/q is ignored."""
    N, W, V = p_NxWxV.shape
    key_u, key_draw = jax.random.split(rng)
    d_NxW1 = draft_NxW[:, 1:].astype(jnp.int32)
    p_d_NxW1 = jnp.take_along_axis(p_NxWxV[:, :-1], d_NxW1[..., None], axis=-1)[..., 0]
    if approx_old_logp_NxW is not None:
        q_d_NxW1 = jnp.exp(approx_old_logp_NxW[:, 1:])
    elif q_NxWxV is None:
        q_d_NxW1 = jnp.ones_like(p_d_NxW1)
    else:
        q_d_NxW1 = jnp.take_along_axis(q_NxWxV[:, 1:], d_NxW1[..., None], axis=-1)[..., 0]
    u_NxW1 = jax.random.uniform(key_u, p_d_NxW1.shape)
    # u < p/q, written without the division: q can underflow to 0 only for a token q never draws.
    ok_NxW1 = drafted_NxW[:, 1:] & (u_NxW1 * q_d_NxW1 < p_d_NxW1)
    a_N = _leading_true(ok_NxW1)
    # Draw at position a: from the residual max(0, p - q) after a rejection, from p itself when every
    # drafted token was accepted (the bonus token) or under the approximate rule.
    p_a_NxV = jnp.take_along_axis(p_NxWxV, a_N[:, None, None], axis=1)[:, 0]
    rejected_N = jnp.take_along_axis(jnp.pad(drafted_NxW[:, 1:], ((0, 0), (0, 1))), a_N[:, None], axis=1)[:, 0]
    if approx_old_logp_NxW is not None:
        residual_NxV = p_a_NxV
    else:
        if q_NxWxV is None:
            d_a_N = jnp.take_along_axis(jnp.pad(d_NxW1, ((0, 0), (0, 1))), a_N[:, None], axis=1)[:, 0]
            q_a_NxV = jax.nn.one_hot(d_a_N, V, dtype=p_NxWxV.dtype)
        else:
            q_pad = jnp.pad(q_NxWxV[:, 1:], ((0, 0), (0, 1), (0, 0)))
            q_a_NxV = jnp.take_along_axis(q_pad, a_N[:, None, None], axis=1)[:, 0]
        residual_NxV = jnp.where(rejected_N[:, None], jnp.maximum(p_a_NxV - q_a_NxV, 0.0), p_a_NxV)
        # p == q to the last bit leaves nothing; a rejection then had probability 0 anyway.
        empty_N = jnp.sum(residual_NxV, axis=-1) <= 0
        residual_NxV = jnp.where(empty_N[:, None], p_a_NxV, residual_NxV)
    new_N = categorical(key_draw, residual_NxV)
    return Verdict(a_N, new_N)


def categorical(rng, probs_NxV) -> jax.Array:
    """One draw per row from unnormalised non-negative probabilities (Gumbel-max over log-probs)."""
    logits_NxV = jnp.where(probs_NxV > 0, jnp.log(jnp.where(probs_NxV > 0, probs_NxV, 1.0)), -jnp.inf)
    return first_argmax(logits_NxV + jax.random.gumbel(rng, logits_NxV.shape, logits_NxV.dtype))
