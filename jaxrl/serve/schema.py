"""The OpenAI request bodies the server accepts, checked field by field: every mistake is an `ApiError`
naming the field (`param`), answered as `{"error": {"message", "type", "param", "code"}}` with a 4xx
status. Pure functions of the parsed JSON body and the server's `Limits`; no FastAPI here.

Accepted (both routes): model, max_tokens, temperature, top_p, n, stop, stream, stream_options
(include_usage), seed, user, logprobs, and vLLM's stop_token_ids. /v1/completions: prompt (a string, a
one-string list, or a list of token ids), logprobs (an int: the sampled token's log-prob is returned;
top alternatives are not). /v1/chat/completions: messages, logprobs (bool), top_logprobs (0 only),
max_completion_tokens. Sampling knobs the engine does not have (presence/frequency penalties, logit_bias,
best_of, echo, suffix, tools) are refused when set to anything but their no-op value, and an unknown
field is refused, so a request is never silently served differently from what it asked.
"""

from __future__ import annotations

import dataclasses
from typing import Any

COMPLETIONS, CHAT = "completions", "chat"
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the limit
MAX_STOP_STRINGS = 4


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the server accepts: prompt length (tokens), max_tokens, n, request body bytes; an API key."""

    max_prompt_tokens: int
    max_tokens: int
    max_n: int = 8
    max_body_bytes: int = 1 << 20
    api_key: str | None = None

    def __post_init__(self):
        for name in ("max_prompt_tokens", "max_tokens", "max_n", "max_body_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name}={value!r}: expected a positive int")
        if self.api_key is not None and not self.api_key:
            raise ValueError("Limits.api_key: empty; give None for no key")


class ApiError(Exception):
    """A request the server refuses: HTTP `status`, and the OpenAI error object's fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        if self.status == 401:
            return "authentication_error"
        if self.status == 404:
            return "not_found_error"
        if self.status == 429:
            return "rate_limit_error"
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {message}", param, code)


@dataclasses.dataclass(frozen=True)
class Parsed:
    """One checked request. `prompt` is text (completions, or the chat template's output) or None when the
    client sent token ids (`prompt_ids` then); `messages` for chat."""

    kind: str  # COMPLETIONS | CHAT
    prompt: str | None
    prompt_ids: tuple[int, ...] | None
    messages: tuple[dict, ...] | None
    max_tokens: int
    temperature: float
    top_p: float
    n: int
    stop: tuple[str, ...]
    stop_ids: tuple[int, ...]
    stream: bool
    include_usage: bool
    logprobs: bool
    seed: int | None


COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "stream",
    "stream_options",
    "seed",
    "user",
    "logprobs",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
}
KNOWN = {
    COMPLETIONS: COMMON | {"prompt", "echo", "suffix", "best_of"},
    CHAT: COMMON
    | {"messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice", "functions", "function_call"},
}
# Fields accepted only at their no-op value (or null).
NO_OP = {
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": ({},),
    "echo": (False,),
    "suffix": ("",),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _int_field(body: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value) or not low <= value <= high:
        raise bad(name, f"got {value!r}, expected an integer in [{low}, {high}]")
    return value


def _number_field(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value) or value > high or value < low or (low_open and value == low):
        shown = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise bad(name, f"got {value!r}, expected a number in {shown}")
    return float(value)


def _bool_field(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(name, f"got {value!r}, expected true or false")
    return value


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", f"got {value!r}, expected a non-empty string or a list of them")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad("stop", f"got {len(stops)} stop strings, at most {MAX_STOP_STRINGS}")
    return tuple(stops)


def _stop_ids(body: dict, vocab_size: int) -> tuple[int, ...]:
    value = body.get("stop_token_ids")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_int(i) and 0 <= i < vocab_size for i in value):
        raise bad("stop_token_ids", f"got {value!r}, expected a list of token ids in [0, {vocab_size})")
    return tuple(value)


def _prompt(body: dict, vocab_size: int) -> tuple[str | None, tuple[int, ...] | None]:
    value = body.get("prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise bad("prompt", "empty string")
        return value, None
    if isinstance(value, list) and value and all(_is_int(i) for i in value):
        if not all(0 <= i < vocab_size for i in value):
            raise bad("prompt", f"a token id outside the vocabulary [0, {vocab_size})")
        return None, tuple(value)
    if value is None:
        raise bad("prompt", "missing: a string or a list of token ids is required", "missing_field")
    raise bad(
        "prompt", "expected a string, a one-string list or a non-empty list of token ids (one prompt per request)"
    )


def _messages(body: dict) -> tuple[dict, ...]:
    value = body.get("messages")
    if value is None:
        raise bad("messages", "missing: a list of {role, content} messages is required", "missing_field")
    if not isinstance(value, list) or not value:
        raise bad("messages", f"got {type(value).__name__}, expected a non-empty list of messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}]", "expected an object with a string `role`")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]: text parts only
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise bad(f"messages[{i}].content", "only text parts ({type: text, text}) are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content", f"got {type(content).__name__}, expected a string")
        out.append({"role": m["role"], "content": content})
    return tuple(out)


def _check_fields(body: dict, kind: str, model_name: str) -> None:
    unknown = sorted(set(body) - KNOWN[kind])
    if unknown:
        raise bad(unknown[0], f"unknown field for /v1/{kind.replace(CHAT, 'chat/completions')}", "unsupported_field")
    for name, allowed in NO_OP.items():
        value = body.get(name)
        if value is not None and not any(
            value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed
        ):
            raise bad(name, f"got {value!r}; this server does not support it", "unsupported_value")
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(
            404, f"model: {model!r} is not served here; this server serves {model_name!r}", "model", "model_not_found"
        )
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user", f"got {user!r}, expected a string")


def _logprobs(body: dict, kind: str) -> bool:
    if kind == CHAT:
        top = _int_field(body, "top_logprobs", 0, 0, 20)
        if top:
            raise bad(
                "top_logprobs", f"got {top}; only the sampled token's log-prob is returned (use 0)", "unsupported_value"
            )
        return _bool_field(body, "logprobs")
    value = body.get("logprobs")
    if value is None:
        return False
    if not _is_int(value) or not 0 <= value <= 5:
        raise bad(
            "logprobs", f"got {value!r}, expected an integer in [0, 5] (the sampled token's log-prob is returned)"
        )
    return True


def _max_tokens(body: dict, kind: str, limits: Limits) -> int:
    name = "max_tokens"
    if kind == CHAT and body.get("max_completion_tokens") is not None:
        if body.get("max_tokens") is not None:
            raise bad("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
        name = "max_completion_tokens"
    default = min(COMPLETION_DEFAULT_MAX_TOKENS, limits.max_tokens) if kind == COMPLETIONS else limits.max_tokens
    value = _int_field(body, name, default, 1, limits.max_tokens)
    assert value is not None
    return value


def parse(body: Any, kind: str, limits: Limits, model_name: str, vocab_size: int) -> Parsed:
    """Check a request body of route `kind` against `limits`; ApiError (400/404) naming the field."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}", None, "invalid_json")
    _check_fields(body, kind, model_name)
    best_of = body.get("best_of")
    if best_of is not None and best_of not in (1, body.get("n") or 1):
        raise bad("best_of", f"got {best_of!r}; only best_of = n is supported", "unsupported_value")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise bad("stream_options", f"got {options!r}, expected {{'include_usage': bool}}")
    stream = _bool_field(body, "stream")
    include_usage = bool(options and options.get("include_usage"))
    if include_usage and not stream:
        raise bad("stream_options", "only with stream: true")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise bad("seed", f"got {seed!r}, expected an integer")
    prompt, prompt_ids, messages = None, None, None
    if kind == COMPLETIONS:
        prompt, prompt_ids = _prompt(body, vocab_size)
    else:
        messages = _messages(body)
    return Parsed(
        kind=kind,
        prompt=prompt,
        prompt_ids=prompt_ids,
        messages=messages,
        max_tokens=_max_tokens(body, kind, limits),
        temperature=_number_field(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number_field(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        n=_int_field(body, "n", 1, 1, limits.max_n) or 1,
        stop=_stop(body),
        stop_ids=_stop_ids(body, vocab_size),
        stream=stream,
        include_usage=include_usage,
        logprobs=_logprobs(body, kind),
        seed=seed,
    )
