"""GMPO on the default task: `configs/grpo_arithmetic.py` with the loss section replaced.

Geometric mean of token ratios clipped in log space at +-0.4.
Preset: `jaxrl.losses.presets.PRESETS["gmpo"]` (`jaxrl variants` lists its parts and paper).
"""

import dataclasses
import pathlib

from jaxrl.config import Config, LossConfig, load_config


def get_config() -> Config:
    base = load_config(pathlib.Path(__file__).with_name("grpo_arithmetic.py"))
    return dataclasses.replace(base, loss=LossConfig(preset="gmpo", reward_weights=(1.0, 0.0)))
