"""Decode attention over a prompt prefix stored once per group (psRL's shared-prefix decode).

The G rows of a group (rows i*G .. i*G+G-1 belong to prompt i) share their prompt's keys/values, so
the sampler keeps them once per group, [B/G, K, P, Hd] per layer, and each row keeps only its own
completion slots, [B, K, C, Hd]. A query then attends to both parts as one softmax:

    prefix part: the G rows' queries against the group's prefix keys, ONE matmul per (group, kv head)
                 with G*T*R query columns (instead of G matmuls with T*R columns each reading the
                 same keys);
    own part:    each row's queries against its own completion slots 0..index+t (causal).

The two parts form one softmax: m = max over both parts' scores, then numerator and denominator are
sums of e^(s - m) over both, the quantities the one-buffer path computes up to float32 summation
order.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxrl.models.cache_kinds import GroupKV

# A masked score: finite, so a fully masked part (a prompt of one real token has no valid prefix
# slot) gives max -1e30 and its weight e^(-1e30 - m) is exactly 0 once combined with the own part.
MASKED_SCORE = -1e30


def write_own(buf_GrpxKxGxCxHd, new_BxTxKxHd, index):
    """Write T new keys (or values) of every row at own slots index..index+T-1 (in place)."""
    Grp, K, G, _, Hd = buf_GrpxKxGxCxHd.shape
    T = new_BxTxKxHd.shape[1]
    new_GrpxKxGxTxHd = new_BxTxKxHd.reshape(Grp, G, T, K, Hd).transpose(0, 3, 1, 2, 4)
    return lax.dynamic_update_slice(
        buf_GrpxKxGxCxHd, new_GrpxKxGxTxHd.astype(buf_GrpxKxGxCxHd.dtype), (0, 0, 0, index, 0)
    )


def attend_group(q_BxTxHxHd, kv: GroupKV, prefix_valid_GrpxP, index, dtype):
    """Attention of T queries per row at own slots index..index+T-1 (a scalar: every row at the same
    slots) over its group's valid prefix slots and its own slots up to the query's.

    Keys-major scores and explicit `dot_general`s, as `attention.attend_kv_head_major` (XLA:CPU then
    neither transposes a cache nor picks a strided GEMM); one max and one sum over both parts."""
    B, T, H, Hd = q_BxTxHxHd.shape
    Grp, K, P, _ = kv.prefix_k.shape
    G, R, C = B // Grp, H // K, kv.own_k.shape[3]
    Q = T * R  # query columns per row and kv head, t major
    q_GrpxKxGxQxHd = q_BxTxHxHd.reshape(Grp, G, T, K, R, Hd).transpose(0, 3, 1, 2, 4, 5).reshape(Grp, K, G, Q, Hd)
    own = ((0, 1, 2), (0, 1, 2))
    s_own = lax.dot_general(
        kv.own_k.astype(dtype), q_GrpxKxGxQxHd, (((4,), (4,)), own), preferred_element_type=jnp.float32
    )  # Grp x K x G x C x Q
    causal_CxQ = jnp.repeat(jnp.arange(C)[:, None] <= index + jnp.arange(T)[None, :], R, axis=1)
    s_own = jnp.where(causal_CxQ, s_own, MASKED_SCORE)
    # The max and the sums reduce a transposed view: XLA:CPU reduces a minor axis far faster.
    max_GrpxKxGxQ = jnp.max(s_own.swapaxes(3, 4), axis=-1)
    if P:  # the prefix: the G rows' queries as G*Q columns of ONE matmul per (group, kv head)
        grouped = ((0, 1), (0, 1))
        s_pre = lax.dot_general(
            kv.prefix_k.astype(dtype),
            q_GrpxKxGxQxHd.reshape(Grp, K, G * Q, Hd),
            (((3,), (3,)), grouped),
            preferred_element_type=jnp.float32,
        )  # Grp x K x P x GQ
        s_pre = jnp.where(prefix_valid_GrpxP.astype(bool)[:, None, :, None], s_pre, MASKED_SCORE)
        max_GrpxKxGxQ = jnp.maximum(max_GrpxKxGxQ, jnp.max(s_pre.swapaxes(2, 3), axis=-1).reshape(Grp, K, G, Q))
    e_own = jnp.exp(s_own - max_GrpxKxGxQ[:, :, :, None, :])
    sum_GrpxKxGxQ = jnp.sum(e_own.swapaxes(3, 4), axis=-1)
    o_GrpxKxGxQxHd = lax.dot_general(
        e_own.astype(dtype), kv.own_v.astype(dtype), (((3,), (3,)), own), preferred_element_type=jnp.float32
    )
    if P:
        e_pre = jnp.exp(s_pre - max_GrpxKxGxQ.reshape(Grp, K, 1, G * Q))
        sum_GrpxKxGxQ = sum_GrpxKxGxQ + jnp.sum(e_pre.swapaxes(2, 3), axis=-1).reshape(Grp, K, G, Q)
        o_pre = lax.dot_general(
            e_pre.astype(dtype), kv.prefix_v.astype(dtype), (((2,), (2,)), grouped), preferred_element_type=jnp.float32
        )  # Grp x K x GQ x Hd
        o_GrpxKxGxQxHd = o_GrpxKxGxQxHd + o_pre.reshape(Grp, K, G, Q, Hd)
    o_GrpxKxGxQxHd = (o_GrpxKxGxQxHd / sum_GrpxKxGxQ[..., None]).astype(dtype)
    return o_GrpxKxGxQxHd.reshape(Grp, K, G, T, R, Hd).transpose(0, 2, 3, 1, 4, 5).reshape(B, T, H, Hd)
