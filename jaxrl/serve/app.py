"""The OpenAI-compatible HTTP API over a `Service` (service.py): `create_app(service, limits)`.

    GET  /v1/models                    the one model served
    POST /v1/completions               prompt text (or token ids) -> completions
    POST /v1/chat/completions          messages -> the service's chat template -> completions
    .../episodes/{episode}/v1/...      the same, with `episode` handed to `service.submit` (agent runs)
    GET  /stats                        the service's `stats()` when it has one (the engine's counters)

Requests are checked by schema.py (a 4xx `{"error": {message, type, param, code}}` naming the field),
tokenized here (BOS first unless the tokenizer's `add_bos` is False, as training encodes prompts) and
submitted as one engine `Request` whose n choices decode side by side. Every choice carries
`token_ids`: every token the model sampled, EOS and stop-string tokens included; with `logprobs`, their
log-probs under softmax(logits / T) (completions: `logprobs.tokens` / `token_logprobs` / `text_offset`;
chat: `logprobs.content[i].token` / `logprob`). The response carries `prompt_token_ids`. Streaming
answers server-sent events in OpenAI's chunk format, ending with `data: [DONE]`. A client that goes
away (mid-stream or while waiting) cancels its request: the engine frees its slots at the next chunk.
Finish reasons: "stop" (EOS, a stop id, a stop string), "length", "cancelled" (the engine stopped).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from jaxrl.serve.requests import Done, Draining, EngineError, QueueFull, Request, RequestError, Token
from jaxrl.serve.schema import CHAT, COMPLETIONS, ApiError, Limits, Parsed, bad, parse
from jaxrl.serve.service import Service
from jaxrl.serve.text import ChoiceText

DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is still there


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _authorize(request: HttpRequest, limits: Limits) -> None:
    if limits.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, key = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), limits.api_key.encode()):
        raise ApiError(401, "missing or wrong API key (Authorization: Bearer <key>)", None, "invalid_api_key")


async def read_json(request: HttpRequest, max_bytes: int) -> Any:
    """The body as JSON; 413 past max_bytes (by Content-Length, or while reading), 400 if not JSON."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"request body of {declared} bytes exceeds {max_bytes}", None, "body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"request body exceeds {max_bytes} bytes", None, "body_too_large")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except ValueError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", None, "invalid_json") from None


def _tokenize(service: Service, parsed: Parsed, limits: Limits) -> tuple[str, tuple[int, ...]]:
    """The prompt's text and token ids, checked against the prompt limit."""
    tokenizer, field = service.tokenizer, "prompt" if parsed.kind == COMPLETIONS else "messages"
    if parsed.prompt_ids is not None:
        text, ids = tokenizer.decode(parsed.prompt_ids), parsed.prompt_ids
    else:
        text = parsed.prompt
        if parsed.kind == CHAT:
            if service.chat_template is None:
                raise bad(
                    "messages",
                    f"model {service.model_name!r} has no chat template; use /v1/completions",
                    "no_chat_template",
                )
            try:
                text = service.chat_template([dict(m) for m in parsed.messages or ()])
            except Exception as e:  # the template's own error (raise_exception, a missing variable)
                raise bad("messages", f"the chat template failed: {e}") from None
        assert text is not None
        bos = [tokenizer.bos_id] if getattr(tokenizer, "add_bos", True) else []
        try:
            ids = tuple(bos + list(tokenizer.encode(text)))
        except ValueError as e:  # a character the tokenizer cannot encode
            raise bad(field, str(e)) from None
    if len(ids) > limits.max_prompt_tokens:
        raise bad(
            field,
            f"{len(ids)} prompt tokens, more than the limit {limits.max_prompt_tokens}",
            "context_length_exceeded",
        )
    return text, ids


def _other_eos_ids(tokenizer, given: tuple[int, ...]) -> tuple[int, ...]:
    """A Hugging Face tokenizer's end-of-sequence ids besides `eos_id` (e.g. both <|im_end|> and
    <|endoftext|>): stop ids of every request, since the tokenizer's text ends at any of them (tokens
    drawn after one would never show)."""
    eos_ids = getattr(tokenizer, "eos_ids", ()) or ()
    return tuple(i for i in eos_ids if i != tokenizer.eos_id and i not in given)


def _submit(service: Service, parsed: Parsed, text: str, ids: tuple[int, ...], episode: str | None):
    try:
        request = Request(
            prompt=ids,
            max_tokens=parsed.max_tokens,
            temperature=parsed.temperature,
            top_p=parsed.top_p,
            n=parsed.n,
            seed=parsed.seed,
            stop_ids=parsed.stop_ids + _other_eos_ids(service.tokenizer, parsed.stop_ids),
        )
        return service.submit(text, ids, request, episode)
    except RequestError as e:
        raise bad(e.param, str(e)) from None
    except QueueFull as e:
        raise ApiError(429, f"the server is busy: {e}", None, "queue_full") from None
    except Draining as e:
        raise ApiError(503, f"the server is shutting down: {e}", None, "draining") from None


