"""Decode attention that reads only the cache slots a row has filled (`model.decode_attention`).

The slot engine's cache (`cache_kinds.LayerKV`) is one contiguous kv-head-major buffer per layer,
k_BxKxSxHd, S = the engine's cache length, and each row decodes at its own slot index_B. The dense
kernel (`attention.attend_kv_head_major`) reads all S slots of every row at every step, masked; on
an accelerator decode is bound by memory traffic, so the slots past a row's fill are wasted reads.
The kernels here read the cache in blocks of `block` slots with an online (flash-style) softmax in
float32 and stop after the last block a query can see:

  dense    `attend_kv_head_major` / `attend_window`: every slot, tuned for XLA:CPU.
  blocked  portable XLA: a `lax.while_loop` over blocks 0 .. ceil((max_b index_b + T) / block) - 1,
           the trip count computed at run time, so one batch stops after the block of its fullest
           row (a batch whose rows are all short reads little; one full row makes every row read
           that far).
  pallas   a Pallas kernel, one program per (row, kv head), each looping over ITS row's blocks only
           (the row's last query slot comes in as a per-row input). On GPU (Triton) the row's cache
           stays in HBM and `ref[..., pl.ds(start, block), :]` reads one block at a time, so the
           traffic is bounded per row. On TPU the BlockSpec below stages the row's whole S x Hd
           slab into VMEM before the program runs, so there it bounds the compute but not the HBM
           read; a fill-bounded TPU read needs manual DMA from `memory_space=ANY` (left undone).

No page table: rows keep their contiguous per-slot buffer (the engine's slot i of a row is cache
slot i), and the bound is each row's fill. JAX's TPU kernels take a page pool instead (jax 0.10.2):
`pallas.ops.tpu.paged_attention` k_pages/v_pages [K, pages, page_size, Hd] with a page table per
row, `ragged_paged_attention` one kv_pages [pages, page_size, 2K, Hd] with keys and values
interleaved by head. Our B x K x S x Hd buffers are the first only through a transpose putting K in
front (and the second through a transpose and an interleave), i.e. a copy of the whole cache per
step, so neither is used; they would fit a cache kept in their layout, which is the page-table
rewrite this module avoids.

All kernels compute the same function; they differ by float32 rounding (the online softmax rescales
partial sums), so results match the dense kernel to float32 noise, not bitwise
(tests/test_decode_kernels.py). Shape letters as in attention.py; Q = T * R queries per kv head.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl.models.prefix_attention import MASKED_SCORE

# model.decode_attention's choices; "auto" is resolved by backend when the layer is traced.
DECODE_KERNELS = ("auto", "dense", "blocked", "pallas")


class DecodeKernel(NamedTuple):
    """The decode-attention kernel a layer runs (static, from the model config): name one of
    DECODE_KERNELS minus "auto" (resolved), block the slots read per loop step, platform the
    backend it was resolved for ("gpu": Triton, "tpu": Mosaic, else the Pallas interpreter)."""

    name: str = "dense"
    block: int = 128
    platform: str = "cpu"


DENSE = DecodeKernel()  # today's kernels: what every caller that names none gets


def resolve_decode_kernel(choice: str, block: int, backend: str | None = None) -> DecodeKernel:
    """The kernel `choice` names on `backend` (default: jax.default_backend() when traced): "auto" is
    "dense" on CPU (XLA:CPU decode is compute-bound and its dense kernel tuned, benchmarks/README.md)
    and "blocked" on GPU and TPU (the portable fill-bounded form; "pallas" is opt-in until verified
    on a device). "pallas" off GPU/TPU runs in the Pallas interpreter (slow; for tests)."""
    if choice not in DECODE_KERNELS:
        raise ValueError(f"model.decode_attention: got {choice!r}; expected one of {', '.join(DECODE_KERNELS)}")
    if block <= 0:
        raise ValueError(f"model.decode_block: got {block}; expected a positive integer")
    backend = jax.default_backend() if backend is None else backend
    name = choice if choice != "auto" else ("dense" if backend == "cpu" else "blocked")
    return DecodeKernel(name, block, backend)


def attend_cache(q_BxTxHxHd, k_BxKxSxHd, v_BxKxSxHd, key_valid_BxS, index, dtype, decode: DecodeKernel):
    """The LayerKV read (queries at slots index.., a scalar or index_B) by `decode`'s kernel."""
    if decode.name == "blocked":
        return attend_blocked(q_BxTxHxHd, k_BxKxSxHd, v_BxKxSxHd, key_valid_BxS, index, dtype, decode.block)
    if decode.name == "pallas":
        args = (q_BxTxHxHd, k_BxKxSxHd, v_BxKxSxHd, key_valid_BxS, index, dtype, decode.block, decode.platform)
        return attend_pallas(*args)
    raise ValueError(f"decode attention: kernel {decode.name!r}; expected 'blocked' or 'pallas' (dense: attention.py)")


