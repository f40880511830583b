"""Rematerialisation of the decoder's scanned blocks: what each block keeps for the backward.

`remat_block(Block, "dots")` is the block class to scan (`transformer.Transformer(cfg, remat)`);
`train.remat` in the config names the policy.
"""

from __future__ import annotations

import flax.linen as nn
import jax

# What each scanned block keeps for the backward: everything (none), only its input (full: the
# whole block is recomputed), or its input and the outputs of the weight matmuls (dots: norms,
# attention and activations are recomputed).
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def remat_block(block_cls, remat: str):
    """`block_cls`, rematerialised under REMAT_POLICIES[remat] (unchanged for "none")."""
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat must be one of {sorted(REMAT_POLICIES)}, got {remat!r}")
    if remat == "none":
        return block_cls
    # prevent_cse=False: inside a scan XLA cannot merge the recomputation back into the forward anyway.
    return nn.remat(block_cls, policy=REMAT_POLICIES[remat], prevent_cse=False)
