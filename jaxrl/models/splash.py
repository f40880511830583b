"""JAX's Pallas TPU splash attention as one of `model.attention`'s kernels (`attention.KERNELS`):
the no-cache and stacked kinds' attention over S key slots, with padding or packed segments as
splash's segment ids, run under `shard_map` on a mesh (`KernelLayout`) since XLA cannot partition a
Mosaic kernel. Shape letters as in layers.py."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import PartitionSpec as P

from jaxrl.models.cache_kinds import SegmentIds


class KernelLayout(NamedTuple):
    """How a Mosaic kernel (splash) splits over the run's mesh: it cannot be partitioned by XLA, so
    it runs under `shard_map`, each device on its rows (`batch`: the mesh axes the rows split over,
    as `models.parallel.Parallel.batch`) and, when the head counts divide, its heads (`heads`: the
    tensor-parallel axis, `Parallel.sequence`, or None). Hashable: a static module attribute."""

    mesh: Any  # jax.sharding.Mesh
    batch: str | tuple[str, ...] | None
    heads: str | None = None


SPLASH_BLOCKS = (512, 256, 128)  # splash's tiles along T and S, largest first (multiples of 128, as it needs)


def _splash_tiles(n: int) -> tuple[int, int]:
    """(tile, padded length) of a length-n axis: n rounded up to a multiple of 128 (under 128 rows
    of padding), tiled by the largest of SPLASH_BLOCKS that divides it."""
    padded = -(-n // 128) * 128
    return next(b for b in SPLASH_BLOCKS if padded % b == 0), padded


def _splash_kernel(H: int, Tp: int, Sp: int, offset: int, bq: int, bkv: int, interpret: bool):
    """The splash kernel of H heads over a Tp x Sp causal mask (query t sees key s <= t + offset),
    built at trace time: its block-sparsity tables come from the static mask (numpy, cached by shape in
    splash's mask_info); the kernel holds them as arrays of the trace, so it is not cached here."""
    causal = splash_mask.CausalMask((Tp, Sp), offset=offset)
    blocks = splash.BlockSizes(
        block_q=bq,
        block_kv=bkv,
        block_kv_compute=bkv,
        block_q_dkv=bq,
        block_kv_dkv=bkv,
        block_kv_dkv_compute=bkv,
        block_q_dq=bq,
        block_kv_dq=bkv,
    )
    mask = splash_mask.MultiHeadMask([causal] * H)
    return splash.make_splash_mha(mask, block_sizes=blocks, head_shards=1, q_seq_shards=1, interpret=interpret)


def _splash_specs(layout: KernelLayout | None, B: int, H: int, K: int):
    """(rows' mesh axes, heads' mesh axis, how many head shards) of splash's shard_map: the
    layout's, each None (that dimension whole on every device) where it does not divide."""
    if layout is None:
        return None, None, 1

    def size(axes) -> int:
        names = () if axes is None else (axes,) if isinstance(axes, str) else axes
        n = 1
        for a in names:
            n *= layout.mesh.shape[a]
        return n

    rows = layout.batch if B % size(layout.batch) == 0 else None
    n_heads = size(layout.heads)
    heads = layout.heads if H % n_heads == 0 and K % n_heads == 0 else None
    return rows, heads, n_heads if heads is not None else 1


def attend_slots_splash(
    q_BxTxHxHd,
    k_BxSxKxHd,
    v_BxSxKxHd,
    key_valid_BxS,
    offset: int | jax.Array,
    dtype,
    interpret: bool | None = None,
    layout: KernelLayout | None = None,
):
    """`attend_slots` through JAX's Pallas TPU splash attention, for queries at the slots
    offset..offset+T-1 (the no-cache kind: 0). Splash rather than the Pallas flash kernel: it takes
    GQA as it is (head h reads kv head h // R, no repeated K/V), skips the tiles above the causal
    diagonal (flash's causal flag has no offset either), and both take padding as segment ids.

    Splash's causal mask is static. A Python int `offset` is that mask's offset. A traced one (a
    StackedKV's `index`) cannot be: the T queries are then written at `offset` into an S-slot buffer
    of zero queries (clamped to 0..S-T like the cache write), that buffer attends at offset 0 and
    the T rows are read back. This costs the S - T buffer rows' attention, cheap in the update's
    shared-prefix pass (offset P, T = the completion) and at most the S x S causal forward in prefill.

    Visibility as `attend_slots`: the causal offset is the static mask; `key_valid_BxS` enters as
    segment ids, every query segment 1 and each key 1 if valid else 0, so a query sees exactly the
    valid keys at or before its slot. A query that sees none (a left-pad query at slot < the first
    real key) gets the uniform average over the tiles it computes: finite, but not `attend_slots`'
    average over all S (nobody reads those rows). T and S are padded up to multiples of 128
    (`_splash_tiles`), the padded keys segment 0, the padded queries dropped. Queries arrive scaled
    (scale 1); the logits, softmax and accumulation are float32 inside the kernel, the output in
    `dtype`. Gradients: splash's own custom VJP (its dq and dkv kernels).

    `interpret` (None: unless the default backend is a TPU) runs Pallas' interpreter: how it is
    tested on CPU (tests/test_attention_kernels.py), slow, for tests only. `layout`: the kernel runs
    under shard_map on the mesh (`KernelLayout`); None: one device (XLA refuses to partition a Mosaic
    kernel over several)."""
    B, T, H, Hd = q_BxTxHxHd.shape
    S = k_BxSxKxHd.shape[1]
    if not isinstance(offset, int):
        if T > S:
            raise ValueError(f"attention: {T} queries at a traced offset over {S} key slots; expected T <= S")
        buf_BxSxHxHd = jnp.zeros((B, S, H, Hd), dtype)
        q_BxSxHxHd = lax.dynamic_update_slice(buf_BxSxHxHd, q_BxTxHxHd.astype(dtype), (0, offset, 0, 0))
        o_BxSxHxHd = attend_slots_splash(q_BxSxHxHd, k_BxSxKxHd, v_BxSxKxHd, key_valid_BxS, 0, dtype, interpret, layout)
        return lax.dynamic_slice_in_dim(o_BxSxHxHd, offset, T, axis=1)
    interpret = jax.default_backend() != "tpu" if interpret is None else interpret
    (bq, Tp), (bkv, Sp) = _splash_tiles(T), _splash_tiles(S)
    q_BxHxTpxHd = jnp.pad(q_BxTxHxHd.astype(dtype), ((0, 0), (0, Tp - T), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    k_BxKxSpxHd, v_BxKxSpxHd = (
        jnp.pad(x.astype(dtype), ((0, 0), (0, Sp - S), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
        for x in (k_BxSxKxHd, v_BxSxKxHd)
    )
    if isinstance(key_valid_BxS, SegmentIds):  # packed rows: the queries are the keys' own slots (offset 0)
        ids_BxS = key_valid_BxS.ids_BxS.astype(jnp.int32)
        q_segment_BxTp = jnp.pad(lax.slice_in_dim(ids_BxS, offset, offset + T, axis=1), ((0, 0), (0, Tp - T)))
        kv_segment_BxSp = jnp.pad(ids_BxS, ((0, 0), (0, Sp - S)))
    else:
        q_segment_BxTp = jnp.ones((B, Tp), jnp.int32)
        kv_segment_BxSp = jnp.pad(key_valid_BxS.astype(jnp.int32), ((0, 0), (0, Sp - S)))
    rows_spec, heads_spec, n_head_shards = _splash_specs(layout, B, H, k_BxSxKxHd.shape[2])
    kernel = _splash_kernel(H // n_head_shards, Tp, Sp, offset, bq, bkv, interpret)

    def run(q_BxHxTpxHd, k_BxKxSpxHd, v_BxKxSpxHd, q_segment_BxTp, kv_segment_BxSp):
        segments = splash.SegmentIds(q=q_segment_BxTp, kv=kv_segment_BxSp)
        o_BxHxTpxHd = jax.vmap(kernel)(q_BxHxTpxHd, k_BxKxSpxHd, v_BxKxSpxHd, segments)
        assert isinstance(o_BxHxTpxHd, jax.Array)  # save_residuals is off: the output alone
        return o_BxHxTpxHd

    if layout is not None:
        heads, rows = P(rows_spec, heads_spec), P(rows_spec)
        specs = (heads, heads, heads, rows, rows)
        run = jax.shard_map(run, mesh=layout.mesh, in_specs=specs, out_specs=heads, check_vma=False)
    o_BxHxTpxHd = run(q_BxHxTpxHd, k_BxKxSpxHd, v_BxKxSpxHd, q_segment_BxTp, kv_segment_BxSp)
    return o_BxHxTpxHd[:, :, :T].transpose(0, 2, 1, 3).astype(dtype)
