"""PPO with a value model on the default task: `configs/grpo_arithmetic.py` with the loss section
replaced, a critic, and two PPO epochs per rollout batch (as the loss study, benchmarks/variants.py).

One rollout for each of 128 prompts (the 128 completions per step of grpo_arithmetic.py, as SAO's
config): with a learned baseline V(prompt, prefix) a group of samples per prompt is not needed to
centre the reward, and more distinct prompts per step give the critic more states to learn from.
The critic is a copy of the warm-started policy with a zero value head (docs/ppo.md), trained with
its own AdamW at 3e-4 (3x the policy's: its head starts from zero), value clip 0.2. GAE with gamma 1,
lambda 0.95, advantages whitened over the batch's live tokens.
Preset: `jaxrl.losses.presets.PRESETS["ppo"]` (`jaxrl variants` lists its parts and paper).
"""

import dataclasses
import pathlib

from jaxrl.config import Config, CriticConfig, LossConfig, load_config


def get_config() -> Config:
    base = load_config(pathlib.Path(__file__).with_name("grpo_arithmetic.py"))
    return dataclasses.replace(
        base,
        train=dataclasses.replace(base.train, ppo_epochs=2),
        rollout=dataclasses.replace(base.rollout, group_size=1, prompts_per_step=128),
        loss=LossConfig(preset="ppo", reward_weights=(1.0, 0.0), options={"gamma": 1.0, "lam": 0.95}),
        critic=CriticConfig(enabled=True, learning_rate=3e-4, value_clip=0.2),
    )
