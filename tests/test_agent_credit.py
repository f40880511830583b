"""Credit for multi-turn episodes (jaxrl.sources.agents): the batch the update gets, StarPO-S
filtering, and the loss contract on masks with holes (observation tokens between model turns).

Every loss preset must give observation tokens exactly zero gradient and must not read their
log-probs: the episodes' completion_mask_BxT is 0 on observations in the MIDDLE of a row, which the
preset contract (tests/test_presets.py, prefix masks) does not exercise."""

from types import SimpleNamespace

import numpy as np
import pytest

from jaxrl.losses import batch_advantages
from jaxrl.losses.presets import PRESETS
from jaxrl.runlog.report import grad_norm_spike
from jaxrl.sources.agents import episode_batch, episode_metrics, episode_rewards, keep_most_varied

T = 8


def _group(returns, shaping, prompt_len=3):
    G = len(returns)
    tokens = np.arange(G * T, dtype=np.int32).reshape(G, T) % 7 + 3
    # model turn (2 tokens), observation (3), model turn (2), pad (1)
    loss_mask = np.tile(np.array([1, 1, 0, 0, 0, 1, 1, 0], np.float32), (G, 1))
    logp = np.where(loss_mask > 0, -0.5, 0.0).astype(np.float32)
    ones = np.ones(G)
    return SimpleNamespace(
        prompt_P=np.array([0, 5, 6][:prompt_len], np.int32),
        prompt_mask_P=np.array([0, 1, 1][:prompt_len], np.int32),
        tokens_GxT=tokens,
        routing_GxCxLxK=None,
        loss_mask_GxT=loss_mask,
        logp_GxT=logp,
        truncated_G=np.array([False] * (G - 1) + [True]),
        return_G=np.asarray(returns, np.float64),
        shaping_G=np.asarray(shaping, np.float64),
        turns_G=2 * ones,
        tool_calls_G=ones,
        tool_errors_G=0 * ones,
        env_errors_G=0 * ones,
        obs_cut_G=0 * ones,
        success_G=np.asarray(returns) > 0,
    )


def test_rewards_are_the_return_and_the_weighted_shaping():
    g = _group([1.0, 0.0], [0.2, -0.1])
    (r,) = episode_rewards([g], shaping_weight=0.5)
    np.testing.assert_allclose(r, [[1.0, 0.1], [0.0, -0.05]])  # column 1 = 0.5 * shaping
    (r0,) = episode_rewards([g], shaping_weight=0.0)
    np.testing.assert_array_equal(r0[:, 1], 0.0)  # StarPO: trajectory reward only


def test_starpo_s_keeps_the_most_varied_groups_in_draw_order():
    rewards = [
        np.array([[1, 0], [1, 0]], np.float32),  # std 0
        np.array([[1, 0], [0, 0]], np.float32),  # std 0.5
        np.array([[0.2, 0], [0, 0]], np.float32),  # std 0.1
        np.array([[0, 0], [1, 0]], np.float32),
    ]  # std 0.5
    assert keep_most_varied(rewards, 2, None) == [1, 3]
    assert keep_most_varied(rewards, 3, None) == [1, 2, 3]
    # The combined reward decides: weighting column 1 alone makes group 0 (std 0 there too) no better.
    rewards[0] = np.array([[1, 3], [1, 0]], np.float32)  # combined 4 vs 1: std 1.5
    assert keep_most_varied(rewards, 1, None) == [0]
    assert keep_most_varied(rewards, 1, (1.0, 0.0)) == [1]  # ties (1 and 3) keep the earlier group


