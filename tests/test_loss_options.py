"""The options every preset takes, as parts (`losses/options.py`), the shared labelled blocks and
`LossPart` (`losses/parts.py`), batch token masks (`losses/masks.py`) and how `compose` places parts.

Hand-sized batches, eager (no compile): each test checks one part's stage, value or order.
"""

import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.losses import aggregation, masks, objectives, options, parts, ratios
from jaxrl.losses import m2po as m2po_lib
from jaxrl.losses.compose import compose
from jaxrl.losses.options import option_parts

MASK = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
LOGP = jnp.array([[-1.0, -0.5, -9.0], [-2.0, -0.2, -0.7]])


def _close(a, b, atol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=1e-6)


def _ones_loss(logp_BxT, batch):
    """A token loss of 1 on live tokens whose gradient is d/dlogp = 1."""
    live = batch["completion_mask_BxT"] > 0
    return jnp.where(live, 1.0 + logp_BxT - jax.lax.stop_gradient(logp_BxT), 0.0), {}


def _grpo(**kw):
    return compose(
        "t",
        **parts.grpo_advantages(None, 1e-6, 1),
        ratio=ratios.token_log_ratio,
        objective=parts.ppo_clip(0.2, None),
        weights=aggregation.token_mean,
        **kw,
    )


def test_every_option_is_off_by_default():
    assert option_parts() == ()
    off = dict(entropy_coef=0.0, kl_reward_beta=0.0, overlong_buffer_frac=0.0, mask_truncated=False)
    assert option_parts(kl_beta=0.0, top_entropy_frac=1.0, tis_cap=0.0, mis_high=0.0, **off) == ()
    assert set(inspect.signature(option_parts).parameters) == {"kl_beta", *options.EXTRAS}


@pytest.mark.parametrize(
    "kwargs, field, needs_ref, needs_old_logp",
    [
        (dict(kl_beta=0.1), "regularizers", True, False),
        (dict(entropy_coef=0.01), "regularizers", False, False),
        (dict(kl_reward_beta=0.1), "shapers", True, False),
        (dict(overlong_buffer_frac=0.2), "shapers", False, False),
        (dict(mask_truncated=True), "rows", False, False),
        (dict(top_entropy_frac=0.5), "prepare", False, True),
        (dict(tis_cap=2.0), "corrections", False, False),
        (dict(mis_high=2.0), "corrections", False, False),
    ],
)
def test_each_option_is_one_part_in_its_stage(kwargs, field, needs_ref, needs_old_logp):
    (part,) = option_parts(**kwargs)
    filled = {f for f in ("rows", "prepare", "shapers", "corrections", "regularizers", "masks") if getattr(part, f)}
    assert filled == ({field, "masks"} if field == "prepare" else {field})
    assert len(getattr(part, field)) == 1
    assert (part.needs_ref, part.needs_old_logp) == (needs_ref, needs_old_logp)


def test_loss_flags_come_from_the_parts():
    assert not _grpo().needs_ref and not _grpo().needs_old_logp
    assert _grpo(options=option_parts(kl_beta=0.1)).needs_ref
    assert _grpo(options=option_parts(kl_reward_beta=0.1)).needs_ref
    assert _grpo(parts=(parts.LossPart(needs_ref=True),)).needs_ref
    assert _grpo(options=option_parts(top_entropy_frac=0.5)).needs_old_logp
    assert _grpo(parts=(m2po_lib.m2po_part(),)).needs_old_logp


def test_composition_order_with_every_option():
    opts = option_parts(
        kl_beta=0.1,
        kl_estimator="k2",
        entropy_coef=0.01,
        kl_reward_beta=0.2,
        overlong_buffer_frac=0.5,
        mask_truncated=True,
        top_entropy_frac=0.5,
        tis_cap=2.0,
        mis_low=0.5,
        mis_high=1.5,
        is_level="sequence",
    )
    loss = _grpo(parts=(parts.row_filter(parts.named("mine", lambda b, g: 1.0)),), options=opts)
    assert loss.parts == (
        "reward_sum -> group_mean_std(eps=1e-06, ddof=1)",
        "reward += overlong_penalty(L_c=0.5*L_max)",
        "reward += kl_reward(beta=0.2, kl_k1)",
        "drop rows: mask_truncated",  # the options' row filters run before the preset's
        "drop rows: mine",
        "top_entropy_keep(0.5)",
        "token_log_ratio",
        "ppo_clip(0.2, 0.2)",
        "mis([0.5, 1.5], sequence)",
        "tis(cap=2.0, sequence)",
        "kl_penalty(0.1, kl_k2)",
        "entropy_bonus(0.01)",
        "token_mean",
    )
    assert len(loss.reward_shaping) == 2


