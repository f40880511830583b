"""Online difficulty filter over the prompt stream (DEPO / HIVE), host only.

Each prompt (by record id) keeps a Beta(a, b) posterior over its success probability: the prior
`rollout.engine.filter_prior`, plus one success per sample whose correctness reward (column 0 of
rewards_BxK) is > 0.5 and one failure per other sample, added after every scored group. Before a
prompt seen before is admitted, p ~ Beta(a, b) is drawn (Thompson sampling) and the prompt is
skipped when p < filter_low or p > filter_high: a prompt almost sure to come back all-0 or all-1 (no
GRPO signal) is skipped, more often the more evidence there is, while one draw in a while still
re-tests it. Prompts never seen always pass. The draws come from a numpy Generator seeded from
train.seed; `to_state` / `from_state` carry the posteriors, the generator and the counters through
a checkpoint's JSON item.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

# Bumps the filter's generator away from other consumers of train.seed.
_FILTER_SEED_SALT = 0x66696C74
# After this many skips in a row the next prompt is admitted anyway (counted): a run whose every
# prompt is solved would otherwise spin on draws that pass with probability ~filter_high ** n.
MAX_SKIPS_IN_A_ROW = 1000


class BetaPromptFilter:
    def __init__(self, low: float, high: float, prior: tuple, rng: np.random.Generator):
        self.low, self.high, self.prior, self.rng = low, high, (float(prior[0]), float(prior[1])), rng
        self.posteriors: dict[str, list[float]] = {}  # record id -> [a, b]
        self.n_filtered = 0  # prompts skipped, over the run
        self.n_forced = 0  # prompts admitted after MAX_SKIPS_IN_A_ROW skips, over the run

    @classmethod
    def from_config(cls, ecfg, seed: int, state: dict | None = None, process: int = 0) -> BetaPromptFilter | None:
        """The filter `rollout.engine.prompt_filter` asks for (None when "none"), resumed from `state`.
        process: the process index of a multi-process run (each process filters its own prompts with
        a generator of its own; 0 draws as a one-process run)."""
        if ecfg.prompt_filter == "none":
            return None
        if state is not None:
            return cls.from_state(state, ecfg.filter_low, ecfg.filter_high, ecfg.filter_prior)
        entropy = (seed, _FILTER_SEED_SALT) if process == 0 else (seed, _FILTER_SEED_SALT, process)
        return cls(ecfg.filter_low, ecfg.filter_high, ecfg.filter_prior, np.random.default_rng(entropy))

    def admit(self, prompt_id) -> bool:
        """One Thompson decision for the prompt (draws only for prompts seen before)."""
        ab = self.posteriors.get(str(prompt_id))
        if ab is None:
            return True
        p = self.rng.beta(ab[0], ab[1])
        return self.low <= p <= self.high

    def update(self, prompt_id, rewards_GxK: np.ndarray) -> None:
        """Add one scored group of the prompt: successes are samples with correctness > 0.5."""
        n_success = int((np.asarray(rewards_GxK)[:, 0] > 0.5).sum())
        a, b = self.posteriors.get(str(prompt_id), self.prior)
        self.posteriors[str(prompt_id)] = [a + n_success, b + len(rewards_GxK) - n_success]

    def admitted(self, feed: Iterable) -> Iterator:
        """The (record, tokens) pairs of `feed` that pass; a skipped one is counted and the feed moves on."""
        in_a_row = 0
        for record, tokens in feed:
            if self.admit(record["id"]):
                in_a_row = 0
                yield record, tokens
            elif in_a_row >= MAX_SKIPS_IN_A_ROW:
                in_a_row, self.n_forced = 0, self.n_forced + 1
                yield record, tokens
            else:
                in_a_row, self.n_filtered = in_a_row + 1, self.n_filtered + 1

    def to_state(self) -> dict:
        """JSON-able: posteriors, counters and the generator (its 128-bit integers as strings)."""
        bg = self.rng.bit_generator.state
        return {
            "posteriors": {k: list(v) for k, v in self.posteriors.items()},
            "n_filtered": self.n_filtered,
            "n_forced": self.n_forced,
            "rng": {**bg, "state": {k: str(v) for k, v in bg["state"].items()}},
        }

    @classmethod
    def from_state(cls, state: dict, low: float, high: float, prior: tuple) -> BetaPromptFilter:
        """The filter `to_state` saved (thresholds and prior come from the config, not the state)."""
        bg = state["rng"]
        f = cls(low, high, prior, np.random.Generator(np.random.PCG64()))
        f.rng.bit_generator.state = {**bg, "state": {k: int(v) for k, v in bg["state"].items()}}
        f.posteriors = {k: [float(a), float(b)] for k, (a, b) in state["posteriors"].items()}
        f.n_filtered, f.n_forced = int(state["n_filtered"]), int(state["n_forced"])
        return f

    def metrics(self, before: tuple) -> dict:
        """engine/filtered_prompts (and forced admissions) since `before` = (n_filtered, n_forced)."""
        return {
            "engine/filtered_prompts": self.n_filtered - before[0],
            "engine/filter_forced": self.n_forced - before[1],
            "engine/filter_prompts_seen": len(self.posteriors),
        }
