"""MC-GRPO on the default task: `configs/grpo_arithmetic.py` with the loss section replaced
and two PPO epochs per rollout batch, as in the loss study (benchmarks/variants.py): the second epoch is
off-policy, so the preset's clipping and ratio corrections act (with one epoch every ratio is exactly 1).

Median baseline over G+1 samples; the median pivot is dropped from the loss.
Preset: `jaxrl.losses.presets.PRESETS["mc_grpo"]` (`jaxrl variants` lists its parts and paper).
"""

import dataclasses
import pathlib

from jaxrl.config import Config, LossConfig, load_config


def get_config() -> Config:
    base = load_config(pathlib.Path(__file__).with_name("grpo_arithmetic.py"))
    # Sample G+1 = 9 per prompt: the median row of each group is the pivot and gets no gradient, so
    # 8 completions per prompt carry gradient, as in grpo_arithmetic.py. MC-GRPO's claim is about
    # small G: try --set rollout.group_size=3 (G = 2).
    return dataclasses.replace(
        base,
        train=dataclasses.replace(base.train, ppo_epochs=2),
        rollout=dataclasses.replace(base.rollout, group_size=9),
        loss=LossConfig(preset="mc_grpo", reward_weights=(1.0, 0.0)),
    )
