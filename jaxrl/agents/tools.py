"""Tools an agent calls from its text: a registry, and the two call formats a turn is parsed with.

    registry = ToolRegistry([Tool("calc", calculate, "integer arithmetic: + - * ( )")], max_output=2000)
    tools = ToolUse(registry, TagFormat())          # or HermesFormat(tokenizer.chat_template)
    turn = tools.respond("[calc 123*456]")           # None: the turn holds no call (a final answer)
    turn.observation, turn.info                       # ">56088\n", {"tool_calls": 1, "tool_errors": 0, ...}

`TagFormat` (char models): a call is `[name argument]` at the end of the turn, the observation
`>result\n`; text outside AGENT_ALPHABET is lower-cased, else `_`. `HermesFormat` (HF chat models): a
`<tool_call>{...}</tool_call>` JSON call, the observation rendered as the chat template's `tool`
message. A format also renders an episode's prompt (`fmt.prompt(text, registry)`).

Nothing the model writes raises: malformed calls, unknown tools, wrong arguments, a tool that raises or
passes its `timeout_s` give an error observation (`info["tool_errors"]`); results longer than
`max_output` are cut (`info["tool_truncated"]`). A timed-out in-process tool's thread cannot be killed,
so such a tool bounds its own work; code that may not stop runs in jaxrl.agents.sandbox.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from collections.abc import Callable
from typing import NamedTuple

from jaxrl.agents.env import AGENT_ALPHABET
from jaxrl.config import ConfigError

TRUNCATION_MARK = "..."


class ToolError(Exception):
    """A tool's own failure; its message (no exception type) is what the model reads."""


@dataclasses.dataclass(frozen=True)
class Tool:
    """name: what a call names; fn: fn(argument_text) for the tag format, fn(**arguments) for JSON
    calls, -> the result (str() of it is shown); description: one line, for a system prompt;
    parameters: the JSON schema of fn's keyword arguments (an "object" schema), which a chat template
    shows the model (HermesFormat.prompt); None: no arguments."""

    name: str
    fn: Callable[..., object]
    description: str
    timeout_s: float | None = None  # in-process wall-clock limit (None: wait for it)
    parameters: dict | None = None

    def schema(self) -> dict:
        """The tool as chat templates take it in `tools=[...]` (the OpenAI function-calling layout)."""
        parameters = self.parameters or {"type": "object", "properties": {}}
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": parameters},
        }


class ToolCall(NamedTuple):
    name: str
    arguments: str | dict | None  # tag format: the text after the name (None: no argument); JSON: a dict


class CallError(NamedTuple):
    """A call that could not be parsed; `message` is shown to the model."""

    message: str


class ToolResult(NamedTuple):
    text: str
    error: bool
    truncated: bool


class ToolRegistry:
    """Tools by name; `call` never raises for anything a model can write."""

    def __init__(self, tools, max_output: int = 2000):
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ConfigError(f"tool registry: repeated tool names in {names}")
        if max_output <= 0:
            raise ConfigError(f"agent.tool_max_output: got {max_output}, expected a positive integer")
        self.tools = {t.name: t for t in tools}
        self.max_output = max_output

    def schemas(self) -> list[dict]:
        return [t.schema() for t in self.tools.values()]

    def call(self, call: ToolCall) -> ToolResult:
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(f"unknown tool {call.name}", True, False)
        args, kwargs = _call_arguments(call.arguments)
        outcome = _run(tool, args, kwargs)
        if isinstance(outcome, ToolResult):
            return outcome
        text = str(outcome)
        if len(text) > self.max_output:
            return ToolResult(text[: self.max_output] + TRUNCATION_MARK, False, True)
        return ToolResult(text, False, False)


def _call_arguments(arguments) -> tuple[tuple, dict]:
    if arguments is None:
        return (), {}
    if isinstance(arguments, dict):
        return (), arguments
    return (arguments,), {}


