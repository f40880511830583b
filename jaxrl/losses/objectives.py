"""Objectives: (log_ratio_BxT, adv_BxT, mask_BxT) -> (loss_BxT, stats).

The per-token loss before aggregation (a quantity to MINIMISE, i.e. the negated surrogate).
`stats` holds per-token float arrays named `<what>_BxT`, 0 on masked tokens; reduce them with
`jaxrl.losses.aggregation.reduce_stats`.

Parts: ppo_clip (PPO / DAPO clip-higher), dual_clip, cispo, sapo, strict_double_side (SAO),
mu_grpo (relaxed clip + negative-advantage veto), gmpo (geometric-mean, sequence-level). Every one
keeps the same signature; CISPO also takes the current log-probs as an optional `logp_BxT`, to
report the paper's value (see `cispo`; `compose` passes them to any objective that names it).
GMPO is an objective rather than a ratio level (see `gmpo`). M2PO's second-moment masking is
batch-level, so it is not an objective: see `jaxrl.losses.m2po`. Objectives that read a whole row
(gmpo) stay exact under microbatching because microbatches split rows, never a row.
"""

from __future__ import annotations

import math
from typing import Protocol

import jax
import jax.numpy as jnp


class Objective(Protocol):
    """(log_ratio_BxT, adv_BxT, mask_BxT) -> (loss_BxT, stats): the per-token loss to minimise. An
    objective may also take the current log-probs as a keyword `logp_BxT` (CISPO's reported value)."""

    def __call__(self, log_ratio_BxT: jax.Array, adv_BxT: jax.Array, mask_BxT: jax.Array, /) -> tuple: ...


def ppo_clip(eps_low: float = 0.2, eps_high: float | None = None) -> Objective:
    """PPO clipped surrogate (Schulman et al. 2017), per token, with asymmetric bounds (DAPO clip-higher).

        l_t = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A),   rho_t = exp(log_ratio_t)

    `eps_high=None` means eps_high = eps_low.

    Clip indicators (float 0/1, 0 on masked tokens) mark exactly the tokens where the clip was
    ACTIVE, i.e. the min picks the clipped (constant) term and the gradient is zero:
      clipped_low_BxT:  A < 0 and rho < 1 - eps_low
      clipped_high_BxT: A > 0 and rho > 1 + eps_high
    Inequalities are strict; at a tie both terms are equal and we take the unclipped branch, so the
    gradient there is -A * rho rather than the half-gradient `jnp.minimum` would give. Everywhere
    else the gradient with respect to logp is d(-rho A)/dlogp = -A * rho.
    When A == 0 the loss and gradient are 0 and neither indicator is set.

    stats: ratio_BxT (rho, no gradient), clipped_low_BxT, clipped_high_BxT; all 0 on masked tokens.
    """
    eps_high = eps_low if eps_high is None else eps_high
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"ppo_clip: eps_low={eps_low!r}, eps_high={eps_high!r}; expected non-negative numbers")
    lo, hi = 1.0 - eps_low, 1.0 + eps_high

    def objective(log_ratio_BxT: jax.Array, adv_BxT: jax.Array, mask_BxT: jax.Array):
        live_BxT = mask_BxT > 0
        ratio_BxT = jnp.exp(log_ratio_BxT)
        clipped_low_BxT = live_BxT & (adv_BxT < 0) & (ratio_BxT < lo)
        clipped_high_BxT = live_BxT & (adv_BxT > 0) & (ratio_BxT > hi)
        active_BxT = clipped_low_BxT | clipped_high_BxT
        # When the clip is active the surrogate is the constant clip bound times A; writing it as a
        # select (rather than min) makes "indicator set" and "gradient zero" the same statement.
        bound_BxT = jnp.clip(jax.lax.stop_gradient(ratio_BxT), lo, hi)
        surrogate_BxT = jnp.where(active_BxT, bound_BxT * adv_BxT, ratio_BxT * adv_BxT)
        stats = {
            "ratio_BxT": jnp.where(live_BxT, jax.lax.stop_gradient(ratio_BxT), 0.0),
            "clipped_low_BxT": clipped_low_BxT.astype(jnp.float32),
            "clipped_high_BxT": clipped_high_BxT.astype(jnp.float32),
        }
        return -surrogate_BxT, stats

    return objective


