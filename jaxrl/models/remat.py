"""Rematerialisation of the decoder's scanned units: what each unit keeps for the backward.

`remat_fn(unit, "dots")` is the scan body `decoder.run_decoder(..., remat=...)` runs; `train.remat`
in the config names the policy.
"""

from __future__ import annotations

import jax

# What each scanned block keeps for the backward: everything (none), only its input (full: the
# whole block is recomputed), or its input and the outputs of the weight matmuls (dots: norms,
# attention and activations are recomputed).
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def remat_fn(fn, remat: str):
    """`fn` (a scan body), rematerialised under REMAT_POLICIES[remat] (unchanged for "none")."""
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat must be one of {sorted(REMAT_POLICIES)}, got {remat!r}")
    if remat == "none":
        return fn
    # prevent_cse=False: inside a scan XLA cannot merge the recomputation back into the forward anyway.
    return jax.checkpoint(fn, policy=REMAT_POLICIES[remat], prevent_cse=False)
