"""Ratio levels: (logp_BxT, old_logp_BxT, mask_BxT) -> log_ratio_BxT.

Every ratio level returns a per-token LOG ratio of the same BxT shape, so objectives never need to
know the level: the sequence level (GSPO, `sequence_log_ratio`) returns its per-sequence value
broadcast along T, GSPO-token (`sequence_token_log_ratio`) the same value with a per-token gradient,
the prefix-geometric level (PNPO, `prefix_log_ratio`) the running mean along the causal prefix.
GMPO's geometric mean is NOT a ratio level: its clip depends on sign(A), see `objectives.gmpo`.

Masked positions return exactly 0 (ratio 1). Padding often holds garbage log-probs (0, -1e9, a
stale value); exp of that overflows to inf, and inf * 0-weight is NaN in the loss and gradient.
Selecting with `where` before any `exp` keeps both finite, and the gradient there is exactly 0.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp


class RatioFn(Protocol):
    """(logp_BxT, old_logp_BxT, mask_BxT) -> log_ratio_BxT: a ratio level."""

    def __call__(self, logp_BxT: jax.Array, old_logp_BxT: jax.Array, mask_BxT: jax.Array, /) -> jax.Array: ...


def token_log_ratio(logp_BxT: jax.Array, old_logp_BxT: jax.Array, mask_BxT: jax.Array | None = None) -> jax.Array:
    """log rho_t = logp_theta(y_t) - logp_old(y_t), per token; 0 where `mask_BxT` is 0.

    `old_logp_BxT` is data (no gradient flows into it).
    """
    log_ratio_BxT = logp_BxT - jax.lax.stop_gradient(old_logp_BxT)
    if mask_BxT is not None:
        log_ratio_BxT = jnp.where(mask_BxT > 0, log_ratio_BxT, 0.0)
    return log_ratio_BxT


def _mask01(mask_BxT: jax.Array | None, like_BxT: jax.Array) -> jax.Array:
    if mask_BxT is None:
        return jnp.ones(like_BxT.shape, jnp.float32)
    return (mask_BxT > 0).astype(jnp.float32)


def sequence_log_ratio(logp_BxT: jax.Array, old_logp_BxT: jax.Array, mask_BxT: jax.Array | None = None) -> jax.Array:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071) sequence level: log s_i = mean_t log rho_t over the
    row's masked-in tokens, broadcast to every token of the row (0 on masked tokens).

    s_i = exp(log s_i) is the length-normalised sequence ratio (pi/pi_old)^(1/|y_i|); an objective
    then clips it as one number per row (GSPO uses tiny clip ranges, ~3e-4 / 4e-4). Gradient:
    d log s_i / d logp_t = m_t / |y_i|. A fully masked row gives 0 everywhere (ratio 1, no NaN).
    """
    m_BxT = _mask01(mask_BxT, logp_BxT)
    token_BxT = token_log_ratio(logp_BxT, old_logp_BxT, m_BxT)
    seq_Bx1 = jnp.sum(token_BxT, axis=1, keepdims=True) / jnp.maximum(jnp.sum(m_BxT, axis=1, keepdims=True), 1.0)
    return jnp.where(m_BxT > 0, seq_Bx1, 0.0)


def sequence_token_log_ratio(
    logp_BxT: jax.Array, old_logp_BxT: jax.Array, mask_BxT: jax.Array | None = None
) -> jax.Array:
    """GSPO-token: s_it = sg(s_i) * rho_t / sg(rho_t), as a log ratio sg(log s_i) + log rho_t - sg(log rho_t).

    Its VALUE is exactly the sequence ratio's (x - sg(x) is exactly 0 in floats), so the objective
    clips the same number as GSPO; its gradient is per token: d log s_it / d logp_t = 1 (and 0 to
    the row's other tokens), so per-token advantages can differ within a row. 0 on masked tokens.
    """
    m_BxT = _mask01(mask_BxT, logp_BxT)
    token_BxT = token_log_ratio(logp_BxT, old_logp_BxT, m_BxT)
    seq_BxT = jax.lax.stop_gradient(sequence_log_ratio(logp_BxT, old_logp_BxT, m_BxT))
    return jnp.where(m_BxT > 0, seq_BxT + (token_BxT - jax.lax.stop_gradient(token_BxT)), 0.0)


def prefix_log_ratio(logp_BxT: jax.Array, old_logp_BxT: jax.Array, mask_BxT: jax.Array | None = None) -> jax.Array:
    """PNPO prefix geometric mean: log w_t = (1/n_t) sum_{j <= t, m_j = 1} log rho_j, n_t = sum_{j <= t} m_j.

    t counts masked-in tokens only (a masked position inside a row neither counts nor contributes),
    so the first live token's value is its own log rho and the last live token's is the GSPO sequence
    value. 0 on masked tokens. Gradient: d log w_t / d logp_j = m_j / n_t for j <= t, else 0 (causal).
    """
    m_BxT = _mask01(mask_BxT, logp_BxT)
    token_BxT = token_log_ratio(logp_BxT, old_logp_BxT, m_BxT)
    count_BxT = jnp.cumsum(m_BxT, axis=1)
    prefix_BxT = jnp.cumsum(token_BxT, axis=1) / jnp.maximum(count_BxT, 1.0)
    return jnp.where(m_BxT > 0, prefix_BxT, 0.0)
