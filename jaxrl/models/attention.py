"""Grouped-query attention over each kind of cache (`cache_kinds`): write this call's keys/values
where the kind keeps them, then attend. `attend` picks the code by the cache's type.

The kernels for the unrolled decode kinds (LayerKV, WindowKV here; GroupKV in `prefix_attention`)
are laid out for XLA:CPU: scores keys-major, both contractions explicit `dot_general`s and the
softmax normalised after the value contraction, so XLA neither transposes a cache nor picks a
strided GEMM. The no-cache and stacked kinds (training, scoring, prefill) run one of the kernels
in `KERNELS` (`model.attention`, resolved by `resolve_kernel`): "cpu" is the plain einsum form
(`attend_slots`), which is what the backward of training differentiates on CPU; "xla" and "cudnn"
are `jax.nn.dot_product_attention` with that implementation (`attend_slots_fused`), the same masks;
"splash" is JAX's Pallas TPU splash attention (`splash.attend_slots_splash`).

Shape letters as in layers.py: B batch, T query tokens, S key slots, K kv heads, R query heads per
kv head, Hd head dim, W window slots.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl.models.cache_kinds import GroupKV, LayerKV, SegmentIds, StackedKV, WindowKV
from jaxrl.models.decode_attention import (
    DENSE,
    DecodeKernel,
    attend_cache,
    attend_window_blocked,
    kv_head_major,
    query_major,
)
from jaxrl.models.prefix_attention import MASKED_SCORE, attend_group, write_own
from jaxrl.models.splash import attend_slots_splash

# model.attention's choices: "auto" resolves by backend at trace time (`resolve_kernel`).
KERNELS = ("auto", "cpu", "xla", "cudnn", "splash")


def resolve_kernel(choice: str, dtype, head_dim: int, backend: str | None = None) -> str:
    """The kernel `choice` ("auto" or one of KERNELS) names on `backend` (default: jax.default_backend(),
    read when the caller is traced): "auto" is "cudnn" on a GPU when cuDNN flash attention takes the
    shapes (a 16-bit `dtype`, head_dim a multiple of 8 and <= 128), else "xla" there; on TPU
    "splash" when head_dim is a multiple of 64 (whole or half 128-lane vregs; any T and S fit, they
    are padded to the block), else "xla"; "cpu" elsewhere. Other choices are returned as they are."""
    if choice not in KERNELS:
        raise ValueError(f"model.attention: got {choice!r}; expected one of {', '.join(KERNELS)}")
    if choice != "auto":
        return choice
    backend = jax.default_backend() if backend is None else backend
    if backend == "gpu":
        cudnn_ok = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0 and head_dim <= 128
        return "cudnn" if cudnn_ok else "xla"
    if backend == "tpu":
        return "splash" if head_dim % 64 == 0 else "xla"
    return "cpu"


def attend(
    q_BxTxHxHd,
    k_BxTxKxHd,
    v_BxTxKxHd,
    kv,
    key_valid_BxS,
    index,
    layer,
    dtype,
    kernel="cpu",
    layout=None,
    decode=DENSE,
) -> tuple[jax.Array, Any]:
    """-> (o_BxTxHxHd, kv updated). Queries occupy key slots index..index+T-1 (`index` a scalar, or
    for a LayerKV also index_B: each row's own slots); a key is visible iff its slot is not after
    the query's (causal) and `key_valid_BxS` marks it real. `layer` (traced) picks a StackedKV's
    layer. With a GroupKV, `index` is the slot in each row's own completion buffer and
    `key_valid_BxS` marks each group's valid prefix slots, [B/G, P]. `kernel` (resolved: "cpu", "xla",
    "cudnn" or "splash") picks the no-cache and StackedKV kernel; `layout` (a KernelLayout or None: one
    device) is how splash splits over the mesh; `decode` (`decode_attention.DecodeKernel`, resolved)
    the LayerKV and WindowKV cache read; GroupKV keeps its own."""
    kind = type(kv)
    if kind in _DECODE_ATTEND:
        return _DECODE_ATTEND[kind](q_BxTxHxHd, k_BxTxKxHd, v_BxTxKxHd, kv, key_valid_BxS, index, dtype, decode)
    if kind not in _ATTEND:
        names = ", ".join(k.__name__ for k in (*_ATTEND, *_DECODE_ATTEND))
        raise TypeError(f"attention: a cache entry of type {kind.__name__}; expected one of {names}")
    if kernel == "splash" and kind in (type(None), StackedKV):
        return _ATTEND_SPLASH[kind](q_BxTxHxHd, k_BxTxKxHd, v_BxTxKxHd, kv, key_valid_BxS, index, layer, dtype, layout)
    return _ATTEND[kind](q_BxTxHxHd, k_BxTxKxHd, v_BxTxKxHd, kv, key_valid_BxS, index, layer, dtype, kernel)


def _slots(q_BxTxHxHd, k_BxSxKxHd, v_BxSxKxHd, key_valid_BxS, index, dtype, kernel):
    if kernel == "cpu":
        return attend_slots(q_BxTxHxHd, k_BxSxKxHd, v_BxSxKxHd, key_valid_BxS, index, dtype)
    if kernel not in ("xla", "cudnn"):
        raise ValueError(
            f"attention: kernel {kernel!r}; expected 'cpu', 'xla' or 'cudnn' here ('auto' resolved first, "
            "'splash' taken by `attend`)"
        )
    implementation = "cudnn" if kernel == "cudnn" else "xla"
    return attend_slots_fused(q_BxTxHxHd, k_BxSxKxHd, v_BxSxKxHd, key_valid_BxS, index, dtype, implementation)


def _no_cache(q_BxTxHxHd, k_BxTxKxHd, v_BxTxKxHd, kv, key_valid_BxS, index, layer, dtype, kernel):
    return _slots(q_BxTxHxHd, k_BxTxKxHd, v_BxTxKxHd, key_valid_BxS, index, dtype, kernel), None


def _write_stacked(k_BxTxKxHd, v_BxTxKxHd, kv: StackedKV, index, layer, dtype):
    """Write this call's keys/values at slots index.. of `layer`: (k_BxSxKxHd, v_BxSxKxHd of that
    layer in `dtype`, the StackedKV updated)."""
    start = (layer, 0, index, 0, 0)
    k_all = lax.dynamic_update_slice(kv.k_LxBxSxKxHd, k_BxTxKxHd[None].astype(kv.k_LxBxSxKxHd.dtype), start)
    v_all = lax.dynamic_update_slice(kv.v_LxBxSxKxHd, v_BxTxKxHd[None].astype(kv.v_LxBxSxKxHd.dtype), start)
    k_BxSxKxHd = lax.dynamic_index_in_dim(k_all, layer, 0, keepdims=False).astype(dtype)
    v_BxSxKxHd = lax.dynamic_index_in_dim(v_all, layer, 0, keepdims=False).astype(dtype)
    return k_BxSxKxHd, v_BxSxKxHd, StackedKV(k_all, v_all)


def _stacked(q_BxTxHxHd, k_BxTxKxHd, v_BxTxKxHd, kv: StackedKV, key_valid_BxS, index, layer, dtype, kernel):
    k_BxSxKxHd, v_BxSxKxHd, kv = _write_stacked(k_BxTxKxHd, v_BxTxKxHd, kv, index, layer, dtype)
    o_BxTxHxHd = _slots(q_BxTxHxHd, k_BxSxKxHd, v_BxSxKxHd, key_valid_BxS, index, dtype, kernel)
    return o_BxTxHxHd, kv


def _no_cache_splash(q_BxTxHxHd, k_BxTxKxHd, v_BxTxKxHd, kv, key_valid_BxS, index, layer, dtype, layout):
    # The keys are this call's own tokens: key t is query t's token, so the causal offset is 0
    # whatever `index` is (the no-cache callers pass 0, where every kernel agrees).
    return attend_slots_splash(q_BxTxHxHd, k_BxTxKxHd, v_BxTxKxHd, key_valid_BxS, 0, dtype, layout=layout), None


def _stacked_splash(q_BxTxHxHd, k_BxTxKxHd, v_BxTxKxHd, kv, key_valid_BxS, index, layer, dtype, layout):
    # `index` is traced (run_decoder): the queries ride in an S-slot buffer (`attend_slots_splash`).
    k_BxSxKxHd, v_BxSxKxHd, kv = _write_stacked(k_BxTxKxHd, v_BxTxKxHd, kv, index, layer, dtype)
    o_BxTxHxHd = attend_slots_splash(q_BxTxHxHd, k_BxSxKxHd, v_BxSxKxHd, key_valid_BxS, index, dtype, layout=layout)
    return o_BxTxHxHd, kv


def _layer(q_BxTxHxHd, k_BxTxKxHd, v_BxTxKxHd, kv: LayerKV, key_valid_BxS, index, dtype, decode: DecodeKernel):
    k_buf = write_layer_kv(kv.k_BxKxSxHd, k_BxTxKxHd.swapaxes(1, 2).astype(kv.k_BxKxSxHd.dtype), index)
    v_buf = write_layer_kv(kv.v_BxKxSxHd, v_BxTxKxHd.swapaxes(1, 2).astype(kv.v_BxKxSxHd.dtype), index)
    args = (q_BxTxHxHd, k_buf.astype(dtype), v_buf.astype(dtype), key_valid_BxS, index, dtype)
    # A call that fills the whole cache (the engine's prefill, T = S) has nothing to bound.
    if decode.name == "dense" or q_BxTxHxHd.shape[1] >= k_buf.shape[2]:
        return attend_kv_head_major(*args), LayerKV(k_buf, v_buf)
    return attend_cache(*args, decode), LayerKV(k_buf, v_buf)


def _window(q_BxTxHxHd, k_BxTxKxHd, v_BxTxKxHd, kv: WindowKV, key_valid_BxS, index, dtype, decode: DecodeKernel):
    win = tuple(
        lax.dynamic_update_slice(buf, new.swapaxes(1, 2).astype(buf.dtype), (0, 0, index, 0))
        for buf, new in zip((kv.win_k, kv.win_v), (k_BxTxKxHd, v_BxTxKxHd))
    )
    cache = (kv.k_BxKxSxHd.astype(dtype), kv.v_BxKxSxHd.astype(dtype), key_valid_BxS)
    window = (win[0].astype(dtype), win[1].astype(dtype), index, dtype)
    # The window read has no Pallas form: "pallas" reads the cache as "blocked" does.
    if decode.name == "dense":
        o_BxTxHxHd = attend_window(q_BxTxHxHd, *cache, *window)
    else:
        o_BxTxHxHd = attend_window_blocked(q_BxTxHxHd, *cache, *window, block=decode.block)
    return o_BxTxHxHd, kv._replace(win_k=win[0], win_v=win[1])


def _group(q_BxTxHxHd, k_BxTxKxHd, v_BxTxKxHd, kv: GroupKV, key_valid_BxS, index, layer, dtype, kernel):
    own = tuple(write_own(buf, new, index) for buf, new in zip((kv.own_k, kv.own_v), (k_BxTxKxHd, v_BxTxKxHd)))
    kv = kv._replace(own_k=own[0], own_v=own[1])
    return attend_group(q_BxTxHxHd, kv, key_valid_BxS, index, dtype), kv


_ATTEND = {type(None): _no_cache, StackedKV: _stacked, GroupKV: _group}
_DECODE_ATTEND = {LayerKV: _layer, WindowKV: _window}
_ATTEND_SPLASH = {type(None): _no_cache_splash, StackedKV: _stacked_splash}


def attend_slots(q_BxTxHxHd, k_BxSxKxHd, v_BxSxKxHd, key_valid_BxS, index, dtype):
    """Queries at slots index.. over keys laid out slot-major (this call's own, or one layer of a
    stacked cache): the einsum form, softmax in float32."""
    B, T, H, Hd = q_BxTxHxHd.shape
    K, S = k_BxSxKxHd.shape[2], k_BxSxKxHd.shape[1]
    # Group query heads by the kv head they share: head h reads kv head h // R.
    q_BxTxKxRxHd = q_BxTxHxHd.reshape(B, T, K, H // K, Hd)
    s_BxKxRxTxS = jnp.einsum("btkrd,bskd->bkrts", q_BxTxKxRxHd, k_BxSxKxHd, preferred_element_type=jnp.float32)
    allowed_BxTxS = allowed_slots(key_valid_BxS, index, T, S)
    s_BxKxRxTxS = jnp.where(allowed_BxTxS[:, None, None], s_BxKxRxTxS, MASKED_SCORE)
    p_BxKxRxTxS = jax.nn.softmax(s_BxKxRxTxS, axis=-1).astype(dtype)
    o_BxTxKxRxHd = jnp.einsum("bkrts,bskd->btkrd", p_BxKxRxTxS, v_BxSxKxHd)
    return o_BxTxKxRxHd.reshape(B, T, H, Hd)


def allowed_slots(key_valid_BxS, index, T: int, S: int):
    """allowed_BxTxS: query t (at slot index+t) sees key slot s iff s <= index+t and the key is valid;
    with `SegmentIds`, also iff the key's segment is the query's."""
    q_slot_T = index + jnp.arange(T)
    causal_TxS = jnp.arange(S)[None, :] <= q_slot_T[:, None]
    if isinstance(key_valid_BxS, SegmentIds):
        ids_BxS = key_valid_BxS.ids_BxS
        q_ids_BxT = lax.dynamic_slice_in_dim(ids_BxS, index, T, axis=1)
        same_BxTxS = (q_ids_BxT[:, :, None] == ids_BxS[:, None, :]) & (ids_BxS > 0)[:, None, :]
        return causal_TxS[None] & same_BxTxS
    return causal_TxS[None] & key_valid_BxS.astype(bool)[:, None, :]


def attend_slots_fused(
    q_BxTxHxHd,
    k_BxSxKxHd,
    v_BxSxKxHd,
    key_valid_BxS,
    index,
    dtype,
    implementation: Literal["xla", "cudnn"],
    pad_to_even: bool | None = None,
):
    """`attend_slots` through `jax.nn.dot_product_attention` (implementation "xla" or "cudnn"): the
    same visibility (causal by slot from `index`, `key_valid_BxS`) as one boolean B x 1 x T x S mask
    shared by the heads; GQA by the API's own grouping (head h reads kv head h // R); the queries
    arrive already scaled (layers.py), so scale=1. "xla" runs the softmax in float32; "cudnn" is
    cuDNN's flash attention (16-bit dtypes only, head_dim a multiple of 8; odd T or S padded by one,
    as `pad_to_even` says: None = for cudnn only;
    the mask enters as an additive bias, so cuDNN does not skip the causal upper triangle). On CPU
    "xla" is tested against `attend_slots` (tests/test_attention_kernels.py); "cudnn" is only lowered
    for CUDA there (with a stand-in cuDNN version), its numbers are left to the device check."""
    T, S = q_BxTxHxHd.shape[1], k_BxSxKxHd.shape[1]
    allowed_BxTxS = allowed_slots(key_valid_BxS, index, T, S)
    q_BxTxHxHd, k_BxSxKxHd, v_BxSxKxHd = (x.astype(dtype) for x in (q_BxTxHxHd, k_BxSxKxHd, v_BxSxKxHd))
    if (implementation == "cudnn" if pad_to_even is None else pad_to_even) and (T % 2 or S % 2):
        # cuDNN's training kernel takes even lengths only: one more query (its output dropped) and one
        # more key (masked for every query).
        dT, dS = T % 2, S % 2
        q_BxTxHxHd = jnp.pad(q_BxTxHxHd, ((0, 0), (0, dT), (0, 0), (0, 0)))
        k_BxSxKxHd, v_BxSxKxHd = (jnp.pad(x, ((0, 0), (0, dS), (0, 0), (0, 0))) for x in (k_BxSxKxHd, v_BxSxKxHd))
        allowed_BxTxS = jnp.pad(allowed_BxTxS, ((0, 0), (0, dT), (0, dS)))
    o_BxTxHxHd = jax.nn.dot_product_attention(
        q_BxTxHxHd,
        k_BxSxKxHd,
        v_BxSxKxHd,
        mask=allowed_BxTxS[:, None],
        scale=1.0,
        implementation=implementation,
    )
    return o_BxTxHxHd[:, :T].astype(dtype)


def write_layer_kv(buf_BxKxSxHd, new_BxKxTxHd, index):
    """Write T new keys (or values) of every row at cache slots index..index+T-1: `index` a scalar
    (every row at the same slots) or index_B (each row at its own, as the slot engine decodes).
    Either way an in-place update that attention then reads, so XLA copies no cache buffer."""
    if jnp.ndim(index) == 0:
        return lax.dynamic_update_slice(buf_BxKxSxHd, new_BxKxTxHd, (0, 0, index, 0))
    write = jax.vmap(lambda buf_KxSxHd, new_KxTxHd, i: lax.dynamic_update_slice(buf_KxSxHd, new_KxTxHd, (0, i, 0)))
    return write(buf_BxKxSxHd, new_BxKxTxHd, index)


def attend_kv_head_major(q_BxTxHxHd, k_BxKxSxHd, v_BxKxSxHd, key_valid_BxS, index, dtype):
    """Attention of queries at slots index.. (a scalar, or index_B: each row's own) over a
    kv-head-major cache; same math as
    `attend_slots`, laid out for XLA:CPU decode: the scores are computed keys-major (S x TR per
    (b, k), softmax over S) and both contractions are explicit `dot_general`s, so XLA neither
    transposes the cache nor picks a strided GEMM (benchmarks/README.md: the cache is read twice per
    layer per step; nothing else in decode grows with S)."""
    B, T, H, Hd = q_BxTxHxHd.shape
    K, S = k_BxKxSxHd.shape[1], k_BxKxSxHd.shape[2]
    R = H // K
    q_BxKxQxHd = kv_head_major(q_BxTxHxHd, K)
    batch = ((0, 1), (0, 1))
    s_BxKxSxQ = lax.dot_general(k_BxKxSxHd, q_BxKxQxHd, (((3,), (3,)), batch), preferred_element_type=jnp.float32)
    q_slot_T = jnp.asarray(index)[..., None] + jnp.arange(T)  # (T,) or, per row, (B, T)
    causal_SxT = jnp.arange(S)[:, None] <= q_slot_T[..., None, :]  # (S, T) or (B, S, T)
    allowed_BxSxT = causal_SxT & key_valid_BxS.astype(bool)[:, :, None]
    s_BxKxSxTxR = jnp.where(allowed_BxSxT[:, None, :, :, None], s_BxKxSxQ.reshape(B, K, S, T, R), MASKED_SCORE)
    s_BxKxSxQ = s_BxKxSxTxR.reshape(B, K, S, T * R)
    # Softmax over S, normalised after the value contraction (on the small output): the max and the
    # sum reduce a transposed view, since XLA:CPU reduces a minor axis far faster than axis 2.
    max_BxKxQ = jnp.max(s_BxKxSxQ.swapaxes(2, 3), axis=-1)
    e_BxKxSxQ = jnp.exp(s_BxKxSxQ - max_BxKxQ[:, :, None, :])
    sum_BxKxQ = jnp.sum(e_BxKxSxQ.swapaxes(2, 3), axis=-1)
    o_BxKxQxHd = lax.dot_general(
        e_BxKxSxQ.astype(dtype), v_BxKxSxHd, (((2,), (2,)), batch), preferred_element_type=jnp.float32
    )
    o_BxKxQxHd = (o_BxKxQxHd / sum_BxKxQ[..., None]).astype(dtype)
    return query_major(o_BxKxQxHd, T)


def attend_window(q_BxTxHxHd, k_BxKxSxHd, v_BxKxSxHd, cache_seen_BxS, wk_BxKxWxHd, wv_BxKxWxHd, index, dtype):
    """Attention over the cache slots marked in cache_seen_BxS, then window slots 0..index+t for
    the query t (one softmax over both parts, laid out as `attend_kv_head_major`)."""
    B, T, H, Hd = q_BxTxHxHd.shape
    K, W = k_BxKxSxHd.shape[1], wk_BxKxWxHd.shape[2]
    R = H // K
    q_BxKxQxHd = kv_head_major(q_BxTxHxHd, K)
    batch = ((0, 1), (0, 1))
    cache_scores = lax.dot_general(k_BxKxSxHd, q_BxKxQxHd, (((3,), (3,)), batch), preferred_element_type=jnp.float32)
    s_BxKxSxQ = jnp.where(cache_seen_BxS[:, None, :, None], cache_scores, MASKED_SCORE)
    causal_WxT = jnp.arange(W)[:, None] <= index + jnp.arange(T)[None, :]
    # The window is a few slots: a fused multiply-reduce beats B*K tiny GEMMs on XLA:CPU.
    window_scores = jnp.sum(wk_BxKxWxHd[:, :, :, None, :].astype(jnp.float32) * q_BxKxQxHd[:, :, None], axis=-1)
    s_BxKxWxQ = jnp.where(jnp.repeat(causal_WxT, R, axis=1)[None, None], window_scores, MASKED_SCORE)
    max_BxKxQ = jnp.maximum(jnp.max(s_BxKxSxQ.swapaxes(2, 3), axis=-1), jnp.max(s_BxKxWxQ.swapaxes(2, 3), axis=-1))
    e_BxKxSxQ = jnp.exp(s_BxKxSxQ - max_BxKxQ[:, :, None, :])
    e_BxKxWxQ = jnp.exp(s_BxKxWxQ - max_BxKxQ[:, :, None, :])
    sum_BxKxQ = jnp.sum(e_BxKxSxQ.swapaxes(2, 3), axis=-1) + jnp.sum(e_BxKxWxQ.swapaxes(2, 3), axis=-1)
    cache_mix = lax.dot_general(
        e_BxKxSxQ.astype(dtype), v_BxKxSxHd, (((2,), (2,)), batch), preferred_element_type=jnp.float32
    )
    window_mix = jnp.sum(e_BxKxWxQ[..., None] * wv_BxKxWxHd[:, :, :, None, :].astype(jnp.float32), axis=2)
    o_BxKxQxHd = ((cache_mix + window_mix) / sum_BxKxQ[..., None]).astype(dtype)
    return query_major(o_BxKxQxHd, T)
