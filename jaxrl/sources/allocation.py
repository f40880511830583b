"""Variance-guided sample allocation (VIGOR): pure host functions, no engine, no JAX.

A step's budget is B = prompts_per_step * group_size samples. Every prompt starts with n0 samples; the
other B - N*n0 are handed out over `rounds` rounds, each to the prompts whose rewards so far vary most.

The rule (`plan_round`):
  score_i    = (sum_j (r_ij - mean_i)^2 + a * v0) / (n_i + a)
               the group's population variance shrunk towards v0 = (range/2)^2 of every reward seen
               this step, with the weight of `a` pseudo-samples (`prior_weight`, default 1)
  one round  spends ceil(left / rounds_left) samples, one at a time, each to the prompt with the
             highest score_i / (1 + given_i) (given_i: samples it got earlier in this round); ties:
             fewer samples so far, then the earlier prompt; a prompt at the cap gets no more.
docs/engine.md works an example by hand.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def prior_variance(rewards: Sequence[Sequence[float]]) -> float:
    """v0 = (range / 2)^2 over every reward of the step (0.25 for 0/1 rewards that differ somewhere)."""
    flat = [r for group in rewards for r in group]
    if not flat:
        return 0.0
    return ((max(flat) - min(flat)) / 2.0) ** 2


def variance_score(rewards: Sequence[float], v0: float, prior_weight: float = 1.0) -> float:
    """The group's population variance shrunk towards v0 with `prior_weight` pseudo-samples."""
    r = np.asarray(rewards, np.float64)
    return float((np.sum((r - r.mean()) ** 2) + prior_weight * v0) / (len(r) + prior_weight))


def plan_round(
    rewards: Sequence[Sequence[float]], budget_left: int, rounds_left: int, cap: int, prior_weight: float = 1.0
) -> list[int]:
    """How many more samples each prompt gets this round (see the module docstring). `rewards[i]`
    holds prompt i's scored rewards so far; the result sums to min(ceil(budget_left / rounds_left),
    room under the cap)."""
    if rounds_left < 1:
        raise ValueError(f"plan_round: rounds_left={rounds_left}, expected >= 1")
    v0 = prior_variance(rewards)
    score = [variance_score(r, v0, prior_weight) for r in rewards]
    n = [len(r) for r in rewards]
    given = [0] * len(rewards)
    for _ in range(math.ceil(budget_left / rounds_left)):
        open_ = [i for i in range(len(rewards)) if n[i] + given[i] < cap]
        if not open_:
            break
        best = min(open_, key=lambda i: (-score[i] / (1 + given[i]), n[i] + given[i], i))
        given[best] += 1
    return given


def allocate(draw, n_prompts: int, initial: int, budget: int, rounds: int, cap: int) -> list[list[float]]:
    """Run the whole allocation: `draw(counts)` draws counts[i] more samples of prompt i (0: none)
    and returns their rewards (a list per prompt, in order). Phase 1 draws `initial` of each; then
    `rounds` rounds of `plan_round` until `budget` samples are drawn. Returns every prompt's rewards."""
    if not 0 < initial <= cap or n_prompts * initial > budget or n_prompts * cap < budget:
        raise ValueError(
            f"allocate: {n_prompts} prompts x initial={initial} must fit budget={budget} <= {n_prompts} x cap={cap}"
        )
    rewards = [list(r) for r in draw([initial] * n_prompts)]
    for r in range(rounds):
        left = budget - sum(map(len, rewards))
        if left <= 0:
            break
        counts = plan_round(rewards, left, rounds - r, cap)
        for i, more in enumerate(draw(counts)):
            rewards[i].extend(more)
    return rewards


def allocation_metrics(rewards: Sequence[Sequence[float]]) -> dict:
    """engine/vigor_*: group sizes (min, max, mean), share of informative groups (rewards not all
    equal) and the mean group variance after allocation."""
    sizes = [len(r) for r in rewards]
    informative = [len(set(np.asarray(r, np.float64).tolist())) > 1 for r in rewards]
    return {
        "engine/vigor_min_group": min(sizes),
        "engine/vigor_max_group": max(sizes),
        "engine/vigor_mean_group": float(np.mean(sizes)),
        "engine/vigor_informative_frac": float(np.mean(informative)),
        "engine/vigor_mean_variance": float(np.mean([np.var(r) for r in rewards])),
    }
