"""One resolution of the policy a config names (jaxrl.policy.resolve) and one batch type for what a rollout
hands the update (jaxrl.rollout.batch): nothing here compiles."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest
from conftest import REPO, TINY

from jaxrl.config import ConfigError, load_config
from jaxrl.data.registry import get_task
from jaxrl.data.tokenizer import CharTokenizer
from jaxrl.models.transformer import abstract_params, init_params
from jaxrl.policy.resolve import resolve_policy
from jaxrl.rollout.batch import RolloutBatch


def test_a_text_task_gets_the_character_tokenizer_and_its_vocabulary():
    tokenizer, model_cfg = resolve_policy(load_config(REPO / "configs" / "grpo_arithmetic.py", TINY))
    assert tokenizer == CharTokenizer() and model_cfg.vocab_size == CharTokenizer().vocab_size


def test_an_environment_brings_its_alphabet():
    cfg = load_config(REPO / "configs" / "agent_gridworld.py", TINY)
    tokenizer, model_cfg = resolve_policy(cfg)
    assert tokenizer.alphabet == get_task(cfg.data.task).suite.alphabet != CharTokenizer().alphabet
    assert model_cfg.vocab_size == tokenizer.vocab_size


def test_a_missing_checkpoint_names_the_field(tmp_path):
    cfg = load_config(REPO / "configs" / "grpo_arithmetic.py", [*TINY, f"model.hf_path={tmp_path / 'nope'}"])
    with pytest.raises(ConfigError, match="model.hf_path"):
        resolve_policy(cfg)


def test_abstract_params_are_init_params_shapes_laid_out_as_asked():
    _, model_cfg = resolve_policy(load_config(REPO / "configs" / "grpo_arithmetic.py", TINY))
    real = init_params(model_cfg, jax.random.key(1))
    abstract = abstract_params(model_cfg)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == jax.tree.map(lambda a: (a.shape, a.dtype), real)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    placed = abstract_params(model_cfg, jax.tree.map(lambda _: device, abstract))
    assert all(a.sharding == device for a in jax.tree.leaves(placed))


def _group(n, version, finished):
    T = 3
    return SimpleNamespace(
        prompt_P=np.array([0, 4], np.int32),
        prompt_mask_P=np.array([0, 1], np.int32),
        tokens_GxT=np.full((n, T), 5, np.int32),
        completion_mask_GxT=np.ones((n, T), np.float32),
        logp_GxT=np.full((n, T), -0.5, np.float32),
        version_GxT=np.array([[version, version, -1]] * n, np.int32),
        finished_G=np.array(finished),
    )


def test_batch_from_groups_numbers_them_and_marks_stale_tokens():
    a, b = _group(2, 3, [True, False]), _group(1, 4, [True])
    groups = [a, b]
    batch = RolloutBatch.from_groups(
        groups,
        [g.completion_mask_GxT for g in groups],
        [~g.finished_G for g in groups],
        versions_GxT=[g.version_GxT for g in groups],
    )
    np.testing.assert_array_equal(batch.group_id_B, [0, 0, 1])
    np.testing.assert_array_equal(batch.truncated_B, [0, 1, 0])
    assert batch.prompt_tokens_BxP.shape == (3, 2) and batch.truncated_B.dtype == np.float32
    fresh = batch.with_staleness(4)  # the step's version is 4: group a's tokens are one version old
    np.testing.assert_array_equal(fresh.stale_BxT, [[1, 1, 0], [1, 1, 0], [0, 0, 0]])
    # The update's dict: only the fields the batch carries, under the names the sharding rules read.
    assert sorted(fresh.fields()) == sorted(
        ["prompt_tokens_BxP", "prompt_mask_BxP", "tokens_BxT", "completion_mask_BxT", "rollout_logp_BxT"]
        + ["truncated_B", "group_id_B", "stale_BxT"]
    )
