"""Token masks decided on the whole batch and applied per microbatch.

A batch-level mask is two pieces: a `Prepare` part that adds keep_BxT (float 0/1) to the batch ONCE,
before microbatching (M2PO's `m2po.m2po_prepare`, `top_entropy_keep`), and `apply_keep_mask`, which
drops the tokens with keep == 0 from a token loss (loss 0, no gradient by any path). `token_mask` makes
the pair one `LossPart` for `compose`; since the keep mask comes from the whole batch, the
microbatched loss and gradient equal the full-batch ones exactly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl.losses.parts import LossPart, TokenLoss, TokenWrapper
from jaxrl.losses.prepare import Prepare


def apply_keep_mask(token_loss: TokenLoss, key: str = "m2po_keep_BxT", stat: str = "m2po_masked_BxT") -> TokenLoss:
    """Wrap `token_loss(logp_BxT, batch) -> (loss_BxT, stats)` so tokens with batch[key] == 0 are dropped.

    A dropped token gets loss exactly 0 and NO gradient by any path: its logp enters the inner loss
    as stop_gradient(logp) (same value), so even a sequence-level ratio (GSPO / PNPO / GMPO) that
    mixes it into other tokens' values passes it no gradient; the loss there is then zeroed (the KL
    and entropy terms of that token too). The inner stats are unchanged (computed on every live
    token), plus `stat` (1.0 on dropped live tokens) so the metrics report the dropped fraction.
    Works for any batch-level token mask, not only M2PO's.
    """

    def wrapped(logp_BxT: jax.Array, batch: dict):
        keep_BxT = batch[key] > 0
        logp_in = jnp.where(keep_BxT, logp_BxT, jax.lax.stop_gradient(logp_BxT))
        loss_BxT, stats = token_loss(logp_in, batch)
        live_BxT = batch["completion_mask_BxT"] > 0
        stats = dict(stats, **{stat: (live_BxT & ~keep_BxT).astype(jnp.float32)})
        return jnp.where(keep_BxT, loss_BxT, 0.0), stats

    return wrapped


def keep_mask(key: str, stat: str) -> TokenWrapper:
    """The TokenWrapper `apply_keep_mask(., key, stat)`."""
    return functools.partial(apply_keep_mask, key=key, stat=stat)


def token_mask(prepare: Prepare, key: str, stat: str, needs_old_logp: bool = False) -> LossPart:
    """A batch token mask as one part: `prepare` adds batch[key] on the whole batch, and the token
    loss (regularisers included) drops the tokens where it is 0, reporting them as `stat`."""
    return LossPart(prepare=(prepare,), masks=(keep_mask(key, stat),), needs_old_logp=needs_old_logp)


def top_entropy_keep(
    frac: float = 0.2, entropy_key: str = "old_entropy_BxT", out_key: str = "entropy_keep_BxT"
) -> Prepare:
    """Train only on the highest-entropy tokens (the "80/20" forking-token rule, top 20% by default).

    keep_BxT = 1 on live tokens with H >= the k-th largest live entropy of the WHOLE batch,
    k = ceil(frac * n_live); ties at the threshold are all kept (so the rule depends only on values,
    never on row order or microbatching); masked tokens are 1 (they are masked anyway). H is the OLD
    policy's entropy recorded for the batch (the Loss sets needs_old_logp). Apply it with
    `apply_keep_mask(token_loss, out_key, "entropy_masked_BxT")`: dropped tokens keep their place
    in the normaliser (our reading: the gradient of low-entropy tokens is removed, the loss scale is
    not renormalised).
    """
    if not 0 < frac <= 1:
        raise ValueError(f"top_entropy_frac: got {frac!r}, expected a number in (0, 1]")

    def prepare(batch, group_size=None, max_new_tokens=None):
        if entropy_key not in batch:
            raise KeyError(
                f"top_entropy_keep needs batch[{entropy_key!r}] (recorded when the Loss sets needs_old_logp)"
            )
        live_BxT = batch["completion_mask_BxT"] > 0
        h_BxT = jax.lax.stop_gradient(batch[entropy_key]).astype(jnp.float32)
        desc = -jnp.sort(-jnp.where(live_BxT, h_BxT, -jnp.inf).reshape(-1))  # live first, descending
        n_live = jnp.sum(live_BxT)
        k = jnp.maximum(jnp.ceil(frac * n_live.astype(jnp.float32)).astype(jnp.int32), 1)
        threshold = jnp.where(n_live > 0, desc[jnp.minimum(k, desc.shape[0]) - 1], -jnp.inf)
        keep_BxT = ~live_BxT | (h_BxT >= threshold)
        return dict(batch, **{out_key: keep_BxT.astype(jnp.float32)})

    return prepare