# ---------------------------------------------------------------------------------------------
# More objectives. Unlike `ppo_clip`, these return a loss of exactly 0 on masked tokens themselves.
# Where a token gets "no gradient", the log-ratio is replaced by 0 on that token BEFORE any exp, so even
# an overflowing ratio (log rho > 88) cannot turn the zero cotangent into NaN.


def _f32(x_BxT: jax.Array) -> jax.Array:
    return x_BxT.astype(jnp.float32)


def dual_clip(eps_low: float = 0.2, eps_high: float | None = None, c: float = 3.0) -> Objective:
    """Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL"):
    `ppo_clip` plus, for A < 0, the loss capped at -c*A:

        l_t = min(-min(rho A, clip(rho, 1-eps_low, 1+eps_high) A), -c A)   if A < 0
        l_t = ppo_clip                                                       otherwise

    c must exceed 1 (with A < 0 the cap binds exactly when rho > c; strict, as in ppo_clip, so at
    rho == c the gradient is still -A * rho). Where it binds the loss is the constant -c*A: no
    gradient, so one very stale token with a huge ratio cannot dominate a negative update.
    stats: those of ppo_clip (0 on masked tokens) plus clipped_dual_BxT.
    """
    if not c > 1:
        raise ValueError(f"dual_clip: c={c!r}; expected a number > 1")
    ppo = ppo_clip(eps_low, eps_high)

    def objective(log_ratio_BxT, adv_BxT, mask_BxT):
        live_BxT = mask_BxT > 0
        # ratio > c  <=>  log_ratio > log c; comparing in log space avoids exp overflow.
        dual_BxT = live_BxT & (adv_BxT < 0) & (log_ratio_BxT > math.log(c))
        safe_BxT = jnp.where(dual_BxT | ~live_BxT, 0.0, log_ratio_BxT)
        loss_BxT, stats = ppo(safe_BxT, adv_BxT, mask_BxT)
        loss_BxT = jnp.where(dual_BxT, -c * adv_BxT, loss_BxT)
        stats = dict(stats, clipped_dual_BxT=_f32(dual_BxT))
        stats["ratio_BxT"] = jnp.where(live_BxT, jnp.exp(jax.lax.stop_gradient(log_ratio_BxT)), 0.0)
        return jnp.where(live_BxT, loss_BxT, 0.0), stats

    return objective


