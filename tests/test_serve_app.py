"""The HTTP layer of `jaxrl serve` (jaxrl/serve/app.py, schema.py, text.py) against a fake Service whose
handles replay scripted tokens: request checking and limits, the response and SSE formats, stop
strings, token ids and log-probs, API keys, engine errors, cancellation. No engine, no JAX; the real
server is tests/test_serve_server.py."""

import asyncio
import json
from typing import Any, cast

import openai
import pytest
from fastapi.testclient import TestClient

from jaxrl.data.tokenizer import CharTokenizer
from jaxrl.serve.app import Answer, Collector, _stream, create_app
from jaxrl.serve.requests import Done, Draining, EngineError, QueueFull, RequestError, Token
from jaxrl.serve.schema import Limits, parse
from jaxrl.serve.text import ChoiceText, held_back

TOK = CharTokenizer()
EOS = TOK.eos_id
LIMITS = Limits(max_prompt_tokens=12, max_tokens=8, max_n=3, max_body_bytes=4096)


def ids(text: str) -> list[int]:
    return TOK.encode(text)


class FakeHandle:
    """Replays `script` (choice -> its tokens and finish reason), the choices' events interleaved."""

    def __init__(self, script: dict[int, tuple[list[int], str]], error: Exception | None = None):
        self.script, self.error, self.cancelled = script, error, False
        self.id = 0

    def cancel(self):
        self.cancelled = True

    def _events(self):
        longest = max(len(toks) for toks, _ in self.script.values())
        for step in range(longest + 1):
            for choice, (toks, reason) in sorted(self.script.items()):
                if step < len(toks):
                    yield Token(choice, toks[step], -0.5 - step, 3)
                elif step == len(toks):
                    yield Done(choice, reason)

    async def aevents(self):
        for event in self._events():
            if self.cancelled:
                break
            await asyncio.sleep(0)
            yield event
            if self.error is not None:  # the engine fails after the first event
                raise self.error
        if self.cancelled:
            for choice in self.script:
                yield Done(choice, "cancelled")


class FakeService:
    model_name = "tiny"
    tokenizer = TOK

    def __init__(self, script=None, chat_template=None, fail: Exception | None = None, error=None):
        self.script = script or {0: (ids("12") + [EOS], "stop")}
        self.chat_template, self.fail, self.error = chat_template, fail, error
        self.submitted: list[tuple] = []
        self.handles: list[FakeHandle] = []

    def submit(self, prompt_text, prompt_ids, request, episode):
        if self.fail is not None:
            raise self.fail
        self.submitted.append((prompt_text, prompt_ids, request, episode))
        script = {c: self.script[c % len(self.script)] for c in range(request.n)}
        self.handles.append(FakeHandle(script, self.error))
        return self.handles[-1]


def client_for(service: Any, limits=LIMITS) -> TestClient:
    return TestClient(create_app(service, limits))


def sse_events(text: str) -> list:
    lines = [line for line in text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def test_models_and_unknown_routes():
    client = client_for(FakeService())
    for path in ("/v1/models", "/episodes/e7/v1/models"):
        body = client.get(path).json()
        assert [m["id"] for m in body["data"]] == ["tiny"]
    missing = client.get("/v2/models")
    assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}
    assert client.get("/stats").json()["error"]["code"] == "no_stats"

    class Counting(FakeService):
        def stats(self):
            return {"active": len(self.handles)}

    assert client_for(Counting()).get("/stats").json() == {"active": 0}


def test_completion_fields_reach_the_engine_request():
    service = FakeService()
    body = {
        "model": "tiny",
        "prompt": "3+4=",
        "max_tokens": 5,
        "temperature": 0.5,
        "top_p": 0.9,
        "n": 2,
        "seed": 11,
        "stop_token_ids": [5],
        "logprobs": 1,
    }
    out = client_for(service).post("/episodes/ep-1/v1/completions", json=body).json()
    text, prompt_ids, request, episode = service.submitted[0]
    assert (text, episode) == ("3+4=", "ep-1")
    assert prompt_ids == request.prompt == (TOK.bos_id, *ids("3+4="))
    assert (request.max_tokens, request.temperature, request.top_p, request.n) == (5, 0.5, 0.9, 2)
    assert (request.seed, request.stop_ids) == (11, (5,))
    assert out["object"] == "text_completion" and out["prompt_token_ids"] == list(prompt_ids)
    assert [c["text"] for c in out["choices"]] == ["12", "12"]
    choice = out["choices"][0]
    assert choice["token_ids"] == [*ids("12"), EOS] and choice["finish_reason"] == "stop"
    assert choice["logprobs"]["tokens"] == ["1", "2", ""]
    assert choice["logprobs"]["token_logprobs"] == [-0.5, -1.5, -2.5]
    assert choice["logprobs"]["text_offset"] == [0, 1, 2]
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
    plain = client_for(FakeService()).post("/v1/completions", json={"prompt": "1"}).json()
    assert plain["choices"][0]["logprobs"] is None


