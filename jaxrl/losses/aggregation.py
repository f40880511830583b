"""Aggregation: how per-token losses become one scalar (the normaliser is the algorithm).

A weights function is `(completion_mask_BxT, max_new_tokens) -> weights_BxT`, computed ONCE on the
whole update batch; the loss is `sum_{i,t} weights_it * loss_it` (`weighted_sum`), summed over
microbatches. The weights hold every batch-level normaliser, so that sum is exactly the full-batch loss
and gradient. "B" in the normalisers counts LIVE rows (at least one completion token): an all-0 row acts
as removed, and an all-empty batch gives weights 0 (never NaN).

Stats reduce the same two-phase way: per-microbatch partial sums that merge exactly (`stat_partials`,
`merge_stat_partials`; `mean_stat_partials` over PPO epochs), then `finalize_stats`; the update's
metrics and `evaluate_loss`'s are both made so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

WeightsFn = Callable[[jax.Array, int], jax.Array]

# Stats whose min and max are also reported (the rest get only a masked mean): the staleness ratio
# (current / old) and the rollout-mismatch importance ratio and weight (old / rollout, corrections.py).
EXTREMA = ("ratio", "is_ratio", "is_weight")


def _lengths_B(mask_BxT: jax.Array) -> jax.Array:
    return jnp.sum((mask_BxT > 0).astype(jnp.float32), axis=1)


def _live_rows(mask_BxT: jax.Array) -> jax.Array:
    return jnp.maximum(jnp.sum((_lengths_B(mask_BxT) > 0).astype(jnp.float32)), 1.0)


def _mask01(mask_BxT: jax.Array) -> jax.Array:
    return (mask_BxT > 0).astype(jnp.float32)


def seq_mean_token_mean(completion_mask_BxT: jax.Array, max_new_tokens: int = 0) -> jax.Array:
    """GRPO: mean over sequences of the per-sequence token mean; w_it = m_it / (|y_i| * B)."""
    del max_new_tokens
    m_BxT = _mask01(completion_mask_BxT)
    len_Bx1 = jnp.maximum(_lengths_B(m_BxT), 1.0)[:, None]
    return m_BxT / (len_Bx1 * _live_rows(m_BxT))


def token_mean(completion_mask_BxT: jax.Array, max_new_tokens: int = 0) -> jax.Array:
    """DAPO / BNPO: every token of the batch weighs the same; w_it = m_it / sum_{j,s} m_js."""
    del max_new_tokens
    m_BxT = _mask01(completion_mask_BxT)
    return m_BxT / jnp.maximum(jnp.sum(m_BxT), 1.0)


def seq_mean_token_sum_norm(completion_mask_BxT: jax.Array, max_new_tokens: int) -> jax.Array:
    """Dr.GRPO: a constant per-token normaliser; w_it = m_it / (B * L_max), L_max = max_new_tokens.

    L_max is the generation limit, not the padded width T, so padding columns change nothing.
    """
    if not max_new_tokens or max_new_tokens <= 0:
        raise ValueError(f"seq_mean_token_sum_norm needs max_new_tokens > 0, got {max_new_tokens!r}")
    m_BxT = _mask01(completion_mask_BxT)
    return m_BxT / (_live_rows(m_BxT) * float(max_new_tokens))


def seq_mean_token_sum(completion_mask_BxT: jax.Array, max_new_tokens: int = 0) -> jax.Array:
    """Sequence-level sum (REINFORCE / RLOO: the loss of a row is its summed token losses, i.e. the
    sequence log-prob times A), mean over rows; w_it = m_it / B. No length normaliser at all."""
    del max_new_tokens
    m_BxT = _mask01(completion_mask_BxT)
    return m_BxT / _live_rows(m_BxT)


def constant_norm(k: float | None = None) -> WeightsFn:
    """AsyncWebRL: GRPO's per-sequence 1/|y_i| replaced by a constant 1/k; w_it = m_it / (B * k).

    1/|y_i| down-weights the negative gradient of failures, which are systematically longer than
    successes; a constant normaliser removes that coupling. `k=None` takes k = max_new_tokens (the
    generation limit; with it the weights equal Dr.GRPO's `seq_mean_token_sum_norm`).
    """
    if k is not None and not k > 0:
        raise ValueError(f"constant_norm: k={k!r}; expected a positive number or None (= max_new_tokens)")

    def weights(completion_mask_BxT: jax.Array, max_new_tokens: int = 0) -> jax.Array:
        kk = k if k is not None else max_new_tokens
        if not kk or kk <= 0:
            raise ValueError(f"constant_norm(k=None) needs max_new_tokens > 0, got {max_new_tokens!r}")
        m_BxT = _mask01(completion_mask_BxT)
        return m_BxT / (_live_rows(m_BxT) * float(kk))

    weights.part = f"constant_norm(k={'max_new_tokens' if k is None else k})"
    return weights


def weighted_sum(weights_BxT: jax.Array, loss_BxT: jax.Array) -> jax.Array:
    """The reduction step: sum_{i,t} w_it * l_it. Zero-weight entries contribute exactly 0."""
    return jnp.sum(jnp.where(weights_BxT != 0, weights_BxT * loss_BxT, 0.0))


# ---------------------------------------------------------------------------------------------
# Stats: masked means (and min/max for EXTREMA) that are exact under microbatching. The update's
# metrics and `evaluate_loss`'s both come from these functions.


def _stat_name(key: str) -> str:
    for suffix in ("_BxT", "_B"):
        if key.endswith(suffix):
            return key[: -len(suffix)]
    return key


def stat_partials(stats: Mapping[str, jax.Array], mask_BxT: jax.Array) -> dict:
    """Per-microbatch partials {key: {"sum", "count"[, "min", "max"]}}, keyed like `stats`, from
    per-token (BxT: live tokens count), per-sequence (B: live rows count) or per-microbatch scalar
    (counts 1: its mean over microbatches) stats; min / max for the keys `EXTREMA` names. A pytree:
    carry it in a scan."""
    live_BxT = mask_BxT > 0
    live_B = jnp.any(live_BxT, axis=1)
    out = {}
    for key, x in stats.items():
        x = jax.lax.stop_gradient(x).astype(jnp.float32)
        if x.ndim == 0:
            out[key] = {"sum": x, "count": jnp.ones((), jnp.float32)}
            continue
        live = live_BxT if x.ndim == 2 else live_B
        part = {"sum": jnp.sum(jnp.where(live, x, 0.0)), "count": jnp.sum(live.astype(jnp.float32))}
        if _stat_name(key) in EXTREMA:
            part["min"] = jnp.min(jnp.where(live, x, jnp.inf))
            part["max"] = jnp.max(jnp.where(live, x, -jnp.inf))
        out[key] = part
    return out


def empty_stat_partials(like: dict) -> dict:
    """The partials of nothing, shaped like `like` (partials or their `jax.eval_shape`): sums and
    counts 0, min +inf, max -inf; `merge_stat_partials(empty, p)` is p. The start of a scan."""
    fill = {"sum": 0.0, "count": 0.0, "min": jnp.inf, "max": -jnp.inf}
    return {key: {k: jnp.full(x.shape, fill[k], x.dtype) for k, x in part.items()} for key, part in like.items()}


def merge_stat_partials(a: dict, b: dict) -> dict:
    """Combine two partials (from two microbatches) exactly: sums add, min/max take min/max."""
    merged = {}
    for name in a:
        pa, pb = a[name], b[name]
        part = {"sum": pa["sum"] + pb["sum"], "count": pa["count"] + pb["count"]}
        if "min" in pa:
            part["min"] = jnp.minimum(pa["min"], pb["min"])
            part["max"] = jnp.maximum(pa["max"], pb["max"])
        merged[name] = part
    return merged


def mean_stat_partials(partials_N: dict) -> dict:
    """Partials of N passes over the same tokens, stacked on a leading axis (PPO epochs) -> one
    partial whose means are the mean over the passes: sums and counts averaged, min / max over all."""
    reduce = {"sum": jnp.mean, "count": jnp.mean, "min": jnp.min, "max": jnp.max}
    return {key: {k: reduce[k](x, axis=0) for k, x in part.items()} for key, part in partials_N.items()}


def finalize_stats(partials: dict) -> dict:
    """Scalars named by the key without its shape suffix: `name` = masked mean, `name_min` /
    `name_max` for EXTREMA. 0 when nothing was live (a metric of an empty batch is reported as 0, not
    NaN, so NaN checks stay meaningful). Two keys of one name (the loss's kl_BxT and the update's
    own kl): the key that sorts last wins."""
    out = {}
    for key in sorted(partials):
        part, name = partials[key], _stat_name(key)
        out[name] = part["sum"] / jnp.maximum(part["count"], 1.0)  # the sum is 0 when the count is
        if "min" in part:
            some = part["count"] > 0
            out[name + "_min"] = jnp.where(some, part["min"], 0.0)
            out[name + "_max"] = jnp.where(some, part["max"], 0.0)
    return out


def reduce_stats(stats: Mapping[str, jax.Array], mask_BxT: jax.Array) -> dict:
    """Masked means (and min/max of the ratio) of loss stats; the same metrics for every preset.

    Keys drop the shape suffix: ratio_BxT -> "ratio", "ratio_min", "ratio_max";
    clipped_low_BxT -> "clipped_low" (fraction of live tokens); kl_BxT -> "kl".
    """
    return finalize_stats(stat_partials(stats, mask_BxT))
