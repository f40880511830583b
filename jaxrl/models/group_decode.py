"""The sampler's decode cache with the prompt prefix stored once per group (psRL for decode).

`decode.LayerCache` gives every row its own copy of its prompt's keys/values: with G samples per
prompt, each decode step reads the same prefix G times per layer. A `GroupCache` keeps the prefix once
per group, read only, and gives each row a buffer for its completion slots alone; attention combines
the two parts exactly (`prefix_attention.attend_group`). Rows i*G .. i*G+G-1 belong to group i.

The completion buffers can start short and grow (`grow_own`): at decode step t only slots 0..t hold
keys, so a loop run in segments whose buffers are just long enough for the segment's last step reads
fewer never-written slots than one loop over the full-length buffer (static shapes per segment).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.config import ModelConfig
from jaxrl.models.cache_kinds import GroupKV
from jaxrl.models.decode import LayerCache
from jaxrl.models.decoder import run_decoder
from jaxrl.models.parallel import Parallel


class GroupCache(NamedTuple):
    prefix: tuple  # per layer (k_GrpxKxPxHd, v_GrpxKxPxHd): the group's prompt prefix, read only
    own: tuple  # per layer (k_GrpxKxGxCxHd, v_..): each row's completion slots, row i*G+g at [i, :, g]
    prefix_valid_GrpxP: jax.Array  # bool: prefix slot holds a real (non-left-padding) token
    pos_B: jax.Array  # int32: position id of each row's next token


def group_cache(prefix: LayerCache, group_size: int, own_len: int) -> GroupCache:
    """A GroupCache over a prefilled per-prompt cache (one row per group, its slots all prefix) with
    zeroed completion buffers of own_len slots for the group_size rows of every group."""

    def zeros(k_GrpxKxPxHd):
        return jnp.zeros(k_GrpxKxPxHd.shape[:2] + (group_size, own_len, k_GrpxKxPxHd.shape[3]), k_GrpxKxPxHd.dtype)

    own = tuple((zeros(k), zeros(v)) for k, v in prefix.kv)
    return GroupCache(prefix.kv, own, prefix.valid_BxS, jnp.repeat(prefix.pos_B, group_size, axis=0))


def grow_own(cache: GroupCache, own_len: int) -> GroupCache:
    """The same cache with completion buffers zero-padded to own_len slots (one copy, between loops)."""

    def pad(buf):
        return jnp.pad(buf, ((0, 0), (0, 0), (0, 0), (0, own_len - buf.shape[3]), (0, 0)))

    return cache._replace(own=tuple((pad(k), pad(v)) for k, v in cache.own))


def decode_group_layers(
    lparams, cfg: ModelConfig, tokens_BxT, cache: GroupCache, index, parallel: Parallel | None = None
):
    """Append T tokens per row at completion slots index..index+T-1 (positions pos_B, pos_B+1, ..):
    `decode.decode_layers` on a GroupCache. Each token sees its group's valid prefix slots, its row's
    completion slots before `index` and the tokens before it in this call.
    -> (logits_BxTxV, cache, experts_BxTxLxK or None)."""
    T = tokens_BxT.shape[1]
    index = jnp.asarray(index, jnp.int32)
    positions_BxT = cache.pos_B[:, None] + jnp.arange(T, dtype=jnp.int32)
    kv_layers = [GroupKV(pk, pv, ok, ov) for (pk, pv), (ok, ov) in zip(cache.prefix, cache.own)]
    logits_BxTxV, kv_out, moe = run_decoder(
        lparams,
        cfg,
        tokens_BxT,
        positions_BxT,
        cache.prefix_valid_GrpxP,
        index,
        kv_layers,
        parallel=parallel,
    )
    own = tuple((kv.own_k, kv.own_v) for kv in kv_out)
    experts_BxTxLxK = None if moe is None else jnp.moveaxis(moe.experts_LxBxTxK, 0, 2)
    return logits_BxTxV, cache._replace(own=own, pos_B=cache.pos_B + T), experts_BxTxLxK


def segment_ends(steps: int, segments: int) -> tuple:
    """Completion-buffer lengths of a decode loop of `steps` steps run in `segments` segments: the
    end (exclusive) of each segment's steps, as equal as possible; step t writes slot t, so the
    segment ending at e needs e slots. E.g. (7, 3) -> (3, 5, 7)."""
    if not 1 <= segments <= max(steps, 1):
        raise ValueError(f"decode_segments: got {segments}, expected 1..{max(steps, 1)} for {steps} steps")
    base, extra = divmod(steps, segments)
    ends, end = [], 0
    for i in range(segments):  # the first `extra` segments take one step more
        end += base + (i < extra)
        ends.append(end)
    return tuple(ends)


def default_segments(steps: int) -> int:
    """Segments of at least 32 steps, at most 4: each segment compiles its own loop body, and past a
    few segments the slots saved no longer pay for it (see benchmarks/README.md)."""
    return max(1, min(4, steps // 32))
