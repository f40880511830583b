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


def load_agent_task(data_cfg):
    """TaskData of an environment suite: its train / test records (generated in memory, deterministic
    in data.seed); episodes are scored by their environments, so there is no verifier."""
    from jaxrl.data.tasks import RecordSource, TaskData

    suite = load_suite(data_cfg.task)
    split = lambda name, n: RecordSource(f"{data_cfg.task}/{name}", suite.records(name, n, data_cfg.seed))
    return TaskData(data_cfg.task, split("train", data_cfg.num_train), split("test", data_cfg.num_test), None, "")
