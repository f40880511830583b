"""Config loading, overrides and validation: every user mistake is one line naming the field."""

import dataclasses
import pathlib

import pytest

from jaxrl import config as C

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_default_config_file_loads_and_validates():
    cfg = C.load_config(REPO / "configs" / "grpo_arithmetic.py")
    assert isinstance(cfg, C.Config)
    assert cfg.data.task == "arithmetic"


def test_override_parses_to_field_type():
    cfg = C.apply_overrides(
        C.Config(),
        ["train.steps=12", "optim.learning_rate=1e-3", "model.tie_embeddings=false", "loss.reward_weights=1,0.5"],
    )
    assert cfg.train.steps == 12 and isinstance(cfg.train.steps, int)
    assert cfg.optim.learning_rate == pytest.approx(1e-3)
    assert cfg.model.tie_embeddings is False
    assert cfg.loss.reward_weights == (1.0, 0.5)
    assert C.apply_overrides(C.Config(), ["loss.reward_weights=(1.0,)"]).loss.reward_weights == (1.0,)
    assert C.apply_overrides(C.Config(), ["loss.reward_weights=none"]).loss.reward_weights is None


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        C.Config().train.steps = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "item, needle",
    [
        ("train.stepz=3", "train.stepz: unknown field 'stepz'"),
        ("trian.steps=3", "trian.steps: unknown field 'trian'"),
        ("train.steps=abc", "train.steps: got 'abc', expected an integer"),
        ("model.tie_embeddings=maybe", "model.tie_embeddings"),
        ("rollout.prompts_per_step=-4", "rollout.prompts_per_step: got -4, expected a positive integer"),
        ("rollout.top_p=1.5", "rollout.top_p"),
        ("model.n_kv_heads=3", "model.n_kv_heads: got 3, expected a divisor of n_heads=4"),
        ("train", "expected the form a.b=value"),
        ("train=3", "train: is a section"),
        # Empty tuple values (or empty elements) are refused, never read as None / fewer values.
        ("loss.reward_weights=", "loss.reward_weights: got '', expected comma-separated numbers"),
        ("loss.reward_weights=()", "loss.reward_weights: got '()', expected comma-separated numbers"),
        ("loss.reward_weights=1,,0.5", "loss.reward_weights: got '1,,0.5'"),
        ("rollout.engine.filter_prior=", "rollout.engine.filter_prior: got ''"),
        ("model.lora.targets=", "model.lora.targets: got '', expected comma-separated names"),
        ("model.lora.targets=q,,v", "model.lora.targets: got 'q,,v'"),
    ],
)
def test_bad_overrides_name_the_field(item, needle):
    with pytest.raises(C.ConfigError) as e:
        C.load_config(REPO / "configs" / "grpo_arithmetic.py", [item])
    msg = str(e.value)
    assert needle in msg
    assert "\n" not in msg


def test_missing_config_file(tmp_path):
    with pytest.raises(C.ConfigError, match="not found"):
        C.load_config(tmp_path / "nope.py")


def test_wrong_type_in_config_file(tmp_path):
    p = tmp_path / "bad.py"
    p.write_text(
        "from jaxrl.config import Config, TrainConfig\n"
        "def get_config():\n    return Config(train=TrainConfig(steps='ten'))\n"
    )
    with pytest.raises(C.ConfigError, match=r"train.steps: got 'ten', expected an integer"):
        C.load_config(p)


def test_unknown_field_in_config_file(tmp_path):
    p = tmp_path / "bad.py"
    p.write_text(
        "from jaxrl.config import Config, TrainConfig\n"
        "def get_config():\n    return Config(train=TrainConfig(stepz=10))\n"
    )
    with pytest.raises(C.ConfigError, match="stepz"):
        C.load_config(p)


def test_microbatches_must_divide_batch():
    with pytest.raises(C.ConfigError, match="train.microbatches"):
        C.apply_overrides(C.Config(), ["train.microbatches=7"]).validate()


def test_config_file_that_is_not_python(tmp_path):
    p = tmp_path / "grpo.yaml"
    p.write_text("train: {steps: 3}\n")
    with pytest.raises(C.ConfigError, match=r"grpo.yaml' is not a Python file"):
        C.load_config(p)


def test_config_file_returning_another_class_names_config(tmp_path):
    p = tmp_path / "bad.py"
    p.write_text("from jaxrl.config import TrainConfig\ndef get_config():\n    return TrainConfig()\n")
    with pytest.raises(C.ConfigError, match=r"get_config\(\) returned TrainConfig, expected Config"):
        C.load_config(p)
