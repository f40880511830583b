"""DAPO on the default task: `configs/grpo_arithmetic.py` with the loss section replaced
and two PPO epochs per rollout batch, as in the loss study (benchmarks/variants.py): the second epoch is
off-policy, so the preset's clipping and ratio corrections act (with one epoch every ratio is exactly 1).

Clip-higher (0.2 / 0.28), token-mean, overlong shaping (L_c = 0.2 * max_new_tokens = 1 token
here), constant groups dropped from the loss.
Preset: `jaxrl.losses.presets.PRESETS["dapo"]` (`jaxrl variants` lists its parts and paper).
"""

import dataclasses
import pathlib

from jaxrl.config import Config, LossConfig, load_config


def get_config() -> Config:
    base = load_config(pathlib.Path(__file__).with_name("grpo_arithmetic.py"))
    return dataclasses.replace(
        base,
        loss=LossConfig(preset="dapo", reward_weights=(1.0, 0.0)),
        train=dataclasses.replace(base.train, ppo_epochs=2),
    )