def _run(tool: Tool, args: tuple, kwargs: dict):
    """tool.fn(*args, **kwargs), or a ToolResult error if it raises or outlives tool.timeout_s."""
    if tool.timeout_s is None:
        return _guarded(tool.fn, args, kwargs)
    box = []
    worker = threading.Thread(
        target=lambda: box.append(_guarded(tool.fn, args, kwargs)), daemon=True, name=f"tool-{tool.name}"
    )
    worker.start()
    worker.join(tool.timeout_s)
    if not box:  # still running: abandoned (a daemon thread; see the module docstring)
        return ToolResult(f"timeout after {tool.timeout_s:g}s", True, False)
    return box[0]


def _guarded(fn, args, kwargs):
    try:
        return fn(*args, **kwargs)
    except ToolError as e:
        return ToolResult(str(e) or "failed", True, False)
    except TypeError as e:  # mostly wrong arguments; a tool's own TypeError reads the same to the model
        return ToolResult(f"bad arguments: {e}", True, False)
    except (Exception, SystemExit) as e:  # the model must see the failure, never the trainer
        return ToolResult(f"{type(e).__name__}: {e}", True, False)


class ToolTurn(NamedTuple):
    observation: str
    info: dict  # tool_calls, tool_errors, tool_truncated


class TagFormat:
    """`[name argument]` calls and `>result\\n` observations in a character alphabet (the embedded models')."""

    name = "tag"
    end_of_turn = "]"
    _CALL = re.compile(r"\[([a-z_][a-z0-9_]*)(?: ([^\[\]]*))?\]\s*$")

    def __init__(self, alphabet: str = AGENT_ALPHABET):
        if not {"[", "]", ">", "\n", "_"} <= set(alphabet):
            raise ConfigError(f"tag tool format: the alphabet {alphabet!r} lacks one of '[', ']', '>', newline, '_'")
        self.alphabet = frozenset(alphabet)

    def parse(self, turn: str) -> list:
        """The calls of one turn ([] for none), each a ToolCall or a CallError."""
        if "[" not in turn and "]" not in turn:
            return []
        match = self._CALL.search(turn)
        if match is None or "[" in turn[: match.start()] or "]" in turn[: match.start()]:
            return [CallError("bad call, expected [tool argument]")]
        return [ToolCall(match.group(1), match.group(2))]

    def prompt(self, text: str, registry: ToolRegistry) -> str:
        """The episode's prompt: the bare problem text (a char model learns the tools from its warm start)."""
        del registry
        return text

    def render(self, results: list) -> str:
        lines = [(f"error: {r.text}" if r.error else r.text) for r in results]
        return "".join(">" + self._fit(line) + "\n" for line in lines)

    def _fit(self, text: str) -> str:
        out = []
        for ch in text:
            if ch not in self.alphabet:
                ch = ch.lower() if ch.lower() in self.alphabet else ("\n" if ch == "\r" else "_")
            out.append(ch)
        return "".join(out)


# Qwen2.5's chat template around one tool message (and between two), after the assistant's text.
QWEN_TOOL_HEAD = "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
QWEN_TOOL_SEP = "\n</tool_response>\n<tool_response>\n"
QWEN_TOOL_TAIL = "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


