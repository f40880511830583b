"""SAO on the default task: `configs/grpo_arithmetic.py` with the loss section replaced
and two PPO epochs per rollout batch, as in the loss study (benchmarks/variants.py): the second epoch is
off-policy, so the preset's clipping and ratio corrections act (with one epoch every ratio is exactly 1).

Single rollout per prompt, batch-mean baseline (our reading: no value head yet), strict
double-side clip.
Preset: `jaxrl.losses.presets.PRESETS["sao"]` (`jaxrl variants` lists its parts and paper).
"""

import dataclasses
import pathlib

from jaxrl.config import Config, LossConfig, load_config


def get_config() -> Config:
    base = load_config(pathlib.Path(__file__).with_name("grpo_arithmetic.py"))
    # One rollout per prompt; 128 prompts per step keeps the 128 completions of grpo_arithmetic.py.
    return dataclasses.replace(
        base,
        train=dataclasses.replace(base.train, ppo_epochs=2),
        rollout=dataclasses.replace(base.rollout, group_size=1, prompts_per_step=128),
        loss=LossConfig(preset="sao", reward_weights=(1.0, 0.0)),
    )
