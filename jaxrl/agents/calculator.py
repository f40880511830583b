"""data.task `agent_calculator`: 3-digit x 3-digit products, answered by calling a calculator tool.

An episode (the char model's text; `]` ends a turn, EOS the episode):

    prompt   123*456=            reset(): the problem, 8 characters
    model    [calc 123*456]      a tool call (tools.TagFormat)
    env      >56088\\n            the tool's result; reward 0, not done
    model    56088<EOS>          a turn without a call is the final answer: reward 1 if it is the
                                 product, else 0; done; info["success"]

On a Hugging Face checkpoint the same episode speaks the Hermes/Qwen format (docs/agents.md).
Records: each pair belongs to one split by a fixed hash (1 in 10 to "test"), so splits are disjoint for
any seed. The teacher calls the tool with probability 1 - error_rate, else guesses a plausible wrong
product (leading digits right), so RL has room to improve.
"""

from __future__ import annotations

import numpy as np

from jaxrl.agents.env import AGENT_ALPHABET, EnvSuite, StepResult
from jaxrl.agents.tools import NO_TOOL_INFO, TagFormat, Tool, ToolError, ToolRegistry, ToolUse

MAX_EXPRESSION = 64  # characters: bounds the calculator's work (no power operator, so |value| < 10**64)
SPLITS = ("train", "test")
_TEST_EVERY = 10


def calculate(expression: str) -> str:
    """The value of an integer expression of + - * and parentheses (unary minus allowed), as text."""
    text = expression.replace(" ", "")
    if not text:
        raise ToolError("empty expression")
    if len(text) > MAX_EXPRESSION:
        raise ToolError(f"expression longer than {MAX_EXPRESSION} characters")
    value, end = _sum(text, 0)
    if end != len(text):
        raise ToolError(f"unexpected {text[end]!r} at {end}")
    return str(value)


def _sum(text: str, i: int) -> tuple[int, int]:
    value, i = _product(text, i)
    while i < len(text) and text[i] in "+-":
        sign = text[i]
        rhs, i = _product(text, i + 1)
        value = value + rhs if sign == "+" else value - rhs
    return value, i


def _product(text: str, i: int) -> tuple[int, int]:
    value, i = _factor(text, i)
    while i < len(text) and text[i] == "*":
        rhs, i = _factor(text, i + 1)
        value *= rhs
    return value, i


def _factor(text: str, i: int) -> tuple[int, int]:
    if i >= len(text):
        raise ToolError("expression ends early")
    if text[i] == "-":
        value, i = _factor(text, i + 1)
        return -value, i
    if text[i] == "(":
        value, i = _sum(text, i + 1)
        if i >= len(text) or text[i] != ")":
            raise ToolError("missing )")
        return value, i + 1
    start = i
    while i < len(text) and text[i].isdigit() and text[i].isascii():
        i += 1
    if i == start:
        raise ToolError(f"unexpected {text[i]!r} at {i}")
    return int(text[start:i]), i


# JSON calls (HermesFormat) name the argument: {"name": "calc", "arguments": {"expression": "123*456"}}.
CALC_PARAMETERS = {
    "type": "object",
    "required": ["expression"],
    "properties": {"expression": {"type": "string", "description": "e.g. (12+3)*456"}},
}


def calculator_tools(max_output: int = 2000, fmt=None) -> ToolUse:
    """The calculator tool in `fmt` (None: the tag format of the char models)."""
    tool = Tool("calc", calculate, "integer arithmetic with + - * and parentheses", parameters=CALC_PARAMETERS)
    return ToolUse(ToolRegistry([tool], max_output), fmt or TagFormat(AGENT_ALPHABET))


class CalculatorEnv:
    """One episode: the problem, tool turns answered by the calculator, then a scored final answer.
    fmt: the tool-call format (None: TagFormat; HermesFormat for a Hugging Face chat model, whose
    prompt is then the chat template's rendering of the problem with the tool's schema)."""

    def __init__(self, max_output: int = 2000, fmt=None):
        self.tools = calculator_tools(max_output, fmt)
        self.answer = None
        self.done = True

    def reset(self, record: dict, rng: np.random.Generator) -> str:
        self.answer, self.done = record["answer"], False
        return self.tools.format.prompt(record["prompt"], self.tools.registry)

    def step(self, action: str) -> StepResult:
        if self.done:
            return StepResult("", 0.0, True, dict(NO_TOOL_INFO))
        turn = self.tools.respond(action)
        if turn is not None:
            return StepResult(turn.observation, 0.0, False, turn.info)
        self.done = True
        success = action.strip() == self.answer
        return StepResult("", float(success), True, {**NO_TOOL_INFO, "success": success})


def _split_of(a: int, b: int) -> str:
    # A fixed integer hash (Knuth's multiplicative constant): the split never depends on a seed.
    return "test" if ((a * 1000 + b) * 2654435761 % 2**32) % _TEST_EVERY == 0 else "train"


def records(split: str, n: int, seed: int) -> list:
    if split not in SPLITS:
        raise ValueError(f"agent_calculator records: split {split!r}, expected one of {SPLITS}")
    rng = np.random.default_rng([seed, SPLITS.index(split)])
    seen, out = set(), []
    while len(out) < n:
        a, b = (int(v) for v in rng.integers(100, 1000, size=2))
        if (a, b) in seen or _split_of(a, b) != split:
            continue
        seen.add((a, b))
        expression = f"{a}*{b}"
        out.append({"id": expression, "prompt": expression + "=", "expression": expression, "answer": str(a * b)})
    return out


def _wrong_guess(answer: str, rng: np.random.Generator) -> str:
    """The answer with its last three digits redrawn (never the answer itself)."""
    head = answer[:-3]
    while True:
        guess = head + f"{int(rng.integers(0, 1000)):03d}"
        if guess != answer:
            return guess


def teacher(record: dict, rng: np.random.Generator, error_rate: float) -> list:
    if rng.random() < error_rate:
        return [(_wrong_guess(record["answer"], rng), True)]
    env = CalculatorEnv()
    env.reset(record, rng)
    call = f"[calc {record['expression']}]"
    observation = env.step(call).observation
    return [(call, True), (observation, False), (observation[1:].strip(), True)]


SUITE = EnvSuite(
    name="agent_calculator",
    make=lambda agent_cfg, fmt=None: CalculatorEnv(agent_cfg.tool_max_output, fmt),
    records=records,
    teacher=teacher,
    alphabet=AGENT_ALPHABET,
    end_of_turn="]",
    formats=("tag", "hermes"),
)
