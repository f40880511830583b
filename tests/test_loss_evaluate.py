"""`jaxrl.losses.evaluate_loss`: a loss on a batch by the functions the update step calls, checked
against the update step itself; the traps it removes (supplied advantages, group_size /
max_new_tokens that do not fit the batch, reward weights for another task); `Loss.needs_ref`.

A toy policy (one logit vector shared by every position) keeps each update program to a second.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import REPO

from jaxrl.config import ConfigError, LossConfig, load_config
from jaxrl.losses import PRESETS, evaluate_loss, make_loss
from jaxrl.train import steps as steps_lib
from jaxrl.train.state import init_state

V, T, G, LR = 5, 4, 2, 0.5
# Six rows, three groups of 2. DAPO (L_max = T = 4, overlong_buffer_frac .25 -> L_c = 1): a completion of
# 4 tokens gets -1. group 0: r [1, 0], |y| [2, 4] -> shaped [1, -1]; group 1: r [1, 1], |y| [4, 1] ->
# shaped [0, 1] (constant before shaping!); group 2: r [0, 0], |y| [2, 3] -> constant, dropped.
LENGTHS = np.array([2, 4, 4, 1, 2, 3])
REWARDS = np.array([[1.0], [0], [1], [1], [0], [0]], np.float32)
OVERLONG_BONUS = np.array([0.0, -1, -1, 0, 0, 0], np.float32)


def _toy_logp(params, batch):
    logp_V = jax.nn.log_softmax(params["w"])
    entropy = -jnp.sum(jnp.exp(logp_V) * logp_V)
    logp_BxT = logp_V[batch["tokens_BxT"]]
    return logp_BxT, jnp.full(logp_BxT.shape, entropy)


PARAMS = {"w": jnp.asarray(np.linspace(-1.0, 1.0, V), jnp.float32)}
REF = {"w": PARAMS["w"] * 0.5}


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    mask = (np.arange(T)[None, :] < LENGTHS[:, None]).astype(np.float32)
    return {
        "tokens_BxT": rng.integers(0, V, (6, T)).astype(np.int32),
        "completion_mask_BxT": mask,
        "rewards_BxK": REWARDS,
        "truncated_B": (LENGTHS == T).astype(np.float32),
        # the sampler's log-probs, away from the trainer's: M2PO has tokens to mask
        "rollout_logp_BxT": np.where(mask > 0, -1.6 + 0.8 * rng.standard_normal((6, T)), 0).astype(np.float32),
    }


def _update(loss, batch, **kw):
    """One update (one PPO epoch, 2 microbatches of 3 rows: groups split across them, plain SGD)."""
    opt = optax.sgd(LR)
    step = steps_lib.make_update_step(
        _toy_logp, loss, opt, ppo_epochs=1, microbatches=2, max_new_tokens=T, group_size=G, **kw
    )
    state = init_state(PARAMS, opt, jax.random.key(0), ref_params=REF if loss.needs_ref else None)
    return jax.jit(step)(state, batch)


def _evaluate(loss, params, batch, **kw):
    batch = dict(batch, ref_logp_BxT=_toy_logp(REF, batch)[0]) if loss.needs_ref else batch
    return evaluate_loss(loss, _toy_logp(params, batch)[0], batch, group_size=G, max_new_tokens=T, **kw)


CASES = {  # a KL term (reference forward), reward shaping + a row filter, an old-log-prob prepare part
    "grpo+kl": PRESETS["grpo"](kl_beta=0.1),
    "dapo": PRESETS["dapo"](overlong_buffer_frac=0.25),
    "m2po": PRESETS["m2po"](tau=0.5),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_evaluate_loss_is_the_update_steps_loss_and_gradient(name):
    loss, batch = CASES[name], _batch()
    state, metrics = _update(loss, batch)
    ev = _evaluate(loss, PARAMS, batch)
    grad = jax.grad(lambda p: _evaluate(loss, p, batch).loss)(PARAMS)["w"]
    np.testing.assert_allclose(float(ev.loss), float(metrics["loss"]), rtol=1e-6, atol=1e-7)
    applied = (PARAMS["w"] - state.params["w"]) / LR  # SGD: the update applied -LR * its gradient
    assert float(jnp.max(jnp.abs(grad))) > 1e-3  # a real gradient is compared
    np.testing.assert_allclose(grad, applied, rtol=1e-5, atol=1e-6)
    for key in ev.metrics:  # the loss's stats: the same masked token means as the update reports
        np.testing.assert_allclose(float(ev.metrics[key]), float(metrics[key]), rtol=1e-5, atol=1e-6, err_msg=key)
    assert {"loss", "ratio", "ratio_min", "ratio_max"} <= set(ev.metrics)
    if name == "m2po":
        assert 0 < float(ev.metrics["m2po_masked"]) < 1


def test_dapo_shapes_its_own_advantages_once():
    # The advantage step adds the overlong bonus (written out above) to the combined reward before the
    # group normaliser; group 1 is constant before shaping, so the shaping is what gives it a signal.
    loss, batch = CASES["dapo"], _batch()
    ev = _evaluate(loss, PARAMS, batch)
    want = loss.advantages(jnp.asarray(REWARDS), G, jnp.asarray(OVERLONG_BONUS))
    np.testing.assert_allclose(ev.batch["advantages_B"], want, rtol=1e-6)
    np.testing.assert_array_equal(np.sign(want), [1, -1, -1, 1, 0, 0])
    np.testing.assert_array_equal(np.asarray(loss.advantages(jnp.asarray(REWARDS), G))[2:4], [0, 0])
    # the informative-groups filter reads the shaped advantages: only group 2 leaves the loss
    np.testing.assert_array_equal(np.asarray(ev.batch["completion_mask_BxT"]).sum(1), [2, 4, 4, 1, 0, 0])


@pytest.mark.parametrize("where", ["evaluate", "update"])
def test_supplied_advantages_are_an_error_not_overwritten(where):
    # DAPO used to replace a batch's advantages_B with its shaped ones without a word.
    loss, batch = CASES["dapo"], dict(_batch(), advantages_B=np.ones(6, np.float32))
    with pytest.raises(ValueError, match="carries advantages_B.*rewards_BxK"):
        _evaluate(loss, PARAMS, batch) if where == "evaluate" else _update(loss, batch)


def test_group_size_and_max_new_tokens_must_fit_the_batch():
    loss, batch = PRESETS["grpo"](), _batch()
    logp = _toy_logp(PARAMS, batch)[0]
    with pytest.raises(ValueError, match=r"group_size=4 does not divide the batch's B=6 rows"):
        evaluate_loss(loss, logp, batch, group_size=4, max_new_tokens=T)
    with pytest.raises(ValueError, match=r"max_new_tokens=5 but the batch's completions are T=4 wide"):
        evaluate_loss(loss, logp, batch, group_size=G, max_new_tokens=5)
    opt = optax.sgd(LR)
    step = steps_lib.make_update_step(
        _toy_logp, loss, opt, ppo_epochs=1, microbatches=1, max_new_tokens=6, group_size=G
    )
    with pytest.raises(ValueError, match=r"max_new_tokens=6 but the batch's completions are T=4 wide"):
        jax.jit(step)(init_state(PARAMS, opt, jax.random.key(0)), batch)
    with pytest.raises(ValueError, match=r"batch\['rewards_BxK'\] has shape \(5, 1\)"):
        evaluate_loss(loss, logp, dict(batch, rewards_BxK=REWARDS[:5]), group_size=G, max_new_tokens=T)


def test_reward_weights_default_weighs_every_reward_one_for_any_k():
    assert LossConfig().reward_weights is None
    loss = make_loss(LossConfig())
    one = jnp.asarray(REWARDS)  # K = 1: the old default (1.0, 0.1) was a ConfigError here
    np.testing.assert_allclose(loss.advantages(one, G), PRESETS["grpo"]().advantages(one, G))
    three = jnp.concatenate([one, 2 * one, 0 * one], axis=1)  # K = 3: r = 3 r_0, same groups' z-scores
    np.testing.assert_allclose(loss.advantages(three, G), loss.advantages(one, G), rtol=1e-5)
    with pytest.raises(ConfigError, match="loss.reward_weights"):
        make_loss(LossConfig(reward_weights=(1.0, 0.1))).advantages(one, G)


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.py")), ids=lambda p: p.stem)
def test_shipped_configs_set_their_reward_weights(path):
    # Their task has two rewards (correctness, format); they keep their own weights, so the new
    # default (None) moves none of their results.
    cfg = load_config(path)
    weights = cfg.loss.reward_weights
    if cfg.reward_model.workdir:  # a reward model's score is a third column, and the one rewarded
        assert weights == (0.0, 0.0, 1.0)
        return
    assert weights is not None and len(weights) == 2 and weights[0] == 1.0


def test_needs_ref_only_with_a_kl_term():
    assert not make_loss(LossConfig()).needs_ref
    assert not any(preset().needs_ref for preset in PRESETS.values())  # every preset's default: no KL
    assert PRESETS["grpo"](kl_beta=0.1).needs_ref
    assert PRESETS["dapo"](kl_reward_beta=0.1).needs_ref  # KL in the reward reads ref_logp_BxT too
    assert make_loss(LossConfig(preset="gspo", kl_beta=0.05)).needs_ref


def _forwards_traced(loss, **kw):
    """How many policy forwards the update step's program holds (logp_fn calls while tracing)."""
    calls = []

    def counting_logp(params, batch):
        calls.append(1)
        return _toy_logp(params, batch)

    opt = optax.sgd(LR)
    step = steps_lib.make_update_step(
        counting_logp, loss, opt, ppo_epochs=1, microbatches=1, max_new_tokens=T, group_size=G, **kw
    )
    state = init_state(PARAMS, opt, jax.random.key(0), ref_params=REF if loss.needs_ref or kw.get("use_ref") else None)
    jax.eval_shape(step, state, _batch())
    return len(calls)


