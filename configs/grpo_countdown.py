"""GRPO on Countdown: reach the target from three two-digit numbers with + - * /, e.g. `79,85,34:198=`
-> `85+79+34`. The verifier checks the expression exactly (every number used once, the target reached).

The base policy comes from a short supervised warm start (cached) on demonstrations from a fallible
teacher that forgets every parenthesis 60% of the time (`(9-3)*7` -> `9-3*7`): wrong on the problems
whose answer needs them, right on the rest. Model, optimizer and rollout budget are the default run's
(`configs/grpo_arithmetic.py`); prompts run to 13 characters and answers to 10, so prompts get 14
tokens and completions 11. With one-digit numbers only 2,144 distinct problems exist, and the warm start
memorises its training problems instead of learning the search.
GRPO: Shao et al. 2024, DeepSeekMath, arXiv:2402.03300.
"""

import dataclasses
import pathlib

from jaxrl.config import Config, DataConfig, load_config


def get_config() -> Config:
    base = load_config(pathlib.Path(__file__).with_name("grpo_arithmetic.py"))
    data = DataConfig(task="countdown", digits=2, operations="+-*/", num_train=8000, num_test=500, max_prompt_len=14)
    return dataclasses.replace(base, data=data, rollout=dataclasses.replace(base.rollout, max_new_tokens=11))