class HermesFormat:
    """`<tool_call>{json}</tool_call>` calls; observations as the chat template renders tool messages.

    chat_template: the checkpoint's template (HFTokenizer.chat_template); the text it puts after an
    assistant message and around tool messages is measured once here. None: Qwen2.5's observations
    (and no `prompt`: rendering a prompt needs the template). template_variables: what the template
    reads besides messages (bos_token, eos_token; `for_tokenizer` passes the checkpoint's)."""

    name = "hermes"
    end_of_turn = "</tool_call>"
    _OPEN, _CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, chat_template: str | None = None, **template_variables):
        self.chat_template, self.template_variables = chat_template, template_variables
        if chat_template is None:
            self.head, self.sep, self.tail = QWEN_TOOL_HEAD, QWEN_TOOL_SEP, QWEN_TOOL_TAIL
        else:
            self.head, self.sep, self.tail = _measure_template(chat_template, template_variables)

    @classmethod
    def for_tokenizer(cls, tokenizer) -> HermesFormat:
        """The format of a checkpoint's tokenizer (jaxrl.data.hf_tokenizer.HFTokenizer) and its template."""
        return cls(tokenizer.chat_template, bos_token=tokenizer.bos_token or "", eos_token=tokenizer.eos_token or "")

    def prompt(self, text: str, registry: ToolRegistry) -> str:
        """The chat the template renders for a user message `text` with the registry's tools
        (`tools=[...]`: the template writes their schemas into its system message) and the
        assistant's generation prompt; the model's first turn starts right after it."""
        from jaxrl.data.hf_tokenizer import render_chat_template

        if self.chat_template is None:
            raise ConfigError("Hermes tool format: rendering a prompt needs the checkpoint's chat template")
        tools = registry.schemas()
        rendered = render_chat_template(
            self.chat_template,
            [{"role": "user", "content": text}],
            add_generation_prompt=True,
            tools=tools,
            **self.template_variables,
        )
        missing = [t["function"]["name"] for t in tools if json.dumps(t["function"]["name"]) not in rendered]
        if missing:
            raise ConfigError(
                f"chat template: it does not render tools=[...] (no schema of {', '.join(missing)} in "
                "the prompt); the Hermes tool format needs a template with tool support"
            )
        return rendered

    def parse(self, turn: str) -> list:
        calls, rest = [], turn
        while self._OPEN in rest:
            body_start = rest.index(self._OPEN) + len(self._OPEN)
            end = rest.find(self._CLOSE, body_start)
            if end < 0:
                calls.append(CallError("unclosed <tool_call>"))
                break
            calls.append(_json_call(rest[body_start:end]))
            rest = rest[end + len(self._CLOSE) :]
        if not calls and self._CLOSE in turn:
            calls.append(CallError("</tool_call> without <tool_call>"))
        return calls

    def render(self, results: list) -> str:
        return self.head + self.sep.join((f"error: {r.text}" if r.error else r.text) for r in results) + self.tail


def _json_call(body: str):
    try:
        call = json.loads(body)
    except ValueError as e:
        return CallError(f"tool call is not valid JSON ({e})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return CallError('tool call needs {"name": "...", "arguments": {...}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return CallError("tool call arguments: not a JSON object")
    if not isinstance(arguments, dict):
        return CallError("tool call arguments: not a JSON object")
    return ToolCall(call["name"], arguments)


def _measure_template(template: str, variables: dict) -> tuple[str, str, str]:
    """(head, sep, tail): the text the template writes after an assistant message's content, between
    two tool messages, and after the last one up to the next assistant message's start."""
    from jaxrl.data.hf_tokenizer import render_chat_template

    mark, a, b = "\x00ASSISTANT\x00", "\x00TOOL_A\x00", "\x00TOOL_B\x00"
    base = [{"role": "user", "content": "question"}, {"role": "assistant", "content": mark}]

    def after_mark(tools):
        text = render_chat_template(
            template, base + [{"role": "tool", "content": c} for c in tools], add_generation_prompt=True, **variables
        )
        if text.count(mark) != 1 or any(text.count(c) != 1 for c in tools):
            raise ConfigError(
                "chat template: it does not render assistant and tool messages' content "
                "(a template without tool support cannot take the Hermes tool format)"
            )
        return text[text.index(mark) + len(mark) :]

    one, two = after_mark([a]), after_mark([a, b])
    head, tail = one.split(a)
    sep = two[len(head) + len(a) : two.index(b)]
    if head + a + sep + b + tail != two:
        raise ConfigError("chat template: two tool messages do not render as one message's text around a separator")
    return head, sep, tail


class ToolUse:
    """A registry and a format: the answer to one model turn."""

    def __init__(self, registry: ToolRegistry, fmt):
        self.registry, self.format = registry, fmt

    @property
    def end_of_turn(self) -> str:
        return self.format.end_of_turn

    def respond(self, turn: str) -> ToolTurn | None:
        """The observation and counters of `turn`'s calls; None if it makes none (a final answer)."""
        calls = self.format.parse(turn)
        if not calls:
            return None
        results = [
            ToolResult(c.message, True, False) if isinstance(c, CallError) else self.registry.call(c) for c in calls
        ]
        info = {
            "tool_calls": len(results),
            "tool_errors": sum(r.error for r in results),
            "tool_truncated": sum(r.truncated for r in results),
        }
        return ToolTurn(self.format.render(results), info)


NO_TOOL_INFO = {"tool_calls": 0, "tool_errors": 0, "tool_truncated": 0}