def test_episode_batch_rows_masks_and_groups():
    a, b = _group([1.0, 0.0], [0, 0]), _group([0.0, 0.0, 1.0], [0, 0, 0])
    batch = episode_batch([a, b], episode_rewards([a, b], 0.0)).fields()
    assert batch["tokens_BxT"].shape == (5, T) and batch["prompt_tokens_BxP"].shape == (5, 3)
    np.testing.assert_array_equal(batch["group_id_B"], [0, 0, 1, 1, 1])
    np.testing.assert_array_equal(batch["completion_mask_BxT"][0], [1, 1, 0, 0, 0, 1, 1, 0])
    np.testing.assert_array_equal(batch["rewards_BxK"][:, 0], [1, 0, 0, 0, 1])
    np.testing.assert_array_equal(batch["truncated_B"], [0, 1, 0, 0, 1])
    assert not batch["stale_BxT"].any()
    m = episode_metrics([a, b], episode_rewards([a, b], 0.0), None)
    assert m["agent/success_rate"] == pytest.approx(2 / 5) and m["agent/turns_mean"] == 2.0
    # group std: [1, 0] -> 0.5; [0, 0, 1] -> sqrt(2/9)
    assert m["agent/reward_std_mean"] == pytest.approx((0.5 + np.sqrt(2 / 9)) / 2)
    assert m["agent/zero_std_groups"] == 0.0


def test_grad_norm_spike_by_hand():
    rows = [{"grad_norm": g} for g in (1.0, 3.0, 2.0)]
    assert grad_norm_spike(rows[:2], 5.0) is None  # fewer than 3 known
    assert grad_norm_spike(rows, 8.0) == pytest.approx(4.0)  # median(1, 3, 2) = 2
    assert grad_norm_spike(rows + [{"grad_norm": 100.0}] * 10, 50.0) == pytest.approx(0.5)  # window of 10


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_leaves_observation_tokens_out(name):
    """Rows of two model turns with an observation between them; observations carry garbage
    log-probs (as the trainer's recomputation gives them: real numbers, not 0). The loss must not see
    them: zero gradient there, and the same loss and model-token gradient as the same rows with the
    observation columns moved to the end (model tokens contiguous, as in a single-turn batch) and
    DIFFERENT garbage in them."""
    from tests.test_presets import L_MAX, _case, _run

    preset, loss = _case(name)
    G = {"mc_grpo": 5, "sao": 1}.get(preset, 4)
    B = 16 if preset == "sao" else 4 * G
    rng = np.random.default_rng(7)
    mask = np.tile(np.array([1, 1, 0, 0, 0, 1, 1, 0], np.float32), (B, 1))
    mask[1, 5:] = 0  # an episode that ended after its first turn
    holes = mask == 0
    logp = (-2.0 * rng.random((B, T))).astype(np.float32)
    old = logp + 0.3 * rng.standard_normal((B, T)).astype(np.float32)
    rewards = rng.integers(0, 2, (B, 2)).astype(np.float32)
    values_BxT = rng.random((B, T)).astype(np.float32)

    def batch_with(garbage):
        g = np.where(holes, garbage, 0).astype(np.float32)
        return {
            "completion_mask_BxT": mask,
            "old_logp_BxT": old + g,
            "ref_logp_BxT": old - g,
            "rollout_logp_BxT": old + g,
            "entropy_BxT": np.ones((B, T), np.float32),
            "old_entropy_BxT": np.ones((B, T), np.float32) + np.abs(g),
            "truncated_B": np.zeros(B, np.float32),
            "rewards_BxK": rewards,
            "teacher_logp_BxT": old - 0.2 - 0.5 * g,  # the distill preset's teacher
            "old_values_BxT": values_BxT + g,  # a critic's (ppo)
        }

    batch = batch_with(37.0)
    batch["advantages_B"] = batch_advantages(loss, batch, G, L_MAX)  # as the update step does
    value, grad, _, _ = _run(loss, G, logp + np.where(holes, 50.0, 0).astype(np.float32), batch)
    grad = np.asarray(grad)
    assert np.max(np.abs(grad)) > 0
    np.testing.assert_array_equal(grad[holes], 0.0)
    order_BxT = np.argsort(holes, axis=1, kind="stable")  # model positions first, in order

    def move(x):
        return np.take_along_axis(x, order_BxT, axis=1) if x.ndim == 2 and x.shape[1] == T else x

    other = dict(batch_with(-11.0), advantages_B=batch["advantages_B"])
    value2, grad2, _, _ = _run(
        loss, G, move(logp - np.where(holes, 50.0, 0).astype(np.float32)), {k: move(v) for k, v in other.items()}
    )
    np.testing.assert_allclose(float(value), float(value2), rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(move(grad), np.asarray(grad2), rtol=2e-5, atol=1e-8)