def cispo(cap: float, floor: float | None = None) -> Objective:
    """CISPO (MiniMax-M1, arXiv:2506.13585): the IS weight is clipped and DETACHED, every token keeps
    its gradient:

        l_t = -sg(w_t) * A * logp_theta(y_t),    w_t = clip(rho_t, floor, cap),  rho_t = exp(log_ratio_t)

    This is the value TRL's and verl's CISPO report (`-clamped_ratio.detach() * advantages *
    per_token_logps`), so logged losses compare directly. `compose.policy_token_loss` passes the
    current log-probs as `logp_BxT` (this objective names that parameter); called without them (a
    caller of the bare objective), logp is replaced by the log-ratio, which differs by the constant
    sg(w) * A * logp_old: same gradient, a value of 0 at rho = 1. Either way the gradient with
    respect to logp is -sg(w_t) * A per token.
    `cap` is the ABSOLUTE upper bound on the weight (TRL's `epsilon_high` for CISPO is this number;
    the preset passes 1 + eps_high); `floor=None` means no lower bound (the paper and TRL use none).
    stats: ratio_BxT; clipped_high_BxT (rho > cap: the weight was capped) and clipped_low_BxT
    (rho < floor); unlike PPO, a "clipped" token still has gradient.
    """
    if not cap > 0:
        raise ValueError(f"cispo: cap={cap!r}; expected a positive number")
    if floor is not None and not 0 <= floor <= cap:
        raise ValueError(f"cispo: floor={floor!r}; expected None or a number in [0, cap]")

    def objective(log_ratio_BxT, adv_BxT, mask_BxT, logp_BxT=None):
        live_BxT = mask_BxT > 0
        log_ratio_BxT = jnp.where(live_BxT, log_ratio_BxT, 0.0)
        ratio_BxT = jnp.exp(jax.lax.stop_gradient(log_ratio_BxT))
        weight_BxT = jnp.minimum(ratio_BxT, cap)
        low_BxT = jnp.zeros_like(live_BxT)
        if floor is not None:
            weight_BxT = jnp.maximum(weight_BxT, floor)
            low_BxT = live_BxT & (ratio_BxT < floor)
        logp_term_BxT = log_ratio_BxT if logp_BxT is None else jnp.where(live_BxT, logp_BxT, 0.0)
        loss_BxT = -jax.lax.stop_gradient(weight_BxT) * adv_BxT * logp_term_BxT
        stats = {
            "ratio_BxT": jnp.where(live_BxT, ratio_BxT, 0.0),
            "clipped_low_BxT": _f32(low_BxT),
            "clipped_high_BxT": _f32(live_BxT & (ratio_BxT > cap)),
        }
        return jnp.where(live_BxT, loss_BxT, 0.0), stats

    return objective


def sapo(tau_pos: float = 1.0, tau_neg: float = 1.05) -> Objective:
    """SAPO soft gate (Qwen, "Soft Adaptive Policy Optimization"; not the "Swarm sAmpling" SAPO):

        l_t = -(4 / tau) * sigmoid(tau * (rho_t - 1)) * A,   tau = tau_pos if A > 0 else tau_neg

    Gradient: d l / d logp = -(4/tau) * sigma'(.) * tau * rho * A = -4 sigma (1 - sigma) rho A.
    At rho = 1 sigma = 1/2, so the gradient is -A: exactly PPO's unclipped -A rho there (the 4/tau
    factor is what makes this so); away from rho = 1 the gate 4 sigma (1 - sigma) decays smoothly to 0
    instead of PPO's hard cut (faster for larger tau, so tau_neg > tau_pos damps negative updates
    more). The value at rho = 1 is -(2/tau) A, not PPO's -A: only gradients match.
    log_ratio is capped at 50 before the exp: past it the gate is exactly 0 in float32 either way,
    and exp would overflow to inf (0 * inf = NaN in the backward pass).
    stats: ratio_BxT, gate_BxT = 4 sigma (1 - sigma) (the gradient relative to PPO's -A rho).
    """
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"sapo: tau_pos={tau_pos!r}, tau_neg={tau_neg!r}; expected positive numbers")

    def objective(log_ratio_BxT, adv_BxT, mask_BxT):
        live_BxT = mask_BxT > 0
        log_ratio_BxT = jnp.where(live_BxT, jnp.minimum(log_ratio_BxT, 50.0), 0.0)
        ratio_BxT = jnp.exp(log_ratio_BxT)
        tau_BxT = jnp.where(adv_BxT > 0, tau_pos, tau_neg)
        sig_BxT = jax.nn.sigmoid(tau_BxT * (ratio_BxT - 1.0))
        loss_BxT = -(4.0 / tau_BxT) * sig_BxT * adv_BxT
        sig_sg = jax.lax.stop_gradient(sig_BxT)
        stats = {
            "ratio_BxT": jnp.where(live_BxT, jax.lax.stop_gradient(ratio_BxT), 0.0),
            "gate_BxT": jnp.where(live_BxT, 4.0 * sig_sg * (1.0 - sig_sg), 0.0),
        }
        return jnp.where(live_BxT, loss_BxT, 0.0), stats

    return objective


