"""GRPO on Countdown: reach the target from three two-digit numbers with + - * /, e.g. `79,85,34:198=`
-> `85+79+34`. The verifier checks the expression exactly (every number used once, the target reached).

The base policy comes from a short supervised warm start (cached) on demonstrations from a fallible
teacher that forgets every parenthesis 60% of the time (`(9-3)*7` -> `9-3*7`). Model and warm start are
the default run's (`configs/grpo_arithmetic.py`); prompts get 14 tokens and completions 11. Two-digit
numbers, since one-digit ones give so few distinct problems that the warm start memorises them. Most of
the base's errors are in the search over number order and operators, and with the default budget GRPO
only sharpens the samples towards the greedy answer; four times the prompts per step (64 x 8 samples,
averaging out the gradient noise Adam would otherwise follow) for 400 steps moves the greedy answer
itself (docs/runs.md, "Countdown"). GRPO: Shao et al. 2024, DeepSeekMath, arXiv:2402.03300.
"""

import dataclasses
import pathlib

from jaxrl.config import Config, DataConfig, load_config


def get_config() -> Config:
    base = load_config(pathlib.Path(__file__).with_name("grpo_arithmetic.py"))
    data = DataConfig(task="countdown", digits=2, operations="+-*/", num_train=8000, num_test=500, max_prompt_len=14)
    rollout = dataclasses.replace(base.rollout, max_new_tokens=11, prompts_per_step=64)
    train = dataclasses.replace(base.train, steps=400, eval_every=50)
    return dataclasses.replace(base, data=data, rollout=rollout, train=train)
