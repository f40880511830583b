"""Chosen-token log-probs and entropies from the final hidden states, a chunk of rows at a time.

The update needs, per completion position, log softmax(logits / temperature) at the sampled token and
the entropy of that distribution. Computed directly, the B x T x V float32 logits, their log-softmax,
its exp and each of their gradients exist at once (256 MiB apiece for 64 x 128 positions over a
8,192-token vocabulary). Here the B*T (position) rows are cut into chunks of `chunk_rows`; a `lax.scan`
applies the LM head to one chunk, reduces it to the two numbers per row, and drops the chunk. The
chunk body is a `jax.checkpoint`: the backward recomputes the chunk's logits from its hidden rows
(one extra head matmul, ~1/3 of the head's forward+backward cost) instead of keeping all logits alive.
The arithmetic per row is the unchunked path's own (same ops in the same order), so values and
gradients match it to float32 reordering.

    logp_BxT, entropy_BxT = chunked_token_logprobs(hidden_BxTxD, head_DxV, tokens_BxT, temperature, 1024)

`hidden_BxTxD` is the final-normed hidden state at the positions that predict `tokens_BxT`;
`head_DxV` the LM head (the embedding's transpose for tied models), cast to the hidden's dtype, with
the matmul accumulated and everything after it computed in float32 (as `decoder.run_decoder`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def logprob_and_entropy(logits_NxV: jax.Array, tokens_N: jax.Array, temperature) -> tuple[jax.Array, jax.Array]:
    """(log-prob of tokens_N, entropy) under softmax(logits / temperature), over the last axis; also
    the unchunked path's reduction (`transformer.token_logprobs`), so both do the same arithmetic."""
    logp_all_NxV = jax.nn.log_softmax(logits_NxV / temperature, axis=-1)
    logp_N = jnp.take_along_axis(logp_all_NxV, tokens_N[..., None].astype(jnp.int32), axis=-1)[..., 0]
    entropy_N = -jnp.sum(jnp.exp(logp_all_NxV) * logp_all_NxV, axis=-1)
    return logp_N, entropy_N


def chunked_token_logprobs(
    hidden_BxTxD: jax.Array, head_DxV: jax.Array, tokens_BxT: jax.Array, temperature, chunk_rows: int
) -> tuple[jax.Array, jax.Array]:
    """(logp_BxT, entropy_BxT) with at most `chunk_rows` rows' logits alive at a time (forward and
    backward). The last chunk is zero-padded; padded rows are computed and dropped."""
    B, T, D = hidden_BxTxD.shape
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    n_rows = B * T
    n_chunks = -(-n_rows // chunk_rows)
    pad = n_chunks * chunk_rows - n_rows
    h_NxD = jnp.pad(hidden_BxTxD.reshape(n_rows, D), ((0, pad), (0, 0)))
    tok_N = jnp.pad(tokens_BxT.reshape(n_rows).astype(jnp.int32), (0, pad))
    head_DxV = head_DxV.astype(hidden_BxTxD.dtype)

    @jax.checkpoint  # residuals per chunk: its hidden rows only; the logits are recomputed in the backward
    def chunk(h_RxD, tok_R):
        logits_RxV = jnp.dot(h_RxD, head_DxV, preferred_element_type=jnp.float32)
        return logprob_and_entropy(logits_RxV, tok_R, temperature)

    _, (logp_CxR, entropy_CxR) = lax.scan(
        lambda c, xs: (c, chunk(*xs)),
        None,
        (h_NxD.reshape(n_chunks, chunk_rows, D), tok_N.reshape(n_chunks, chunk_rows)),
    )

    def unpad(x_CxR):
        return x_CxR.reshape(-1)[:n_rows].reshape(B, T)

    return unpad(logp_CxR), unpad(entropy_CxR)