def strict_double_side(eps_low: float = 0.2, eps_high: float | None = None) -> Objective:
    """SAO strict double-side masking: l_t = -rho_t A if 1 - eps_low <= rho_t <= 1 + eps_high, else the
    token is DROPPED (loss 0, gradient 0), whatever the sign of A.

    PPO only stops the gradient on the side where the clip helps (A > 0 and rho high, A < 0 and rho
    low) and keeps -A rho on the other; this drops both sides. Bounds are inclusive (rho exactly on a
    bound keeps its gradient). stats: ratio_BxT, clipped_low_BxT (rho < 1 - eps_low),
    clipped_high_BxT (rho > 1 + eps_high): here both mean "dropped", for any A.
    """
    eps_high = eps_low if eps_high is None else eps_high
    if eps_low < 0 or eps_high < 0:
        raise ValueError(
            f"strict_double_side: eps_low={eps_low!r}, eps_high={eps_high!r}; expected non-negative numbers"
        )
    lo, hi = 1.0 - eps_low, 1.0 + eps_high

    def objective(log_ratio_BxT, adv_BxT, mask_BxT):
        live_BxT = mask_BxT > 0
        ratio_sg = jnp.exp(jax.lax.stop_gradient(jnp.where(live_BxT, log_ratio_BxT, 0.0)))
        low_BxT, high_BxT = live_BxT & (ratio_sg < lo), live_BxT & (ratio_sg > hi)
        keep_BxT = live_BxT & ~low_BxT & ~high_BxT
        ratio_BxT = jnp.exp(jnp.where(keep_BxT, log_ratio_BxT, 0.0))
        stats = {
            "ratio_BxT": jnp.where(live_BxT, ratio_sg, 0.0),
            "clipped_low_BxT": _f32(low_BxT),
            "clipped_high_BxT": _f32(high_BxT),
        }
        return jnp.where(keep_BxT, -ratio_BxT * adv_BxT, 0.0), stats

    return objective


def mu_grpo(eps_low: float, eps_high: float, delta: float) -> Objective:
    """Mu-GRPO: relaxed (wider) PPO clipping plus a negative-advantage veto, OUR READING:

        l_t = ppo_clip(eps_low, eps_high), except: for A_t < 0, every live token from the FIRST live
        token with |log rho| > delta (strict) to the end of the row is vetoed: loss 0, gradient 0.

    The veto is per row and causal: the tokens before the first offending one keep the PPO loss.
    With per-token advantages (advantages_BxT) only tokens with A_t < 0 can offend or be vetoed.
    The "relaxed" part is just the caller's wider eps (no defaults here: choose them in the preset).
    stats: ppo_clip's plus vetoed_BxT.
    """
    if not delta >= 0:
        raise ValueError(f"mu_grpo: delta={delta!r}; expected a non-negative number")
    ppo = ppo_clip(eps_low, eps_high)

    def objective(log_ratio_BxT, adv_BxT, mask_BxT):
        live_BxT = mask_BxT > 0
        neg_BxT = live_BxT & (adv_BxT < 0)
        offending_BxT = neg_BxT & (jnp.abs(jax.lax.stop_gradient(log_ratio_BxT)) > delta)
        vetoed_BxT = neg_BxT & (jnp.cumsum(offending_BxT.astype(jnp.int32), axis=1) > 0)
        keep_BxT = live_BxT & ~vetoed_BxT
        loss_BxT, _ = ppo(jnp.where(keep_BxT, log_ratio_BxT, 0.0), adv_BxT, mask_BxT)
        # ratio and clip indicators of the TRUE ratio, vetoed tokens included (this call is stats only)
        _, stats = ppo(jax.lax.stop_gradient(jnp.where(live_BxT, log_ratio_BxT, 0.0)), adv_BxT, mask_BxT)
        stats = dict(stats, vetoed_BxT=_f32(vetoed_BxT))
        return jnp.where(keep_BxT, loss_BxT, 0.0), stats

    return objective


