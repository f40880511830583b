"""Ratio levels: (logp_BxT, old_logp_BxT, mask_BxT) -> log_ratio_BxT.

Every ratio level returns a per-token LOG ratio of the same BxT shape, so objectives never need to
know the level: a sequence-level ratio (GSPO) will return its per-sequence value broadcast along T,
a prefix-geometric one (PNPO) the running mean along the causal prefix.

Masked positions return exactly 0 (ratio 1). Padding often holds garbage log-probs (0, -1e9, a
stale value); exp of that overflows to inf, and inf * 0-weight is NaN in the loss and gradient.
Selecting with `where` before any `exp` keeps both finite, and the gradient there is exactly 0.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

RatioFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def token_log_ratio(logp_BxT: jax.Array, old_logp_BxT: jax.Array,
                    mask_BxT: Optional[jax.Array] = None) -> jax.Array:
    """log rho_t = logp_theta(y_t) - logp_old(y_t), per token; 0 where `mask_BxT` is 0.

    `old_logp_BxT` is data (no gradient flows into it).
    """
    log_ratio_BxT = logp_BxT - jax.lax.stop_gradient(old_logp_BxT)
    if mask_BxT is not None:
        log_ratio_BxT = jnp.where(mask_BxT > 0, log_ratio_BxT, 0.0)
    return log_ratio_BxT
