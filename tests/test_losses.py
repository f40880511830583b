"""Loss algebra: hand-worked numbers for each part, then one contract test over every preset."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import losses
from jaxrl.config import ConfigError, LossConfig
from jaxrl.losses import advantages as adv_lib
from jaxrl.losses import aggregation

ATOL = 1e-5


# ----------------------------------------------------------------------------- advantages


def test_group_mean_std_hand_worked():
    # r = [1,0,0,0]: mean 0.25; deviations [0.75,-0.25,-0.25,-0.25]; sum of squares .5625 + 3*.0625 = .75
    # DEFAULT, unbiased (ddof=1, TRL / verl): var = .75 / 3 = .25, std = .5
    #   A = [0.75, -0.25, -0.25, -0.25] / 0.5 = [1.5, -0.5, -0.5, -0.5]
    adv = adv_lib.group_mean_std(eps=1e-6)(jnp.array([1.0, 0.0, 0.0, 0.0]), 4)
    np.testing.assert_allclose(adv, [1.5, -0.5, -0.5, -0.5], atol=ATOL)
    # ddof=0 (population): var = .75 / 4 = .1875, std = .4330127 -> A = [1.7320508, -0.5773503 x3]
    adv0 = adv_lib.group_mean_std(eps=1e-6, ddof=0)(jnp.array([1.0, 0.0, 0.0, 0.0]), 4)
    np.testing.assert_allclose(adv0, [1.7320508, -0.5773503, -0.5773503, -0.5773503], atol=ATOL)
    with pytest.raises(ValueError, match="std_ddof: got 2"):
        adv_lib.group_mean_std(ddof=2)


@pytest.mark.slow
def test_group_of_one_gets_zero_advantage_not_nan():
    # G = 1 with ddof=1: n - ddof = 0 would be 0/0 = NaN; the divisor is clamped to 1, the centred
    # value r - mean = 0, so A = 0 / (0 + eps) = 0 exactly, for every estimator dividing by a std.
    r = jnp.array([1.0, 0.0, 0.5])
    for ddof in (0, 1):
        for norm in (adv_lib.group_mean_std(ddof=ddof), adv_lib.group_mean_batch_whiten(ddof=ddof)):
            adv = np.asarray(norm(r, 1))
            assert np.all(adv == 0.0), (norm, ddof, adv)
    # a batch of ONE row: the batch std of a single reward is 0 too, never NaN
    one = jnp.array([0.7])
    assert np.asarray(adv_lib.group_mean_batch_std(ddof=1)(one, 1)).tolist() == [0.0]
    from jaxrl.losses import multi_reward

    assert np.asarray(multi_reward.gdpo(ddof=1)(jnp.array([[1.0, 0.0]]), 1)).tolist() == [0.0]


def test_two_groups_stacked_are_independent():
    # group 0 as above (unbiased): [1.5, -.5, -.5, -.5]
    # group 1 = [0,1,1,0]: mean .5, deviations +-.5, sum of squares 1, unbiased var 1/3, std .5773503
    #   -> A = +-.5 / .5773503 = +-.8660254
    r = jnp.array([1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    adv = adv_lib.group_mean_std()(r, 4)
    h = 0.8660254
    np.testing.assert_allclose(adv, [1.5, -0.5, -0.5, -0.5, -h, h, h, -h], atol=ATOL)


@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, 1.1])
def test_constant_group_gives_exact_zeros(value):
    # In float32 the mean of three 1.1s is not 1.1: the ~1e-7 residue over (std ~1e-7 + 1e-6)
    # would be a spurious advantage of ~0.1 without the constant-group guard (0.007 for 0.1).
    r = jnp.array([value] * 3 + [1.0, 0.0, 1.0])
    for norm in (adv_lib.group_mean_std(1e-6), adv_lib.group_mean):
        adv = np.asarray(norm(r, 3))
        assert np.all(adv[:3] == 0.0) and np.all(np.isfinite(adv))
    # the other group is untouched: [1, 0, 1] - 2/3 = [1/3, -2/3, 1/3]
    np.testing.assert_allclose(adv_lib.group_mean(r, 3)[3:], [1 / 3, -2 / 3, 1 / 3], atol=ATOL)


def test_reward_sum_and_estimator():
    # weights (1, 0.1): row0 = 1*1 + 0.1*1 = 1.1, row1 = 0 + 0.1 = 0.1
    combine = adv_lib.reward_sum((1.0, 0.1))
    np.testing.assert_allclose(combine(jnp.array([[1.0, 1.0], [0.0, 1.0]])), [1.1, 0.1], atol=ATOL)
    # None -> every column weight 1
    np.testing.assert_allclose(adv_lib.reward_sum()(jnp.array([[1.0, 2.0, 3.0]])), [6.0])
    # group of 2 with Dr.GRPO centring: r = [1.1, 0.1] -> mean 0.6 -> A = [0.5, -0.5]
    est = adv_lib.estimator(combine, adv_lib.group_mean)
    np.testing.assert_allclose(est(jnp.array([[1.0, 1.0], [0.0, 1.0]]), 2), [0.5, -0.5], atol=ATOL)
    with pytest.raises(ConfigError, match="loss.reward_weights"):
        combine(jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="groups of 3"):
        est(jnp.ones((4, 2)), 3)


# ----------------------------------------------------------------------------- ppo clip

# (rho, A) -> (loss, d loss / d logp, clipped_low, clipped_high) for eps_low = eps_high = 0.2.
# loss = -min(rho*A, clip(rho, 0.8, 1.2)*A); unclipped gradient = -A*rho (d rho/d logp = rho).
PPO_CASES = [
    (0.5, +1.0, -0.5, -0.5, 0, 0),  # min(0.5, 0.8) = 0.5: unclipped (A>0 never clips below)
    (1.0, +1.0, -1.0, -1.0, 0, 0),  # inside the trust region
    (1.5, +1.0, -1.2, 0.0, 0, 1),  # min(1.5, 1.2) = 1.2: high clip active, grad 0
    (0.5, -1.0, 0.8, 0.0, 1, 0),  # min(-0.5, -0.8) = -0.8: low clip active, grad 0
    (1.0, -1.0, 1.0, 1.0, 0, 0),  # grad = -(-1)*1 = 1
    (1.5, -1.0, 1.5, 1.5, 0, 0),  # min(-1.5, -1.2) = -1.5: unclipped, grad = 1.5
]


def _ppo_batch(rhos, advs):
    rhos, advs = jnp.array(rhos)[:, None], jnp.array(advs)
    old = jnp.full_like(rhos, -1.0)  # logp = old + log(rho)
    batch = {"completion_mask_BxT": jnp.ones_like(rhos), "old_logp_BxT": old, "advantages_B": advs}
    return old + jnp.log(rhos), batch


@functools.partial(jax.jit, static_argnums=0)
def _loss_stats_grad(token_loss, logp, batch):
    """(loss_BxT, stats, d sum(loss) / d logp); jitted because eager dispatch compiles per op."""
    (_, (loss, stats)), grad = jax.value_and_grad(
        lambda lp: (lambda out: (jnp.sum(out[0]), out))(token_loss(lp, batch)), has_aux=True
    )(logp)
    return loss, stats, grad


def test_ppo_clip_values_and_gradients_by_hand():
    rhos, advs, want_loss, want_grad, want_low, want_high = map(list, zip(*PPO_CASES))
    logp, batch = _ppo_batch(rhos, advs)
    loss, stats, grad = _loss_stats_grad(losses.grpo(eps_low=0.2, eps_high=0.2).token_loss, logp, batch)
    np.testing.assert_allclose(loss[:, 0], want_loss, atol=ATOL)
    np.testing.assert_allclose(stats["clipped_low_BxT"][:, 0], want_low)
    np.testing.assert_allclose(stats["clipped_high_BxT"][:, 0], want_high)
    np.testing.assert_allclose(stats["ratio_BxT"][:, 0], rhos, atol=ATOL)
    np.testing.assert_allclose(grad[:, 0], want_grad, atol=ATOL)


def test_ppo_clip_higher_is_asymmetric():
    # rho = 1.25, A = +1: clipped with eps_high = 0.2 (1.25 > 1.2), not with 0.28 (1.25 < 1.28).
    logp, batch = _ppo_batch([1.25], [1.0])
    sym, _, g_sym = _loss_stats_grad(losses.grpo(eps_low=0.2, eps_high=0.2).token_loss, logp, batch)
    dapo, _, g_dapo = _loss_stats_grad(losses.grpo(eps_low=0.2, eps_high=0.28).token_loss, logp, batch)
    np.testing.assert_allclose(sym, [[-1.2]], atol=ATOL)
    np.testing.assert_allclose(g_sym, [[0.0]], atol=ATOL)
    np.testing.assert_allclose(dapo, [[-1.25]], atol=ATOL)
    np.testing.assert_allclose(g_dapo, [[-1.25]], atol=ATOL)


def test_ppo_clip_at_the_bound_keeps_full_gradient():
    # rho exactly 1 with eps 0: both terms tie; we take the unclipped branch: grad = -A*rho = -2
    obj = losses.ppo_clip(0.0, 0.0)
    g = jax.grad(lambda lr: jnp.sum(obj(lr, jnp.array([[2.0]]), jnp.ones((1, 1)))[0]))(jnp.zeros((1, 1)))
    np.testing.assert_allclose(g, [[-2.0]])


# ----------------------------------------------------------------------------- KL


def test_kl_estimators_by_hand():
    # logp = ln 0.5, ref = ln 0.25: d = ref - logp = -ln 2, exp(d) = 0.5
    # k3 = 0.5 + ln 2 - 1 = 0.1931472 ; dk3/dlogp = 1 - exp(d) = 0.5
    # k1 = ln 2 = 0.6931472, dk1/dlogp = 1 ; k2 = (ln 2)^2 / 2 = 0.2402265, dk2/dlogp = ln 2
    logp, ref = jnp.array([[math.log(0.5)]]), jnp.array([[math.log(0.25)]])
    for fn, value, grad in [
        (losses.kl_k3, 0.1931472, 0.5),
        (losses.kl_k1, 0.6931472, 1.0),
        (losses.kl_k2, 0.2402265, 0.6931472),
    ]:
        np.testing.assert_allclose(fn(logp, ref), [[value]], atol=ATOL)
        np.testing.assert_allclose(jax.grad(lambda lp, fn=fn: jnp.sum(fn(lp, ref)))(logp), [[grad]], atol=ATOL)


def test_k3_nonnegative_and_zero_on_equal():
    rng = np.random.default_rng(0)
    logp, ref = (jnp.asarray(-3 * rng.random((64, 8), np.float32)) for _ in range(2))
    assert float(jnp.min(losses.kl_k3(logp, ref))) >= 0.0
    np.testing.assert_array_equal(losses.kl_k3(logp, logp), 0.0)
    np.testing.assert_array_equal(jax.grad(lambda lp: jnp.sum(losses.kl_k3(lp, logp)))(logp), 0.0)


def test_kl_penalty_adds_beta_k3_and_is_skipped_at_zero():
    logp, batch = _ppo_batch([1.0], [0.0])  # A = 0: the PPO term is 0, only the KL remains
    batch["ref_logp_BxT"] = logp + math.log(0.5)  # ref - logp = -ln 2 -> k3 = 0.1931472
    loss, stats, grad = _loss_stats_grad(losses.grpo(kl_beta=0.1).token_loss, logp, batch)
    np.testing.assert_allclose(loss, [[0.01931472]], atol=ATOL)
    np.testing.assert_allclose(stats["kl_BxT"], [[0.1931472]], atol=ATOL)
    # PPO term with A = 0 has no gradient; 0.1 * dk3/dlogp = 0.1 * (1 - 0.5) = 0.05
    np.testing.assert_allclose(grad, [[0.05]], atol=ATOL)
    del batch["ref_logp_BxT"]  # beta == 0 must not need the reference at all
    loss0, stats0, _ = _loss_stats_grad(losses.grpo(kl_beta=0.0).token_loss, logp, batch)
    np.testing.assert_allclose(loss0, [[0.0]])
    assert "kl_BxT" not in stats0


def test_entropy_bonus():
    batch = {"completion_mask_BxT": jnp.array([[1.0, 0.0]]), "entropy_BxT": jnp.array([[2.0, 5.0]])}
    extra, _ = losses.entropy_bonus(0.01)(jnp.zeros((1, 2)), batch)
    np.testing.assert_allclose(extra, [[-0.02, 0.0]])


# ----------------------------------------------------------------------------- aggregation

# lengths |y| = [3, 1, 0, 2] in T = 4; 3 live rows (the empty row counts as removed).
RAGGED = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]], jnp.float32)


def test_aggregation_weights_by_hand():
    # seq_mean_token_mean: 1/(|y_i| * 3) -> row0 1/9, row1 1/3, row3 1/6 ; sums to 1
    want = [[1 / 9] * 3 + [0], [1 / 3, 0, 0, 0], [0] * 4, [1 / 6, 1 / 6, 0, 0]]
    np.testing.assert_allclose(losses.seq_mean_token_mean(RAGGED, 4), want, atol=1e-7)
    # token_mean: 6 live tokens -> 1/6 each
    np.testing.assert_allclose(losses.token_mean(RAGGED, 4), RAGGED / 6, atol=1e-7)
    # Dr.GRPO: 1/(3 rows * L_max 8) = 1/24 each, independent of |y_i|
    np.testing.assert_allclose(losses.seq_mean_token_sum_norm(RAGGED, 8), RAGGED / 24, atol=1e-7)
    # token_mean vs seq_mean_token_mean: per-token loss = 1 on row0, 0 elsewhere.
    # token_mean: 3 tokens * 1/6 = 0.5 ; seq_mean_token_mean: 3 * 1/9 = 1/3 (one of 3 sequences).
    loss = jnp.zeros((4, 4)).at[0].set(1.0)
    assert abs(float(losses.weighted_sum(losses.token_mean(RAGGED, 4), loss)) - 0.5) < 1e-6
    assert abs(float(losses.weighted_sum(losses.seq_mean_token_mean(RAGGED, 4), loss)) - 1 / 3) < 1e-6


@pytest.mark.parametrize("fn", [losses.seq_mean_token_mean, losses.token_mean, losses.seq_mean_token_sum_norm])
def test_aggregation_all_empty_is_zero_not_nan(fn):
    w = fn(jnp.zeros((3, 5)), 5)
    assert np.all(np.asarray(w) == 0.0)


def test_reduce_stats_by_hand_and_partials_merge_exactly():
    mask = jnp.array([[1, 1, 0], [1, 0, 0]], jnp.float32)
    stats = {
        "ratio_BxT": jnp.array([[0.5, 1.5, 9.0], [2.0, 9.0, 9.0]]),
        "clipped_high_BxT": jnp.array([[0.0, 1.0, 1.0], [1.0, 1.0, 1.0]]),
    }
    out = aggregation.reduce_stats(stats, mask)
    # live ratios 0.5, 1.5, 2.0 -> mean 4/3, min 0.5, max 2 ; clipped_high 2 of 3 live tokens
    np.testing.assert_allclose(
        [out["ratio"], out["ratio_min"], out["ratio_max"], out["clipped_high"]], [4 / 3, 0.5, 2.0, 2 / 3], atol=1e-6
    )
    halves = [aggregation.stat_partials({k: v[i : i + 1] for k, v in stats.items()}, mask[i : i + 1]) for i in (0, 1)]
    merged = aggregation.finalize_stats(aggregation.merge_stat_partials(*halves))
    for k in out:
        np.testing.assert_allclose(merged[k], out[k], atol=1e-6)


# ----------------------------------------------------------------------------- presets


def test_make_loss_reads_config_and_rejects_unknown_preset():
    loss = losses.make_loss(LossConfig(preset="grpo", eps_high=0.28, reward_weights=(1.0, 0.1)))
    assert loss.name == "grpo"
    logp, batch = _ppo_batch([1.25], [1.0])  # not clipped at eps_high = 0.28 -> loss -1.25
    np.testing.assert_allclose(loss.token_loss(logp, batch)[0], [[-1.25]], atol=ATOL)
    # reward_weights (1, 0.1): r = [1.1, 0.1], mean 0.6, deviations +-.5; unbiased var (.25 + .25) / 1 = .5,
    # std .7071068 -> A = +-.5 / .7071068 = +-.7071068 (to eps)
    np.testing.assert_allclose(
        loss.advantages(jnp.array([[1.0, 1.0], [0.0, 1.0]]), 2), [0.7071068, -0.7071068], atol=1e-4
    )
    assert losses.make_loss(LossConfig(preset="dr_grpo")).name == "dr_grpo"
    with pytest.raises(ConfigError, match=r"loss\.preset.*'dr_grpo'.*'grpo'"):
        losses.make_loss(LossConfig(preset="nope"))


def test_losses_never_import_models():
    import ast
    import pathlib

    for path in pathlib.Path(losses.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(n.startswith("jaxrl.models") for n in names), path


# ----------------------------------------------------------------------------- contract

G, N_GROUPS, T, L_MAX = 4, 4, 6, 8
B = G * N_GROUPS


def _dapo_like(**kw):
    # A composition not in PRESETS, to show the parts combine: clip-higher + token-mean.
    return losses.Loss(
        "dapo_like",
        losses.estimator(losses.reward_sum(), losses.group_mean_std()),
        losses.token_mean,
        losses.policy_token_loss(
            losses.token_log_ratio, losses.ppo_clip(0.2, 0.28), [losses.kl_penalty(kw.get("kl_beta", 0.0))]
        ),
    )


# The GRPO-family presets this file grew with, plus a composition outside the registry. The contract
# over EVERY registered preset (with prepare, odd MC-GRPO groups, ...) is tests/test_presets.py.
LOSSES = {"grpo": losses.PRESETS["grpo"], "dr_grpo": losses.PRESETS["dr_grpo"], "dapo_like": _dapo_like}


def _contract_inputs():
    # numpy RNG: eager jax.random would compile a kernel per shape and dominate the test time.
    rng = np.random.default_rng(42)
    lengths = rng.integers(0, T + 1, B)
    lengths[0], lengths[1] = T, 0  # a full row and an empty row
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    rewards = rng.integers(0, 2, (B, 2)).astype(np.float32)
    rewards[:G] = 1.0  # one constant group
    logp = -2.0 * rng.random((B, T), np.float32)
    old = logp + 0.6 * rng.standard_normal((B, T), np.float32)  # wide enough that some tokens clip
    ref = logp + 0.3 * rng.standard_normal((B, T), np.float32)
    garbage = np.where(rng.random((B, T)) < 0.5, 1e4, -1e4).astype(np.float32)
    old, ref = np.where(mask > 0, old, garbage), np.where(mask > 0, ref, -garbage)
    batch = {
        "completion_mask_BxT": mask,
        "old_logp_BxT": old,
        "ref_logp_BxT": ref,
        "rollout_logp_BxT": old,
        "entropy_BxT": np.ones((B, T), np.float32),
    }
    return jnp.asarray(logp), {k: jnp.asarray(v) for k, v in batch.items()}, jnp.asarray(rewards)


def _mb_step(token_loss, logp, weights, batch):
    """One microbatch: (weighted_sum(w, loss), stat partials) and d/dlogp, as an update step would."""

    def f(lp):
        loss_BxT, stats = token_loss(lp, batch)
        return losses.weighted_sum(weights, loss_BxT), aggregation.stat_partials(stats, batch["completion_mask_BxT"])

    return jax.value_and_grad(f, has_aux=True)(logp)


_mb_step_jit = jax.jit(_mb_step, static_argnums=0)


# Variants run eagerly (jit=False): eager kernels are cached per op and shape and so shared by every
# loss, while a jit compile is paid per (loss, shape); on CPU that makes eager the cheaper test.
def _loss_and_grad(loss, logp, batch, microbatches=1, jit=False):
    """Sum over microbatches of weighted_sum(weights, token_loss), weights from the WHOLE batch.
    Returns (loss, d loss / d logp in row order, metrics merged from per-microbatch partials)."""
    weights = loss.weights(batch["completion_mask_BxT"], L_MAX)
    step = _mb_step_jit if jit else _mb_step

    def split(x):  # host slicing is free
        return np.split(np.asarray(x), microbatches)

    keys = sorted(batch)
    value, grads, partials = 0.0, [], None
    for lp, w, *vals in zip(split(logp), split(weights), *(split(batch[k]) for k in keys)):
        (v, part), g = step(loss.token_loss, lp, w, dict(zip(keys, vals)))
        value, grads = value + v, grads + [g]
        partials = part if partials is None else aggregation.merge_stat_partials(partials, part)
    return value, jnp.concatenate(grads), aggregation.finalize_stats(partials)


PAD = 3
GROUP_ORDER = (2, 0, 3, 1)
PERM_ROWS = np.concatenate([g * G + np.arange(G) for g in GROUP_ORDER])


def _contract_results(loss, logp, batch, rewards):
    """Every variant the contract compares; each is (loss, grad, metrics)."""
    mask = batch["completion_mask_BxT"]
    batch = dict(batch, advantages_B=loss.advantages(rewards, G))
    out = {"adv": batch["advantages_B"], "weights": loss.weights(mask, L_MAX)}
    out["full"] = _loss_and_grad(loss, logp, batch)

    # Padding columns: masked, with garbage old/ref log-probs there.
    def pad(x, c):
        return np.pad(np.asarray(x), ((0, 0), (0, PAD)), constant_values=c)

    padded = {k: pad(v, 1e4) if v.ndim == 2 else v for k, v in batch.items()}
    padded["completion_mask_BxT"] = pad(mask, 0.0)
    out["pad"] = _loss_and_grad(loss, pad(logp, -5.0), padded)
    for k in (2, 4):
        out[f"mb{k}"] = _loss_and_grad(loss, logp, batch, microbatches=k)
    # Whole groups reordered; advantages recomputed from the permuted rewards, as the pipeline does.
    permuted = {k: np.asarray(v)[PERM_ROWS] for k, v in batch.items()}
    permuted["advantages_B"] = out["adv_perm"] = loss.advantages(np.asarray(rewards)[PERM_ROWS], G)
    out["perm"] = _loss_and_grad(loss, np.asarray(logp)[PERM_ROWS], permuted)
    return out


def _close(a, b, **kw):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **{"rtol": 1e-6, "atol": 1e-7, **kw})


# Every loss with a KL term (the superset path), plus GRPO without one and without ref log-probs.
CONTRACT_CASES = [(name, 0.05) for name in sorted(LOSSES)] + [("grpo", 0.0)]


@pytest.mark.slow
@pytest.mark.parametrize("name,kl_beta", CONTRACT_CASES)
def test_contract(name, kl_beta):
    loss = LOSSES[name](kl_beta=kl_beta)
    logp, batch, rewards = _contract_inputs()
    if kl_beta == 0:
        del batch["ref_logp_BxT"]  # must not be needed
    mask = np.asarray(batch["completion_mask_BxT"])
    out = _contract_results(loss, logp, batch, rewards)
    value, grad, metrics = out["full"]
    grad = np.asarray(grad)
    assert np.isfinite(float(value)) and np.all(np.isfinite(grad))
    assert np.max(np.abs(grad)) > 0  # the test batch does exercise the gradient
    np.testing.assert_array_equal(grad[mask == 0], 0.0)
    assert all(np.isfinite(float(v)) for v in metrics.values())
    assert float(metrics["clipped_low"]) > 0 and float(metrics["clipped_high"]) > 0  # clipping is exercised
    assert ("kl" in metrics) == (kl_beta > 0)

    def same(variant, rows=slice(None), **kw):
        v, g, m = out[variant]
        _close(v, value, **kw)
        _close(np.asarray(g)[:, :T], grad[rows])
        assert m.keys() == metrics.keys()
        for key in m:
            _close(m[key], metrics[key], rtol=1e-5)

    same("pad")  # padding columns change neither loss, gradient nor metrics ...
    np.testing.assert_array_equal(out["pad"][1][:, T:], 0.0)  # ... and get no gradient
    same("mb2")  # microbatches with full-batch weights == full batch
    same("mb4")
    # Permuting whole groups permutes the advantages and leaves the loss unchanged.
    _close(out["adv_perm"], out["adv"][PERM_ROWS], atol=1e-6)
    same("perm", rows=PERM_ROWS, rtol=1e-5)

    # jit == no jit (above), for all three functions of the Loss.
    _close(jax.jit(loss.advantages, static_argnums=1)(rewards, G), out["adv"], atol=1e-6)
    _close(jax.jit(loss.weights, static_argnums=1)(batch["completion_mask_BxT"], L_MAX), out["weights"])
    j_value, j_grad, j_metrics = _loss_and_grad(loss, logp, dict(batch, advantages_B=out["adv"]), jit=True)
    _close(j_value, value)
    _close(j_grad, grad)
    for key in metrics:
        _close(j_metrics[key], metrics[key], rtol=1e-5)


def test_contract_detects_per_microbatch_normalisers():
    # Self-check of the contract test: weights computed per microbatch (the classic bug) differ.
    loss = losses.PRESETS["dr_grpo"]()
    logp, batch, rewards = _contract_inputs()
    batch["advantages_B"] = loss.advantages(rewards, G)
    full, _, _ = _loss_and_grad(loss, logp, batch)
    host = {k: np.asarray(v) for k, v in dict(batch, logp=logp).items()}
    wrong = 0.0
    for i in range(0, B, 4):
        mb = {k: v[i : i + 4] for k, v in host.items()}
        wrong += losses.weighted_sum(loss.weights(mb["completion_mask_BxT"], L_MAX), loss.token_loss(mb["logp"], mb)[0])
    assert abs(float(wrong) - float(full)) > 1e-4


def test_reward_shaping_needs_both_reward_combine_and_normaliser():
    """Shaping adds to the combined reward, then normalises: a given estimator with a reward_combine
    but no normaliser is refused at build time (it used to fail later, inside the update)."""
    from jaxrl.losses import aggregation, ratios
    from jaxrl.losses.compose import compose
    from jaxrl.losses.options import option_parts

    parts = dict(ratio=ratios.token_log_ratio, objective=lambda *a: None, weights=aggregation.seq_mean_token_mean)
    estimator = adv_lib.estimator(adv_lib.reward_sum(None), adv_lib.group_mean_std(1e-6))
    options = option_parts(kl_reward_beta=0.1)
    with pytest.raises(ValueError, match="kl_reward_beta.*combines the rewards first"):
        compose("x", estimator=estimator, reward_combine=adv_lib.reward_sum(None), options=options, **parts)
