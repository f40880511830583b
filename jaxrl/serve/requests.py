"""What a client of the serving engine holds: a `Request` (checked as it is built), the events of its
stream (`Token`, `Done`), the `Handle` they arrive on, and the errors a request can meet. The engine
that fills the handles is engine.py.

    handle = engine.submit(Request(prompt=(5, 9, 2), max_tokens=16, temperature=0.7, n=2))
    for event in handle.events():            # Token(choice, token, logprob, version)..., Done(choice, reason)
        ...
    async for batch in handle.abatches():    # the same from asyncio, a chunk's events at a time
        ...
    handle.cancel()                          # its slots are freed at the next chunk boundary

A handle is safe from any thread and from asyncio: the decode thread publishes under its condition
variable and wakes asyncio readers with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Iterator
from typing import NamedTuple

import numpy as np

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
    prompt: tuple[int, ...]  # token ids, 1..engine.max_prompt_tokens
    max_tokens: int  # 1..engine.max_new_tokens
    temperature: float = 1.0  # >= 0; 0 = greedy (the engine's T -> 0 limit)
    top_p: float = 1.0  # (0, 1]
    n: int = 1  # independent samples of the prompt, 1..engine.max_n
    seed: int | None = None  # fixes the request's draws; None: the engine's key stream
    stop_ids: tuple[int, ...] = ()  # token ids that end a choice (besides EOS), kept in the output like EOS

    def __post_init__(self):
        object.__setattr__(self, "prompt", _int_tuple("prompt", self.prompt))
        object.__setattr__(self, "stop_ids", _int_tuple("stop_ids", self.stop_ids))
        if not self.prompt:
            raise RequestError("prompt", "empty, expected at least one token id")
        check_int("max_tokens", self.max_tokens, 1)
        check_int("n", self.n, 1)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise RequestError("seed", f"got {self.seed!r}, expected an int or None")
        if not (isinstance(self.temperature, int | float) and float(self.temperature) >= 0):
            raise RequestError("temperature", f"got {self.temperature!r}, expected a number >= 0 (0 = greedy)")
        if not (isinstance(self.top_p, int | float) and 0 < float(self.top_p) <= 1):
            raise RequestError("top_p", f"got {self.top_p!r}, expected a number in (0, 1]")


def _int_tuple(name: str, value) -> tuple[int, ...]:
    try:
        out = tuple(value)
    except TypeError:
        raise RequestError(name, f"got {type(value).__name__}, expected a sequence of token ids") from None
    for x in out:
        if isinstance(x, bool) or not isinstance(x, int | np.integer):
            raise RequestError(name, f"got element {x!r}, expected int token ids")
    return tuple(int(x) for x in out)


def check_int(name: str, value, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise RequestError(name, f"got {value!r}, expected an int {bound}")


class Token(NamedTuple):
    choice: int
    token: int
    logprob: float  # under softmax(logits / temperature), as the trainer recomputes it
    version: int  # the params version that drew it


class Done(NamedTuple):
    choice: int
    reason: str  # "stop" (EOS or a stop id) | "length" | "cancelled"


Event = Token | Done


class Handle:
    """One submitted request's event stream: Token events in order per choice, then one Done per
    choice. Its events are kept, so `events()` / `aevents()` replay from the start when called again."""

    def __init__(self, id: int, request: Request, wake):
        self.id, self.request = id, request
        self._wake = wake  # tells the engine a cancel is pending
        self._cond = threading.Condition()
        self._events: list[Event] = []
        self._n_done = 0
        self._error: BaseException | None = None
        self._cancelled = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    @property
    def finished(self) -> bool:
        """Every choice has its Done (or the engine failed the request)."""
        return self._n_done >= self.request.n or self._error is not None

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Free the request's slots at the next chunk boundary; its unfinished choices end with
        Done(choice, "cancelled"). A no-op once finished."""
        with self._cond:
            if self.finished:
                return
            self._cancelled = True
        self._wake()

    def _publish(self, events: list[Event]) -> None:
        with self._cond:
            self._events.extend(events)
            self._n_done += sum(isinstance(e, Done) for e in events)
            self._notify()

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._notify()

    def _notify(self) -> None:  # under self._cond
        self._cond.notify_all()
        waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that loop is closed (its reader is gone): nothing to wake
                pass

    def _take(self, start: int) -> tuple[list[Event], bool]:  # under self._cond
        return self._events[start:], self.finished

    def _raise_error(self) -> None:
        if self._error is not None:
            raise EngineError(f"request {self.id}: the engine failed: {self._error}") from self._error

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """The events, blocking until each arrives; ends after the n-th Done. `timeout` (seconds): a
        TimeoutError when no event arrives within it. EngineError if the decode thread failed."""
        i = 0
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda i=i: len(self._events) > i or self.finished, timeout):
                    raise TimeoutError(f"request {self.id}: no event within {timeout} s")
                batch, finished = self._take(i)
            i += len(batch)
            yield from batch
            if finished:
                self._raise_error()
                return

    async def aevents(self) -> AsyncIterator[Event]:
        """`events()` for asyncio: awaits instead of blocking the loop."""
        async for batch in self.abatches():
            for event in batch:
                yield event

    async def abatches(self) -> AsyncIterator[list[Event]]:
        """`aevents()` a wake-up at a time: each list holds every event that arrived since the last one
        (a chunk's tokens, for all the request's choices), so a reader's per-wake work (an HTTP write)
        is paid once per chunk, not once per token."""
        loop = asyncio.get_running_loop()
        i = 0
        while True:
            wake = None
            with self._cond:
                batch, finished = self._take(i)
                if not batch and not finished:
                    wake = asyncio.Event()
                    self._waiters.append((loop, wake))
            if wake is not None:
                await wake.wait()
                continue
            i += len(batch)
            if batch:
                yield batch
            if finished:
                self._raise_error()
                return
