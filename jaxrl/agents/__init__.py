"""Multi-turn agent episodes: the environment protocol (env.py), tools (tools.py), the embedded
environments, and the suite registry: `data.task` names an environment suite."""

from __future__ import annotations

import importlib

from jaxrl.config import ConfigError

# data.task -> "module:attribute" of its EnvSuite (imported on first use).
SUITES = {
    "agent_calculator": "jaxrl.agents.calculator:SUITE",
    "agent_gridworld": "jaxrl.agents.gridworld:SUITE",
}


def is_agent_task(task: str) -> bool:
    return task in SUITES


def load_suite(task: str):
    """The EnvSuite that data.task names."""
    if task not in SUITES:
        raise ConfigError(f"data.task: got {task!r}, expected an environment: {' or '.join(map(repr, SUITES))}")
    module, attr = SUITES[task].split(":")
    return getattr(importlib.import_module(module), attr)
