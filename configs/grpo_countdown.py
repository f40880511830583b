"""GRPO on Countdown: reach the target from three two-digit numbers with + - * /, e.g. `79,85,34:198=`
-> `85+79+34`. The verifier checks the expression exactly (every number used once, the target reached).

The base policy comes from a short supervised warm start (cached) on demonstrations from a fallible
teacher that forgets every parenthesis 60% of the time (`(9-3)*7` -> `9-3*7`): wrong on the problems
whose answer needs them, right on the rest. Model and warm start are the default run's
(`configs/grpo_arithmetic.py`); prompts run to 13 characters and answers to 10, so prompts get 14
tokens and completions 11. With one-digit numbers only 2,144 distinct problems exist, and the warm start
memorises its training problems instead of learning the search.

The base solves 38% greedily but 65% within 8 samples (pass@8): most of its errors are in the search
over number order and operators, not in parentheses (it writes one in only 11% of its samples on the
24% of problems that need them). With the default rollout budget (16 prompts a step, 100 steps) GRPO
only sharpens the sampled policy towards its greedy answer and held-out greedy accuracy stays flat
(37.8% -> 36.4%); a higher learning rate (5e-4) destabilises it (down to 11.6%). Four times the
prompts per step (64 x 8 samples, averaging out the gradient noise Adam would otherwise follow) for
400 steps at the default 1e-4 moves the greedy answer itself: 37.8% -> 46.8% (seed 0) and 35.4% ->
41.4% (seed 1); 200 steps gave +5.2 and +2.2 (docs/runs.md, "Countdown").
GRPO: Shao et al. 2024, DeepSeekMath, arXiv:2402.03300.
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
