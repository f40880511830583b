"""PLACEHOLDER for Part A's module (branch serveengine): only the request/event types and errors of the
issue-34 interface, so the HTTP server (app.py) and its fake-service tests run before the engine lands.
Merging serveengine replaces this file with the real `ServingEngine` (take theirs on conflict)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

STOP, LENGTH, CANCELLED = "stop", "length", "cancelled"


class RequestError(ValueError):
    """A request the engine cannot serve; `param` names the offending field."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


class QueueFull(RuntimeError):
    """`submit` while max_queue requests are waiting for slots."""


class Draining(RuntimeError):
    """`submit` after `drain` or `stop`."""


class EngineError(RuntimeError):
    """The decode thread failed while the request was in flight (raised by its event stream)."""


@dataclasses.dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()


class Token(NamedTuple):
    choice: int
    token: int
    logprob: float
    version: int


class Done(NamedTuple):
    choice: int
    reason: str


class Handle:
    """Part A's request handle (events, aevents, cancel); only its name here."""

    id: int
