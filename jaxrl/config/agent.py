"""Config section of multi-turn agent episodes (jaxrl.agents), re-exported by `jaxrl.config`.

An episode runs when `data.task` names an environment (`agent_calculator`, `agent_gridworld`): the
policy writes a turn, the environment answers with an observation, and so on until the environment
says done, the model emits EOS, or a limit below is reached. Observation tokens are context only
(no loss, no log-prob)."""

from __future__ import annotations

import dataclasses

from jaxrl.config.checks import _check


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    max_turns: int = 4  # model turns per episode; an episode still going after them is truncated
    max_obs_tokens: int = 48  # tokens of one observation; a longer one is cut (agent/obs_cut counts them)
    env_workers: int = 8  # threads running environment steps while the other slots keep decoding
    overlap: bool = True  # False: turn-synchronous (every sample waits for every environment step)
    # Credit: the trajectory's return (sum of the environment's rewards) is reward column 0; with
    # shaping_weight > 0 column 1 is shaping_weight * the sum of the per-turn shaping rewards the
    # environment reports (info["shaping"]); 0: trajectory-level reward only (StarPO).
    shaping_weight: float = 0.0
    # StarPO-S: draw ceil(prompts_per_step / keep_top_variance) groups, keep the prompts_per_step
    # whose rewards vary most (1.0: keep every group drawn).
    keep_top_variance: float = 1.0
    # The most characters of a tool's result returned to the model (longer ones are cut, counted).
    tool_max_output: int = 2000

    def validate(self, prefix: str = "agent") -> None:
        _check(self.max_turns > 0, f"{prefix}.max_turns", "a positive integer", self.max_turns)
        _check(self.max_obs_tokens > 0, f"{prefix}.max_obs_tokens", "a positive integer", self.max_obs_tokens)
        _check(self.env_workers > 0, f"{prefix}.env_workers", "a positive integer", self.env_workers)
        _check(self.shaping_weight >= 0, f"{prefix}.shaping_weight", "a non-negative number", self.shaping_weight)
        _check(
            0 < self.keep_top_variance <= 1,
            f"{prefix}.keep_top_variance",
            "a fraction in (0, 1]",
            self.keep_top_variance,
        )
        _check(self.tool_max_output > 0, f"{prefix}.tool_max_output", "a positive integer", self.tool_max_output)
