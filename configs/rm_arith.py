"""A scalar reward model for 2-digit addition, trained by `jaxrl reward-model train` from synthetic
preference pairs: the right sum preferred over the sum with its carries dropped (the warm-started
policy's own typical mistake) or, when there is no carry, over a nearby wrong number. The backbone starts
from the cached warm-started policy of configs/grpo_arithmetic.py (reward_model.init='base', as
InstructGPT's reward model starts from the SFT model: Ouyang et al. 2022, arXiv:2203.02155), so it
already reads sums; the Bradley-Terry loss trains it and a linear score head.

    jaxrl reward-model train configs/rm_arith.py --workdir runs/rm_arith
"""

import dataclasses
import pathlib

from jaxrl.config import Config, RewardModelConfig, load_config


def get_config() -> Config:
    return dataclasses.replace(
        load_config(pathlib.Path(__file__).with_name("grpo_arithmetic.py")),
        reward_model=RewardModelConfig(
            synthetic="arithmetic",
            init="base",
            num_train=4000,
            num_test=500,
            steps=600,
            batch_size=32,
            learning_rate=3e-4,
            eval_every=50,
            checkpoint_every=100,
        ),
    )