def test_kl_penalty_part_value_and_estimator():
    ref = LOGP + jnp.array([[0.3, -0.2, 5.0], [0.0, 0.1, -0.4]])
    batch = {"completion_mask_BxT": MASK, "ref_logp_BxT": ref}
    for name, kl in (("k1", LOGP - ref), ("k2", 0.5 * (LOGP - ref) ** 2)):
        (part,) = option_parts(kl_beta=0.5, kl_estimator=name)
        extra, stats = part.regularizers[0](LOGP, batch)
        _close(extra, 0.5 * kl * MASK)
        _close(stats["kl_BxT"], kl * MASK)


def test_entropy_part_subtracts_coef_times_entropy():
    h = jnp.array([[0.5, 1.0, 7.0], [2.0, 0.0, 1.5]])
    (part,) = option_parts(entropy_coef=0.1)
    extra, _ = part.regularizers[0](LOGP, {"completion_mask_BxT": MASK, "entropy_BxT": h})
    _close(extra, -0.1 * h * MASK)


def test_truncation_part_keeps_untruncated_rows():
    (part,) = option_parts(mask_truncated=True)
    _close(part.rows[0]({"truncated_B": jnp.array([0.0, 1.0])}, 1), [1.0, 0.0])


def test_tis_part_weights_the_policy_term_by_the_capped_ratio():
    old = LOGP + jnp.array([[0.5, -0.3, 0.0], [1.0, 0.0, -2.0]])  # old - rollout
    batch = {"completion_mask_BxT": MASK, "old_logp_BxT": old, "rollout_logp_BxT": LOGP}
    (part,) = option_parts(tis_cap=1.5)
    loss, stats = part.corrections[0](_ones_loss)(LOGP, batch)
    w = np.minimum(np.exp([[0.5, -0.3, 0.0], [1.0, 0.0, -2.0]]), 1.5) * np.asarray(MASK)
    _close(loss, w)
    _close(stats["is_truncated_BxT"], [[1, 0, 0], [1, 0, 0]])  # log ratio > log 1.5
    (seq,) = option_parts(tis_cap=1.5, is_level="sequence")
    loss, _ = seq.corrections[0](_ones_loss)(LOGP, batch)
    _close(loss, [[math.exp(0.2), math.exp(0.2), 0.0], [math.exp(-1.0)] * 3])  # row sums 0.2, -1


