"""AsyncWebRL constant normaliser on the default task: `configs/grpo_arithmetic.py` with the loss section replaced
and two PPO epochs per rollout batch, as in the loss study (benchmarks/variants.py): the second epoch is
off-policy, so the preset's clipping and ratio corrections act (with one epoch every ratio is exactly 1).

GRPO with 1/|y_i| replaced by 1/k, k = max_new_tokens.
Preset: `jaxrl.losses.presets.PRESETS["async_const_norm"]` (`jaxrl variants` lists its parts and paper).
"""

import dataclasses
import pathlib

from jaxrl.config import Config, LossConfig, load_config


def get_config() -> Config:
    base = load_config(pathlib.Path(__file__).with_name("grpo_arithmetic.py"))
    return dataclasses.replace(
        base,
        loss=LossConfig(preset="async_const_norm", reward_weights=(1.0, 0.0)),
        train=dataclasses.replace(base.train, ppo_epochs=2),
    )