class Collector:
    """The choices of one handle as its events arrive. A choice that reaches a stop string is finished
    here; its later events are dropped, and once every choice is finished the handle is cancelled (the
    engine cancels whole requests), freeing the slots of choices still decoding."""

    def __init__(self, handle, tokenizer, parsed: Parsed):
        self.handle, self.parsed = handle, parsed
        self.choices = [ChoiceText(tokenizer, parsed.stop) for _ in range(parsed.n)]

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    def feed(self, event: Token | Done) -> tuple[int, str, bool] | None:
        """One engine event -> (choice, text released, whether the event is a token), or None when the
        choice was already finished (its event is dropped)."""
        choice = self.choices[event.choice]
        if choice.finished:
            return None
        if isinstance(event, Token):
            piece = choice.add(event.token, event.logprob)
        else:
            piece = choice.finish(event.reason)
        if self.finished:
            self.handle.cancel()  # no-op when the engine finished them itself
        return event.choice, piece, isinstance(event, Token)

    def feed_batch(self, events: list) -> dict[int, tuple[str, bool]]:
        """Several engine events (one wake-up's) -> per choice they touch, in the order of their first
        event: (text released, whether tokens came). A choice's tokens are added together (one decode);
        a choice already finished gets nothing."""
        runs: dict[int, tuple[list[int], list[float], list[str]]] = {}
        for event in events:
            tokens, logprobs, reasons = runs.setdefault(event.choice, ([], [], []))
            if isinstance(event, Token):
                tokens.append(event.token)
                logprobs.append(event.logprob)
            else:
                reasons.append(event.reason)
        out = {}
        for index, (tokens, logprobs, reasons) in runs.items():
            choice = self.choices[index]
            if choice.finished:
                continue
            piece = choice.add_many(tokens, logprobs) if tokens else ""
            if reasons and not choice.finished:
                piece += choice.finish(reasons[0])
            out[index] = (piece, bool(tokens))
        if self.finished:
            self.handle.cancel()  # no-op when the engine finished them itself
        return out


def _logprobs(kind: str, choice: ChoiceText, start: int, stop: int, offset: int = 0) -> dict:
    texts = [choice.token_text(i) for i in range(start, stop)]
    if kind == CHAT:
        return {
            "content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(texts, choice.logprobs[start:stop])
            ]
        }
    offsets, at = [], offset
    for t in texts:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": texts,
        "token_logprobs": choice.logprobs[start:stop],
        "top_logprobs": None,
        "text_offset": offsets,
    }


def _usage(prompt_ids: tuple[int, ...], collector: Collector) -> dict:
    done = sum(len(c.ids) for c in collector.choices)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": done, "total_tokens": len(prompt_ids) + done}


class Answer:
    """The response (whole, or its stream of chunks) of one request."""

    def __init__(self, service: Service, parsed: Parsed, prompt_ids: tuple[int, ...], collector: Collector):
        self.service, self.parsed, self.prompt_ids, self.collector = service, parsed, prompt_ids, collector
        chat = parsed.kind == CHAT
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.object = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.service.model_name}

    def whole(self) -> dict:
        choices = []
        for i, c in enumerate(self.collector.choices):
            logprobs = _logprobs(self.parsed.kind, c, 0, len(c.ids)) if self.parsed.logprobs else None
            entry = {"index": i, "logprobs": logprobs, "finish_reason": c.finish_reason, "token_ids": c.ids}
            if self.parsed.kind == CHAT:
                entry["message"] = {"role": "assistant", "content": c.text}
            else:
                entry["text"] = c.text
            choices.append(entry)
        usage = _usage(self.prompt_ids, self.collector)
        return {
            **self._head(self.object),
            "choices": choices,
            "usage": usage,
            "prompt_token_ids": list(self.prompt_ids),
        }

    def chunk(self, index: int, piece: str, token: bool, sent: list[int], first: bool, at: list[int]) -> dict:
        """One SSE chunk for choice `index`: its released text, its new tokens (if tokens came), its
        finish reason once finished. `sent[index]`: the choice's tokens already streamed; `at[index]`:
        the text offset of the next one (the sum of the streamed tokens' texts, as `whole` counts)."""
        c = self.collector.choices[index]
        start, stop = sent[index], len(c.ids) if token else sent[index]
        sent[index] = stop
        logprobs = None
        if self.parsed.logprobs and stop > start:
            logprobs = _logprobs(self.parsed.kind, c, start, stop, at[index])
            at[index] += sum(len(t) for t in logprobs.get("tokens", ()))
        entry: dict = {
            "index": index,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
            "token_ids": c.ids[start:stop],
        }
        if self.parsed.kind == CHAT:
            entry["delta"] = {"role": "assistant", "content": piece} if first else {"content": piece}
            return {**self._head("chat.completion.chunk"), "choices": [entry]}
        entry["text"] = piece
        return {**self._head("text_completion"), "choices": [entry]}

    def usage_chunk(self) -> dict:
        return {
            **self._head("chat.completion.chunk" if self.parsed.kind == CHAT else "text_completion"),
            "choices": [],
            "usage": _usage(self.prompt_ids, self.collector),
        }


def sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


async def _batches(handle) -> AsyncIterator[list]:
    """The handle's events a wake-up at a time (`Handle.abatches`: a chunk's tokens together); a handle
    with only `aevents` (a service's own) one event at a time."""
    if hasattr(handle, "abatches"):
        async for batch in handle.abatches():
            yield batch
    else:
        async for event in handle.aevents():
            yield [event]


async def _stream(answer: Answer, handle):
    """The SSE body: per batch of engine events, one chunk per choice holding all its new tokens (and
    its finish reason once finished), written in one send; the last batch's chunks, the usage chunk and
    `[DONE]` go together."""
    n = answer.parsed.n
    collector, sent, started, at = answer.collector, [0] * n, [False] * n, [0] * n
    pending: list[bytes] = []
    try:
        async for batch in _batches(handle):
            new = collector.feed_batch(batch)
            pending += [sse(answer.chunk(i, text, token, sent, not started[i], at)) for i, (text, token) in new.items()]
            for i in new:
                started[i] = True
            if collector.finished:
                break
            if pending:
                yield b"".join(pending)
                pending = []
        if answer.parsed.include_usage:
            pending.append(sse(answer.usage_chunk()))
    except EngineError as e:
        pending.append(sse(ApiError(500, f"the engine failed: {e}", None, "engine_error").body()))
    finally:  # also when the client went away (the response task is cancelled / its send fails)
        if not collector.finished:
            handle.cancel()
    yield b"".join([*pending, sse("[DONE]")])


async def _collect(collector: Collector, handle, request: HttpRequest) -> bool:
    """Feed every event; False when the client went away first (the handle is then cancelled)."""

    async def run():
        async for batch in _batches(handle):
            collector.feed_batch(batch)
            if collector.finished:
                return

    task = asyncio.ensure_future(run())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                task.result()  # the engine's error, if any
                return True
            if await request.is_disconnected():
                return False
    finally:
        if not task.done():
            task.cancel()
        if not collector.finished:
            handle.cancel()


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error object: ours (ApiError), the router's (404, 405), and any other
    exception (500 for that request; the server goes on)."""

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):
        return error_response(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}"))

    @app.exception_handler(Exception)
    async def _server_error(request, e: Exception):
        return error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}", None, "internal_error"))


async def _serve(service: Service, limits: Limits, request: HttpRequest, kind: str, episode: str | None) -> Response:
    _authorize(request, limits)
    body = await read_json(request, limits.max_body_bytes)
    parsed = parse(body, kind, limits, service.model_name, service.tokenizer.vocab_size)
    text, ids = _tokenize(service, parsed, limits)
    handle = _submit(service, parsed, text, ids, episode)
    collector = Collector(handle, service.tokenizer, parsed)
    answer = Answer(service, parsed, ids, collector)
    if parsed.stream:
        return StreamingResponse(_stream(answer, handle), media_type="text/event-stream")
    try:
        if not await _collect(collector, handle, request):
            return Response(status_code=499)  # the client went away: nobody reads it
    except EngineError as e:
        raise ApiError(500, f"the engine failed: {e}", None, "engine_error") from None
    return JSONResponse(answer.whole())


def create_app(service: Service, limits: Limits) -> FastAPI:
    """The FastAPI app serving `service` within `limits` (see the module docstring)."""
    app = FastAPI(title="jaxrl serve", docs_url=None, redoc_url=None, openapi_url=None)
    _add_error_handlers(app)

    async def models(request: HttpRequest):
        _authorize(request, limits)
        entry = {"id": service.model_name, "object": "model", "created": 0, "owned_by": "jaxrl"}
        return {"object": "list", "data": [entry]}

    async def stats(request: HttpRequest):
        _authorize(request, limits)
        if not hasattr(service, "stats"):
            raise ApiError(404, f"model {service.model_name!r}: its service keeps no stats", None, "no_stats")
        return service.stats()  # pyright: ignore[reportAttributeAccessIssue]

    async def completions(request: HttpRequest):
        return await _serve(service, limits, request, COMPLETIONS, None)

    async def chat(request: HttpRequest):
        return await _serve(service, limits, request, CHAT, None)

    async def episode_models(request: HttpRequest, episode: str):
        return await models(request)

    async def episode_completions(request: HttpRequest, episode: str):
        return await _serve(service, limits, request, COMPLETIONS, episode)

    async def episode_chat(request: HttpRequest, episode: str):
        return await _serve(service, limits, request, CHAT, episode)

    app.add_api_route("/stats", stats, methods=["GET"])
    routes = {
        "": (models, completions, chat),
        "/episodes/{episode}": (episode_models, episode_completions, episode_chat),
    }
    for prefix, (get_models, post_completions, post_chat) in routes.items():
        app.add_api_route(f"{prefix}/v1/models", get_models, methods=["GET"])
        app.add_api_route(f"{prefix}/v1/completions", post_completions, methods=["POST"])
        app.add_api_route(f"{prefix}/v1/chat/completions", post_chat, methods=["POST"])
    return app