def test_mis_part_drops_tokens_outside_the_band_without_gradient():
    old = LOGP + jnp.array([[0.5, -0.3, 0.0], [1.0, 0.0, -2.0]])
    batch = {"completion_mask_BxT": MASK, "old_logp_BxT": old, "rollout_logp_BxT": LOGP}
    (part,) = option_parts(mis_low=0.7, mis_high=1.5)
    wrapped = part.corrections[0](_ones_loss)
    keep = [[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]  # e^0.5 > 1.5, e^-0.3 in, e^1 out, 1 in, e^-2 out
    _close(wrapped(LOGP, batch)[0], keep)
    _close(jax.grad(lambda lp: wrapped(lp, batch)[0].sum())(LOGP), keep)


def test_top_entropy_part_masks_low_entropy_tokens_of_the_whole_loss():
    h = jnp.array([[0.5, 1.0, 9.0], [2.0, 0.1, 1.5]])
    (part,) = option_parts(top_entropy_frac=0.5)
    batch = part.prepare[0]({"completion_mask_BxT": MASK, "old_entropy_BxT": h}, 2, 3)
    _close(batch["entropy_keep_BxT"], [[0, 1, 1], [1, 0, 1]])  # top ceil(0.5 * 5) = 3 live of 5
    loss, stats = part.masks[0](_ones_loss)(LOGP, batch)
    _close(loss, [[0, 1, 0], [1, 0, 1]])
    _close(stats["entropy_masked_BxT"], [[1, 0, 0], [0, 1, 0]])


def test_masks_wrap_the_regularisers_too():
    """A keep mask drops a token's KL term as well (masks act after the regularisers)."""
    keep = jnp.array([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    mask_part = masks.token_mask(lambda b, g, t: dict(b, k_BxT=keep), "k_BxT", "k_masked_BxT")
    loss = _grpo(parts=(mask_part,), options=option_parts(kl_beta=1.0, kl_estimator="k1"))
    batch = {
        "completion_mask_BxT": MASK,
        "old_logp_BxT": LOGP,
        "ref_logp_BxT": LOGP - 1.0,
        "advantages_B": jnp.zeros(2),
        "k_BxT": keep,
    }
    value, stats = loss.token_loss(LOGP, batch)
    _close(value, keep * MASK)  # A = 0: only KL (k1 = 1) is left, on kept live tokens
    _close(stats["k_masked_BxT"], [[0, 1, 0], [0, 0, 1]])


def test_bad_options_name_the_field():
    for kwargs, field in (
        (dict(mis_low=0.5), "mis_low"),
        (dict(top_entropy_frac=0.0), "top_entropy_frac"),
        (dict(top_entropy_frac=1.5), "top_entropy_frac"),
        (dict(is_level="row"), "is_level"),
        (dict(kl_beta=0.1, kl_estimator="k9"), "kl_estimator"),
        (dict(kl_reward_beta=0.1, kl_reward_estimator="k9"), "kl_reward_estimator"),
        (dict(kl_estimator="k9"), "kl_estimator"),  # named even with its beta 0 (off)
        (dict(kl_reward_estimator="k9"), "kl_reward_estimator"),
        (dict(tis_cap=-1.0), "tis_cap"),
        (dict(overlong_buffer_frac=1.5), "overlong_buffer_frac"),
        (dict(kl_reward_beta=-1.0), "kl_reward_beta"),
    ):
        with pytest.raises(ValueError, match=field):
            option_parts(**kwargs)
    with pytest.raises(TypeError, match="option_parts"):
        option_parts(foo=1)


def test_compose_refuses_an_old_flag_and_names_option_parts():
    with pytest.raises(TypeError, match=r"'tis_cap'.*option_parts\(\.\.\.\)"):
        _grpo(tis_cap=2.0)
    with pytest.raises(TypeError, match=r"'kl_beta'.*option_parts"):
        _grpo(kl_beta=0.1)
    with pytest.raises(TypeError, match="'bogus'") as e:
        _grpo(bogus=1)
    assert "option_parts" not in str(e.value)


def test_shared_blocks_are_labelled_and_equal_to_their_sources():
    assert parts.label(parts.reward_sum(None)) == "reward_sum"
    assert parts.label(parts.reward_sum([1.0, 0.5])) == "reward_sum(1.0, 0.5)"
    r = jnp.array([[1.0, 2.0], [0.0, 4.0]])
    _close(parts.reward_sum([1.0, 0.5])(r), [2.0, 2.0])
    assert parts.label(parts.group_mean_std(1e-6, 0)) == "group_mean_std(eps=1e-06, ddof=0)"
    _close(parts.group_mean_std(1e-9, 0)(jnp.array([1.0, 0.0, 3.0, 1.0]), 2), [1, -1, 1, -1])
    assert parts.label(parts.ppo_clip(0.2, None)) == "ppo_clip(0.2, 0.2)"
    assert parts.label(parts.ppo_clip(0.2, 0.28)) == "ppo_clip(0.2, 0.28)"
    lr = jnp.log(jnp.array([[1.5, 0.5]]))
    adv, m = jnp.ones((1, 2)), jnp.ones((1, 2))
    _close(parts.ppo_clip(0.2, None)(lr, adv, m)[0], objectives.ppo_clip(0.2, 0.2)(lr, adv, m)[0])
    _close(parts.ppo_clip(0.2, None)(lr, adv, m)[0], [[-1.2, -0.5]])
    assert set(parts.grpo_advantages(None, 1e-6, 1)) == {"reward_combine", "normaliser"}


def test_m2po_part_masks_then_sets_the_behaviour_policy():
    part = m2po_lib.m2po_part(0.04, "all")
    assert part.needs_old_logp and len(part.prepare) == 1 and len(part.masks) == 2
    loss = _grpo(parts=(part,))
    assert loss.parts[-1] == "behaviour = rollout policy (ratio pi_theta / pi_rollout)"
    assert loss.parts[1] == "m2po_mask(tau=0.04, all)"
    rollout = LOGP - 0.5
    batch = {
        "completion_mask_BxT": MASK,
        "old_logp_BxT": LOGP,
        "rollout_logp_BxT": rollout,
        "advantages_B": jnp.ones(2),
        "m2po_keep_BxT": jnp.ones((2, 3)),
    }
    value, _ = loss.token_loss(LOGP, batch)
    # ratio pi_theta / pi_rollout = e^0.5 > 1.2: clipped at 1.2 for A = 1, on live tokens
    _close(value, -1.2 * MASK)


def test_preset_and_option_masks_both_apply():
    """The preset's token mask (M2PO) and an option's (top-entropy) both drop their tokens."""
    loss = _grpo(parts=(m2po_lib.m2po_part(),), options=option_parts(top_entropy_frac=0.5))
    m2po_keep, entropy_keep = (
        jnp.array([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]]),
        jnp.array([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0]]),
    )
    batch = {
        "completion_mask_BxT": MASK,
        "old_logp_BxT": LOGP,
        "advantages_B": jnp.ones(2),
        "m2po_keep_BxT": m2po_keep,
        "entropy_keep_BxT": entropy_keep,
    }
    value, stats = loss.token_loss(LOGP, batch)
    _close(value, -(m2po_keep * entropy_keep * MASK))  # ratio 1, A = 1: -1 on kept live tokens
    _close(stats["m2po_masked_BxT"], [[0, 1, 0], [0, 0, 0]])
    _close(stats["entropy_masked_BxT"], [[0, 0, 0], [1, 0, 0]])
