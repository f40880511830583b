"""GRPO on Countdown: reach the target from three one-digit numbers with + - * /, e.g. `6,9,8:6=` ->
`6*(9-8)`. The verifier checks the expression exactly (every number used once, the target reached).

The base policy comes from a short supervised warm start (cached) on demonstrations from a fallible
teacher that forgets every parenthesis 60% of the time (`(9-3)*7` -> `9-3*7`): wrong on the third of
the problems whose answer needs them, right on the rest. RL then learns from the correctness reward
where the parentheses matter. Model, optimizer and rollout budget are the default run's
(`configs/grpo_arithmetic.py`); answers run to 7 characters, so completions get 8 tokens.
GRPO: Shao et al. 2024, DeepSeekMath, arXiv:2402.03300.
"""

import dataclasses
import pathlib

from jaxrl.config import Config, DataConfig, load_config


def get_config() -> Config:
    base = load_config(pathlib.Path(__file__).with_name("grpo_arithmetic.py"))
    # 2,144 distinct problems exist with one-digit numbers and all four operations: 1,944 train, 200 test.
    data = DataConfig(task="countdown", digits=1, operations="+-*/", num_train=1944, num_test=200, max_prompt_len=10)
    return dataclasses.replace(
        base,
        data=data,
        rollout=dataclasses.replace(base.rollout, max_new_tokens=8),
        train=dataclasses.replace(base.train, eval_prompts=200),
    )