def kv_head_major(q_BxTxHxHd, K: int):
    """Queries grouped by the kv head they read (head h reads kv head h // R): q_BxKxQxHd, Q = T*R, t major."""
    B, T, H, Hd = q_BxTxHxHd.shape
    return q_BxTxHxHd.reshape(B, T, K, H // K, Hd).transpose(0, 2, 1, 3, 4).reshape(B, K, T * (H // K), Hd)


def query_major(o_BxKxQxHd, T: int):
    """The inverse of `kv_head_major`: o_BxTxHxHd."""
    B, K, Q, Hd = o_BxKxQxHd.shape
    return o_BxKxQxHd.reshape(B, K, T, Q // T, Hd).transpose(0, 2, 1, 3, 4).reshape(B, T, K * (Q // T), Hd)


def _block_start(j, block: int, S: int):
    """Block j's first slot, clamped so the block stays inside S (the last block of an S that
    `block` does not divide overlaps the one before; its already-read slots are masked by `fresh`)."""
    return jnp.minimum(j * block, S - block)


def _online_step(carry, s_QxC, allowed_QxC, v_CxHd):
    """One block of the float32 online softmax: (max_Q, sum_Q, acc_QxHd) updated by scores s_QxC
    (masked by allowed_QxC) over values v_CxHd. Leading batch axes broadcast."""
    m_Q, l_Q, acc_QxHd = carry
    s_QxC = jnp.where(allowed_QxC, s_QxC, MASKED_SCORE)
    m_new_Q = jnp.maximum(m_Q, jnp.max(s_QxC, axis=-1))
    scale_Q = jnp.exp(m_Q - m_new_Q)
    p_QxC = jnp.where(allowed_QxC, jnp.exp(s_QxC - m_new_Q[..., None]), 0.0)
    l_Q = l_Q * scale_Q + jnp.sum(p_QxC, axis=-1)
    pv_QxHd = jnp.einsum("...qc,...cd->...qd", p_QxC.astype(v_CxHd.dtype), v_CxHd, preferred_element_type=jnp.float32)
    return m_new_Q, l_Q, acc_QxHd * scale_Q[..., None] + pv_QxHd


def _blocked_partial(q_BxKxQxHd, k_BxKxSxHd, v_BxKxSxHd, allowed, n_blocks, block: int):
    """The online softmax over blocks 0..n_blocks-1 (n_blocks traced: a while loop) -> float32
    (max_BxKxQ, sum_BxKxQ, acc_BxKxQxHd), unnormalised. allowed(slot_C) -> allowed_BxQxC."""
    B, K, Q, Hd = q_BxKxQxHd.shape
    S = k_BxKxSxHd.shape[2]
    init = (
        jnp.full((B, K, Q), MASKED_SCORE, jnp.float32),
        jnp.zeros((B, K, Q), jnp.float32),
        jnp.zeros((B, K, Q, Hd), jnp.float32),
    )

    def body(j, carry):
        start = _block_start(j, block, S)
        k_BxKxCxHd = lax.dynamic_slice_in_dim(k_BxKxSxHd, start, block, axis=2)
        v_BxKxCxHd = lax.dynamic_slice_in_dim(v_BxKxSxHd, start, block, axis=2)
        slot_C = start + jnp.arange(block)
        fresh_C = slot_C >= j * block
        s_BxKxQxC = jnp.einsum("bkqd,bkcd->bkqc", q_BxKxQxHd, k_BxKxCxHd, preferred_element_type=jnp.float32)
        allowed_BxKxQxC = (allowed(slot_C) & fresh_C)[:, None]
        return _online_step(carry, s_BxKxQxC, allowed_BxKxQxC, v_BxKxCxHd)

    return lax.fori_loop(0, n_blocks, body, init)


def _n_blocks(last_slot, block: int):
    """Blocks holding slots 0..last_slot (traced: the loop's run-time trip count)."""
    return (last_slot + block) // block


def attend_blocked(q_BxTxHxHd, k_BxKxSxHd, v_BxKxSxHd, key_valid_BxS, index, dtype, block: int = 128):
    """`attention.attend_kv_head_major` (queries at slots index.. , a scalar or index_B) reading only
    the blocks up to the furthest query slot of the batch: a while loop whose trip count is
    ceil((max index + T) / block), computed at run time."""
    B, T, H, _ = q_BxTxHxHd.shape
    K, S = k_BxKxSxHd.shape[1], k_BxKxSxHd.shape[2]
    block = min(block, S)
    q_slot_BxT = jnp.broadcast_to(jnp.asarray(index, jnp.int32)[..., None] + jnp.arange(T), (B, T))
    R = H // K
    q_slot_BxQ = jnp.repeat(q_slot_BxT, R, axis=1)  # query q = t * R + r (as `kv_head_major` orders them)
    valid_BxS = key_valid_BxS.astype(bool)

    def allowed(slot_C):
        valid_BxC = jnp.take(valid_BxS, slot_C, axis=1)
        return (slot_C[None, None, :] <= q_slot_BxQ[:, :, None]) & valid_BxC[:, None, :]

    n = _n_blocks(jnp.max(q_slot_BxT), block)
    q_BxKxQxHd = kv_head_major(q_BxTxHxHd, K)
    _, l_BxKxQ, acc_BxKxQxHd = _blocked_partial(q_BxKxQxHd, k_BxKxSxHd, v_BxKxSxHd, allowed, n, block)
    return query_major((acc_BxKxQxHd / l_BxKxQ[..., None]).astype(dtype), T)


def attend_window_blocked(
    q_BxTxHxHd, k_BxKxSxHd, v_BxKxSxHd, cache_seen_BxS, wk_BxKxWxHd, wv_BxKxWxHd, index, dtype, block=128
):
    """`attention.attend_window` reading the cache in blocks up to the batch's furthest seen slot
    (`decode.window_layers` sees slots below each row's fill_B, so that is max fill_B; found from
    the B x S mask, which is small next to the cache), then the window slots 0..index+t, one softmax."""
    B, T, H, _ = q_BxTxHxHd.shape
    K, S, W = k_BxKxSxHd.shape[1], k_BxKxSxHd.shape[2], wk_BxKxWxHd.shape[2]
    block = min(block, S)
    R = H // K
    seen_BxS = cache_seen_BxS.astype(bool)

    def allowed(slot_C):
        return jnp.take(seen_BxS, slot_C, axis=1)[:, None, :]

    q_BxKxQxHd = kv_head_major(q_BxTxHxHd, K)
    end = jnp.max(jnp.where(seen_BxS, jnp.arange(1, S + 1), 0))  # one past the furthest seen slot
    carry = _blocked_partial(q_BxKxQxHd, k_BxKxSxHd, v_BxKxSxHd, allowed, _n_blocks(end - 1, block), block)
    causal_QxW = jnp.repeat(jnp.arange(W)[None, :] <= index + jnp.arange(T)[:, None], R, axis=0)
    s_BxKxQxW = jnp.einsum("bkqd,bkwd->bkqw", q_BxKxQxHd, wk_BxKxWxHd, preferred_element_type=jnp.float32)
    _, l_BxKxQ, acc_BxKxQxHd = _online_step(carry, s_BxKxQxW, causal_QxW, wv_BxKxWxHd)
    return query_major((acc_BxKxQxHd / l_BxKxQ[..., None]).astype(dtype), T)


def _pallas_program(last_ref, q_ref, k_ref, v_ref, valid_ref, o_ref, *, block: int, T: int, R: int, S: int, tpu: bool):
    """One (row, kv head): the online softmax over this row's blocks 0..last // block only. `tpu`:
    the row's last query slot is a scalar-prefetched SMEM array indexed by the program's row, and
    the contractions are MXU dots; else a per-row (1, 1, 1) block, and elementwise products (Q =
    T*R is often below the 16 rows a Triton dot needs)."""
    from jax.experimental import pallas as pl

    last = last_ref[pl.program_id(0)] if tpu else last_ref[0, 0, 0]  # the row's last query slot
    q_QxHd = q_ref[0, 0].astype(jnp.float32)
    Q, Hd = q_QxHd.shape
    q_slot_Q = last - (T - 1) + lax.broadcasted_iota(jnp.int32, (Q, 1), 0) // R

    def body(j, carry):
        start = _block_start(j, block, S)
        k_CxHd = k_ref[0, 0, pl.ds(start, block), :].astype(jnp.float32)
        v_CxHd = v_ref[0, 0, pl.ds(start, block), :].astype(jnp.float32)
        valid_1xC = valid_ref[0, :, pl.ds(start, block)] > 0
        slot_1xC = start + lax.broadcasted_iota(jnp.int32, (1, block), 1)
        allowed_QxC = (slot_1xC <= q_slot_Q) & valid_1xC & (slot_1xC >= j * block)
        if tpu:
            s_QxC = lax.dot_general(q_QxHd, k_CxHd, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        else:
            s_QxC = jnp.sum(q_QxHd[:, None, :] * k_CxHd[None, :, :], axis=-1)
        m_Qx1, l_Qx1, acc_QxHd = carry
        s_QxC = jnp.where(allowed_QxC, s_QxC, MASKED_SCORE)
        m_new_Qx1 = jnp.maximum(m_Qx1, jnp.max(s_QxC, axis=-1, keepdims=True))
        scale_Qx1 = jnp.exp(m_Qx1 - m_new_Qx1)
        p_QxC = jnp.where(allowed_QxC, jnp.exp(s_QxC - m_new_Qx1), 0.0)
        if tpu:
            pv_QxHd = jnp.dot(p_QxC, v_CxHd, preferred_element_type=jnp.float32)
        else:
            pv_QxHd = jnp.sum(p_QxC[:, :, None] * v_CxHd[None, :, :], axis=1)
        return m_new_Qx1, l_Qx1 * scale_Qx1 + jnp.sum(p_QxC, axis=-1, keepdims=True), acc_QxHd * scale_Qx1 + pv_QxHd

    init = (
        jnp.full((Q, 1), MASKED_SCORE, jnp.float32),
        jnp.zeros((Q, 1), jnp.float32),
        jnp.zeros((Q, Hd), jnp.float32),
    )
    _, l_Qx1, acc_QxHd = lax.fori_loop(0, _n_blocks(last, block), body, init)
    o_ref[0, 0] = (acc_QxHd / l_Qx1).astype(o_ref.dtype)


def attend_pallas(
    q_BxTxHxHd,
    k_BxKxSxHd,
    v_BxKxSxHd,
    key_valid_BxS,
    index,
    dtype,
    block: int = 128,
    platform: str = "cpu",
    interpret: bool | None = None,
):
    """`attention.attend_kv_head_major` as a Pallas kernel: grid (B, K), each program reading only
    its row's blocks up to that row's last query slot (index_b + T - 1): per-row bounds where the
    blocked form bounds the batch. `platform` ("gpu": Triton, "tpu": Mosaic, else the interpreter)
    picks the program's form; `interpret` (default: platform is neither) runs that form in the
    Pallas interpreter, which is how CPU tests check the GPU and TPU forms."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    B, T, H, Hd = q_BxTxHxHd.shape
    K, S = k_BxKxSxHd.shape[1], k_BxKxSxHd.shape[2]
    block = min(block, S)
    R = H // K
    tpu = platform == "tpu"
    q_BxKxQxHd = kv_head_major(q_BxTxHxHd, K).astype(dtype)
    if platform == "gpu":
        _check_triton_shapes(block, Hd)
        # Triton tiles are powers of 2: zero queries pad Q (their outputs are dropped below).
        Q = T * R
        q_BxKxQxHd = jnp.pad(q_BxKxQxHd, ((0, 0), (0, 0), (0, _pow2(Q) - Q), (0, 0)))
    Q = q_BxKxQxHd.shape[2]
    interpret = platform not in ("gpu", "tpu") if interpret is None else interpret
    last_B = jnp.broadcast_to(jnp.asarray(index, jnp.int32), (B,)) + (T - 1)
    valid_Bx1xS = key_valid_BxS.astype(jnp.int32)[:, None, :]
    program = functools.partial(_pallas_program, block=block, T=T, R=R, S=S, tpu=tpu)
    # The index maps take (b, k) and, on TPU, the scalar-prefetched last_B after them.
    specs = [
        pl.BlockSpec((1, 1, Q, Hd), lambda b, k, *_: (b, k, 0, 0)),
        # The row's whole slab: on GPU a pointer into HBM that the program reads block by block; on
        # TPU copied to VMEM before the program runs (see the module docstring).
        pl.BlockSpec((1, 1, S, Hd), lambda b, k, *_: (b, k, 0, 0)),
        pl.BlockSpec((1, 1, S, Hd), lambda b, k, *_: (b, k, 0, 0)),
        pl.BlockSpec((1, 1, S), lambda b, k, *_: (b, 0, 0)),
    ]
    out_spec = pl.BlockSpec((1, 1, Q, Hd), lambda b, k, *_: (b, k, 0, 0))
    out_shape = jax.ShapeDtypeStruct((B, K, Q, Hd), jnp.dtype(dtype))
    kv = (k_BxKxSxHd.astype(dtype), v_BxKxSxHd.astype(dtype))
    if tpu:
        from jax.experimental.pallas import tpu as pltpu

        grid_spec = pltpu.PrefetchScalarGridSpec(1, grid=(B, K), in_specs=specs, out_specs=out_spec)
        call = pl.pallas_call(program, out_shape, grid_spec=grid_spec, interpret=interpret)
        o_BxKxQxHd = call(last_B, q_BxKxQxHd, *kv, valid_Bx1xS)
    else:
        last_spec = pl.BlockSpec((1, 1, 1), lambda b, k: (b, 0, 0))
        # Triton on GPU (jax otherwise picks Mosaic GPU, whose copies need 128-byte multiples and
        # refuse the 4-byte per-row bound); the interpreter ignores it.
        params = pltriton.CompilerParams(num_warps=4, num_stages=1) if platform == "gpu" else None
        call = pl.pallas_call(
            program,
            out_shape,
            grid=(B, K),
            in_specs=[last_spec, *specs],
            out_specs=out_spec,
            interpret=interpret,
            compiler_params=params,
        )
        o_BxKxQxHd = call(last_B[:, None, None], q_BxKxQxHd, *kv, valid_Bx1xS)
    return query_major(o_BxKxQxHd[:, :, : T * R], T)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _check_triton_shapes(block: int, head_dim: int) -> None:
    """Triton's tiles are powers of 2: the block (model.decode_block) and the head dim."""
    if block != _pow2(block):
        raise ValueError(f"model.decode_block: got {block}; the pallas decode kernel on GPU needs a power of 2")
    if head_dim != _pow2(head_dim):
        raise ValueError(
            f"model.head_dim: got {head_dim}; the pallas decode kernel on GPU needs a power of 2 "
            "(set model.decode_attention=blocked)"
        )
