"""The default run (configs/grpo_arithmetic.py) training low-rank adapters on a frozen base.

LoRA (Hu et al. 2021, arXiv:2106.09685) of rank 8, alpha 16, on every projection (attention q/k/v/o
and the MLP's gate/up/down); the base is the same cached warm start as the full fine-tuning run's.
Adapters start at B = 0 (the policy is the base exactly) and train at ten times full fine-tuning's
learning rate (LORA_LR, the best of 3e-4, 1e-3, 3e-3 on 30-step runs: docs/scale.md "LoRA"): with B = 0 the
first steps move B only, and a product A @ B moves the policy slowly at full fine-tuning's rate.
"""

import dataclasses
import pathlib

from jaxrl.config import Config, load_config
from jaxrl.config.lora import LoraConfig

LORA_LR = 1e-3


def get_config() -> Config:
    base = load_config(pathlib.Path(__file__).with_name("grpo_arithmetic.py"))
    model = dataclasses.replace(base.model, lora=LoraConfig(rank=8, alpha=16.0))
    optim = dataclasses.replace(base.optim, learning_rate=LORA_LR)
    return dataclasses.replace(base, model=model, optim=optim)
