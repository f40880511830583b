"""PPO with a value model: GAE by hand and against a plain loop, whitening, the clipped value loss and
explained variance by hand; the critic's gradient reaches the policy only with a shared trunk; the
`ppo` preset needs critic.enabled; a tiny `jaxrl train` with the ppo preset logs the critic metrics,
saves the critic in its checkpoints and resumes exactly.

One tiny model (d_model 32, 1 layer, vocab 23) and one (B=4, P=3 | T=4) batch for the update steps.
"""

import functools
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import DEFAULT_CONFIG, TINY
from etils import epath
from test_resume import train_in_process

from jaxrl.config import Config, ConfigError, CriticConfig, LossConfig, ModelConfig, OptimConfig
from jaxrl.losses import PRESETS, make_loss
from jaxrl.losses.gae import explained_variance, gae_BxT, value_loss_terms, whiten_BxT
from jaxrl.models.transformer import init_params
from jaxrl.models.value import token_values
from jaxrl.train import checkpoint as ckpt
from jaxrl.train import critic as critic_lib
from jaxrl.train import steps as steps_lib
from jaxrl.train.state import init_state, make_optimizer

# ---------------------------------------------------------------------------------------------
# GAE


def test_gae_hand_worked():
    """gamma 0.9, lam 0.8 (gamma * lam = 0.72). Row 0: 3 live tokens, V = (0.5, 0.2, 0.1), R = 1;
    the value 9 on the masked 4th token must be ignored.
        delta_2 = 1 - 0.1                  = 0.9        A_2 = 0.9
        delta_1 = 0.9 * 0.1 - 0.2          = -0.11      A_1 = -0.11 + 0.72 * 0.9   = 0.538
        delta_0 = 0.9 * 0.2 - 0.5          = -0.32      A_0 = -0.32 + 0.72 * 0.538 = 0.06736
        returns = A + V                    = (0.56736, 0.738, 1.0)
    Row 1: 2 live tokens, V = (0.4, -0.2), R = 0:
        delta_1 = 0 - (-0.2) = 0.2                      A_1 = 0.2
        delta_0 = 0.9 * (-0.2) - 0.4 = -0.58            A_0 = -0.58 + 0.72 * 0.2 = -0.436
        returns = (-0.036, 0.0)
    Row 2: no live token: all 0."""
    values = jnp.array([[0.5, 0.2, 0.1, 9.0], [0.4, -0.2, 3.0, 3.0], [1.0, 1.0, 1.0, 1.0]])
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], jnp.float32)
    adv, ret = gae_BxT(jnp.array([1.0, 0.0, 5.0]), values, mask, 0.9, 0.8)
    np.testing.assert_allclose(
        adv, [[0.06736, 0.538, 0.9, 0.0], [-0.436, 0.2, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        ret, [[0.56736, 0.738, 1.0, 0.0], [-0.036, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], rtol=1e-5, atol=1e-6
    )


def _gae_loop(reward, values, length, gamma, lam):
    """Textbook GAE on one row: sum_l (gamma lam)^l delta_{t+l}, by two nested loops."""
    rewards = [0.0] * length
    rewards[-1] = reward
    v = list(values[:length]) + [0.0]
    deltas = [rewards[t] + gamma * v[t + 1] - v[t] for t in range(length)]
    return [sum((gamma * lam) ** k * deltas[t + k] for k in range(length - t)) for t in range(length)]


def test_gae_matches_a_plain_loop():
    rng = np.random.default_rng(0)
    B, T, gamma, lam = 6, 7, 0.95, 0.7
    lengths = np.array([7, 1, 0, 4, 6, 3])
    values = rng.normal(size=(B, T)).astype(np.float32)
    rewards = rng.normal(size=B).astype(np.float32)
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    adv, ret = gae_BxT(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma, lam)
    want = np.zeros((B, T), np.float32)
    for i, n in enumerate(lengths):
        if n:
            want[i, :n] = _gae_loop(float(rewards[i]), values[i].tolist(), int(n), gamma, lam)
    np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, np.where(mask > 0, want + values, 0.0), rtol=1e-5, atol=1e-5)


def test_whitening_over_live_tokens():
    x = jnp.array([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = jnp.array([[1, 1, 0], [1, 0, 0]], jnp.float32)
    # live: 1, 2, 3 -> mean 2, std sqrt(2/3)
    s = np.sqrt(2 / 3)
    np.testing.assert_allclose(whiten_BxT(x, mask), [[-1 / s, 0.0, 0.0], [1 / s, 0.0, 0.0]], rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# The value loss and explained variance


def test_value_loss_by_hand():
    """eps 0.2. Token 0: V 0.5, V_old 0.0, R 1.0: unclipped (0.5)^2 = 0.25, clipped V 0.2 -> 0.64:
    the clipped term is larger, loss 0.32, clipped. Token 1: V 0.1, V_old 0, R 1: clip does not bind
    (0.81 both), loss 0.405, not counted as clipped. Token 2: V 0.9, V_old 1.0, R 0.0: unclipped 0.81,
    clipped 0.9 -> 0.81; loss 0.405. Token 3 masked. Unclipped (eps 0): 0.5 (V - R)^2."""
    v = jnp.array([[0.5, 0.1, 0.9, 7.0]])
    v_old = jnp.array([[0.0, 0.0, 1.0, 0.0]])
    r = jnp.array([[1.0, 1.0, 0.0, 0.0]])
    mask = jnp.array([[1, 1, 1, 0]], jnp.float32)
    loss, clipped = value_loss_terms(v, v_old, r, mask, 0.2)
    np.testing.assert_allclose(loss, [[0.32, 0.405, 0.405, 0.0]], rtol=1e-6)
    np.testing.assert_array_equal(clipped, [[1.0, 0.0, 0.0, 0.0]])
    loss0, clipped0 = value_loss_terms(v, v_old, r, mask, 0.0)
    np.testing.assert_allclose(loss0, [[0.125, 0.405, 0.405, 0.0]], rtol=1e-6)
    np.testing.assert_array_equal(clipped0, 0.0)


def test_explained_variance_by_hand():
    r = jnp.array([[1.0, 0.0, 9.0], [1.0, 0.0, 9.0]])
    mask = jnp.array([[1, 1, 0], [1, 1, 0]], jnp.float32)
    # live R = (1, 0, 1, 0): Var(R) = 0.25. V = R: 1. V = 0.5: R - V = (0.5, -0.5, ...), Var 0.25 -> 0.
    assert float(explained_variance(r, r, mask)) == pytest.approx(1.0)
    assert float(explained_variance(jnp.full_like(r, 0.5), r, mask)) == pytest.approx(0.0)
    v = jnp.array([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]])  # R - V = (1, -1, 1, -1): Var 1 -> 1 - 4 = -3
    assert float(explained_variance(v, r, mask)) == pytest.approx(-3.0)
    assert float(explained_variance(v, jnp.zeros_like(r), mask)) == 0.0  # constant returns


# ---------------------------------------------------------------------------------------------
# The update step with a critic: gradient isolation

V, P, T, B = 23, 3, 4, 4
CFG = ModelConfig(
    vocab_size=V, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64, max_seq_len=16
)


def _batch():
    rng = np.random.default_rng(1)
    cmask = (np.arange(T)[None] < np.array([4, 2, 3, 1])[:, None]).astype(np.float32)
    return {
        "prompt_tokens_BxP": jnp.asarray(rng.integers(3, V, (B, P)), jnp.int32),
        "prompt_mask_BxP": jnp.ones((B, P), jnp.int32),
        "tokens_BxT": jnp.asarray(np.where(cmask > 0, rng.integers(3, V, (B, T)), 0), jnp.int32),
        "completion_mask_BxT": jnp.asarray(cmask),
        "rewards_BxK": jnp.asarray([[1.0], [0.0], [1.0], [0.0]], jnp.float32),
    }


@functools.cache
def _params():
    return init_params(CFG, jax.random.PRNGKey(0))


def _stepper(preset: str, critic_cfg: CriticConfig | None, ppo_epochs: int = 1):
    """(jitted update step, a fresh state): 2 microbatches, the critic's head set non-zero so that the
    value loss has a gradient into the trunk from the first step."""
    optimizer = make_optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=0), 10)
    critic, critic_state = None, None
    if critic_cfg is not None:
        c_opt = critic_lib.critic_optimizer(critic_cfg, 10)
        critic = critic_lib.make_critic_update(CFG, critic_cfg, c_opt, microbatches=2)
        critic_state = critic_lib.init_critic(_params(), CFG, critic_cfg, c_opt)
        head = {"w_D": jnp.linspace(-1.0, 1.0, CFG.d_model), "b": jnp.asarray(0.3)}
        critic_state = critic_state._replace(params=dict(critic_state.params, head=head))
    state = init_state(jax.tree.map(jnp.copy, _params()), optimizer, jax.random.key(0))._replace(critic=critic_state)
    step = steps_lib.make_update_step(
        steps_lib.make_logp_fn(CFG, 1.0),
        make_loss(LossConfig(preset=preset)),
        optimizer,
        ppo_epochs=ppo_epochs,
        microbatches=2,
        max_new_tokens=T,
        group_size=2,
        critic=critic,
    )
    return jax.jit(step), state


def _update(preset: str, critic_cfg: CriticConfig | None, ppo_epochs: int = 1):
    step, state = _stepper(preset, critic_cfg, ppo_epochs)
    return step(state, _batch())


def _with_other_critic(state):
    """The state with the critic's params changed (head and trunk), nothing else."""
    assert state.critic is not None
    params = jax.tree.map(lambda x: 3.0 * x + 0.1, state.critic.params)
    return state._replace(critic=state.critic._replace(params=params))


def _same(a, b) -> bool:
    return all(bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _max_diff(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_critic_gradient_reaches_the_policy_only_when_shared():
    """One compiled update, two critics: with a trunk of its own, the policy's update does not depend on
    the critic at all (bit for bit); with a shared trunk it does (the value loss's gradient reaches the
    policy). Against the update without a critic (another program, so
    equal up to XLA's rounding): the same policy update without sharing, a different one with it."""
    batch = _batch()
    step, state = _stepper("grpo", CriticConfig(enabled=True))
    own, metrics = step(state, batch)
    own_other, _ = step(_with_other_critic(state), batch)
    assert _same(own.params, own_other.params) and _same(own.opt_state, own_other.opt_state)
    assert own.critic is not None and state.critic is not None
    assert not _same(own.critic.params, state.critic.params)  # the critic itself trained
    assert float(metrics["critic/value_loss"]) > 0 and float(metrics["critic/grad_norm"]) > 0

    step, state = _stepper("grpo", CriticConfig(enabled=True, share_trunk=True, trunk_grad_scale=0.5))
    shared, _ = step(state, batch)
    shared_other, _ = step(_with_other_critic(state), batch)
    assert "trunk" not in shared.critic.params
    assert _max_diff(shared.params, shared_other.params) > 1e-4

    plain, _ = _update("grpo", None)
    assert _max_diff(plain.params, own.params) < 1e-6
    assert _max_diff(plain.params, shared.params) > 1e-4


def test_ppo_update_uses_gae_of_the_old_values():
    """The ppo preset with a critic, two epochs: the values GAE reads are the critic's BEFORE the
    update (V_old, recomputed here with `token_values`), its returns are GAE(gamma 1, lam 0.95) of the
    summed reward and V_old, its advantages are whitened, and the critic's params move."""
    step, state = _stepper("ppo", CriticConfig(enabled=True), ppo_epochs=2)
    batch = _batch()
    new, metrics = step(state, batch)
    assert state.critic is not None and new.critic is not None
    v_old = token_values(
        state.critic.params["trunk"],
        state.critic.params["head"],
        CFG,
        batch["prompt_tokens_BxP"],
        batch["prompt_mask_BxP"],
        batch["tokens_BxT"],
    )
    mask = batch["completion_mask_BxT"]
    adv, ret = gae_BxT(batch["rewards_BxK"].sum(axis=1), v_old, mask, 1.0, 0.95)
    n = float(mask.sum())
    assert float(metrics["critic/values_mean"]) == pytest.approx(float((v_old * mask).sum()) / n, rel=1e-4)
    assert float(metrics["critic/returns_mean"]) == pytest.approx(float(ret.sum()) / n, rel=1e-4)
    want_ev = float(explained_variance(v_old, ret, mask))
    assert float(metrics["critic/explained_variance"]) == pytest.approx(want_ev, rel=1e-3, abs=1e-5)
    white = whiten_BxT(adv, mask)
    assert float(metrics["advantages/max"]) == pytest.approx(float(white.max()), rel=1e-4)
    assert float(metrics["advantages/mean"]) == pytest.approx(0.0, abs=1e-6)
    assert float(metrics["advantages/std"]) == pytest.approx(1.0, abs=1e-5)
    assert not _same(new.critic.params, state.critic.params)
    with pytest.raises(ValueError, match="needs a value model"):
        steps_lib.make_update_step(
            steps_lib.make_logp_fn(CFG, 1.0),
            make_loss(LossConfig(preset="ppo")),
            make_optimizer(OptimConfig(), 10),
            ppo_epochs=1,
            microbatches=1,
            max_new_tokens=T,
            group_size=1,
        )


# ---------------------------------------------------------------------------------------------
# Config and registration


def test_ppo_preset_is_registered_and_needs_a_critic():
    assert "ppo" in PRESETS and PRESETS["ppo"].min_group_size == 1
    loss = make_loss(LossConfig(preset="ppo", options={"gamma": 0.99, "lam": 0.9, "whiten": False}))
    assert loss.needs_critic and loss.needs_old_logp is False
    assert "gae(gamma=0.99, lam=0.9)" in loss.parts and "whiten_advantages" not in loss.parts
    assert not make_loss(LossConfig(preset="grpo")).needs_critic
    with pytest.raises(ConfigError, match=r"critic\.enabled"):
        critic_lib.check_critic(Config(loss=LossConfig(preset="ppo")), loss)
    with pytest.raises(ConfigError, match=r"lam"):
        make_loss(LossConfig(preset="ppo", options={"lam": 1.5}))
    with pytest.raises(ConfigError, match=r"critic\.value_clip"):
        Config(critic=CriticConfig(value_clip=-1.0)).validate()
    with pytest.raises(ConfigError, match=r"model\.lora\.rank"):
        cfg = Config(critic=CriticConfig(enabled=True))
        cfg = cfg.__class__(**{**cfg.__dict__, "model": ModelConfig(lora=cfg.model.lora.__class__(rank=4))})
        critic_lib.check_critic(cfg, loss)


def test_checkpoint_critic_mismatch_names_the_field():
    """A run without a critic saves the five-field tree it always did (older checkpoints restore, older
    jaxrl reads new ones); one with a critic saves six. A critic on one side only is a ConfigError
    naming critic.enabled."""
    from jaxrl.train.state import SavedCriticState, SavedState, TrainState, saved_part

    plain = TrainState(jnp.asarray(1), {}, {}, jnp.asarray(0))
    assert type(saved_part(plain)) is SavedState and len(saved_part(plain)) == 5
    with_critic = saved_part(plain._replace(critic={"head": 1}))
    assert type(with_critic) is SavedCriticState and with_critic.critic == {"head": 1}
    ckpt._match_critic(saved_part(plain), False, 3)
    ckpt._match_critic(with_critic, True, 3)
    with pytest.raises(ConfigError, match=r"critic\.enabled"):
        ckpt._match_critic(saved_part(plain), True, 3)
    with pytest.raises(ConfigError, match=r"critic\.enabled"):
        ckpt._match_critic(with_critic, False, 3)


# ---------------------------------------------------------------------------------------------
# A tiny run: metrics, the critic in the checkpoint, exact resume

PPO_ARGS = [
    str(DEFAULT_CONFIG),
    *sum((["--set", t] for t in TINY), []),
    "--set",
    "loss.preset=ppo",
    "--set",
    "critic.enabled=true",
    "--set",
    "loss.reward_weights=1,1",  # the format reward too: the tiny base policy is never correct
    "--set",
    "train.steps=4",
    "--set",
    "train.ppo_epochs=2",
    "--set",
    "checkpoint.every=2",
]
CRITIC_KEYS = (
    "critic/value_loss",
    "critic/value_clip_frac",
    "critic/grad_norm",
    "critic/explained_variance",
    "critic/values_mean",
    "critic/returns_mean",
    "advantages/mean",
    "advantages/std",
    "advantages/min",
    "advantages/max",
)


@pytest.mark.usefixtures("persistent_compile_cache")
def test_tiny_ppo_run_logs_saves_and_resumes_exactly(tmp_path: pathlib.Path, cache_env):
    full = train_in_process(PPO_ARGS, tmp_path / "full", cache_env)
    assert sorted(full) == [0, 1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        for key in CRITIC_KEYS:
            assert np.isfinite(full[step][key]), (step, key)
    assert any(full[step]["reward/mean"] > 0 for step in (1, 2, 3))  # else the critic has nothing to learn
    assert full[4]["critic/value_loss"] > 0 and full[4]["critic/grad_norm"] > 0
    assert full[4]["critic/values_mean"] != 0  # the critic moved from its zero head

    meta = ocp.StandardCheckpointHandler().metadata(epath.Path(tmp_path / "full" / "checkpoints" / "4" / "state"))
    assert set(meta["critic"]["params"]) == {"head", "trunk"} and meta["critic"]["opt_state"] is not None

    # Resume from step 2: the copy loses checkpoint 4 (and the rows after 2 are rewritten).
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "4")
    resumed = train_in_process(PPO_ARGS, tmp_path / "resumed", cache_env)
    timing = ("step_seconds", "wall_time", "rollout/seconds", "rollout/tokens_per_s")
    for step in (3, 4):
        a = {k: v for k, v in full[step].items() if k not in timing}
        b = {k: v for k, v in resumed[step].items() if k not in timing}
        assert a == b, step  # bit for bit, critic metrics included: its params and Adam state were restored
    lines = (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2, 3, 4]
