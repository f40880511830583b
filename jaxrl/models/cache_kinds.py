"""The kinds of key/value cache one attention layer can be given; attention picks its code by kind.

    None         no cache: the keys are this call's own tokens (training, scoring).
    StackedKV    every layer's buffers in one array, k_LxBxSxKxHd, carried whole through the scanned
                 layers; each layer writes its slice at the traced layer counter (prefill, scoring a
                 prompt once per group).
    LayerKV      ONE layer's own kv-head-major buffers, k_BxKxSxHd, for decode loops that unroll the
                 layers: attention reads the cache where it lies, so no step copies a slice of it
                 (on CPU those copies cost as much as the decode matmuls).
    WindowKV     one layer's cache, read only, plus a small window that this call's keys/values go
                 to (speculative windows: `decode.window_layers`, committed later).
    GroupKV      one layer's prompt prefix stored once per group plus each row's own completion
                 slots (`group_decode`, psRL's shared-prefix decode).

Model-level caches (what the decode functions carry between steps) hold one of these per layer:
`kv_cache.Cache` (stacked), `decode.LayerCache` (LayerKV), `group_decode.GroupCache` (GroupKV).

Which keys a query may see comes as `key_valid_BxS` (bool) or, for a packed forward, `SegmentIds`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax


class StackedKV(NamedTuple):
    k_LxBxSxKxHd: jax.Array
    v_LxBxSxKxHd: jax.Array


class LayerKV(NamedTuple):
    k_BxKxSxHd: jax.Array
    v_BxKxSxHd: jax.Array


class WindowKV(NamedTuple):
    """The cache slots marked by the call's `key_valid_BxS` come first, then the window slots up to
    each query's own (`index` is the window slot of the first query)."""

    k_BxKxSxHd: jax.Array
    v_BxKxSxHd: jax.Array
    win_k: jax.Array  # k_BxKxWxHd
    win_v: jax.Array


class GroupKV(NamedTuple):
    """The prefix is read only; the own buffers get this call's keys/values at slots
    index..index+T-1. Which prefix slots are real (not left padding) travels as the attention's
    `key_valid` argument, [Grp, P]. The own buffers are group-major too, so the rows' scores line up
    with the prefix part's query columns without any transpose."""

    prefix_k: jax.Array  # k_GrpxKxPxHd, Grp = B / G groups
    prefix_v: jax.Array
    own_k: jax.Array  # k_GrpxKxGxCxHd: row i*G + g is [i, :, g], C completion slots
    own_v: jax.Array


LayerCacheKind = StackedKV | LayerKV | WindowKV | GroupKV | None


class SegmentIds(NamedTuple):
    """`key_valid_BxS` of a packed forward (`models.packing`): several sequences share a row, each its
    own segment id (> 0; 0 = an empty slot). A key is valid where its id is > 0, and a query sees only
    keys of its own segment (a query's id is the id of the slot it occupies), causally as always. Only
    the no-cache and stacked kinds take it (training's one-pass forward), by every kernel: the einsum and
    `jax.nn.dot_product_attention` ones through `allowed_slots`, splash as its own segment ids."""

    ids_BxS: jax.Array  # int32
