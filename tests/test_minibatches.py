"""`train.minibatches`: several optimizer steps per rollout batch (DAPO's and verl's mini-batches). The
update step equals hand-rolled optimizer steps on contiguous row slices, each normalised over its own
live tokens, all against the log-probs recorded before the first; later mini-batches are off-policy,
so ratios leave 1 and clipping acts. Gradient accumulation inside a mini-batch changes nothing."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import DEFAULT_CONFIG, TINY

from jaxrl import losses
from jaxrl.config import ConfigError, ModelConfig, load_config
from jaxrl.losses.evaluate import prepare_batch, weighted_loss
from jaxrl.models.transformer import init_params
from jaxrl.train import steps as steps_lib
from jaxrl.train.state import init_state

V, P, T, B, G, M = 23, 3, 4, 8, 2, 2  # 4 groups of 2 rows; 2 mini-batches of 2 groups
CFG = ModelConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, mlp_dim=32, max_seq_len=8)
LOGP_FN = steps_lib.make_logp_fn(CFG, 1.0)
LENGTHS = np.array([4, 1, 3, 0, 2, 4, 4, 1])  # ragged: the two mini-batches hold 8 and 11 live tokens


def _batch():
    rng = np.random.default_rng(0)
    cmask = (np.arange(T)[None] < LENGTHS[:, None]).astype(np.float32)
    return {
        "prompt_tokens_BxP": jnp.asarray(rng.integers(3, V, (B, P)), jnp.int32),
        "prompt_mask_BxP": jnp.ones((B, P), jnp.int32),
        "tokens_BxT": jnp.asarray(np.where(cmask > 0, rng.integers(3, V, (B, T)), 0), jnp.int32),
        "completion_mask_BxT": jnp.asarray(cmask),
        "rewards_BxK": jnp.asarray([[1.0], [0.0], [0.0], [1.0], [1.0], [0.0], [0.5], [0.0]]),
        "truncated_B": jnp.zeros((B,), jnp.float32),
    }


def _optimizer():
    # Plain SGD: Adam and gradient clipping would hide a wrong normaliser (both undo a gradient's scale).
    return optax.sgd(1.0)


@functools.cache
def _update(minibatches: int, microbatches: int):
    loss = losses.PRESETS["grpo"](eps_low=0.2)
    step = steps_lib.make_update_step(
        LOGP_FN,
        loss,
        _optimizer(),
        ppo_epochs=1,
        minibatches=minibatches,
        microbatches=microbatches,
        max_new_tokens=T,
        group_size=G,
    )
    return jax.jit(step)


def _state():
    return init_state(init_params(CFG, jax.random.key(0)), _optimizer(), jax.random.key(1))


def test_each_minibatch_is_one_optimizer_step_against_the_old_policy():
    loss, opt, batch = losses.PRESETS["grpo"](eps_low=0.2), _optimizer(), _batch()
    state, metrics = _update(M, 1)(_state(), batch)

    # By hand: old log-probs once from the starting params, advantages over the whole batch, then one
    # SGD step per half of the rows, each half normalised over its own live tokens.
    params = _state().params
    old = dict(batch, old_logp_BxT=LOGP_FN(params, batch)[0], old_entropy_BxT=LOGP_FN(params, batch)[1])
    prepared = prepare_batch(loss, old, group_size=G, max_new_tokens=T)
    opt_state, ratios, clipped = opt.init(params), [], []
    for rows in (slice(0, B // M), slice(B // M, B)):
        mb = jax.tree.map(lambda x, rows=rows: x[rows], prepared)
        mb["weights_BxT"] = loss.weights(mb["completion_mask_BxT"], T)

        def value(p, mb=mb):
            logp_BxT, entropy_BxT = LOGP_FN(p, mb)
            return weighted_loss(loss, logp_BxT, dict(mb, entropy_BxT=entropy_BxT))

        (_, stats), grads = jax.value_and_grad(value, has_aux=True)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        live = mb["completion_mask_BxT"] > 0
        ratios.append(float(jnp.sum(jnp.where(live, stats["ratio_BxT"], 0.0))))
        clipped.append(float(jnp.sum(jnp.where(live, stats["clipped_high_BxT"] + stats["clipped_low_BxT"], 0.0))))
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(params)):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-6)
    n = float(np.sum(LENGTHS))
    np.testing.assert_allclose(float(metrics["ratio"]), sum(ratios) / n, rtol=1e-5)
    assert ratios[0] == pytest.approx(float(np.sum(LENGTHS[: B // M])), rel=1e-6)  # the first step is on-policy
    assert abs(float(metrics["ratio"]) - 1.0) > 1e-3  # the second is not
    assert float(metrics["clipped_low"]) + float(metrics["clipped_high"]) == pytest.approx(sum(clipped) / n, abs=1e-6)
    assert sum(clipped) > 0  # clipping acts on the second mini-batch


def test_microbatches_inside_a_minibatch_change_nothing():
    batch = _batch()
    one, metrics_one = _update(M, 1)(_state(), batch)
    two, metrics_two = _update(M, 2)(_state(), batch)
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(two.params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(float(metrics_one["loss"]), float(metrics_two["loss"]), rtol=1e-4, atol=1e-7)


def test_minibatch_counts_that_do_not_divide_are_errors_naming_the_field():
    base = ["rollout.prompts_per_step=4", "rollout.group_size=4"]
    with pytest.raises(ConfigError, match=r"train\.minibatches.*prompts_per_step\*group_size=16"):
        load_config(DEFAULT_CONFIG, [*base, "train.minibatches=3"])
    with pytest.raises(ConfigError, match=r"train\.microbatches.*train\.minibatches=8"):
        load_config(DEFAULT_CONFIG, [*base, "train.minibatches=2", "train.microbatches=3"])
    with pytest.raises(ConfigError, match=r"train\.minibatches"):
        load_config(DEFAULT_CONFIG, [*base, "train.minibatches=0"])


@pytest.mark.slow
def test_a_run_with_minibatches_trains_and_clips(tmp_path, in_process_cache):
    from jaxrl.train.loop import train

    # The format reward too: the tiny warm start answers nothing right, and constant rewards give no gradient.
    overrides = ["train.steps=2", "train.minibatches=4", "optim.learning_rate=0.05", "optim.warmup_steps=0"]
    cfg = load_config(DEFAULT_CONFIG, [*TINY, *overrides, "loss.reward_weights=1.0,1.0"])
    rows = train(cfg, tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(np.isfinite(r["loss"]) for r in rows[1:])
    assert all(r["ratio_max"] - r["ratio_min"] > 1e-3 for r in rows[1:])  # later mini-batches are off-policy
    assert max(r["clip_frac"] for r in rows[1:]) > 0
