"""GDPO on the default task: `configs/grpo_arithmetic.py` with the loss section replaced
and two PPO epochs per rollout batch, as in the loss study (benchmarks/variants.py): the second epoch is
off-policy, so the preset's clipping and ratio corrections act (with one epoch every ratio is exactly 1).

Each reward function normalised within the group before combining. The format reward gets
weight 0.1 here (the other variants reward correctness only): with one live reward column GDPO
would reduce to batch-whitened GRPO.
Preset: `jaxrl.losses.presets.PRESETS["gdpo"]` (`jaxrl variants` lists its parts and paper).
"""

import dataclasses
import pathlib

from jaxrl.config import Config, LossConfig, load_config


def get_config() -> Config:
    base = load_config(pathlib.Path(__file__).with_name("grpo_arithmetic.py"))
    return dataclasses.replace(
        base,
        loss=LossConfig(preset="gdpo", reward_weights=(1.0, 0.1)),
        train=dataclasses.replace(base.train, ppo_epochs=2),
    )
