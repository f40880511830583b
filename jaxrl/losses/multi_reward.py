"""Multi-reward advantage estimators: rewards_BxK -> adv_B, normalising each reward function first.

GRPO sums the K rewards and then normalises, so reward combinations with the same sum get the same
advantage. These estimators normalise each reward column within its group first, then combine: whole
estimators `(rewards_BxK, groups) -> adv_B`, the contract of `advantages.estimator(...)`'s result.
`groups` as in `advantages.py` (padding rows: A = 0, in no statistic); the final batch normalisation is
over every live row of the call, so run it on the whole update batch. Every std follows
`advantages.py`'s convention (ddof=1 by default, eps added to the std).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxrl.config import ConfigError
from jaxrl.losses import segments as seg
from jaxrl.losses.advantages import Estimator, _check_ddof, batch_whiten
from jaxrl.losses.segments import GroupsLike


def _weights_K(weights: Sequence[float] | None, k: int) -> jax.Array:
    if weights is None:
        return jnp.ones((k,), jnp.float32)
    weights = tuple(float(w) for w in weights)
    if len(weights) != k:
        raise ConfigError(
            f"loss.reward_weights: got {weights!r} ({len(weights)} weights), "
            f"expected one weight per reward function (rewards_BxK has K={k})"
        )
    return jnp.asarray(weights, jnp.float32)


def group_z_scores(rewards_BxK: jax.Array, groups: GroupsLike, eps: float = 1e-6, ddof: int = 1) -> jax.Array:
    """z_BxK: z_ik = (r_ik - mean_G r_k) / (std_G r_k + eps), per reward function k within each group.

    Unbiased std by default (ddof=1; 0 = population std) over the row's own group, eps added to the
    std. A reward column that is constant within a group (or a group of one) gets exactly 0 there (no
    float residue, no NaN); a padding row gets 0.
    """
    if rewards_BxK.ndim != 2:
        raise ValueError(f"expected rewards_BxK of rank 2, got shape {rewards_BxK.shape}")
    if not eps > 0:
        raise ValueError(f"eps: got {eps!r}, expected a positive number")
    ddof = _check_ddof(ddof)
    g = seg.as_groups(groups, rewards_BxK)
    r_BxK = rewards_BxK.astype(jnp.float32)
    z_BxK = (r_BxK - seg.mean_B(r_BxK, g)) / (seg.std_B(r_BxK, g, ddof) + eps)
    return jnp.where(seg.constant_B(r_BxK, g) | ~g.live_B[:, None], 0.0, z_BxK)


def gdpo(
    weights: Sequence[float] | None = None, eps: float = 1e-6, batch_eps: float = 1e-6, ddof: int = 1
) -> Estimator:
    """GDPO (group reward-decoupled normalisation):

        z_ik = (r_ik - mean_G r_k) / (std_G r_k + eps)        (`group_z_scores`)
        a_i  = sum_k w_k z_ik
        A_i  = (a_i - mean_B a) / (std_B a + batch_eps)       std over all B rows

    Both stds use `ddof` (1 = unbiased, the default).
    `weights=None` gives every reward function weight 1; a count mismatch raises ConfigError.
    mean_B a is 0 in exact arithmetic (each z column sums to 0 within a group); a group whose a_i are
    all exactly 0 (e.g. every reward constant in the group) stays exactly 0.
    """
    if not batch_eps > 0:
        raise ValueError(f"batch_eps: got {batch_eps!r}, expected a positive number")
    ddof = _check_ddof(ddof)

    def advantages(rewards_BxK: jax.Array, groups: GroupsLike) -> jax.Array:
        g = seg.as_groups(groups, rewards_BxK)
        z_BxK = group_z_scores(rewards_BxK, g, eps, ddof)
        a_B = z_BxK @ _weights_K(weights, z_BxK.shape[1])
        return jax.lax.stop_gradient(batch_whiten(a_B, g, batch_eps, ddof))

    return advantages


def _check_gd2po(batch_eps: float, conflict_threshold: float, consensus_power: float) -> None:
    if not conflict_threshold >= 0:
        raise ValueError(f"conflict_threshold: got {conflict_threshold!r}, expected a number >= 0")
    if not consensus_power >= 0:
        raise ValueError(f"consensus_power: got {consensus_power!r}, expected a number >= 0")
    if not batch_eps > 0:
        raise ValueError(f"batch_eps: got {batch_eps!r}, expected a positive number")


_CANCEL_RTOL = 1e-5  # ~100 float32 ulps of the summed terms' scale: far above rounding, far below signal


def _sign_beyond(x, tol):
    """sign(x), with |x| <= tol counted as 0."""
    return jnp.where(jnp.abs(x) <= tol, 0.0, jnp.sign(x))


def gd2po_parts(
    rewards_BxK: jax.Array,
    groups: GroupsLike,
    *,
    weights: Sequence[float] | None = None,
    eps: float = 1e-6,
    batch_eps: float = 1e-6,
    conflict_threshold: float = 0.5,
    consensus_power: float = 1.0,
    ddof: int = 1,
) -> dict:
    """GD2PO (arXiv:2606.16771), OUR READING (its abstract gives no formula): GDPO + conflict masking +
    query reweighting.

    With z_ik and a_i = sum_k w_k z_ik as in `gdpo`, and A_i^GDPO its batch normalisation:

      conflict_i  = sum_k |w_k| [sign(w_k z_ik) == -sign(a_i) != 0] / sum_k |w_k|
                    the weighted share of reward functions pushing AGAINST the combined advantage
                    (a z_ik of 0 neither agrees nor disagrees; a_i == 0 gives conflict 0; "0"
                    up to rounding: |z_ik| <= 1e-5 and |a_i| <= 1e-5 * sum_k |w_k z_ik|).
      keep_i      = conflict_i <= conflict_threshold      (masked when the share EXCEEDS it)
      consensus_g = 1 - mean_{i in g} conflict_i          in [0, 1]; 1 when no rollout conflicts
      A_i         = keep_i * consensus_g ** consensus_power * A_i^GDPO

    Masking and reweighting come after the batch normalisation (they do not change its statistics);
    consensus uses every rollout of the group, masked or not. consensus_power = 0 disables the
    reweighting, conflict_threshold >= 1 disables the masking. No renormalisation after reweighting:
    the overall advantage scale shrinks by the consensus factor.

    Both stds use `ddof` (1 = unbiased, the default). The mask and the consensus read only signs, so
    they do not depend on ddof (it rescales every z of equal-size groups by one constant).
    Returns {"adv_B", "keep_B" (float 0/1), "conflict_B", "consensus_B" (the row's group consensus)}.
    A masked rollout gets A = 0; to remove it from the loss entirely (KL, normaliser counts) the
    preset should also do completion_mask_BxT *= keep_B[:, None], like the MC-GRPO pivot.
    """
    _check_gd2po(batch_eps, conflict_threshold, consensus_power)
    g = seg.as_groups(groups, rewards_BxK)
    z_BxK = group_z_scores(rewards_BxK, g, eps, ddof)
    w_K = _weights_K(weights, z_BxK.shape[1])
    a_B = z_BxK @ w_K
    adv_B = batch_whiten(a_B, g, batch_eps, _check_ddof(ddof))
    abs_w_K = jnp.abs(w_K)
    # Signs with a dead band at rounding level: a z_ik at its group's mean, or an a_i whose terms
    # cancel (equal-weight rewards that exactly disagree), is 0 up to float error, and its sign would
    # otherwise be rounding noise that flips with the batch's composition.
    sign_a_B = _sign_beyond(a_B, _CANCEL_RTOL * (jnp.abs(z_BxK) @ abs_w_K))
    against_BxK = _sign_beyond(z_BxK * w_K[None, :], _CANCEL_RTOL * abs_w_K[None, :]) == -sign_a_B[:, None]
    against_BxK = against_BxK & (sign_a_B[:, None] != 0)
    conflict_B = (against_BxK.astype(jnp.float32) @ abs_w_K) / jnp.maximum(jnp.sum(abs_w_K), 1e-12)
    keep_B = (conflict_B <= conflict_threshold).astype(jnp.float32)
    consensus_B = 1.0 - seg.mean_B(conflict_B, g)  # over the group's live rows
    scale_B = consensus_B**consensus_power if consensus_power != 0 else jnp.ones_like(consensus_B)
    out = {
        "adv_B": jnp.where(keep_B > 0, scale_B * adv_B, 0.0),
        "keep_B": keep_B,
        "conflict_B": conflict_B,
        "consensus_B": consensus_B,
    }
    return jax.tree.map(jax.lax.stop_gradient, out)


def gd2po(
    weights: Sequence[float] | None = None,
    eps: float = 1e-6,
    batch_eps: float = 1e-6,
    conflict_threshold: float = 0.5,
    consensus_power: float = 1.0,
    ddof: int = 1,
) -> Estimator:
    """GD2PO advantages, OUR READING (formula in `gd2po_parts`): (rewards_BxK, groups) -> adv_B."""
    ddof = _check_ddof(ddof)
    _check_gd2po(batch_eps, conflict_threshold, consensus_power)  # bad values fail at build time

    def advantages(rewards_BxK: jax.Array, groups: GroupsLike) -> jax.Array:
        return gd2po_parts(
            rewards_BxK,
            groups,
            weights=weights,
            eps=eps,
            batch_eps=batch_eps,
            conflict_threshold=conflict_threshold,
            consensus_power=consensus_power,
            ddof=ddof,
        )["adv_B"]

    return advantages


def gd2po_keep(
    weights: Sequence[float] | None = None, eps: float = 1e-6, conflict_threshold: float = 0.5
) -> Callable[[jax.Array, GroupsLike], jax.Array]:
    """(rewards_BxK, groups) -> keep_B (float 0/1): the GD2PO conflict mask (see `gd2po_parts`)."""
    _check_gd2po(1e-6, conflict_threshold, 0.0)

    def keep(rewards_BxK: jax.Array, groups: GroupsLike) -> jax.Array:
        return gd2po_parts(rewards_BxK, groups, weights=weights, eps=eps, conflict_threshold=conflict_threshold)[
            "keep_B"
        ]

    return keep
