"""GRPO against a learned reward model instead of the verifier: configs/grpo_arithmetic.py with every
completion scored by the reward model of configs/rm_arith.py (reward_model.workdir), the only reward
the loss sees (loss.reward_weights = (0, 0, 1): correctness and format are logged, not rewarded). The
held-out eval/accuracy then measures the preference the reward model was trained on (the right sum).
Train the reward model first:

    jaxrl reward-model train configs/rm_arith.py --workdir runs/rm_arith
    jaxrl train configs/grpo_rm_arith.py --workdir runs/grpo_rm_arith
"""

import dataclasses
import pathlib

from jaxrl.config import Config, load_config


def get_config() -> Config:
    base = load_config(pathlib.Path(__file__).with_name("rm_arith.py"))
    return dataclasses.replace(
        base,
        loss=dataclasses.replace(base.loss, reward_weights=(0.0, 0.0, 1.0)),
        reward_model=dataclasses.replace(base.reward_model, workdir="runs/rm_arith"),
    )
