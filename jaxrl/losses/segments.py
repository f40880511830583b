"""Groups as segments: per-row group ids instead of a [B/G, G] reshape.

`groups` is either a static int `group_size` (contiguous equal groups, row i in group i // group_size:
what a plain rollout makes) or a `Groups` (one id per row, any sizes, rows anywhere, padding rows).
Both become a `Groups` (`as_groups`); every statistic is a segment reduction over a STATIC number of
segments (`num`: B // group_size, or B for ids relabelled densely by `from_ids`).

Padding (`live_B` False) counts in no statistic and gets advantage exactly 0. `group_id_B < 0` marks
padding; `mark_padding` (run by `evaluate.prepare_batch` before the advantages) also marks every row
whose completion mask is all 0, once, so rows a prepare part drops later are not mistaken for padding.
Sums are `jax.ops.segment_sum`; medians use one stable sort by (segment, value, row).
"""

from __future__ import annotations

import dataclasses
import operator

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Groups:
    id_B: jax.Array  # int32 segment of each row, in [0, num)
    live_B: jax.Array  # bool: False on padding rows (no group)
    num: int  # static number of segments (an upper bound on the number of groups)


jax.tree_util.register_dataclass(Groups, data_fields=["id_B", "live_B"], meta_fields=["num"])

GroupsLike = int | Groups


def check_group_size(group_size, B: int) -> int:
    """group_size as an int; ValueError when it is not a static positive int dividing B."""
    try:
        group_size = operator.index(group_size)  # a Python/NumPy int; a tracer is not allowed
    except TypeError:
        raise ValueError(f"group_size: got {group_size!r}, expected a static int (or a segments.Groups)") from None
    if group_size <= 0:
        raise ValueError(f"group_size: got {group_size!r}, expected a positive int")
    if B % group_size:
        raise ValueError(f"batch of {B} rows is not a whole number of groups of {group_size}")
    return group_size


