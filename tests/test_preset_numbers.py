"""Hand-worked numbers for what each preset's composition adds, the new parts (aggregations, prepare
parts, rollout corrections, objectives), config plumbing (LossConfig fields and options, group-size
rules) and the update step's wiring of `prepare` (with a toy policy, so it compiles in seconds).

The arithmetic is in the comments. `_run` (prepare and weights on the whole batch, then the
microbatch sum, as steps.py does) is shared with the contract in test_presets.py.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_presets import _close, _run

from jaxrl import losses
from jaxrl.config import Config, ConfigError, LossConfig, apply_overrides
from jaxrl.losses import advantages as adv_lib
from jaxrl.losses import aggregation, corrections, masks, objectives, ratios
from jaxrl.losses import prepare as prep
from jaxrl.losses.presets import PRESETS, make_loss, preset_parameters
from jaxrl.train import steps as steps_lib
from jaxrl.train.state import init_state

LOG = math.log


# ============================================================================= hand-worked compositions

# Two rows of one group, rewards [1, 0]; lengths 1 and 3 in T = 4; L_max = 4; logp = old (rho = 1).
# At rho = 1 the gradient d J / d logp_it is -A_i * w_it (ratio levels differ, see PNPO), so the
# numbers below check each preset's advantage estimator and normaliser together.
# The std is UNBIASED (ddof 1, the default): rewards [1, 0]: mean .5, deviations +-.5, squares .5,
# std sqrt(.5 / (2 - 1)) = .7071068, so A = +-.5 / .7071068 = +-U with U = 1/sqrt(2) = .7071068.
# (With ddof 0 the std is .5 and A = +-1.) Presets without a std (dr_grpo, rloo, sao) are unchanged.
TINY_MASK = np.array([[1, 0, 0, 0], [1, 1, 1, 0]], np.float32)
S = 1 / 6
U = 1 / math.sqrt(2)
TABLE = {
    # preset: (row-0 token gradient, row-1 token gradients)
    "grpo": (-0.5 * U, [S * U] * 3),  # A = +-U; w = 1/(|y| B): 1/2 and 1/6
    "gmpo": (-0.5 * U, [S * U] * 3),  # loss -A s on every token, d s / d logp_j = s/|y|: same as GRPO
    "sapo": (-0.5 * U, [S * U] * 3),  # gradient -4 sig(1-sig) rho A = -A at rho = 1
    "gspo": (-0.5 * U, [S * U] * 3),  # d s / d logp_j = s/|y|, row value counted once: same as GRPO
    "gspo_token": (-0.5 * U, [S * U] * 3),
    "tbpo": (-0.5 * U, [S * U] * 3),  # GSPO's sequence ratio and band; the dual cap needs s > 3
    "mu_grpo": (-0.5 * U, [S * U] * 3),  # |log rho| = 0: no veto
    # GDPO: one reward column: z = +-U; batch whitening of [U, -U]: mean 0, std sqrt((U^2 + U^2) / 1) = 1
    # -> A = +-U
    "gdpo": (-0.5 * U, [S * U] * 3),
    "gd2po": (-0.5 * U, [S * U] * 3),  # one column: no conflict, consensus 1; as GDPO
    "dr_grpo": (-1 / 16, [1 / 16] * 3),  # A = +-.5 (no std); w = 1/(B L_max) = 1/8
    "bnpo": (-0.25 * U, [0.25 * U] * 3),  # A = +-U; w = 1/(4 tokens)
    "cispo": (-0.25 * U, [0.25 * U] * 3),  # weight sg(min(1, 1.28)) = 1; token mean
    "m2po": (-0.25 * U, [0.25 * U] * 3),  # rollout = old: nothing masked, r = 1; unclipped; token mean
    "dapo": (-0.25 * U, [0.25 * U] * 3),  # lengths 1, 3 <= L_max - L_c = 3.2: no penalty; token mean
    # centred [.5,-.5], batch-whitened: mean 0, std sqrt(.5 / 1) = U -> +-.5 / U = +-U; token mean
    "reinforce_pp": (-0.25 * U, [0.25 * U] * 3),
    "rloo": (-0.5, [0.5] * 3),  # A = 1 - 0, 0 - 1 (no std); w = 1/B: the sequence log-prob, no 1/|y|
    "async_const_norm": (-U / 8, [U / 8] * 3),  # A = +-U; w = 1/(B k), k = L_max = 4
    "sao": (-0.125, [0.125] * 3),  # batch baseline (no std): A = [.5, -.5]; token mean 1/4
    # PNPO: loss_t = -w_t A with w_t the prefix geometric mean; d w_t / d logp_j = 1/n_t (j <= t), so
    # row 1 (A = -U, weight 1/(3*2)): j=0: U (1 + 1/2 + 1/3)/6 = 11/36 U, j=1: U (1/2 + 1/3)/6 = 5/36 U,
    # j=2: U/18
    "pnpo": (-0.5 * U, [11 / 36 * U, 5 / 36 * U, 1 / 18 * U]),
}


@functools.partial(jax.jit, static_argnums=(0, 1))
def _tiny_grad(loss, G, logp, batch):
    # The advantages inside the same program: run eagerly, the estimators (GD2PO's, DAPO's shaping,
    # MC-GRPO's median) compile op by op for each new batch shape, seconds per test on 2 cores.
    batch = dict(batch, advantages_B=losses.batch_advantages(loss, batch, G, 4))  # with reward shaping, as the update
    return _run(loss, G, logp, batch, max_new_tokens=4)  # L_max = 4 in the hand-worked examples


def _tiny(loss, G, batch, logp=None):
    logp = np.zeros(batch["completion_mask_BxT"].shape, np.float32) - 1.0 if logp is None else logp
    batch = dict(batch)
    batch.setdefault("old_logp_BxT", logp)
    batch.setdefault("rollout_logp_BxT", batch["old_logp_BxT"])
    return _tiny_grad(loss, G, logp, batch)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TABLE))
def test_gradient_at_ratio_one_by_hand(name):
    # MC-GRPO needs an odd group: its own test below; distill's per-token advantage: test_distill.py
    assert set(TABLE) == set(PRESETS) - {"mc_grpo", "distill"}
    batch = {
        "completion_mask_BxT": TINY_MASK,
        "rewards_BxK": np.array([[1.0], [0.0]], np.float32),
        "truncated_B": np.zeros(2, np.float32),
    }
    _, grad, _, _ = _tiny(PRESETS[name](), 2, batch)
    row0, row1 = TABLE[name]
    _close(grad, [[row0, 0, 0, 0], row1 + [0]], atol=1e-6, rtol=1e-5)


def test_dapo_clip_higher_token_mean_overlong_and_dynamic_sampling_by_hand():
    # L_max = 4, overlong_buffer_frac .25 -> L_c = 1: |y| <= 3 no penalty, |y| = 4 -> -1.
    # group 0: r [1, 0], |y| [2, 4] -> shaped [1, -1]: mean 0, deviations +-1, unbiased std
    #          sqrt((1 + 1) / 1) = sqrt 2 -> A [U, -U], U = 1/sqrt 2
    # group 1: r [1, 1], |y| [4, 1] -> shaped [0, 1] -> A [-U, U]  (constant before shaping!)
    # group 2: r [0, 0], |y| [2, 3] -> shaped [0, 0] -> constant: dropped (and not counted)
    # token_mean over the 2+4+4+1 = 11 kept tokens. log-ratios (logp - old):
    #   row 0 (A=+U): rho [1.25, 1.3]: 1.25 < 1.28 unclipped (loss -1.25U, grad -1.25U/11);
    #                 1.3 > 1.28 clipped (loss -1.28U, grad 0)  [GRPO's 0.2 would clip 1.25 too]
    #   row 1 (A=-U): rho [0.7, 1, 1, 1]: 0.7 < 0.8 clipped low (loss 0.8U, grad 0); others loss U, grad U/11
    #   row 2 (A=-U): rho 1 x4: loss U, grad U/11 ; row 3 (A=+U): rho 1: loss -U, grad -U/11 ; rows 4, 5: 0
    # J = U (-1.25 - 1.28 + 0.8 + 3 + 4 - 1) / 11 = 4.27 U / 11
    lengths = np.array([2, 4, 4, 1, 2, 3])
    mask = (np.arange(4)[None, :] < lengths[:, None]).astype(np.float32)
    old = np.full((6, 4), -1.0, np.float32)
    logp = old.copy()
    logp[0, :2] += [LOG(1.25), LOG(1.3)]
    logp[1, 0] += LOG(0.7)
    logp[4:, :] += 0.5  # dropped rows: any ratio, no gradient
    batch = {
        "completion_mask_BxT": mask,
        "rewards_BxK": np.array([[1.0], [0], [1], [1], [0], [0]], np.float32),
        "old_logp_BxT": old,
        "truncated_B": np.zeros(6, np.float32),
    }
    value, grad, metrics, kept = _tiny(PRESETS["dapo"](overlong_buffer_frac=0.25), 2, batch, logp)
    _close(value, 4.27 * U / 11, atol=1e-5)
    want = np.zeros((6, 4))
    want[0, 0] = -1.25 * U / 11
    want[1, 1:] = U / 11
    want[2] = U / 11
    want[3, 0] = -U / 11
    _close(grad, want, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(kept).sum(1), [2, 4, 4, 1, 0, 0])
    _close([metrics["clipped_high"], metrics["clipped_low"]], [1 / 11, 1 / 11])


@pytest.mark.slow
def test_mc_grpo_pivot_gets_no_gradient_and_is_not_counted():
    # The plain form (mad_scale / nonzero_rescale off, so A stays readable; the paper-code default is
    # tested by hand in test_loss_parts and below).
    # G+1 = 3, r = [1, 0, 0]: median 0, A = [1, 0, 0]; pivot = row 2 (stable sort (1, 2, 0), middle).
    # Rows 0 and 1 remain: B = 2 (not 3). |y| = [2, 1, 2]. rho = 1; KL beta .1 with ref = logp - ln 2,
    # so d k3 / d logp = 1 - 1/2 = 1/2 on every live token.
    #   row 0: -A/(|y| B) + .1 * .5 /(|y| B) = -1/4 + .0125 = -.2375 per token
    #   row 1: A = 0, KL only: .1 * .5 / (1 * 2) = .025 ; row 2 (pivot): 0, KL included.
    mask = np.array([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0]], np.float32)
    logp = np.full((3, 4), -1.0, np.float32)
    batch = {
        "completion_mask_BxT": mask,
        "rewards_BxK": np.array([[1.0], [0.0], [0.0]], np.float32),
        "ref_logp_BxT": logp - LOG(2.0),
    }
    plain = PRESETS["mc_grpo"](kl_beta=0.1, mad_scale=False, nonzero_rescale=False)
    _, grad, metrics, kept = _tiny(plain, 3, batch)
    _close(grad, [[-0.2375, -0.2375, 0, 0], [0.025, 0, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(kept)[2], 0.0)
    # Default (the paper's code): MAD of |[1,0,0] - 0| = 0 -> A_0 = 1 / 1e-3 = 1000, one nonzero of 3
    # -> x 3 = 3000: row 0 gets -3000 / (2 * 2) + .0125 = -749.9875 per token; rows 1, 2 as above.
    _, grad, _, _ = _tiny(PRESETS["mc_grpo"](kl_beta=0.1), 3, batch)
    _close(grad, [[-749.9875, -749.9875, 0, 0], [0.025, 0, 0, 0], [0, 0, 0, 0]], atol=1e-3)


def test_gd2po_masked_rows_leave_the_normaliser():
    # test_loss_parts' GD2PO example (weights (1, .5), G = 3) at threshold .25: group 0 is masked.
    # Rows 3-5 remain, B' = 3, |y| = 1: grad = -A_i / 3 with A = [1.7320508, -.8660254, -.8660254]
    # (unbiased stds; worked in test_loss_parts.test_gd2po_our_reading_by_hand).
    rewards = np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]], np.float32)
    mask = np.zeros((6, 4), np.float32)
    mask[:, 0] = 1.0
    loss = PRESETS["gd2po"](reward_weights=(1.0, 0.5), conflict_threshold=0.25)
    _, grad, _, kept = _tiny(loss, 3, {"completion_mask_BxT": mask, "rewards_BxK": rewards})
    _close(np.asarray(grad)[:, 0], [0, 0, 0, -1.7320508 / 3, 0.8660254 / 3, 0.8660254 / 3], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(kept)[:, 0], [0, 0, 0, 1, 1, 1])


def test_gspo_clips_the_sequence_ratio_as_one_number():
    # eps 3e-4 / 4e-4, A = +-U (unbiased std, see TABLE). Row 0 (A = +U): log rho [.001, .001] -> s = e^.001
    # = 1.0010005 > 1.0004: clipped, grad 0 on both tokens. Row 1 (A = -U): log rho [.0002, 0] -> s = e^.0001
    # = 1.0001 in range: d/dlogp_j of (1/B)(-A s) = U s / (|y| B) = .7071068 * 1.0001 / 4 = .1767944.
    mask = np.array([[1, 1, 0, 0], [1, 1, 0, 0]], np.float32)
    old = np.full((2, 4), -1.0, np.float32)
    logp = old + np.array([[1e-3, 1e-3, 0, 0], [2e-4, 0, 0, 0]], np.float32)
    batch = {"completion_mask_BxT": mask, "rewards_BxK": np.array([[1.0], [0.0]], np.float32), "old_logp_BxT": old}
    _, grad, metrics, _ = _tiny(PRESETS["gspo"](), 2, batch, logp)
    _close(grad, [[0, 0, 0, 0], [0.1767944, 0.1767944, 0, 0]], atol=2e-6)
    _close(metrics["clipped_high"], 0.5)  # 2 of 4 live tokens


def test_tbpo_caps_a_negative_sample_whose_sequence_ratio_exploded():
    # Rewards [1, 0] -> A = [+U, -U] (unbiased std, see TABLE). Row 0: log rho [0, 0] -> s = 1, in the
    # band: gradient -A s / (|y| B) = -U/4 per token, loss -U. Row 1 (A = -U): log rho [log 4, log 4] ->
    # s = 4 > c = 3: TBPO's loss is the constant -c A = 3U (no gradient); GSPO's is -s A = 4U with
    # gradient U s/(|y| B) = U.
    mask = np.array([[1, 1, 0, 0], [1, 1, 0, 0]], np.float32)
    old = np.full((2, 4), -1.0, np.float32)
    logp = old + np.array([[0, 0, 0, 0], [LOG(4), LOG(4), 0, 0]], np.float32)
    batch = {"completion_mask_BxT": mask, "rewards_BxK": np.array([[1.0], [0.0]], np.float32), "old_logp_BxT": old}
    value, grad, metrics, _ = _tiny(PRESETS["tbpo"](), 2, batch, logp)
    _close(value, (-U + 3 * U) / 2, atol=1e-5)  # A = +-.5/(.7071068 + 1e-6): adv_eps
    _close(grad, [[-U / 4, -U / 4, 0, 0], [0, 0, 0, 0]], atol=1e-6)
    _close(metrics["clipped_dual"], 0.5)  # 2 of 4 live tokens
    value, grad, _, _ = _tiny(PRESETS["gspo"](), 2, batch, logp)
    _close(value, (-U + 4 * U) / 2, atol=1e-5)
    _close(grad, [[-U / 4, -U / 4, 0, 0], [U, U, 0, 0]], atol=1e-5)
    assert (
        "dual_clip(0.1, 0.2, c=2)"
        in make_loss(LossConfig(preset="tbpo", eps_low=0.1, eps_high=0.2, options="c=2")).parts
    )


# ============================================================================= new parts, by hand

RAGGED = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]], jnp.float32)


def test_seq_mean_token_sum_and_constant_norm_weights():
    # 3 live rows: seq_mean_token_sum w = 1/3 per live token; constant_norm(5): 1/(3*5); k=None -> L_max 8.
    _close(aggregation.seq_mean_token_sum(RAGGED, 4), RAGGED / 3)
    _close(aggregation.constant_norm(5.0)(RAGGED, 4), RAGGED / 15)
    _close(aggregation.constant_norm()(RAGGED, 8), aggregation.seq_mean_token_sum_norm(RAGGED, 8))
    assert np.all(np.asarray(aggregation.seq_mean_token_sum(jnp.zeros((2, 3)), 3)) == 0)
    with pytest.raises(ValueError, match="k="):
        aggregation.constant_norm(0.0)


def test_overlong_penalty_and_truncation_rows():
    batch = {
        "completion_mask_BxT": (np.arange(5)[None, :] < np.array([3, 4, 5])[:, None]).astype(np.float32),
        "truncated_B": np.array([0.0, 0.0, 1.0], np.float32),
    }
    # L_max 5, L_c = 1: L_max - L_c = 4 -> [0, 0, -1] ; L_c = 2: 3 -> [0, (3-4)/2 = -.5, -1]
    _close(prep.overlong_penalty(0.2)(batch, 5), [0, 0, -1])
    _close(prep.overlong_penalty(0.4)(batch, 5), [0, -0.5, -1])
    _close(prep.overlong_penalty(0.4, max_len=10)(batch, 5), [0, 0, 0])  # explicit L_max 10, L_c 4
    _close(prep.not_truncated_rows(batch), [1, 1, 0])
    with pytest.raises(ValueError, match="overlong_buffer_frac"):
        prep.overlong_penalty(0.0)


def test_kl_reward_and_shaped_advantages():
    # one token each; rollout - ref = ln 2 and 0: k1 = [ln 2, 0]; beta .5 -> bonus [-.3465736, 0];
    # rewards [1, 1] -> shaped [.6534264, 1] -> group_mean [-.1732868, .1732868].
    batch = {
        "completion_mask_BxT": np.array([[1.0, 0.0], [1.0, 0.0]], np.float32),
        "rollout_logp_BxT": np.array([[LOG(0.5), 9e3], [-1.0, -9e3]], np.float32),
        "ref_logp_BxT": np.array([[LOG(0.25), -9e3], [-1.0, 9e3]], np.float32),
        "rewards_BxK": np.ones((2, 1), np.float32),
    }
    _close(prep.kl_reward(0.5)(batch, 2), [-0.5 * LOG(2), 0.0])
    shaped = prep.shaped_estimator(adv_lib.reward_sum(), adv_lib.group_mean)
    _close(shaped(batch["rewards_BxK"], 2, prep.kl_reward(0.5)(batch, 2)), [-0.1732868, 0.1732868])
    loss = losses.PRESETS["dr_grpo"](kl_reward_beta=0.5)  # the same shaping, through the advantage step
    assert loss.needs_ref
    _close(losses.batch_advantages(loss, batch, 2, 2), [-0.1732868, 0.1732868])


def test_informative_rows_and_batch_mean():
    batch = {"advantages_B": jnp.array([0.0, 0.0, 1.0, -1.0, 0.0, 0.5])}
    _close(prep.informative_rows(batch, 2), [0, 0, 1, 1, 1, 1])
    _close(adv_lib.batch_mean(jnp.array([1.0, 0.0, 0.0, 0.0])), [0.75, -0.25, -0.25, -0.25])
    assert np.all(np.asarray(adv_lib.batch_mean(jnp.full((3,), 0.3))) == 0.0)


def test_top_entropy_keep_by_hand():
    # 5 live tokens H = [3, 1, 2 | 2, 0.5] (masked 9 ignored); frac .4 -> k = ceil(2) = 2 -> threshold
    # = 2nd largest = 2 -> keep H >= 2: 3 and BOTH 2s (ties kept); frac .2 -> k = 1 -> keep only 3.
    batch = {
        "completion_mask_BxT": np.array([[1, 1, 1], [1, 1, 0]], np.float32),
        "old_entropy_BxT": np.array([[3.0, 1.0, 2.0], [2.0, 0.5, 9.0]], np.float32),
    }
    _close(masks.top_entropy_keep(0.4)(batch)["entropy_keep_BxT"], [[1, 0, 1], [1, 0, 1]])
    _close(masks.top_entropy_keep(0.2)(batch)["entropy_keep_BxT"], [[1, 0, 0], [0, 0, 1]])
    _close(masks.top_entropy_keep(1.0)(batch)["entropy_keep_BxT"], 1.0)


def _ppo_token_loss():
    return losses.policy_token_loss(ratios.token_log_ratio, objectives.ppo_clip(10.0))  # no clipping


@functools.partial(jax.jit, static_argnums=0)
def _loss_grad(token_loss, logp, batch):
    (_, (loss, stats)), g = jax.value_and_grad(
        lambda lp: (lambda o: (jnp.sum(o[0]), o))(token_loss(lp, batch)), has_aux=True
    )(logp)
    return loss, g, stats


def test_tis_and_mis_token_and_sequence_by_hand():
    # logp = old (rho = 1), A = 1, so the inner loss is -1 per token with gradient -1.
    # old / rollout per token: row 0 [3, 1], row 1 [.5, .5].
    # TIS token, cap 2: weights [2, 1 | .5, .5] -> loss = -w, grad = -w.
    # TIS sequence, cap 2: products row 0: 3 -> 2 ; row 1: .25 (under the cap).
    # MIS token [0.6, 2.5]: drop 3 and both .5s ; MIS sequence [0.3, 2.5]: drop row 0 (3) and row 1 (.25).
    old = np.full((2, 2), -1.0, np.float32)
    batch = {
        "completion_mask_BxT": np.ones((2, 2), np.float32),
        "old_logp_BxT": old,
        "rollout_logp_BxT": old - np.array([[LOG(3), 0], [LOG(0.5), LOG(0.5)]], np.float32),
        "advantages_B": np.ones(2, np.float32),
    }
    inner = _ppo_token_loss()
    loss, g, st = _loss_grad(corrections.tis(inner, 2.0, "token"), old, batch)
    _close(loss, [[-2, -1], [-0.5, -0.5]], atol=1e-5)
    _close(g, [[-2, -1], [-0.5, -0.5]], atol=1e-5)
    _close(st["is_truncated_BxT"], [[1, 0], [0, 0]])
    _close(st["is_ratio_BxT"], [[3, 1], [0.5, 0.5]], atol=1e-5)
    loss, g, st = _loss_grad(corrections.tis(inner, 2.0, "sequence"), old, batch)
    _close(g, [[-2, -2], [-0.25, -0.25]], atol=1e-5)
    _close(st["is_ratio_BxT"], [[3, 3], [0.25, 0.25]], atol=1e-5)
    loss, g, st = _loss_grad(corrections.mis(inner, 0.6, 2.5, "token"), old, batch)
    _close(g, [[0, -1], [0, 0]])
    _close(st["mis_masked_BxT"], [[1, 0], [1, 1]])
    loss, g, st = _loss_grad(corrections.mis(inner, 0.3, 2.5, "sequence"), old, batch)
    _close(g, 0.0)
    _close(st["mis_masked_BxT"], 1.0)
    # A dropped token gets no gradient even through GSPO's sequence ratio.
    gspo_inner = losses.policy_token_loss(ratios.sequence_log_ratio, objectives.ppo_clip(10.0))
    _, g, _ = _loss_grad(
        corrections.mis(gspo_inner, 0.6, 2.5, "token"),
        old,
        dict(batch, rollout_logp_BxT=old - np.array([[0, 0], [0, LOG(0.5)]], np.float32)),
    )
    # row 1: token 1 dropped; token 0 kept: loss -s, d s / d logp_0 = s/2 = .5 -> grad -.5 ; token 1: 0
    _close(g, [[-1, -1], [-0.5, 0]], atol=1e-5)


def test_unclipped_objective():
    loss, g, _ = _loss_grad(
        losses.policy_token_loss(ratios.token_log_ratio, objectives.unclipped()),
        jnp.array([[LOG(3.0), 0.0]]),
        {
            "completion_mask_BxT": np.array([[1.0, 0.0]], np.float32),
            "old_logp_BxT": np.array([[0.0, 1e4]], np.float32),
            "advantages_B": np.array([2.0]),
        },
    )
    _close(loss, [[-6.0, 0.0]], atol=1e-5)  # -rho A = -3 * 2 ; masked 0
    _close(g, [[-6.0, 0.0]], atol=1e-5)


# ============================================================================= config plumbing


def test_loss_config_defaults_are_the_papers_and_fields_are_checked():
    assert "ppo_clip(0.2, 0.28)" in make_loss(LossConfig(preset="dapo")).parts
    assert "ppo_clip(0.0003, 0.0004)" in make_loss(LossConfig(preset="gspo")).parts
    assert "ppo_clip(0.1, 0.3)" in make_loss(LossConfig(preset="gspo", eps_low=0.1, eps_high=0.3)).parts
    with pytest.raises(ConfigError, match=r"loss\.eps_high: got 0\.3, but preset 'sapo' has no eps_high"):
        make_loss(LossConfig(preset="sapo", eps_high=0.3))
    with pytest.raises(ConfigError, match=r"loss\.adv_eps.*'dr_grpo'"):
        make_loss(LossConfig(preset="dr_grpo", adv_eps=1e-3))


def test_loss_options():
    assert "m2po_mask(tau=0.02, trust_region)" in make_loss(LossConfig(preset="m2po", options="tau=0.02")).parts
    assert "m2po_mask(tau=0.04, all)" in make_loss(LossConfig(preset="m2po", options="token_set=all")).parts
    parts = make_loss(LossConfig(preset="grpo", options="tis_cap=2, is_level=sequence, entropy_coef=1e-3")).parts
    assert "tis(cap=2, sequence)" in parts and "entropy_bonus(0.001)" in parts
    cfg = apply_overrides(Config(), ["loss.preset=mu_grpo", "loss.options=delta=0.3,mask_truncated=true"])
    assert "drop rows: mask_truncated" in make_loss(cfg.loss).parts
    for options, needle in [
        ("tua=0.1", r"loss\.options: preset 'm2po' has no parameter 'tua'; allowed: tau, "),
        ("eps_low=0.1", r"loss\.options: 'eps_low' is a LossConfig field"),
        ("tis_cap=-1", r"loss \(preset 'm2po'\): tis_cap: got -1"),
        ("is_level=row", r"is_level: got 'row'"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            make_loss(LossConfig(preset="m2po", options=options))
    with pytest.raises(ConfigError, match=r"loss\.options: got 'tau'.*name=value"):
        apply_overrides(Config(), ["loss.options=tau"]).validate()
    with pytest.raises(ConfigError, match="kl_reward_beta.*combines the rewards first"):
        make_loss(LossConfig(preset="gdpo", options="kl_reward_beta=0.1"))
    assert preset_parameters("sapo")[:2] == ("tau_pos", "tau_neg")


def test_group_size_rules():
    losses.check_rollout("mc_grpo", 9)
    losses.check_rollout("sao", 1)
    with pytest.raises(ConfigError, match=r"rollout\.group_size: got 8, expected an odd G\+1 >= 3.*'mc_grpo'"):
        losses.check_rollout("mc_grpo", 8)
    with pytest.raises(ConfigError, match=r"rollout\.group_size: got 1, expected G >= 2 for loss\.preset='grpo'"):
        losses.check_rollout("grpo", 1)


# ============================================================================= update-step wiring

V = 5


def _toy_logp(params, batch):
    """A row-independent toy policy: one logits vector; logp of each token, its entropy everywhere."""
    logp_V = jax.nn.log_softmax(params["w"])
    logp_BxT = logp_V[batch["tokens_BxT"]]
    entropy = -jnp.sum(jnp.exp(logp_V) * logp_V)
    return logp_BxT, jnp.full(logp_BxT.shape, entropy)


def _toy_batch(B, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 5, B)
    mask = (np.arange(4)[None, :] < lengths[:, None]).astype(np.float32)
    tokens = rng.integers(0, V, (B, 4)).astype(np.int32)
    return {
        "tokens_BxT": tokens,
        "completion_mask_BxT": mask,
        "rewards_BxK": rng.integers(0, 3, (B, 1)).astype(np.float32),
        "rollout_logp_BxT": np.where(mask > 0, -1.5 + 0.4 * rng.standard_normal((B, 4)), 0).astype(np.float32),
    }


def _update(loss, G, batch, microbatches, ppo_epochs, lr=0.5):
    opt = optax.sgd(lr)
    step = steps_lib.make_update_step(
        _toy_logp,
        loss,
        opt,
        ppo_epochs=ppo_epochs,
        microbatches=microbatches,
        max_new_tokens=4,
        use_ref=True,
        group_size=G,
    )
    params = {"w": jnp.asarray(np.linspace(-1, 1, V), jnp.float32)}
    state = init_state(params, opt, jax.random.key(0), ref_params={"w": params["w"] * 0.5})
    return jax.jit(step)(state, batch), params


@pytest.mark.slow
def test_update_step_runs_prepare_and_reports_exact_metrics():
    # MC-GRPO, G+1 = 3, two PPO epochs (ratios != 1 in epoch 2), microbatches 1 vs 3 (rows of a group
    # split across microbatches): the pivot is dropped on the WHOLE batch before splitting, so the
    # update and every metric, ratio min / max included, agree. The plain form: the paper-code default
    # divides these 0/1/2 rewards by MAD + 1e-3 (often 1e-3), |A| ~ 1000, which at SGD lr .5 would
    # drive every ratio to 0 in epoch 2.
    loss = PRESETS["mc_grpo"](kl_beta=0.1, mad_scale=False, nonzero_rescale=False)
    batch = _toy_batch(6)
    (s1, m1), params = _update(loss, 3, batch, 1, 2)
    (s3, m3), _ = _update(loss, 3, batch, 3, 2)
    _close(s1.params["w"], s3.params["w"], atol=1e-6)
    assert set(m1) == set(m3)
    for k in m1:
        _close(m1[k], m3[k], atol=1e-6, rtol=1e-5)
    _close(m1["rows_dropped"], 2 / 6)  # one pivot in each of the 2 groups
    assert float(m1["ratio_max"]) > 1.0 > float(m1["ratio_min"]) > 0
    # epoch 1 is a plain gradient step on the prepared batch: check it against _run by hand.
    (s_one, _), _ = _update(loss, 3, batch, 1, 1)

    @jax.jit  # eagerly, the median estimator and autodiff through prepare compile op by op (seconds)
    def hand_grad_w(params):
        hand = dict(
            batch,
            advantages_B=loss.advantages(batch["rewards_BxK"], 3),
            old_logp_BxT=_toy_logp(params, batch)[0],
            ref_logp_BxT=_toy_logp({"w": params["w"] * 0.5}, batch)[0],
        )
        return jax.grad(lambda p: _run(loss, 3, _toy_logp(p, hand)[0], hand)[0])(params)["w"]

    grad_w = hand_grad_w(params)
    _close(s_one.params["w"], params["w"] - 0.5 * grad_w, atol=1e-6)


def test_update_step_records_old_logp_for_m2po_and_reports_the_mismatch():
    # One PPO epoch, but M2PO's prepare needs the whole batch's old log-probs: recorded up front.
    loss = PRESETS["m2po"](tau=0.01)
    batch = _toy_batch(8, seed=1)
    (_, m), params = _update(loss, 2, batch, 2, 1)
    logp, _ = _toy_logp(params, batch)
    live = batch["completion_mask_BxT"] > 0
    gap = np.abs(np.asarray(batch["rollout_logp_BxT"]) - np.asarray(logp))[live]
    _close(m["mismatch_abs_logp"], gap.mean(), rtol=1e-5)
    q = np.log(np.exp(np.asarray(logp)) / np.exp(batch["rollout_logp_BxT"]))[live] ** 2
    assert q.mean() > 0.01 and 0 < float(m["m2po_masked"]) < 1  # the batch does need masking
    # One epoch: current == recorded old, but M2PO's ratio is pi_theta / pi_rollout (its behaviour
    # policy is the sampler), so ratio_min / max are those of exp(logp - rollout) over live tokens.
    r = np.exp(np.asarray(logp) - batch["rollout_logp_BxT"])[live]
    _close(m["ratio_min"], r.min(), rtol=1e-5)
    _close(m["ratio_max"], r.max(), rtol=1e-5)


@pytest.mark.slow
def test_adv_eps_and_std_ddof_exactly_on_the_presets_that_divide_by_a_std():
    # Every preset that divides by a group or batch std takes adv_eps AND std_ddof (loss.adv_eps,
    # loss.options "std_ddof=0"); the others (centring only: Dr.GRPO's mean, RLOO's leave-one-out,
    # SAO's batch mean; MC-GRPO divides by a MAD, with its own mad_eps) refuse both with a ConfigError.
    no_std = {"dr_grpo", "rloo", "sao", "mc_grpo"}
    rewards = np.array([[1.0], [0], [0], [0], [1], [1], [0], [1], [0.5], [0.25], [0], [1]], np.float32)  # G = 3
    for name in sorted(PRESETS):
        params = preset_parameters(name)
        cfg = functools.partial(LossConfig, preset=name, reward_weights=(1.0,))
        if name in no_std:
            assert "adv_eps" not in params and "std_ddof" not in params, name
            with pytest.raises(ConfigError, match=rf"loss\.adv_eps: got 0\.001, but preset '{name}' has no adv_eps"):
                make_loss(cfg(adv_eps=1e-3))
            with pytest.raises(ConfigError, match=rf"preset '{name}' has no parameter 'std_ddof'"):
                make_loss(cfg(options="std_ddof=0"))
            continue
        assert "adv_eps" in params and "std_ddof" in params, name
        unbiased = np.asarray(make_loss(cfg()).advantages(rewards, 3))
        population = np.asarray(make_loss(cfg(options="std_ddof=0")).advantages(rewards, 3))
        assert np.max(np.abs(unbiased - population)) > 0.05, name  # the option reaches the std
        # it divides by a spread: rewards x 10 give the same advantages
        _close(make_loss(cfg()).advantages(10 * rewards, 3), unbiased, atol=1e-4)
        # adv_eps reaches every std it divides by: a huge eps shrinks every advantage
        assert np.max(np.abs(np.asarray(make_loss(cfg(adv_eps=1e3)).advantages(rewards, 3)))) < 1e-2, name
