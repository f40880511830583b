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
