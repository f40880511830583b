"""GD2PO on the default task: `configs/grpo_arithmetic.py` with the loss section replaced
and two PPO epochs per rollout batch, as in the loss study (benchmarks/variants.py): the second epoch is
off-policy, so the preset's clipping and ratio corrections act (with one epoch every ratio is exactly 1).

GDPO plus conflict masking and consensus reweighting (our reading). Format weight 0.1 as in
gdpo_arithmetic.py: with a zero weight no reward could ever conflict.
Preset: `jaxrl.losses.presets.PRESETS["gd2po"]` (`jaxrl variants` lists its parts and paper).
"""

import dataclasses
import pathlib

from jaxrl.config import Config, LossConfig, load_config


def get_config() -> Config:
    base = load_config(pathlib.Path(__file__).with_name("grpo_arithmetic.py"))
    return dataclasses.replace(
        base,
        loss=LossConfig(preset="gd2po", reward_weights=(1.0, 0.1)),
        train=dataclasses.replace(base.train, ppo_epochs=2),
    )