def test_token_id_prompt_is_not_tokenized_again():
    service = FakeService()
    prompt = [TOK.bos_id, *ids("7+")]
    client_for(service).post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    text, prompt_ids, request, _ = service.submitted[0]
    assert (text, prompt_ids, request.prompt, request.max_tokens) == ("7+", tuple(prompt), tuple(prompt), 2)


def test_stop_string_cuts_text_keeps_tokens_and_cancels():
    service = FakeService({0: (ids("12+345"), "length")})
    out = client_for(service).post("/v1/completions", json={"prompt": "1", "stop": ["+3", "9"]}).json()
    choice = out["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("12", "stop")
    assert choice["token_ids"] == ids("12+3")  # every token drawn up to the stop string's end
    assert service.handles[0].cancelled


def test_one_choice_stopping_waits_for_the_others():
    script = {0: (ids("1,2"), "length"), 1: (ids("345") + [EOS], "stop")}
    service = FakeService(script)
    out = client_for(service).post("/v1/completions", json={"prompt": "1", "n": 2, "stop": ","}).json()
    # choice 1 ran to its EOS (a cancel at choice 0's stop string would have ended it "cancelled"), then the
    # handle was cancelled: choice 0's slot may still be decoding in the engine
    assert [(c["text"], c["finish_reason"]) for c in out["choices"]] == [("1", "stop"), ("345", "stop")]
    assert service.handles[0].cancelled


def test_stream_chunks_hold_back_partial_stop_strings():
    service = FakeService({0: (ids("1233345"), "length")})
    response = client_for(service).post("/v1/completions", json={"prompt": "1", "stream": True, "stop": "34"})
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = sse_events(response.text)
    pieces = [c["choices"][0]["text"] for c in chunks]
    assert "".join(pieces) == "1233"
    assert pieces == ["1", "2", "", "3", "3", ""]  # each "3" waits for the next token: "34" would stop there
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == ids("123334")


def test_chat_stream_role_logprobs_usage():
    template = lambda messages: "".join(m["content"] for m in messages) + "="  # noqa: E731
    service = FakeService({0: (ids("7") + [EOS], "stop")}, chat_template=template)
    body = {
        "messages": [{"role": "user", "content": "3+4"}],
        "stream": True,
        "logprobs": True,
        "stream_options": {"include_usage": True},
    }
    chunks = sse_events(client_for(service).post("/v1/chat/completions", json=body).text)
    assert service.submitted[0][0] == "3+4="
    assert chunks[0]["object"] == "chat.completion.chunk" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "role" not in chunks[1]["choices"][0]["delta"]
    assert chunks[0]["choices"][0]["logprobs"]["content"][0]["token"] == "7"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
    whole = client_for(service).post("/v1/chat/completions", json={**body, "stream": False, "stream_options": None})
    assert whole.json()["choices"][0]["message"] == {"role": "assistant", "content": "7"}


@pytest.mark.parametrize(
    ("route", "body", "status", "param"),
    [
        ("completions", {"prompt": "1", "temperature": -1}, 400, "temperature"),
        ("completions", {"prompt": "1", "top_p": 0}, 400, "top_p"),
        ("completions", {"prompt": "1", "n": 4}, 400, "n"),
        ("completions", {"prompt": "1", "max_tokens": 9}, 400, "max_tokens"),
        ("completions", {"prompt": "1", "max_tokens": 0}, 400, "max_tokens"),
        ("completions", {"prompt": "1", "stop": ["1", "2", "3", "4", "5"]}, 400, "stop"),
        ("completions", {"prompt": "1", "stop": 7}, 400, "stop"),
        ("completions", {"prompt": "1", "stream": "yes"}, 400, "stream"),
        ("completions", {"prompt": "1", "seed": "x"}, 400, "seed"),
        ("completions", {"prompt": "1", "logprobs": 6}, 400, "logprobs"),
        ("completions", {"prompt": "1", "presence_penalty": 0.5}, 400, "presence_penalty"),
        ("completions", {"prompt": "1", "echo": True}, 400, "echo"),
        ("completions", {"prompt": "1", "frobnicate": 1}, 400, "frobnicate"),
        ("completions", {"prompt": "1", "model": "gpt-4"}, 404, "model"),
        ("completions", {"prompt": "1", "stop_token_ids": [99]}, 400, "stop_token_ids"),
        ("completions", {}, 400, "prompt"),
        ("completions", {"prompt": ["1", "2"]}, 400, "prompt"),
        ("completions", {"prompt": [1, 999]}, 400, "prompt"),
        ("completions", {"prompt": "abc"}, 400, "prompt"),  # not in the character alphabet
        ("completions", {"prompt": "1" * 12}, 400, "prompt"),  # 13 tokens with BOS > 12
        ("chat/completions", {"messages": [{"role": "user", "content": "1"}]}, 400, "messages"),  # no template
        ("chat/completions", {}, 400, "messages"),
        ("chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
        ("chat/completions", {"messages": [{"role": "user", "content": "1"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ],
)
def test_bad_requests_name_their_field(route, body, status, param):
    service = FakeService()
    response = client_for(service).post(f"/v1/{route}", json=body)
    error = response.json()["error"]
    assert (response.status_code, error["param"]) == (status, param), error
    assert param in error["message"] and error["type"] in ("invalid_request_error", "not_found_error")
    assert not service.submitted


def test_long_prompt_code_and_body_limits():
    client = client_for(FakeService())
    error = client.post("/v1/completions", json={"prompt": "1" * 12}).json()["error"]
    assert error["code"] == "context_length_exceeded"
    big = client.post("/v1/completions", json={"prompt": "1", "user": "x" * 5000})
    assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"
    for raw in (b"{not json", b"[1, 2]"):
        response = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


def test_api_key():
    client = client_for(FakeService(), Limits(max_prompt_tokens=12, max_tokens=8, api_key="sesame"))
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "sesame"}):
        response = client.post("/v1/completions", json={"prompt": "1"}, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/models").status_code == 401
    ok = client.post("/v1/completions", json={"prompt": "1"}, headers={"Authorization": "Bearer sesame"})
    assert ok.status_code == 200


@pytest.mark.parametrize(
    ("fail", "status", "param"),
    [
        (QueueFull("full"), 429, None),
        (Draining("draining"), 503, None),
        (RequestError("n", "too many"), 400, "n"),
        (RuntimeError("boom"), 500, None),
    ],
)
def test_engine_refusals_and_failures_are_json(fail, status, param):
    client = TestClient(
        create_app(FakeService(fail=fail), LIMITS),  # pyright: ignore[reportArgumentType]
        raise_server_exceptions=False,
    )
    response = client.post("/v1/completions", json={"prompt": "1"})
    assert (response.status_code, response.json()["error"]["param"]) == (status, param)
    assert client.get("/v1/models").status_code == 200  # the server goes on


def test_engine_error_mid_request():
    service = FakeService(error=EngineError("device lost"))
    client = client_for(service)
    response = client.post("/v1/completions", json={"prompt": "1"})
    assert response.status_code == 500 and "device lost" in response.json()["error"]["message"]
    chunks = sse_events(client.post("/v1/completions", json={"prompt": "1", "stream": True}).text)
    assert chunks[-1]["error"]["code"] == "engine_error"


def test_stream_closed_early_cancels_the_handle():
    parsed = parse({"prompt": "1", "stream": True}, "completions", LIMITS, "tiny", TOK.vocab_size)
    handle = FakeHandle({0: (ids("1234567"), "length")})
    service: Any = FakeService()
    answer = Answer(service, parsed, (1,), Collector(handle, TOK, parsed))

    async def read_one_then_leave():
        stream = _stream(answer, handle)
        first = await anext(stream)
        await stream.aclose()  # what the server does when the client's connection drops
        return first

    assert json.loads(asyncio.run(read_one_then_leave())[6:])["choices"][0]["text"] == "1"
    assert handle.cancelled


class BatchedHandle(FakeHandle):
    """A handle with `abatches`, as the engine's: the script's events in batches of `size`."""

    size = 3

    async def abatches(self):
        events = list(self._events())
        for start in range(0, len(events), self.size):
            yield events[start : start + self.size]


def test_stream_sends_one_chunk_per_choice_per_batch():
    """Two choices' events (1 4 | 2 5 | 3 6 | Done Done) in batches of 3: one SSE chunk per choice per
    batch (in the order the choices first appear), holding all its tokens of the batch, in one send."""
    script = {0: (ids("123"), "length"), 1: (ids("456"), "length")}
    handle, service = BatchedHandle(script), cast(Any, FakeService(script))
    parsed = parse(
        {"prompt": "1", "stream": True, "n": 2, "logprobs": 1}, "completions", LIMITS, "tiny", TOK.vocab_size
    )
    answer = Answer(service, parsed, (1,), Collector(handle, TOK, parsed))

    async def read():
        return [part async for part in _stream(answer, handle)]

    parts = asyncio.run(read())  # batches [1 4 2] [5 3 6] [Done Done]; [DONE] goes with the last
    assert len(parts) == 3 and parts[-1].endswith(b"\n\ndata: [DONE]\n\n")
    sends = [[json.loads(e[6:])["choices"][0] for e in p.decode().split("\n\n") if e[6:7] == "{"] for p in parts]
    got = [[(c["index"], c["text"], c["token_ids"], c["finish_reason"]) for c in send] for send in sends]
    assert got == [
        [(0, "12", ids("12"), None), (1, "4", ids("4"), None)],
        [(1, "56", ids("56"), None), (0, "3", ids("3"), None)],
        [(0, "", [], "length"), (1, "", [], "length")],
    ]
    assert sends[0][0]["logprobs"]["token_logprobs"] == [-0.5, -1.5]
    assert sends[1][0]["logprobs"]["token_logprobs"] == [-1.5, -2.5]
    # text offsets run on across a choice's chunks, as in the whole response
    assert [sends[0][0]["logprobs"]["text_offset"], sends[1][1]["logprobs"]["text_offset"]] == [[0, 1], [2]]
    assert [sends[0][1]["logprobs"]["text_offset"], sends[1][0]["logprobs"]["text_offset"]] == [[0], [1, 2]]


def test_stream_batch_ends_a_choice_at_its_stop_string():
    """Batches [1 2 3] [4 5 Done] with stop "34": "3" is held back, the choice ends at token 4 (its id
    sent, its text cut), the rest of the batch is dropped and the handle cancelled."""
    handle = BatchedHandle({0: (ids("12345"), "length")})
    parsed = parse({"prompt": "1", "stream": True, "stop": "34"}, "completions", LIMITS, "tiny", TOK.vocab_size)
    answer = Answer(cast(Any, FakeService()), parsed, (1,), Collector(handle, TOK, parsed))

    async def read():
        return [part async for part in _stream(answer, handle)]

    parts = asyncio.run(read())
    events = [e[6:] for e in b"".join(parts).decode().split("\n\n") if e]
    assert len(parts) == 2 and events[-1] == "[DONE]"
    got = [(c["text"], c["token_ids"], c["finish_reason"]) for c in (json.loads(e)["choices"][0] for e in events[:-1])]
    assert got == [("12", ids("123"), None), ("", ids("4"), "stop")] and handle.cancelled


def test_openai_client_parses_the_responses():
    service = FakeService({0: (ids("42") + [EOS], "stop")}, chat_template=lambda m: m[-1]["content"])
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client_for(service))
    completion = client.completions.create(model="tiny", prompt="40+2=", max_tokens=4, logprobs=1)
    assert completion.choices[0].text == "42"
    logprobs, extra = completion.choices[0].logprobs, completion.choices[0].model_extra
    assert logprobs is not None and extra is not None
    assert logprobs.token_logprobs == [-0.5, -1.5, -2.5] and extra["token_ids"] == [*ids("42"), EOS]
    streamed = client.completions.create(model="tiny", prompt="40+2=", stream=True)
    assert "".join(c.choices[0].text for c in streamed) == "42"
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1"}], logprobs=True)
    chat_logprobs = chat.choices[0].logprobs
    assert chat_logprobs is not None and chat_logprobs.content is not None
    assert chat.choices[0].message.content == "42" and chat_logprobs.content[1].logprob == -1.5
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="1", temperature=5)


def test_held_back_and_utf8():
    assert held_back("12+3", ("+34",)) == 2 and held_back("12", ("+34",)) == 0
    assert held_back("ab\ufffd", ()) == 1

    class Bytes:  # a byte-level tokenizer: one token per UTF-8 byte
        def decode(self, ids):
            return bytes(ids).decode("utf-8", errors="replace")

    choice = ChoiceText(Bytes())  # type: ignore[arg-type]
    pieces = [choice.add(b, 0.0) for b in "é!".encode()]
    assert pieces == ["", "é", "!"]


@pytest.mark.parametrize("stops", [(), ("é!",), ("!",)])
def test_add_many_releases_what_adding_one_by_one_does(stops):
    """A batch of tokens (one decode without stop strings) ends as the same tokens, text and finish as
    the tokens added one at a time; with a stop string, at the token that completes it."""

    class Bytes:  # a byte-level tokenizer: one token per UTF-8 byte
        def decode(self, ids):
            return bytes(ids).decode("utf-8", errors="replace")

    tokens = list("ab é! c".encode())
    one, many = ChoiceText(Bytes(), stops), ChoiceText(Bytes(), stops)  # type: ignore[arg-type]
    pieces = [one.add(t, -1.0) for t in tokens if not one.finished]
    released = many.add_many(tokens[:3], [-1.0] * 3) + many.add_many(tokens[3:], [-1.0] * (len(tokens) - 3))
    assert (many.ids, many.text, many.finish_reason) == (one.ids, one.text, one.finish_reason)
    assert released == "".join(pieces) == one.text
    if stops:
        assert one.finish_reason == "stop" and len(one.ids) < len(tokens)


def test_every_eos_id_of_the_tokenizer_stops_a_choice():
    class TwoEos(CharTokenizer):
        eos_ids = (EOS, 5)

    service = FakeService()
    service.tokenizer = TwoEos()
    client_for(service).post("/v1/completions", json={"prompt": "1", "stop_token_ids": [7]})
    assert service.submitted[0][2].stop_ids == (7, 5)


def test_serve_command_errors_name_the_path_or_flag(tmp_path, capsys):
    from jaxrl.cli import main

    def error(*args) -> str:
        assert main(["serve", *args]) == 2
        return capsys.readouterr().err.strip()

    assert error(str(tmp_path / "nope")) == f"jaxrl: error: serve: {tmp_path / 'nope'}: directory not found"
    assert "neither a run directory" in error(str(tmp_path))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert "a Hugging Face checkpoint, it has no steps" in error(str(tmp_path / "hf"), "--step", "3")
    step = tmp_path / "elsewhere" / "7"
    (step / "state").mkdir(parents=True)
    assert "--config FILE" in error(str(step))
    run = tmp_path / "run"
    (run / "checkpoints" / "1" / "state").mkdir(parents=True)
    assert "--step 2 was not saved" in error(str(run), "--step", "2")


def test_a_port_in_use_is_a_one_line_error():
    import socket

    from jaxrl.config import ConfigError
    from jaxrl.serve.server import run_server

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"--port {port}: cannot listen there"):
            run_server(create_app(FakeService(), LIMITS), "127.0.0.1", port, 1.0, lambda host, port: None)  # pyright: ignore[reportArgumentType]


def test_a_client_gone_while_waiting_cancels_the_handle():
    """The non-streaming path checks its client between events: gone -> the request is cancelled."""
    from jaxrl.serve.app import _collect

    class Endless(FakeHandle):
        async def aevents(self):
            while not self.cancelled:
                await asyncio.sleep(0.01)
                yield Token(0, ids("1")[0], -1.0, 0)

    class Gone:
        async def is_disconnected(self):
            return True

    parsed = parse({"prompt": "1"}, "completions", LIMITS, "tiny", TOK.vocab_size)
    handle = Endless({0: ([], "length")})
    collector = Collector(handle, TOK, parsed)
    assert asyncio.run(_collect(collector, handle, Gone())) is False  # pyright: ignore[reportArgumentType]
    assert handle.cancelled and collector.choices[0].ids  # it had started
