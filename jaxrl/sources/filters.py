"""DAPO dynamic sampling: which of a step's scored groups go into the update batch (host only).

A group whose combined rewards (as the loss combines them: `scoring.combined_reward` with
loss.reward_weights) are all equal has zero group-relative advantage: it carries no GRPO signal.
`select_informative` drops such groups and draws more until the step holds `n_groups` informative
ones, or until it has drawn `max_extra` groups beyond the first `n_groups`. At the cap the batch is
filled with dropped groups, in the order they were drawn, so that it keeps its B rows (the update
is compiled for one shape). Filling with real groups rather than padding rows (group_id -1, zero
mask): a dropped group adds nothing to the policy-gradient term either way, but real rows keep the
KL / entropy terms and the loss's token counts as the run without filtering would see them, and a
step where every group is uninformative still has rows to normalise by.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from jaxrl.sources.scoring import combined_reward


class ScoredGroup(NamedTuple):
    group: Any  # the engine's Group (jaxrl.rollout.engine.driver)
    rewards_GxK: np.ndarray  # one row per sample, one column per reward function


class Selection(NamedTuple):
    groups: list  # the batch's ScoredGroups, in draw order: informative first, then any fill
    n_drawn: int  # every group drawn this step
    n_dropped: int  # uninformative groups drawn (n_filled of them were put back at the cap)
    n_filled: int  # uninformative groups put back to keep B rows (only when the cap was hit)
    n_extra: int  # groups drawn beyond the first n_groups
    cap_hit: bool  # the cap stopped the draws before n_groups informative groups were found
    drawn_reward_mean: float  # mean combined reward over every sample drawn, kept or not


def informative(rewards_GxK: np.ndarray, reward_weights) -> bool:
    """Whether the group's combined rewards differ (exact comparison: any difference is a signal,
    as GRPO's std normalisation scales it up)."""
    r_G = combined_reward(rewards_GxK, reward_weights)
    return bool(np.any(r_G != r_G[0]))


def select_informative(draw: Callable[[int], list], n_groups: int, max_extra: int, reward_weights) -> Selection:
    """`draw(n)` -> up to n more ScoredGroups (fewer, or none, only when the prompts run out)."""
    drawn = list(draw(n_groups))
    kept = [g for g in drawn if informative(g.rewards_GxK, reward_weights)]
    n_extra = 0
    while len(kept) < n_groups and n_extra < max_extra:
        more = list(draw(min(n_groups - len(kept), max_extra - n_extra)))
        if not more:
            break
        n_extra += len(more)
        drawn += more
        kept += [g for g in more if informative(g.rewards_GxK, reward_weights)]
    cap_hit = len(kept) < n_groups
    kept_ids = {id(g) for g in kept}
    fill = [g for g in drawn if id(g) not in kept_ids][: n_groups - len(kept)]
    rewards = [combined_reward(g.rewards_GxK, reward_weights) for g in drawn]
    return Selection(
        groups=kept + fill,
        n_drawn=len(drawn),
        n_dropped=len(drawn) - len(kept),
        n_filled=len(fill),
        n_extra=n_extra,
        cap_hit=cap_hit,
        drawn_reward_mean=float(np.concatenate(rewards).mean()) if rewards else 0.0,
    )


def selection_metrics(sel: Selection) -> dict:
    """The engine/dyn_* metrics row of one step (the reward/* metrics describe the kept batch)."""
    return {
        "engine/dyn_dropped": sel.n_dropped,
        "engine/dyn_filled": sel.n_filled,
        "engine/dyn_extra": sel.n_extra,
        "engine/dyn_cap_hit": int(sel.cap_hit),
        "engine/dyn_reward_mean_drawn": sel.drawn_reward_mean,
    }