def test_update_runs_a_reference_forward_only_when_the_loss_needs_it():
    without, with_kl = _forwards_traced(PRESETS["grpo"]()), _forwards_traced(PRESETS["grpo"](kl_beta=0.1))
    assert with_kl == without + 1
    assert _forwards_traced(PRESETS["grpo"](), use_ref=True) == without + 1  # asked for: the kl metric only
    with pytest.raises(ValueError, match="use_ref=False.*needs the reference"):
        _forwards_traced(PRESETS["grpo"](kl_beta=0.1), use_ref=False)


def _readme_example() -> str:
    text = (REPO / "docs" / "losses.md").read_text()
    blocks = re.findall(r"<!-- loss-evaluation example -->\n```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1, "docs/losses.md: the loss-evaluation example block is missing"
    return blocks[0]


@pytest.mark.slow
def test_readme_loss_evaluation_example_runs(capsys):
    namespace = {}
    exec(compile(_readme_example(), "docs/losses.md example", "exec"), namespace)
    ev, grad_BxT = namespace["ev"], namespace["grad_BxT"]
    # the page's hand values: A = [.5, -.5, 0, 0], w = 1/(B L_max) = 1/12, ratio 1
    np.testing.assert_allclose(ev.batch["advantages_B"], [0.5, -0.5, 0, 0])
    np.testing.assert_allclose(float(ev.loss), (2 * -0.5 + 3 * 0.5) / 12, rtol=1e-6)
    want = np.array([[-1, -1, 0], [1, 1, 1], [0, 0, 0], [0, 0, 0]]) * 0.5 / 12
    np.testing.assert_allclose(grad_BxT, want, rtol=1e-5, atol=1e-8)
    assert "loss 0.0417" in capsys.readouterr().out
