"""Loss-algebra parts beyond GRPO: hand-worked numbers (arithmetic in the comments) and gradient checks.

Advantage estimators (advantages.py, multi_reward.py), ratio levels (ratios.py), objectives
(objectives.py); the batch-level M2PO mask is in test_loss_m2po.py. Shapes are kept few and tiny: eager
kernels are cached per (op, shape), so reusing shapes keeps this file fast on a busy CPU.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import ConfigError
from jaxrl.losses import advantages as adv_lib
from jaxrl.losses import multi_reward, ratios
from jaxrl.losses import objectives as obj
from jaxrl.losses.compose import policy_token_loss
from jaxrl.losses.objectives import ppo_clip

ATOL = 1e-5
LOG = math.log


def _close(a, b, atol=ATOL):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=0)


# ============================================================================= advantages


def _adv(estimator, rewards, group_size):
    """Run an estimator (or normaliser) jitted, as the advantage step does: one compile is cheaper
    than the per-op eager compiles, and it checks the part traces with a static group_size."""
    return jax.jit(estimator, static_argnums=1)(rewards, group_size)


def test_group_mean_batch_std_by_hand():
    # r = [1,0 | 1,1], G = 2. Group means 0.5, 1 -> centred [0.5, -0.5, 0, 0].
    # Batch std of the RAW rewards [1,0,1,1]: mean 0.75, squares (0.0625+0.5625+0.0625+0.0625) = 0.75;
    # unbiased (default): var .75 / 3 = .25, std .5 -> A = [0.5, -0.5] / 0.5 = [1, -1]; constant group 0.
    adv = _adv(adv_lib.group_mean_batch_std(1e-6), jnp.array([1.0, 0.0, 1.0, 1.0]), 2)
    _close(adv, [1.0, -1.0, 0.0, 0.0])
    assert np.all(np.asarray(adv)[2:] == 0.0)
    # ddof 0: var .75 / 4 = .1875, std .4330127 -> A = +-0.5 / .4330127 = +-1.1547005
    _close(
        _adv(adv_lib.group_mean_batch_std(1e-6, ddof=0), jnp.array([1.0, 0.0, 1.0, 1.0]), 2),
        [1.1547005, -1.1547005, 0.0, 0.0],
    )
    # GRPO's per-group std would give +-.5 / .7071068 = +-.7071068: make sure the batch std is used.
    assert abs(float(adv[0]) - 0.7071068) > 0.1
    # A constant batch: every group constant, std 0 -> exactly 0, never NaN.
    assert np.all(np.asarray(_adv(adv_lib.group_mean_batch_std(), jnp.full((4,), 0.3), 2)) == 0.0)


def test_rloo_by_hand():
    # group [1,0,0,0]: A_0 = 1 - mean(0,0,0) = 1 ; A_1 = 0 - mean(1,0,0) = -1/3 (= 4/3 * (r - 0.25))
    # group [0.3]*4 (float mean != 0.3): exactly 0.
    adv = _adv(adv_lib.rloo, jnp.array([1.0, 0.0, 0.0, 0.0] + [0.3] * 4), 4)
    _close(adv, [1.0, -1 / 3, -1 / 3, -1 / 3, 0, 0, 0, 0])
    assert np.all(np.asarray(adv)[4:] == 0.0)
    with pytest.raises(ValueError, match="group_size >= 2"):
        adv_lib.rloo(jnp.array([1.0, 0.0]), 1)


def test_reinforce_pp_baseline_by_hand():
    # r = [1,0 | 1,1 | 0,1], G = 2: centred [0.5,-0.5, 0,0, -0.5,0.5]; batch mean 0, squares 4 * .25 = 1
    # unbiased (default): std = sqrt(1 / 5) = .4472136 -> 0.5 / .4472136 = 1.1180340
    adv = _adv(adv_lib.group_mean_batch_whiten(1e-6), jnp.array([1.0, 0.0, 1.0, 1.0, 0.0, 1.0]), 2)
    _close(adv, [1.1180340, -1.1180340, 0, 0, -1.1180340, 1.1180340])
    assert np.all(np.asarray(adv)[2:4] == 0.0)  # constant group: exact zeros, no whitening residue
    # ddof 0: std = sqrt(1 / 6) = 0.4082483 -> 0.5 / 0.4082483 = 1.2247449
    _close(
        _adv(adv_lib.group_mean_batch_whiten(1e-6, ddof=0), jnp.array([1.0, 0.0, 1.0, 1.0, 0.0, 1.0]), 2),
        [1.2247449, -1.2247449, 0, 0, -1.2247449, 1.2247449],
    )
    # Whitening subtracts the batch mean: centred values [2,-2], unbiased std sqrt(8 / 1) = 2.8284271
    # -> [.7071068, -.7071068] (ddof 0: std 2 -> [1, -1]).
    _close(_adv(adv_lib.group_mean_batch_whiten(), jnp.array([4.0, 0.0]), 2), [0.7071068, -0.7071068])
    _close(_adv(adv_lib.group_mean_batch_whiten(ddof=0), jnp.array([4.0, 0.0]), 2), [1.0, -1.0])


MC_R = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 3.0, 1.0, 2.0, 0.7, 0.7, 0.7]  # G+1 = 3 per group


def test_mc_grpo_median_baseline_and_pivot():
    r = jnp.array(MC_R)
    # medians: [1,0,0] -> 0 ; [0,1,1] -> 1 ; [3,1,2] -> 2 ; constant 0.7 -> 0.7
    # Plain form (no MAD, no rescale): A = r - median = [1,0,0 | -1,0,0 | 1,-1,0 | 0,0,0]
    adv = _adv(adv_lib.group_median(mad_scale=False, nonzero_rescale=False), r, 3)
    _close(adv, [1, 0, 0, -1, 0, 0, 1, -1, 0, 0, 0, 0])
    # Pivot = row at position 1 of a STABLE ascending sort:
    #   [1,0,0]: order (1,2,0) -> row 2 (the 2nd of the rows tied at the median 0)
    #   [0,1,1]: order (0,1,2) -> row 1 (the 1st of the rows tied at 1)
    #   [3,1,2]: order (1,2,0) -> row 2 ; constant: order (0,1,2) -> row 1
    pivot = np.asarray(_adv(adv_lib.median_pivot, r, 3))
    np.testing.assert_array_equal(pivot, [0, 0, 1, 0, 1, 0, 0, 0, 1, 0, 1, 0])
    assert np.all(np.asarray(adv)[pivot == 1] == 0.0)  # the pivot's advantage is exactly 0
    np.testing.assert_array_equal(pivot.reshape(-1, 3).sum(1), 1)  # exactly one pivot per group
    # Group of 5 with a 3-way tie at the median: [2,2,2,0,5] sorted rows (3,0,1,2,4) -> position 2
    # is row 1; rule: #{r < 2} = 1, so it is tied row number 2 - 1 + 1 = 2 in row order (rows 0,1,2).
    np.testing.assert_array_equal(_adv(adv_lib.median_pivot, jnp.array([2.0, 2, 2, 0, 5]), 5), [0, 1, 0, 0, 0])
    # Composes with reward_combine like any normaliser.
    est = adv_lib.estimator(adv_lib.reward_sum(), adv_lib.median_pivot)
    np.testing.assert_array_equal(_adv(est, r[:, None], 3), pivot)
    with pytest.raises(ValueError, match="must be odd"):
        adv_lib.group_median()(jnp.zeros((4,)), 2)
    with pytest.raises(ValueError, match="must be odd"):
        adv_lib.median_pivot(jnp.zeros((4,)), 4)


def test_mc_grpo_mad_scaling():
    # MAD only (nonzero_rescale off):
    # [3,1,2]: median 2, |dev| [1,1,0] -> sorted [0,1,1], MAD = 1 -> A = [1,-1,0] / 1.001
    # [1,0,0]: |dev| [1,0,0], MAD = 0 -> A_0 = 1 / 1e-3 = 1000 (the binary-reward hazard documented)
    # constant group: 0 / 1e-3 = 0 exactly.
    adv = _adv(adv_lib.group_median(mad_scale=True, nonzero_rescale=False), jnp.array(MC_R), 3)
    _close(adv[6:9], [1 / 1.001, -1 / 1.001, 0.0])
    _close(adv[:3], [1000.0, 0.0, 0.0], atol=1e-2)
    assert np.all(np.asarray(adv)[9:] == 0.0)


def test_mc_grpo_paper_code_default_by_hand():
    # Default = the paper's code: / (MAD + 1e-3), then the nonzero A of each group of G+1 times
    # (G+1) / #nonzero. G+1 = 3, MC_R:
    #   [1,0,0]: MAD 0 -> [1000, 0, 0]; 1 nonzero -> x3 -> [3000, 0, 0]
    #   [0,1,1]: median 1, MAD 0 -> [-1000, 0, 0] -> [-3000, 0, 0]
    #   [3,1,2]: MAD 1 -> [1, -1, 0] / 1.001; 2 nonzero -> x3/2 -> [1.4985015, -1.4985015, 0]
    #   constant: all 0, nothing to rescale (no division by #nonzero = 0)
    adv = np.asarray(_adv(adv_lib.group_median(), jnp.array(MC_R), 3))
    _close(adv[:6], [3000, 0, 0, -3000, 0, 0], atol=0.05)
    _close(adv[6:], [1.4985015, -1.4985015, 0, 0, 0, 0])
    assert np.all(adv[9:] == 0.0) and np.all(adv[[1, 2, 4, 5, 8]] == 0.0)
    # G+1 = 5, r = [0,1,2,3,4]: median 2, |dev| [2,1,0,1,2] -> sorted [0,1,1,2,2], MAD 1
    #   A = [-2,-1,0,1,2] / 1.001; 4 nonzero -> x5/4: [-2.4975025, -1.2487512, 0, 1.2487512, 2.4975025]
    _close(_adv(adv_lib.group_median(), jnp.arange(5.0), 5), [-2.4975025, -1.2487512, 0, 1.2487512, 2.4975025])
    # Rescale only (no MAD): [1,0,0] -> [3,0,0] ; [3,1,2] -> [1,-1,0] x 3/2 = [1.5,-1.5,0]
    _close(_adv(adv_lib.group_median(mad_scale=False), jnp.array(MC_R), 3)[:9], [3, 0, 0, -3, 0, 0, 1.5, -1.5, 0])


@pytest.mark.slow
def test_gdpo_by_hand_and_differs_from_summing():
    # K = 2, G = 2, weights (1,1). Group 0: (1,0),(0,0) ; group 1: (1,1),(0,0).
    # Unbiased stds (default). z: group 0 k0 = [1,0]: mean .5, deviations +-.5, std sqrt(.5 / 1) = .7071068
    #   -> z = +-.7071068; k1 constant -> [0,0]                      => a = [.7071068, -.7071068]
    #    group 1 k0 = k1 = [1,0] -> z = +-.7071068 each              => a = [1.4142136, -1.4142136]
    # batch: mean 0, squares .5+.5+2+2 = 5, std sqrt(5 / 3) = 1.2909944
    #   -> A = [.5477226, -.5477226, 1.0954451, -1.0954451]
    rewards = jnp.array([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    adv = _adv(multi_reward.gdpo((1.0, 1.0)), rewards, 2)
    _close(adv, [0.5477226, -0.5477226, 1.0954451, -1.0954451])
    # ddof 0: z = +-1 (std .5), a = [1,-1,2,-2], batch std sqrt(10 / 4) = 1.5811388
    #   -> A = [.6324555, -.6324555, 1.2649111, -1.2649111]
    _close(_adv(multi_reward.gdpo((1.0, 1.0), ddof=0), rewards, 2), [0.6324555, -0.6324555, 1.2649111, -1.2649111])
    # Plain GRPO sums first: [1,0] and [2,0] both normalise to [1,-1]; the two groups look identical.
    grpo = _adv(adv_lib.estimator(adv_lib.reward_sum(), adv_lib.group_mean_std()), rewards, 2)
    _close(grpo[:2], grpo[2:])
    assert float(adv[2]) > float(adv[0]) + 0.5
    # A constant reward column inside a group and fully constant groups: exact 0, no NaN.
    z = _adv(multi_reward.group_z_scores, jnp.array([[1.1, 1.0], [1.1, 0.0], [0.3, 0.3], [0.3, 0.3]]), 2)
    np.testing.assert_array_equal(np.asarray(z)[:, 0], 0.0)
    assert np.all(np.asarray(_adv(multi_reward.gdpo(), jnp.full((4, 2), 0.3), 2)) == 0.0)
    with pytest.raises(ConfigError, match="loss.reward_weights"):
        multi_reward.gdpo((1.0, 2.0, 3.0))(rewards, 2)


GD2PO_R = jnp.array([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])


def test_gd2po_our_reading_by_hand():
    # weights (1, 0.5), G = 3, unbiased stds (default).
    # Group 0: k0 = [1,0,0]: mean 1/3, deviations [2/3,-1/3,-1/3], squares 6/9, std sqrt((2/3) / 2) = .5773503
    #          -> z0 = [1.1547005, -.5773503, -.5773503]
    #          k1 = [0,1,1] -> z1 = -z0 ;  a = z0 + .5 z1 = .5 z0 = [.5773503, -.2886751, -.2886751]
    #   row 0: a > 0, k1 contributes .5 * (-1.155) < 0 (against) -> conflict = .5 / 1.5 = 1/3
    #   rows 1,2: a < 0, k1 contributes + (against) -> 1/3 ; consensus = 1 - 1/3 = 2/3
    # Group 1: k0 = k1 = [1,0,0] -> a = 1.5 z0 = [1.7320508, -.8660254, -.8660254]; conflict 0, consensus 1
    # Batch: mean 0, squares (1/3 + 2/12) + (3 + 2*.75) = .5 + 4.5 = 5, std sqrt(5 / 5) = 1
    #   GDPO A = a / (1 + 1e-6) = [.5773503, -.2886751, -.2886751, 1.7320508, -.8660254, -.8660254]
    # threshold .5 (1/3 <= .5: kept), power 1: group 0 scaled by 2/3 -> [.3849002, -.1924501, -.1924501]
    gdpo_adv = [0.5773503, -0.2886751, -0.2886751, 1.7320508, -0.8660254, -0.8660254]
    _close(_adv(multi_reward.gdpo((1.0, 0.5)), GD2PO_R, 3), gdpo_adv)
    parts_fn = functools.partial(multi_reward.gd2po_parts, weights=(1.0, 0.5), conflict_threshold=0.5)
    parts = _adv(parts_fn, GD2PO_R, 3)
    _close(parts["conflict_B"], [1 / 3] * 3 + [0] * 3)
    _close(parts["consensus_B"], [2 / 3] * 3 + [1] * 3)
    _close(parts["adv_B"], [0.3849002, -0.1924501, -0.1924501] + gdpo_adv[3:])
    np.testing.assert_array_equal(parts["keep_B"], 1.0)
    # threshold .25 < 1/3: group 0's rollouts are masked (A exactly 0, keep 0).
    adv = _adv(multi_reward.gd2po(weights=(1.0, 0.5), conflict_threshold=0.25), GD2PO_R, 3)
    keep = _adv(multi_reward.gd2po_keep(weights=(1.0, 0.5), conflict_threshold=0.25), GD2PO_R, 3)
    _close(adv, [0, 0, 0] + gdpo_adv[3:])
    np.testing.assert_array_equal(keep, [0, 0, 0, 1, 1, 1])
    # power 0 disables the reweighting; threshold >= 1 disables the masking: GD2PO == GDPO.
    _close(
        _adv(multi_reward.gd2po(weights=(1.0, 0.5), conflict_threshold=1.0, consensus_power=0.0), GD2PO_R, 3), gdpo_adv
    )
    with pytest.raises(ValueError, match="conflict_threshold"):
        multi_reward.gd2po(conflict_threshold=-1.0)


def test_gd2po_exactly_opposed_rewards_do_not_conflict_by_rounding():
    """Two equal-weight rewards that exactly disagree give a_i = z_i0 + z_i1 = 0 for every rollout:
    by the definition no reward pushes against a zero advantage (conflict 0, consensus 1). In float32
    the sum is +-1 ulp, whose sign used to count one reward as against (conflict 0.5, consensus 0.5),
    and flip with which rows shared the batch."""
    r_B = jnp.array([0.1, 0.7, 0.3, 0.45, 0.2, 0.9, 0.35, 0.05])
    for scale in (3.0, 0.7, 10.0):
        parts = _adv(multi_reward.gd2po_parts, jnp.stack([r_B, -scale * r_B], 1), 2)
        np.testing.assert_array_equal(parts["conflict_B"], 0.0)
        np.testing.assert_array_equal(parts["consensus_B"], 1.0)
        np.testing.assert_array_equal(parts["keep_B"], 1.0)
    # A real disagreement is untouched: the by-hand case's conflicts stay 1/3.
    _close(
        _adv(functools.partial(multi_reward.gd2po_parts, weights=(1.0, 0.5)), GD2PO_R, 3)["conflict_B"][:3], [1 / 3] * 3
    )


# ============================================================================= ratio levels

# One row, T = 4, last column padding with a garbage log-prob (exp would overflow).
R_LOGP = jnp.array([[0.3, -0.1, 0.4, 1e4], [5.0, 5.0, 5.0, 5.0]])
R_OLD = jnp.zeros((2, 4))
R_MASK = jnp.array([[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # row 1 fully masked


@functools.partial(jax.jit, static_argnums=0)
def _jac_row0(fn, mask=R_MASK):
    """d out[0, t] / d logp[0, j] as a TxT matrix (t = row, j = column)."""
    return jax.jacobian(lambda lp: fn(lp, R_OLD, mask)[0])(R_LOGP)[:, 0, :]


def test_sequence_log_ratio_gspo():
    # log s_0 = (0.3 - 0.1 + 0.4) / 3 = 0.2 on the three live tokens; padding 0; masked row all 0.
    lr = ratios.sequence_log_ratio(R_LOGP, R_OLD, R_MASK)
    _close(lr, [[0.2, 0.2, 0.2, 0.0], [0, 0, 0, 0]])
    # d log s / d logp_j = m_j / |y| = 1/3 for every live j, 0 for the padding column.
    _close(_jac_row0(ratios.sequence_log_ratio), [[1 / 3] * 3 + [0]] * 3 + [[0] * 4])
    g = jax.jit(jax.grad(lambda lp: jnp.sum(ratios.sequence_log_ratio(lp, R_OLD, R_MASK))))(R_LOGP)
    assert np.all(np.isfinite(np.asarray(g))) and np.all(np.asarray(g)[1] == 0.0)


def test_sequence_token_log_ratio_gspo_token():
    # Same VALUE as GSPO, exactly; gradient is per token (identity on live tokens).
    lr = ratios.sequence_token_log_ratio(R_LOGP, R_OLD, R_MASK)
    np.testing.assert_array_equal(lr, ratios.sequence_log_ratio(R_LOGP, R_OLD, R_MASK))
    _close(_jac_row0(ratios.sequence_token_log_ratio), np.diag([1.0, 1.0, 1.0, 0.0]))


def test_prefix_log_ratio_pnpo():
    # log rho = [0.3, -0.1, 0.4]: prefix means 0.3, 0.2/2 = 0.1, 0.6/3 = 0.2 ; padding 0.
    _close(ratios.prefix_log_ratio(R_LOGP, R_OLD, R_MASK), [[0.3, 0.1, 0.2, 0.0], [0, 0, 0, 0]])
    # d log w_t / d logp_j = 1/n_t for j <= t (causal).
    _close(_jac_row0(ratios.prefix_log_ratio), [[1, 0, 0, 0], [0.5, 0.5, 0, 0], [1 / 3, 1 / 3, 1 / 3, 0], [0] * 4])
    # t counts live tokens only: mask [1,0,1,0] -> t0: 0.3 ; t2: (0.3 + 0.4) / 2 = 0.35 (not / 3).
    gap = jnp.array([[1.0, 0.0, 1.0, 0.0], [0.0] * 4])
    _close(ratios.prefix_log_ratio(R_LOGP, R_OLD, gap), [[0.3, 0.0, 0.35, 0.0], [0, 0, 0, 0]])


# ============================================================================= objectives


@functools.partial(jax.jit, static_argnums=0)
def _value_grad(objective, log_ratio_BxT, adv_BxT, mask_BxT):
    """(loss_BxT, d sum(loss) / d log_ratio_BxT, stats). Jitted: one compile per objective and shape
    is much cheaper on CPU than the dozens of per-op eager compiles of a fresh objective."""

    def total(x):
        loss, stats = objective(x, adv_BxT, mask_BxT)
        return jnp.sum(loss), (loss, stats)

    (_, (loss, stats)), g = jax.value_and_grad(total, has_aux=True)(log_ratio_BxT)
    return loss, g, stats


def _obj_grad(objective, log_ratios, advs):
    """One token per row: (loss_B, d sum(loss) / d log_ratio_B, stats)."""
    lr = np.array(log_ratios, np.float32)[:, None]
    adv = np.array(advs, np.float32)[:, None]
    loss, g, stats = _value_grad(objective, lr, adv, np.ones_like(lr))
    return np.asarray(loss[:, 0]), np.asarray(g[:, 0]), {k: np.asarray(v[:, 0]) for k, v in stats.items()}


def test_dual_clip_by_hand():
    # eps 0.2, c = 3. d loss / d log_ratio = -A rho where unclipped.
    #   rho 4,  A -1: PPO loss -min(-4, -1.2*... ) = 4 > c*|A| = 3 -> capped: loss 3, grad 0, dual
    #   rho 2,  A -1: PPO loss 2 < 3 -> unchanged: loss 2, grad -A rho = 2
    #   rho 4,  A +1: PPO high clip: loss -1.2, grad 0 (dual never applies to A > 0)
    #   rho .5, A -1: PPO low clip: loss 0.8, grad 0
    #   rho e^100, A -1: huge stale ratio: loss 3, grad 0, finite
    #   rho 3 (= c), A -2: tie -> unclipped branch: loss 6, grad 6
    loss, g, st = _obj_grad(
        obj.dual_clip(0.2, 0.2, c=3.0), [LOG(4), LOG(2), LOG(4), LOG(0.5), 100.0, LOG(3)], [-1, -1, 1, -1, -1, -2]
    )
    _close(loss, [3, 2, -1.2, 0.8, 3, 6], atol=1e-4)
    _close(g, [0, 2, 0, 0, 0, 6], atol=1e-4)
    np.testing.assert_array_equal(st["clipped_dual_BxT"], [1, 0, 0, 0, 1, 0])
    np.testing.assert_array_equal(st["clipped_high_BxT"], [0, 0, 1, 0, 0, 0])
    np.testing.assert_array_equal(st["clipped_low_BxT"], [0, 0, 0, 1, 0, 0])
    with pytest.raises(ValueError, match="c="):
        obj.dual_clip(c=1.0)


def test_cispo_by_hand_and_paper_gradient():
    # cap 1.2: rho 1.5, A 1 -> w = 1.2: loss = -1.2 * 1 * ln 1.5 = -0.4865581, grad -1.2 (NOT zero)
    #          rho .5, A -2 -> w = .5: loss = -.5 * -2 * ln .5 = -0.6931472, grad = -.5 * -2 = 1
    loss, g, st = _obj_grad(obj.cispo(cap=1.2), [LOG(1.5), LOG(0.5)], [1.0, -2.0])
    _close(loss, [-0.4865581, -0.6931472])
    _close(g, [-1.2, 1.0])
    np.testing.assert_array_equal(st["clipped_high_BxT"], [1, 0])
    # floor .8: rho .5 -> w = .8, grad 1.6, clipped_low
    _, g, st = _obj_grad(obj.cispo(cap=1.2, floor=0.8), [LOG(1.5), LOG(0.5)], [1.0, -2.0])
    _close(g, [-1.2, 1.6])
    np.testing.assert_array_equal(st["clipped_low_BxT"], [0, 1])
    # Through token_log_ratio, the gradient wrt logp equals the paper's -sg(w) A logp form.
    logp, old = jnp.array([[-1.0, -2.0]]), jnp.array([[-1.0 - LOG(1.5), -2.0 - LOG(0.5)]])
    adv, mask = jnp.array([[1.0, -2.0]]), jnp.ones((1, 2))
    cispo = obj.cispo(1.2)

    @jax.jit
    def ours_and_paper(logp):
        ours = jax.grad(lambda lp: jnp.sum(cispo(ratios.token_log_ratio(lp, old, mask), adv, mask)[0]))(logp)
        w = jnp.minimum(jnp.exp(logp - old), 1.2)
        return ours, jax.grad(lambda lp: jnp.sum(-jax.lax.stop_gradient(w) * adv * lp))(logp)

    ours, paper = ours_and_paper(logp)
    _close(ours, paper)


def test_cispo_reports_minus_w_a_logp_like_trl_with_the_same_gradient():
    # TRL / verl report l_t = -sg(w) A logp. logp = [-1, -2], rho = [1.5, .5], A = [1, -2], cap 1.2:
    #   w = [1.2, .5]; l = [-1.2 * 1 * -1, -.5 * -2 * -2] = [1.2, -2.0]
    #   (the log-ratio form would report [-1.2 ln 1.5, -.5 * -2 * ln .5] = [-.4865581, -.6931472])
    #   gradient d l / d logp = -w A = [-1.2, 1.0] either way.
    logp = jnp.array([[-1.0, -2.0]])
    batch = {
        "completion_mask_BxT": jnp.ones((1, 2)),
        "old_logp_BxT": jnp.array([[-1.0 - LOG(1.5), -2.0 - LOG(0.5)]]),
        "advantages_BxT": jnp.array([[1.0, -2.0]]),
    }
    token_loss = policy_token_loss(ratios.token_log_ratio, obj.cispo(cap=1.2))
    loss, g, _ = _value_grad(lambda lp, _a, _m: token_loss(lp, batch), logp, None, None)
    _close(loss, [[1.2, -2.0]])
    _close(g, [[-1.2, 1.0]])
    # The preset: eps_high .2 is the RELATIVE bound, cap = 1 + .2 = TRL's absolute epsilon_high 1.2.
    from jaxrl.losses.presets import PRESETS

    preset = PRESETS["cispo"](eps_high=0.2)
    loss, g, _ = _value_grad(lambda lp, _a, _m: preset.token_loss(lp, batch), logp, None, None)
    _close(loss, [[1.2, -2.0]])
    _close(g, [[-1.2, 1.0]])


def test_sapo_gradient_at_one_is_ppo_and_by_hand():
    # rho = 1: sigma(0) = 1/2 -> loss = -(4/tau)(1/2) A: A = 2, tau_pos 1 -> -4 ; A = -2, tau_neg 1.05
    # -> 4/1.05 = 3.8095238. Gradient -4 sigma(1-sigma) rho A = -A: -2 and +2 (PPO's -A rho at rho 1).
    # rho = 2, A = 1, tau 1: sigma(1) = .7310586: loss -4 * .7310586 = -2.9242343,
    #   grad = -4 * .7310586 * .2689414 * 2 * 1 = -1.5728955 (PPO unclipped would be -2)
    # log rho = 100 (would overflow): loss -4 (sigma = 1), grad 0, finite.
    loss, g, st = _obj_grad(obj.sapo(1.0, 1.05), [0.0, 0.0, LOG(2), 100.0], [2.0, -2.0, 1.0, 1.0])
    _close(loss, [-4.0, 3.8095238, -2.9242343, -4.0])
    _close(g, [-2.0, 2.0, -1.5728955, 0.0])
    assert np.all(np.isfinite(g))
    _close(st["gate_BxT"][:3], [1.0, 1.0, 4 * 0.7310586 * 0.2689414])
    _, g_ppo, _ = _obj_grad(ppo_clip(0.2), [0.0, 0.0], [2.0, -2.0])
    _close(g[:2], g_ppo)


def test_strict_double_side_by_hand():
    # eps 0.2, loss -rho A inside [0.8, 1.2] (inclusive), dropped (0, grad 0) outside for ANY sign of A.
    #   1.1,+1: -1.1 / -1.1 ; 1.5,+1: 0/0 ; 1.5,-1: 0/0 (PPO: 1.5 / 1.5) ; 0.5,+1: 0/0 (PPO: -.5/-.5)
    #   0.8,-1 on the bound: 0.8 / 0.8 ; e^100, -1: 0 / 0 finite
    lrs, advs = [LOG(1.1), LOG(1.5), LOG(1.5), LOG(0.5), LOG(0.8) + 1e-7, 100.0], [1, 1, -1, 1, -1, -1]
    loss, g, st = _obj_grad(obj.strict_double_side(0.2), lrs, advs)
    _close(loss, [-1.1, 0, 0, 0, 0.8, 0])
    _close(g, [-1.1, 0, 0, 0, 0.8, 0])
    np.testing.assert_array_equal(st["clipped_high_BxT"], [0, 1, 1, 0, 0, 1])
    np.testing.assert_array_equal(st["clipped_low_BxT"], [0, 0, 0, 1, 0, 0])
    _, g_ppo, _ = _obj_grad(ppo_clip(0.2), lrs[:4], advs[:4])
    _close(g_ppo, [-1.1, 0, 1.5, -0.5])  # the two tokens PPO keeps and SAO drops


def _row_grad(objective, lr_row, adv, mask_row):
    """One row, the same advantage on every token: (loss_T, d sum(loss) / d log_ratio_T, stats)."""
    lr = np.array([lr_row], np.float32)
    loss, g, stats = _value_grad(objective, lr, np.full_like(lr, adv), np.array([mask_row], np.float32))
    return np.asarray(loss[0]), np.asarray(g[0]), {k: np.asarray(v[0]) for k, v in stats.items()}


def test_mu_grpo_negative_veto_by_hand():
    # eps 0.3, delta 0.5, row log rho [0.1, 0.6, 0.0, 0.1, 9.0 (masked)].
    # A = -1: first |log rho| > .5 is t = 1 -> t = 1..3 vetoed (0, no grad);
    #         t = 0: rho = e^.1 = 1.1051709, loss -rho A = 1.1051709, grad 1.1051709.
    # The masked garbage at t = 4 never triggers anything.
    f = obj.mu_grpo(0.3, 0.3, 0.5)
    row, mask = [0.1, 0.6, 0.0, 0.1, 9.0], [1, 1, 1, 1, 0]
    loss, g, st = _row_grad(f, row, -1.0, mask)
    _close(loss, [1.1051709, 0, 0, 0, 0])
    _close(g, [1.1051709, 0, 0, 0, 0])
    np.testing.assert_array_equal(st["vetoed_BxT"], [0, 1, 1, 1, 0])
    # A = +1: no veto; plain relaxed PPO: t = 1 rho e^.6 = 1.8221188 > 1.3 -> clipped: -1.3, grad 0;
    # others -rho: e^.1 = 1.1051709, e^0 = 1.
    loss, g, st = _row_grad(f, row, 1.0, mask)
    _close(loss, [-1.1051709, -1.3, -1.0, -1.1051709, 0])
    _close(g, [-1.1051709, 0, -1.0, -1.1051709, 0])
    assert st["vetoed_BxT"].sum() == 0 and st["clipped_high_BxT"][1] == 1


def test_gmpo_by_hand():
    # eps 0.4, row log rho [0.2, 0.6, -0.6, 9 (masked)], |y| = 3; loss -A s on each live token.
    # A = +1: clip above at 0.4 -> [0.2, 0.4, -0.6], mean 0, s = 1: loss -1 per token.
    #   d sum_t l_t / d lr_j = 3 * (-A s / 3) = -1 for unclipped j (t0, t2), 0 for the clipped t1.
    f = obj.gmpo(0.4)
    row, mask = [0.2, 0.6, -0.6, 9.0], [1, 1, 1, 0]
    loss, g, st = _row_grad(f, row, 1.0, mask)
    _close(loss, [-1, -1, -1, 0])
    _close(g, [-1, 0, -1, 0])
    np.testing.assert_array_equal(st["clipped_high_BxT"], [0, 1, 0, 0])
    # A = -1: clip below at -0.4 -> [0.2, 0.6, -0.4], mean 0.1333333, s = e^0.1333333 = 1.1426308
    #   loss +1.1426308 per token; grad = -A s = 1.1426308 for t0, t1; 0 for the clipped t2.
    loss, g, st = _row_grad(f, row, -1.0, mask)
    _close(loss, [1.1426308, 1.1426308, 1.1426308, 0])
    _close(g, [1.1426308, 1.1426308, 0, 0])
    _close(st["seq_ratio_BxT"], [1.1426308] * 3 + [0])
    np.testing.assert_array_equal(st["clipped_low_BxT"], [0, 0, 1, 0])


# Every objective on one shared batch: masked tokens (with garbage log-ratios) and a fully masked row
# give loss 0 and gradient 0, and nothing is NaN.
ALL_OBJECTIVES = {
    "dual_clip": obj.dual_clip(),
    "cispo": obj.cispo(1.28),
    "sapo": obj.sapo(),
    "strict_double_side": obj.strict_double_side(),
    "mu_grpo": obj.mu_grpo(0.3, 0.3, 0.5),
    "gmpo": obj.gmpo(),
}


@pytest.mark.parametrize("name", sorted(ALL_OBJECTIVES))
def test_objectives_masked_tokens_and_empty_rows(name):
    lr = np.array([[0.1, -0.05, 1e4], [-1e4, 1e4, 50.0], [0.02, 0.3, -0.2]], np.float32)
    adv = np.array([[1.0] * 3, [-1.0] * 3, [-0.5] * 3], np.float32)
    mask = np.array([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]], np.float32)
    loss, g, stats = _value_grad(ALL_OBJECTIVES[name], lr, adv, mask)
    dead = np.asarray(mask) == 0
    assert np.all(np.isfinite(np.asarray(loss))) and np.all(np.isfinite(np.asarray(g)))
    np.testing.assert_array_equal(np.asarray(loss)[dead], 0.0)
    np.testing.assert_array_equal(np.asarray(g)[dead], 0.0)
    assert np.max(np.abs(np.asarray(g))) > 0
    for key, v in stats.items():
        assert key.endswith("_BxT") and np.all(np.asarray(v)[dead] == 0.0), key