def contiguous(B: int, group_size: int) -> Groups:
    """The equal-group form: row i is in group i // group_size, every row live."""
    group_size = check_group_size(group_size, B)
    return Groups(jnp.arange(B, dtype=jnp.int32) // group_size, jnp.ones((B,), bool), B // group_size)


def from_ids(group_id_B: jax.Array, live_B=None) -> Groups:
    """Groups from arbitrary int ids (equal id = one group; id < 0 = padding), relabelled densely to
    [0, B) by a sort, so num = B is static whatever the ids' range."""
    group_id_B = jnp.asarray(group_id_B)
    if group_id_B.ndim != 1 or not jnp.issubdtype(group_id_B.dtype, jnp.integer):
        raise ValueError(f"group_id_B: got shape {group_id_B.shape} dtype {group_id_B.dtype}, expected int32 [B]")
    B = group_id_B.shape[0]
    order_B = jnp.argsort(group_id_B, stable=True)
    sorted_B = group_id_B[order_B]
    starts_B = jnp.concatenate([jnp.ones((1,), bool), sorted_B[1:] != sorted_B[:-1]])
    dense_B = jnp.zeros((B,), jnp.int32).at[order_B].set(jnp.cumsum(starts_B, dtype=jnp.int32) - 1)
    live = group_id_B >= 0 if live_B is None else (group_id_B >= 0) & jnp.asarray(live_B, bool)
    return Groups(dense_B, live, B)


def as_groups(groups: GroupsLike, x: jax.Array) -> Groups:
    """`groups` (a group_size int or a Groups) as Groups for the rows of x (B leading)."""
    if x.ndim < 1:
        raise ValueError(f"expected rows (B leading), got shape {x.shape}")
    if isinstance(groups, Groups):
        if groups.id_B.shape != (x.shape[0],):
            raise ValueError(f"group ids of shape {groups.id_B.shape} for a batch of {x.shape[0]} rows")
        return groups
    return contiguous(x.shape[0], groups)


def batch_groups(batch: dict, group_size: int) -> GroupsLike:
    """The batch's groups: `Groups` from its `group_id_B` when it has one (id < 0 = padding; see
    `mark_padding`), else `group_size` itself (contiguous equal groups; the estimators check it)."""
    if "group_id_B" in batch:
        return from_ids(batch["group_id_B"])
    return group_size


def mark_padding(batch: dict) -> dict:
    """group_id_B = -1 on rows whose completion mask is all 0 (padding); a batch without group ids is
    returned as is (the equal-group form has no padding)."""
    if "group_id_B" not in batch:
        return batch
    live_B = jnp.any(batch["completion_mask_BxT"] > 0, axis=1)
    ids_B = batch["group_id_B"]
    return dict(batch, group_id_B=jnp.where(live_B, ids_B, -1).astype(ids_B.dtype))


# ---------------------------------------------------------------------------------------------
# Segment statistics over live rows. x has B leading (x_B or x_BxK); `_N` results are per segment,
# `_B` results are gathered back to the rows.


def _live(g: Groups, x: jax.Array) -> jax.Array:
    return g.live_B.reshape(g.live_B.shape + (1,) * (x.ndim - 1))


def count_N(g: Groups) -> jax.Array:
    return jax.ops.segment_sum(g.live_B.astype(jnp.float32), g.id_B, g.num)


def sum_N(x: jax.Array, g: Groups) -> jax.Array:
    return jax.ops.segment_sum(jnp.where(_live(g, x), x, 0), g.id_B, g.num)


def size_B(g: Groups) -> jax.Array:
    """The size of each row's group (live rows only), as float."""
    return count_N(g)[g.id_B]


def mean_B(x: jax.Array, g: Groups) -> jax.Array:
    n_N = count_N(g).reshape((g.num,) + (1,) * (x.ndim - 1))
    return (sum_N(x, g) / jnp.maximum(n_N, 1.0))[g.id_B]


def std_B(x: jax.Array, g: Groups, ddof: int) -> jax.Array:
    """Each row's group std with `ddof`; the divisor n - ddof is clamped to >= 1, so a group of one has
    std 0 (its centred value is 0) instead of 0/0 = NaN."""
    sq_B = jnp.square(x - mean_B(x, g))
    n_B = size_B(g).reshape(g.id_B.shape + (1,) * (x.ndim - 1))
    return jnp.sqrt(sum_N(sq_B, g)[g.id_B] / jnp.maximum(n_B - ddof, 1.0))


def constant_B(x: jax.Array, g: Groups) -> jax.Array:
    """True on the rows of a group whose live values are all equal (exactly)."""
    high = jax.ops.segment_max(jnp.where(_live(g, x), x, -jnp.inf), g.id_B, g.num)
    low = jax.ops.segment_min(jnp.where(_live(g, x), x, jnp.inf), g.id_B, g.num)
    return (high == low)[g.id_B]


def any_B(pred_B: jax.Array, g: Groups) -> jax.Array:
    """True on the rows of a group where pred holds on some live row."""
    return jax.ops.segment_max((pred_B & g.live_B).astype(jnp.int32), g.id_B, g.num)[g.id_B] > 0


def sorted_rows(x_B: jax.Array, g: Groups) -> tuple:
    """(order_B, pos_N): rows sorted by (segment, x, row), padding last; the lower-median member of
    segment n is row order_B[pos_N[n]] (position (size - 1) // 2 of the group: THE median of an odd
    group, the lower one of an even group, as torch.median)."""
    key_B = jnp.where(g.live_B, g.id_B, g.num)  # padding after every segment
    by_x_B = jnp.argsort(x_B, stable=True)
    order_B = by_x_B[jnp.argsort(key_B[by_x_B], stable=True)]
    n_N = count_N(g).astype(jnp.int32)
    pos_N = jnp.cumsum(n_N) - n_N + jnp.maximum(n_N - 1, 0) // 2
    return order_B, pos_N


def lower_median_B(x_B: jax.Array, g: Groups) -> jax.Array:
    order_B, pos_N = sorted_rows(x_B, g)
    return x_B[order_B][pos_N][g.id_B]


# Batch statistics over the live rows (padding excluded); scalars.


def live_mean(x: jax.Array, live_B: jax.Array) -> jax.Array:
    live = live_B.reshape(live_B.shape + (1,) * (x.ndim - 1))
    n = jnp.sum(jnp.broadcast_to(live, x.shape).astype(jnp.float32))
    return jnp.sum(jnp.where(live, x, 0)) / jnp.maximum(n, 1.0)


def live_std(x: jax.Array, live_B: jax.Array, ddof: int) -> jax.Array:
    """std over the live rows with `ddof`, divisor clamped to >= 1 (one live row: std 0)."""
    live = jnp.broadcast_to(live_B.reshape(live_B.shape + (1,) * (x.ndim - 1)), x.shape)
    n = jnp.sum(live.astype(jnp.float32))
    sq = jnp.where(live, jnp.square(x - live_mean(x, live_B)), 0)
    return jnp.sqrt(jnp.sum(sq) / jnp.maximum(n - ddof, 1.0))
