"""Chosen-token log-probs and entropies from the final hidden states, a chunk of rows at a time.

    logp_BxT, entropy_BxT = chunked_token_logprobs(hidden_BxTxD, head_DxV, tokens_BxT, temperature, 1024)

Per completion position: log softmax(logits / temperature) at the sampled token, and that
distribution's entropy. The B*T rows are cut into chunks of `chunk_rows`; a `lax.scan` applies the LM
head to one chunk under `jax.checkpoint` and keeps only the two numbers per row, so the B x T x V logits
and their gradients never exist at once (the backward recomputes a chunk's logits). The arithmetic per
row is the unchunked path's own, so values and gradients match it to float32 reordering.
`hidden_BxTxD` is the final-normed hidden state at the positions that predict `tokens_BxT`; `head_DxV`
the LM head (the embedding's transpose for tied models), accumulated and followed in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl.models import int8
from jaxrl.models.parallel import Parallel, rows


def logprob_and_entropy(logits_NxV: jax.Array, tokens_N: jax.Array, temperature) -> tuple[jax.Array, jax.Array]:
    """(log-prob of tokens_N, entropy) under softmax(logits / temperature), over the last axis; also
    the unchunked path's reduction (`transformer.token_logprobs`), so both do the same arithmetic."""
    logp_all_NxV = jax.nn.log_softmax(logits_NxV / temperature, axis=-1)
    logp_N = jnp.take_along_axis(logp_all_NxV, tokens_N[..., None].astype(jnp.int32), axis=-1)[..., 0]
    entropy_N = -jnp.sum(jnp.exp(logp_all_NxV) * logp_all_NxV, axis=-1)
    return logp_N, entropy_N


def chunked_token_logprobs(
    hidden_BxTxD: jax.Array,
    head_DxV: jax.Array | int8.Int8Weight,
    tokens_BxT: jax.Array,
    temperature,
    chunk_rows: int,
    parallel: Parallel | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(logp_BxT, entropy_BxT) with at most `chunk_rows` rows' logits alive at a time (forward and
    backward). The last chunk is zero-padded; padded rows are computed and dropped.

    With `parallel` splitting the B rows over d devices, each device cuts its own B/d * T rows into
    chunks of chunk_rows / d (rounded up), and chunk c is every device's c-th piece: all devices work
    on every chunk, on rows they hold. On one device (d = 1) that is the plain contiguous cut."""
    B, T, D = hidden_BxTxD.shape
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    d = 1 if parallel is None or B % parallel.n_rows_devices else parallel.n_rows_devices
    n_rows = B * T // d  # per device
    rows_per_chunk = -(-chunk_rows // d)
    n_chunks = -(-n_rows // rows_per_chunk)
    pad = n_chunks * rows_per_chunk - n_rows

    def chunked(x_dxN, fill=0):  # (d, N, ...) -> (n_chunks, d, rows_per_chunk, ...), devices on axis 1
        x_dxN = jnp.pad(x_dxN, [(0, 0), (0, pad)] + [(0, 0)] * (x_dxN.ndim - 2), constant_values=fill)
        x = jnp.swapaxes(x_dxN.reshape((d, n_chunks, rows_per_chunk) + x_dxN.shape[2:]), 0, 1)
        return rows(parallel, x, axis=1)

    h_CxdxRxD = chunked(hidden_BxTxD.reshape(d, n_rows, D))
    tok_CxdxR = chunked(tokens_BxT.reshape(d, n_rows).astype(jnp.int32))
    head_DxV = int8.dense(head_DxV, hidden_BxTxD.dtype)  # an int8 head: dequantised once, not per chunk

    @jax.checkpoint  # residuals per chunk: its hidden rows only; the logits are recomputed in the backward
    def chunk(h_dxRxD, tok_dxR):
        logits_NxV = jnp.dot(h_dxRxD.reshape(-1, D), head_DxV, preferred_element_type=jnp.float32)
        logp_N, entropy_N = logprob_and_entropy(logits_NxV, tok_dxR.reshape(-1), temperature)
        return logp_N.reshape(tok_dxR.shape), entropy_N.reshape(tok_dxR.shape)

    _, (logp_CxdxR, entropy_CxdxR) = lax.scan(lambda c, xs: (c, chunk(*xs)), None, (h_CxdxRxD, tok_CxdxR))

    def unpad(x_CxdxR):
        return jnp.swapaxes(x_CxdxR, 0, 1).reshape(d, -1)[:, :n_rows].reshape(B, T)

    return unpad(logp_CxdxR), unpad(entropy_CxdxR)
