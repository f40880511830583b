"""What the HTTP server (app.py) serves: a `Service` takes a checked, tokenized request and returns the
engine's `Handle`. `EngineService` is the plain one, a `ServingEngine` behind it; a training run's
recorder (black-box agents) is another, keeping each episode's tokens by the `episode` the route names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from jaxrl.data.tokenizer import Tokenizer
from jaxrl.serve.requests import Handle, Request


class Service(Protocol):
    model_name: str
    tokenizer: Tokenizer
    chat_template: Callable[[list[dict]], str] | None  # messages -> prompt text; None: chat answers 400

    # Optional: `stats() -> dict`, served as GET /stats.

    def submit(self, prompt_text: str, prompt_ids: tuple[int, ...], request: Request, episode: str | None) -> Handle:
        """Queue one request -> its handle (RequestError / QueueFull / Draining as `ServingEngine.submit`)."""
        ...


def chat_template_of(tokenizer: Any) -> Callable[[list[dict]], str] | None:
    """The tokenizer's chat template as messages -> prompt text (with the assistant turn opened), or None
    when it has none (the character tokenizer; an HF tokenizer without a chat_template)."""
    if not getattr(tokenizer, "chat_template", None) or not hasattr(tokenizer, "apply_chat_template"):
        return None
    return lambda messages: tokenizer.apply_chat_template(messages, add_generation_prompt=True)


class EngineService:
    """A `ServingEngine` served as is: every request submitted unchanged, the episode ignored."""

    def __init__(self, engine, tokenizer: Tokenizer, model_name: str, chat_template=None):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.chat_template = chat_template

    def submit(self, prompt_text: str, prompt_ids: tuple[int, ...], request: Request, episode: str | None) -> Handle:
        del prompt_text, prompt_ids, episode  # the request carries the prompt ids
        return self.engine.submit(request)

    def stats(self) -> dict:
        """The engine's counters (GET /stats): queued, active, completed, cancelled, tokens, chunks, ..."""
        return self.engine.stats()
