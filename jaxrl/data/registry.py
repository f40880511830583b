"""The task registry: `data.task` names a `Task`, a verified text task or a multi-turn environment.

A user's config file registers its own task before `get_config()` runs, so the name it sets in
`data.task` validates like a built-in's:

    register_task(Task("echo", records=my_records, verifier=my_verifier))          # a text task
    register_task(Task("agent_mygame", environment=EnvSuite("agent_mygame", ...)))  # an environment
    register_task(Task("my_agent", agent=my_agent, records=my_records))              # a black-box agent

Records are dicts of str with "id" and "prompt" ("answer": the reference a text task's warm start
imitates; "info": anything the verifier reads). Every character of a record's prompt and answer (and
of an environment's observations) must be in the task's alphabet when the run uses the character
tokenizer; one that is not is a ConfigError naming it, the task and the record.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from jaxrl.config import ConfigError, DataConfig
from jaxrl.config.checks import _check
from jaxrl.data import arithmetic, countdown, long_addition, math_jsonl
from jaxrl.data.rewards import (
    Verifier,
    arithmetic_answer,
    countdown_answer,
    long_addition_answer,
    verify_arithmetic,
    verify_countdown,
    verify_long_addition,
)
from jaxrl.data.teachers import fallible_answer
from jaxrl.data.tokenizer import DEFAULT_ALPHABET

FinalAnswer = Callable[[str], Hashable | None]
# A text task's records: a function (split, n, seed) -> n records of that split; a mapping
# {"train": [...], "test": [...]}; or one list whose last data.num_test records are the test split.
Records = Callable[[str, int, int], Sequence[Mapping]] | Mapping[str, Sequence[Mapping]] | Sequence[Mapping]


@dataclasses.dataclass(frozen=True)
class Task:
    """What `data.task` names.

    A text task: `records`, `verifier` (completion, finished, record) -> (correctness, format);
    `final_answer(completion)` -> the hashable answer maj@k votes with (default: the stripped text);
    `teacher(record)` -> a fallible answer the warm start mixes in with warmstart.teacher_error.
    An environment: `environment`, an EnvSuite (jaxrl.agents.env) or its "module:attr"; its records,
    teacher and alphabet are the suite's.
    alphabet: the character tokenizer's (text tasks; default: digits, arithmetic signs and space).
    generated_in_alphabet: its records are known to use only `alphabet` (the generated built-ins), so a
        run does not read them all to check.
    check(data_cfg, prefix): the task's own checks of data.* fields (ConfigError naming the field).
    builder / params: built-in tasks only, their TFDS builder ("module:attr") and its kwargs for a config.
    agent: a black-box agent (docs/agents.md): `agent(client, record) -> reward | None`, a plain or an
        async function (or its "module:attr") given an `openai.OpenAI` (async: `openai.AsyncOpenAI`)
        client pointed at the run's own engine; None as the reward: `verifier` scores the last
        completion. Its records are `records` (a text task's) or `environment`'s, whose teacher then
        makes the warm start; its episodes replace the environment's in training and evaluation.
    """

    name: str
    records: Records | None = None
    verifier: Verifier | None = None
    final_answer: FinalAnswer | None = None
    teacher: Callable[[dict], str] | None = None
    alphabet: str = DEFAULT_ALPHABET
    environment: Any = None
    generated_in_alphabet: bool = False
    check: Callable[[DataConfig, str], None] | None = None
    builder: str | None = None
    params: Callable[[DataConfig], dict] | None = None
    agent: Callable[..., Any] | str | None = None

    @property
    def episodic(self) -> bool:
        """Multi-turn episodes against an environment (else single completions scored by the verifier)."""
        return self.environment is not None

    @property
    def black_box(self) -> bool:
        """Episodes played by a black-box agent function through the run's OpenAI-compatible server."""
        return self.agent is not None

    @property
    def agent_fn(self) -> Callable[..., Any]:
        """The agent function (imported on first use when registered as "module:attr")."""
        if self.agent is None:
            raise ConfigError(f"data.task: {self.name!r} has no agent (Task.agent)")
        return resolve(self.agent) if isinstance(self.agent, str) else self.agent

    @property
    def suite(self):
        """The environment's EnvSuite (imported on first use when registered as "module:attr")."""
        if not self.episodic:
            raise ConfigError(f"data.task: {self.name!r} is a text task, not an environment")
        return resolve(self.environment) if isinstance(self.environment, str) else self.environment

    @property
    def char_alphabet(self) -> str:
        """The character tokenizer's alphabet for this task's runs."""
        return self.suite.alphabet if self.episodic else self.alphabet

    def answer_of(self, completion: str) -> Hashable | None:
        """The completion's final answer; None (no vote) when it cannot be read."""
        try:
            return (self.final_answer or arithmetic_answer)(completion)
        except Exception:  # an unreadable answer casts no vote; it never stops the evaluation
            return None

    def split_records(self, data: DataConfig) -> tuple[list[dict], list[dict]]:
        """(train, test): data.num_train / data.num_test records (fewer when the task has fewer), each a
        dict with "id" and "prompt" (an environment's: whatever its reset reads)."""
        if self.episodic:
            suite = self.suite
            splits = suite.records("train", data.num_train, data.seed), suite.records("test", data.num_test, data.seed)
        elif callable(self.records):
            splits = self.records("train", data.num_train, data.seed), self.records("test", data.num_test, data.seed)
        elif isinstance(self.records, Mapping):
            splits = self.records.get("train", ()), self.records.get("test", ())
        elif self.records is not None:
            held_out = len(self.records) - data.num_test
            splits = self.records[: max(held_out, 0)], self.records[max(held_out, 0) :]
        else:
            raise ConfigError(f"data.task: {self.name!r} has no records (a built-in task's are read by load_task)")
        train, test = (list(s)[:n] for s, n in zip(splits, (data.num_train, data.num_test)))
        for split, found in (("train", train), ("test", test)):
            for i, record in enumerate(found):
                if not isinstance(record, Mapping) or not (self.episodic or {"id", "prompt"} <= set(record)):
                    raise ConfigError(
                        f"data.task: record {i} of {self.name!r}/{split} is not a dict with 'id' and 'prompt'"
                    )
        return [dict(r) for r in train], [dict(r) for r in test]


_TASKS: dict[str, Task] = {}
_BUILT_IN: set[str] = set()


def register_task(task: Task) -> Task:
    """Make `task` the one `data.task=task.name` names; registering a name again replaces it (a config
    file loaded twice), except the built-ins'. -> task."""
    if not isinstance(task, Task):
        raise ConfigError(f"register_task: got {type(task).__name__}, expected a jaxrl.data.registry.Task")
    if not task.name or not task.name.replace("_", "").replace("-", "").isalnum():
        raise ConfigError(f"register_task: task name {task.name!r} is not a word (letters, digits, '_', '-')")
    if task.name in _BUILT_IN:
        raise ConfigError(f"register_task: {task.name!r} is a built-in task; choose another name")
    if task.black_box:
        _check_agent_task(task)
        _TASKS[task.name] = task
        return task
    if task.episodic == (task.records is not None or task.verifier is not None):
        raise ConfigError(
            f"register_task: task {task.name!r} needs records and a verifier (a text task) or an environment, "
            "exactly one of the two"
        )
    if task.episodic and getattr(task.environment, "name", task.name) != task.name:
        raise ConfigError(
            f"register_task: task {task.name!r} has an environment named {task.environment.name!r}; name both alike"
        )
    if not task.episodic and not callable(task.verifier):
        raise ConfigError(f"register_task: task {task.name!r} has records but no verifier")
    if not task.episodic and task.builder is None and task.records is None:
        raise ConfigError(f"register_task: task {task.name!r} has no records")
    _TASKS[task.name] = task
    return task


def _check_agent_task(task: Task) -> None:
    """A black-box agent's task: a callable agent, and records from exactly one of records / environment."""
    if not (callable(task.agent) or (isinstance(task.agent, str) and ":" in task.agent)):
        raise ConfigError(
            f"register_task: task {task.name!r}: Task.agent is {task.agent!r}, expected a function "
            "agent(client, record) -> reward | None (or its 'module:attr')"
        )
    if (task.records is None) == (task.environment is None):
        raise ConfigError(
            f"register_task: task {task.name!r} has an agent; it needs its records from exactly one of "
            "Task.records and Task.environment"
        )
    if task.verifier is not None and not callable(task.verifier):
        raise ConfigError(f"register_task: task {task.name!r}: Task.verifier is not callable")


def get_task(name: str, field: str = "data.task") -> Task:
    """The registered task `name`; an unknown name is a ConfigError naming it and the closest names."""
    if name not in _TASKS:
        close = difflib.get_close_matches(name, _TASKS, n=3)
        hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
        raise ConfigError(
            f"{field}: got {name!r}, expected a registered task ({hint}registered: {', '.join(sorted(_TASKS))}; "
            "a config file registers its own with jaxrl.data.registry.register_task)"
        )
    return _TASKS[name]


@functools.cache
def resolve(ref: str):
    """The attribute a "module:attr" string names."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def check_alphabet(task: Task, alphabet: str, records: Sequence[Mapping], fields=("prompt", "answer")) -> None:
    """A character of a record's `fields` outside `alphabet` is a ConfigError naming it, the task and the record."""
    allowed = set(alphabet)
    for record in records:
        for field in fields:
            extra = set(str(record.get(field, ""))) - allowed
            if extra:
                raise ConfigError(
                    f"data.task: character {min(extra)!r} in the {field} of record {record.get('id')!r} of task "
                    f"{task.name!r} is not in the character tokenizer's alphabet {alphabet!r} (Task.alphabet)"
                )


# ---------------------------------------------------------------------------------------------
# The built-in tasks: their data.* checks and their TFDS builders' kwargs.


def _check_generated(max_digits: int = 6, ops: str = "+-*") -> Callable[[DataConfig, str], None]:
    """The checks of a generated task's data.digits and data.operations."""

    def check(cfg: DataConfig, prefix: str) -> None:
        _check(1 <= cfg.digits <= max_digits, f"{prefix}.digits", f"an integer in [1, {max_digits}]", cfg.digits)
        _check(
            len(cfg.operations) > 0 and set(cfg.operations) <= set(ops),
            f"{prefix}.operations",
            f"a non-empty string over {ops!r}" + ("" if "/" in ops else " ('/' only for countdown)"),
            cfg.operations,
        )

    return check


def _check_math_jsonl(cfg: DataConfig, prefix: str) -> None:
    _check(bool(cfg.train_file), f"{prefix}.train_file", "a JSONL file when task='math_jsonl'", cfg.train_file)
    _check_generated()(cfg, prefix)


def _generated_params(allowed: str, space_check: bool = False) -> Callable[[DataConfig], dict]:
    """The generator kwargs; the operations are canonicalized so '-+' and '+-' share data."""

    def params(cfg: DataConfig) -> dict:
        arithmetic.check_sizes(cfg.num_train, cfg.num_test)
        ops = arithmetic.canonical_operations(cfg.operations, allowed)
        if space_check:  # fail before TFDS creates any folder
            arithmetic.check_space(cfg.digits, ops, cfg.num_train + cfg.num_test)
        return dict(digits=cfg.digits, operations=ops, num_train=cfg.num_train, num_test=cfg.num_test, seed=cfg.seed)

    return params


def _math_jsonl_params(cfg: DataConfig) -> dict:
    """Local files: the config name is their content hash."""
    arithmetic.check_sizes(cfg.num_train, cfg.num_test)
    files = [os.path.abspath(os.path.expanduser(f)) if f else "" for f in (cfg.train_file, cfg.test_file)]
    for field, f in zip(("data.train_file", "data.test_file"), files):
        if f and not os.path.isfile(f):
            raise ConfigError(f"{field}: file {f!r} not found")
    return dict(
        train_file=files[0],
        test_file=files[1],
        prompt_template=cfg.prompt_template,
        num_train=cfg.num_train,
        num_test=cfg.num_test,
        digest=math_jsonl.digest(*files),
    )


_BUILT_IN_TASKS = (
    Task(
        "arithmetic",
        verifier=verify_arithmetic,
        final_answer=arithmetic_answer,
        teacher=fallible_answer,
        check=_check_generated(),
        builder="jaxrl.data.tasks:JaxrlArithmetic",
        generated_in_alphabet=True,
        params=_generated_params(arithmetic.OPERATIONS, space_check=True),
    ),
    Task(
        "countdown",
        verifier=verify_countdown,
        final_answer=countdown_answer,
        teacher=fallible_answer,
        check=_check_generated(ops="+-*/"),
        builder="jaxrl.data.tasks:JaxrlCountdown",
        generated_in_alphabet=True,
        params=_generated_params(countdown.OPERATIONS),
    ),
    Task(
        "long_addition",
        verifier=verify_long_addition,
        final_answer=long_addition_answer,
        teacher=fallible_answer,
        check=_check_generated(max_digits=8),  # its longest solution still fits with 8 digits
        builder="jaxrl.data.tasks:JaxrlLongAddition",
        generated_in_alphabet=True,
        params=_generated_params(long_addition.OPERATIONS),
    ),
    Task(
        "math_jsonl",
        verifier=math_jsonl.verify_math_answer,
        final_answer=math_jsonl.math_answer,
        check=_check_math_jsonl,
        builder="jaxrl.data.tasks:JaxrlMathJsonl",
        params=_math_jsonl_params,
    ),
    Task("agent_calculator", environment="jaxrl.agents.calculator:SUITE", check=_check_generated()),
    Task("agent_gridworld", environment="jaxrl.agents.gridworld:SUITE", check=_check_generated()),
)
for _task in _BUILT_IN_TASKS:
    register_task(_task)
    _BUILT_IN.add(_task.name)
