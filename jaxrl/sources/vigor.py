"""A step's groups under `rollout.engine.allocation=vigor`: variance-guided allocation of the
step's B = prompts_per_step * group_size samples (the rule: jaxrl.sources.allocation).

Phase 1 takes prompts_per_step prompts from the feed and draws `initial_samples` of each; each
round then scores what it has (the combined reward, as the loss combines the reward parts) and
draws more samples of the prompts `plan_round` picks, with `Engine.sample` (the prompt is prefilled
again; the new samples use the same kernels and fresh noise, so each is a draw of the policy). A
prompt's samples from all rounds form one group, so the batch has exactly B rows in groups of
unequal size. Every sample is drawn under this step's params (admission=exact): no staleness.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxrl.rollout.engine.driver import Engine
from jaxrl.rollout.engine.groups import Group, concat_groups
from jaxrl.sources.allocation import allocate, allocation_metrics
from jaxrl.sources.scoring import combined_reward, score_completions


def group_rewards(group: Group, *, tokenizer, verifier, reward_weights) -> np.ndarray:
    """The combined reward of each sample of `group` against its record (the group's tag)."""
    records = [group.tag] * len(group.tokens_GxT)
    rewards_GxK, _ = score_completions(
        group.tokens_GxT, group.finished_G, records, tokenizer=tokenizer, verifier=verifier
    )
    return combined_reward(rewards_GxK, reward_weights)


def collect_vigor(
    engine: Engine, params, version: int, feed, rollout_cfg, rewards_of: Callable[[Group], np.ndarray]
) -> tuple[list[Group], dict]:
    """(the step's groups, one per prompt, in feed order; engine/vigor_* metrics). `feed` yields
    (record, tokens); `rewards_of(group)` scores a group's samples."""
    ecfg, N, G = rollout_cfg.engine, rollout_cfg.prompts_per_step, rollout_cfg.group_size
    items = [next(feed) for _ in range(N)]
    parts: list[list[Group]] = [[] for _ in items]
    rounds = [0]

    def draw(counts: list[int]) -> list[list[float]]:
        groups = engine.sample(params, version, [(rec, tokens, k) for (rec, tokens), k in zip(items, counts)])
        rounds[0] += 1
        for part, group, k in zip(parts, groups, counts):
            if k:
                part.append(group)
        return [rewards_of(g).tolist() if k else [] for g, k in zip(groups, counts)]

    cap = ecfg.max_group_samples or 2 * G
    rewards = allocate(draw, N, ecfg.initial_samples, N * G, ecfg.allocation_rounds, cap)
    groups = [concat_groups(p, p[0].tag, p[0].prompt_P, p[0].prompt_mask_P) for p in parts]
    assert sum(len(g.tokens_GxT) for g in groups) == N * G, "vigor: the step's budget not exactly spent"
    return groups, {**allocation_metrics(rewards), "engine/vigor_draws": rounds[0]}