def gmpo(eps_low: float = 0.4, eps_high: float | None = None) -> Objective:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization"):

        clipped_t = min(log rho_t, eps_high) if A > 0;  max(log rho_t, -eps_low) if A < 0
        s_i       = exp(mean_{t live} clipped_t)            (geometric mean of the clipped ratios)
        l_t       = -A_t * s_i  on every live token of row i

    (this is the paper's sign(A) * prod_t |min(rho A, clip(rho, e^-eps_low, e^eps_high) A)|^(1/|y|).)
    Clipped tokens are constant (no gradient); d l_t / d logp_j = -A s_i / |y_i| for unclipped j.
    With seq-mean-token-mean aggregation the row's loss is -A s_i, as in the paper.

    Why an OBJECTIVE and not a ratio level: the clip is sign-aware (it needs A, which ratio levels do
    not see) and must happen per token BEFORE the mean, so it cannot be "sequence ratio, then
    ppo_clip". Feed it the TOKEN log-ratio (`token_log_ratio`). The mean is per row, so microbatches
    (which split rows, never a row) keep it exact.
    stats: ratio_BxT (token rho), seq_ratio_BxT (s_i), clipped_low_BxT (A < 0 and log rho < -eps_low),
    clipped_high_BxT (A > 0 and log rho > eps_high); all 0 on masked tokens.
    """
    eps_high = eps_low if eps_high is None else eps_high
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"gmpo: eps_low={eps_low!r}, eps_high={eps_high!r}; expected non-negative numbers")

    def objective(log_ratio_BxT, adv_BxT, mask_BxT):
        live_BxT = mask_BxT > 0
        lr_BxT = jnp.where(live_BxT, log_ratio_BxT, 0.0)
        lr_sg = jax.lax.stop_gradient(lr_BxT)
        high_BxT = live_BxT & (adv_BxT > 0) & (lr_sg > eps_high)
        low_BxT = live_BxT & (adv_BxT < 0) & (lr_sg < -eps_low)
        clipped_BxT = jnp.where(high_BxT, eps_high, jnp.where(low_BxT, -eps_low, lr_BxT))
        n_Bx1 = jnp.maximum(jnp.sum(live_BxT, axis=1, keepdims=True), 1).astype(jnp.float32)
        seq_Bx1 = jnp.exp(jnp.sum(clipped_BxT, axis=1, keepdims=True) / n_Bx1)
        stats = {
            "ratio_BxT": jnp.where(live_BxT, jnp.exp(lr_sg), 0.0),
            "seq_ratio_BxT": jnp.where(live_BxT, jax.lax.stop_gradient(seq_Bx1), 0.0),
            "clipped_low_BxT": _f32(low_BxT),
            "clipped_high_BxT": _f32(high_BxT),
        }
        return jnp.where(live_BxT, -adv_BxT * seq_Bx1, 0.0), stats

    return objective


def unclipped() -> Objective:
    """The plain importance-weighted policy gradient, no clip: l_t = -rho_t A (gradient -A rho).

    For objectives whose trust region lives elsewhere (M2PO masks the tokens with the largest
    (log rho)^2 at the batch level instead of clipping: `m2po.py`). log rho is capped at 50 before the
    exp so a garbage or huge ratio cannot overflow (the cap only matters where the loss is already
    astronomically large). stats: ratio_BxT.
    """

    def objective(log_ratio_BxT, adv_BxT, mask_BxT):
        live_BxT = mask_BxT > 0
        ratio_BxT = jnp.exp(jnp.where(live_BxT, jnp.minimum(log_ratio_BxT, 50.0), 0.0))
        stats = {"ratio_BxT": jnp.where(live_BxT, jax.lax.stop_gradient(ratio_BxT), 0.0)}
        return jnp.where(live_BxT, -ratio_BxT * adv_BxT, 0.0), stats

    return objective
