"""M2PO (Zheng, Zhao, Chen 2025, "Prosperity before Collapse", arXiv:2510.01161): the batch-level
second-moment mask (m2po.py), its token sets (Algorithm 1's trust-region tokens, or every token), its
behaviour policy (the rollout policy) and the preset through `prepare`. Hand-worked numbers, the
arithmetic in the comments.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_loss_parts import _close, _value_grad
from test_preset_numbers import U, _tiny

from jaxrl.losses import m2po, masks, ratios
from jaxrl.losses import objectives as obj
from jaxrl.losses.compose import policy_token_loss
from jaxrl.losses.objectives import ppo_clip
from jaxrl.losses.presets import PRESETS

LOG = math.log


_keep_mask = jax.jit(m2po.m2po_keep_mask)  # tau traced: one compile per shape


def test_m2po_keep_mask_by_hand():
    # live log rho [0.1, -0.2, 0.5 | 0.3, 0.0] (7.0 is masked): q = [.01, .04, .25, .09, 0]
    # ascending [0, .01, .04, .09, .25], prefix means [0, .005, .0167, .035, .078]
    #   tau .04: largest prefix with mean <= .04 is 4 -> drop q >= .25: the 0.5 token
    #   tau .02: prefix 3 -> drop q >= .09: the 0.5 and 0.3 tokens
    lr = jnp.array([[0.1, -0.2, 0.5], [0.3, 0.0, 7.0]])
    mask = jnp.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    np.testing.assert_array_equal(_keep_mask(lr, mask, 0.04), [[1, 1, 0], [1, 1, 1]])
    np.testing.assert_array_equal(_keep_mask(lr, mask, 0.02), [[1, 1, 0], [0, 1, 1]])
    # Ties: q = [.01, .09, .09], tau .06: prefix means .01, .05, .0633 -> prefix 2, threshold .09
    # -> BOTH tied tokens go (kept mean .01), whichever order they come in.
    tie = jnp.array([[0.1, 0.3, -0.3]])
    np.testing.assert_array_equal(_keep_mask(tie, jnp.ones((1, 3)), 0.06), [[1, 0, 0]])
    np.testing.assert_array_equal(_keep_mask(tie[:, ::-1], jnp.ones((1, 3)), 0.06), [[0, 0, 1]])
    # Nothing over tau: keep all ; every q > tau: drop every live token ; all masked: keep all.
    np.testing.assert_array_equal(_keep_mask(lr, mask, 1.0), 1.0)
    np.testing.assert_array_equal(_keep_mask(lr + 1.0, mask, 0.001), 1.0 - mask)
    np.testing.assert_array_equal(_keep_mask(lr, jnp.zeros_like(mask), 0.0), 1.0)


def test_m2po_prepare_and_exact_under_microbatching():
    # 4 rows x 3 tokens: the stalest tokens sit in rows 0 and 3, so a per-microbatch mask (rows 0-1
    # vs rows 2-3) would differ from the batch mask; the prepared full-batch mask does not.
    rng = np.random.default_rng(0)
    mask = np.ones((4, 3), np.float32)
    mask[2, 2] = 0.0
    logp = (-1.0 - rng.random((4, 3))).astype(np.float32)
    # current vs old log-ratio = -offset: all inside PPO's [0.8, 1.2], so only the mask can zero a gradient
    old = logp + np.array([[0.05, 0.05, 0.1], [0.02, 0.0, -0.1], [0.1, 0.05, 50.0], [0.15, 0.0, 0.03]], np.float32)
    batch = {
        "completion_mask_BxT": mask,
        "old_logp_BxT": old,
        "advantages_B": np.array([1.0, -1.0, 0.5, -0.5], np.float32),
    }
    # Staleness log(old / rollout) lives in the data: the rollout log-probs are shifted by known amounts
    # (the masked (2,2) entry holds garbage).
    stale = np.array([[0.05, 0.6, 0.1], [0.02, 0.0, 0.1], [0.1, 0.05, 0.0], [0.45, 0.0, 0.03]], np.float32)
    batch["rollout_logp_BxT"] = old - stale
    # token_set "all" (every live token in the budget; the trust-region default is tested below):
    # q = stale^2 over 11 live tokens: [.0025,.36,.01,.0004,0,.01,.01,.0025,.2025,0,.0009], sum .5988
    # ascending: 0,0,.0004,.0009,.0025,.0025,.01,.01,.01,.2025,.36 ; prefix of 9: .0363/9 = .0040 <= .04,
    # prefix of 10: .2388/10 = .0239 <= .04, all 11: .5988/11 = .0544 > .04 -> drop q >= .36: token (0,1).
    prepared = jax.jit(m2po.m2po_prepare(0.04, "all"))(batch)
    want_keep = np.ones((4, 3))
    want_keep[0, 1] = 0.0
    np.testing.assert_array_equal(prepared["m2po_keep_BxT"], want_keep)
    # tau .015: prefix 10 mean .0239 > .015 -> drop q >= .2025 too: token (3,0).
    np.testing.assert_array_equal(jax.jit(m2po.m2po_prepare(0.015, "all"))(batch)["m2po_keep_BxT"][3], [0, 1, 1])

    token_loss = masks.apply_keep_mask(policy_token_loss(ratios.token_log_ratio, ppo_clip(0.2)))
    weights = mask / mask.sum()

    @jax.jit
    def value_grad(lp, b):
        return jax.value_and_grad(lambda x: jnp.sum(b["w"] * token_loss(x, b)[0]))(lp)

    full = dict(prepared, w=weights)
    v_full, g_full = value_grad(jnp.asarray(logp), full)
    halves = [
        value_grad(jnp.asarray(logp[i : i + 2]), {k: np.asarray(v)[i : i + 2] for k, v in full.items()}) for i in (0, 2)
    ]
    _close(v_full, halves[0][0] + halves[1][0], atol=1e-6)
    _close(g_full, np.concatenate([halves[0][1], halves[1][1]]), atol=1e-6)
    # The dropped token: gradient exactly 0 (unmasked it would be -A rho w = -e^-0.05 / 11); the
    # others keep -A rho w, e.g. token (0,0): -1 * e^-0.05 / 11 = -0.0864821.
    assert float(g_full[0, 1]) == 0.0
    _close(g_full[0, 0], -math.exp(-0.05) / 11, atol=1e-6)
    _, stats = jax.jit(token_loss)(jnp.asarray(logp), prepared)
    np.testing.assert_array_equal(stats["m2po_masked_BxT"], 1.0 - want_keep)
    # A per-microbatch mask of the SAME data differs: rows 2-3 alone have q = [.01,.0025,.2025,0,.0009],
    # mean .2159/5 = .0432 > .04, so they would drop token (3,0). Hence: prepare on the whole batch.
    half = {k: np.asarray(v)[2:] for k, v in batch.items()}
    np.testing.assert_array_equal(jax.jit(m2po.m2po_prepare(0.04, "all"))(half)["m2po_keep_BxT"][1], [0, 1, 1])


def _m2po_batch():
    stale = np.array([[0.05, 0.6, 0.1], [0.02, 0.0, 0.1], [0.1, 0.05, 0.0], [0.45, 0.0, 0.03]], np.float32)
    mask = np.ones((4, 3), np.float32)
    mask[2, 2] = 0.0
    old = np.full((4, 3), -1.0, np.float32)
    return {
        "completion_mask_BxT": mask,
        "old_logp_BxT": old,
        "rollout_logp_BxT": old - stale,
        "advantages_B": np.array([1.0, -1.0, 0.5, -0.5], np.float32),
    }


def test_m2po_trust_region_token_set_by_hand():
    # Algorithm 1 budgets only the trust-region tokens: A > 0 with r > 1, A < 0 with r < 1, where
    # log r = old - rollout = the stale offsets above (all >= 0, so r >= 1):
    #   rows 0, 2 (A > 0): tokens with stale > 0 are in: (0,0) .05, (0,1) .6, (0,2) .1, (2,0) .1, (2,1) .05
    #   rows 1, 3 (A < 0, r >= 1): outside, never masked, not counted, however stale ((3,0): .45).
    # In-set q = [.0025, .36, .01, .01, .0025]; ascending .0025, .0025, .01, .01, .36;
    # prefix means .0025, .0025, .005, .00625, .077.
    #   tau .04: prefix 4 (.00625) -> drop q >= .36: (0,1) only.
    #   tau .004: prefix 2 (.0025; prefix 3 is .005 > .004) -> drop q >= .01: (0,1), (0,2), (2,0).
    batch = _m2po_batch()
    keep = jax.jit(m2po.m2po_prepare(0.04))(batch)["m2po_keep_BxT"]
    np.testing.assert_array_equal(keep, [[1, 0, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]])
    keep = jax.jit(m2po.m2po_prepare(0.004))(batch)["m2po_keep_BxT"]
    np.testing.assert_array_equal(keep, [[1, 0, 0], [1, 1, 1], [0, 1, 1], [1, 1, 1]])
    # token_set "all", tau .004: 11 live q ascending 0,0,.0004,.0009,.0025,.0025,.01,.01,.01,.2025,.36;
    # prefix 8: .0263/8 = .0033 <= .004, prefix 9: .0363/9 = .0040333 > .004 -> drop q >= .01:
    # (0,1), (0,2), (1,2), (2,0), (3,0).
    keep = jax.jit(m2po.m2po_prepare(0.004, "all"))(batch)["m2po_keep_BxT"]
    np.testing.assert_array_equal(keep, [[1, 0, 0], [1, 1, 0], [0, 1, 1], [0, 1, 1]])
    with pytest.raises(ValueError, match="token_set"):
        m2po.m2po_prepare(0.04, "trust")


def test_m2po_behaviour_policy_is_the_rollout_policy():
    # logp = old, rollout = old - ln 2 on every token: pi_theta / pi_rollout = 2, pi_theta / pi_old = 1.
    # Unclipped loss -r A with A = 1: through rollout_behaviour r = 2 -> loss -2, gradient -2 per token;
    # without rollout log-probs in the batch the behaviour policy is the old one: r = 1 -> -1, -1.
    batch = {k: v[:1, :2] for k, v in _m2po_batch().items() if k != "advantages_B"}
    batch["rollout_logp_BxT"] = batch["old_logp_BxT"] - LOG(2.0)
    batch["advantages_B"] = np.ones(1, np.float32)
    tl = m2po.rollout_behaviour(policy_token_loss(ratios.token_log_ratio, obj.unclipped()))
    loss, g, _ = _value_grad(lambda lp, _a, _m: tl(lp, batch), jnp.asarray(batch["old_logp_BxT"]), None, None)
    _close(loss, [[-2.0, -2.0]])
    _close(g, [[-2.0, -2.0]])
    no_rollout = {k: v for k, v in batch.items() if k != "rollout_logp_BxT"}
    loss, g, _ = _value_grad(lambda lp, _a, _m: tl(lp, no_rollout), jnp.asarray(batch["old_logp_BxT"]), None, None)
    _close(loss, [[-1.0, -1.0]])
    _close(g, [[-1.0, -1.0]])


def test_apply_keep_mask_blocks_gradient_through_sequence_ratio():
    # GSPO mixes every token into the row's ratio; a dropped token must still get no gradient.
    # Row log rho [0.1, -0.1, 0.3], A = 1, ppo eps 1 (no clipping), keep [1, 1, 0]:
    #   s = e^{0.1} = 1.1051709; loss on kept tokens -s each, on the dropped one 0.
    #   grad: d(-2 s)/d logp_j = -2 s / 3 = -0.7368 for j = 0, 1 ; 0 for j = 2.
    logp = jnp.array([[0.1, -0.1, 0.3]])
    batch = {
        "completion_mask_BxT": jnp.ones((1, 3)),
        "old_logp_BxT": jnp.zeros((1, 3)),
        "advantages_B": jnp.array([1.0]),
        "keep": jnp.array([[1.0, 1.0, 0.0]]),
    }
    tl = masks.apply_keep_mask(policy_token_loss(ratios.sequence_log_ratio, ppo_clip(1.0)), key="keep")
    loss, g, _ = _value_grad(lambda lp, _a, _m: tl(lp, batch), logp, None, None)
    _close(loss, [[-1.1051709, -1.1051709, 0.0]])
    _close(g, [[-2 * 1.1051709 / 3, -2 * 1.1051709 / 3, 0.0]])


def test_m2po_mask_through_prepare_by_hand():
    # Staleness log r = log(old / rollout) = 0.9 on token (0, 1), 0.1 on the 5 others; A = [U, -U].
    # Trust-region tokens (default): row 0 (A > 0, r > 1) all 3; row 1 (A < 0 but r > 1) none.
    # In-set q = [.01, .81, .01], mean .83/3 = .277 > .04 -> drop the .81 token; kept mean .01 <= .04.
    # (token_set "all": q = .81 and .01 x 5, mean .86/6 = .143 > .04 -> the same token.)
    # The ratio's behaviour policy is the rollout policy: at logp = old, r = e^.1 on every kept token.
    # Unclipped, token mean over all 6 live tokens (dropped ones keep their count):
    # grad -r A / 6 = -+e^.1 U / 6 on kept tokens, 0 on the dropped one.
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 0]], np.float32)
    old = np.full((2, 4), -1.0, np.float32)
    stale = np.full((2, 4), 0.1, np.float32)
    stale[0, 1] = 0.9
    batch = {
        "completion_mask_BxT": mask,
        "rewards_BxK": np.array([[1.0], [0.0]], np.float32),
        "old_logp_BxT": old,
        "rollout_logp_BxT": old - stale,
    }
    g = math.exp(0.1) * U / 6
    for token_set in ("trust_region", "all"):
        loss = PRESETS["m2po"](token_set=token_set)
        assert loss.needs_old_logp
        _, grad, metrics, _ = _tiny(loss, 2, batch)
        _close(grad, [[-g, 0, -g, 0], [g, g, g, 0]])
        _close(metrics["m2po_masked"], 1 / 6)
    # Row 1 (A < 0) made as stale as the dropped token: outside the trust region it is never masked
    # (in-set q unchanged), while "all" (q = .81, .81, .01 x 4: mean .2767 > .04) drops both .81s.
    stale[1, 0] = 0.9
    batch["rollout_logp_BxT"] = old - stale
    g1 = math.exp(0.9) * U / 6
    _, grad, metrics, _ = _tiny(PRESETS["m2po"](), 2, batch)
    _close(grad, [[-g, 0, -g, 0], [g1, g, g, 0]], atol=1e-5)
    _close(metrics["m2po_masked"], 1 / 6)
    _, grad, metrics, _ = _tiny(PRESETS["m2po"](token_set="all"), 2, batch)
    _close(grad, [[-g, 0, -g, 0], [0, g, g, 0]], atol=1e-5)
    _close(metrics["m2po_masked"], 2 / 6)
