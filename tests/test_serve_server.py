"""`jaxrl serve` as a real process on a free localhost port, driven by the official `openai` client: a
tiny checkpoint trained here, completions (greedy, seeded, n, stop strings, log-probs and token ids),
streaming, the chat route's 400 (the character tokenizer has no chat template), bad requests, the API
key, a client leaving mid-stream (its slots freed: the engine's stats), SIGTERM draining the request in
flight and exiting 0. One server for the whole file: each start trains and compiles."""

import json
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import httpx2 as httpx  # the HTTP client the openai package and starlette use
import openai
import pytest
from conftest import DEFAULT_CONFIG, TINY
from harness import child_env

KEY = "sesame"
EOS = 2  # the character tokenizer's
LONG = 48  # --max-tokens: a greedy completion this long is still decoding when the client leaves


def _train(run: pathlib.Path, env: dict) -> None:
    sets = sum((["--set", s] for s in [*TINY, "train.steps=1", "checkpoint.every=1"]), [])
    cmd = [sys.executable, "-m", "jaxrl.cli", "train", str(DEFAULT_CONFIG), "--workdir", str(run), *sets]
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=300)


def _start(run: pathlib.Path, env: dict) -> tuple[subprocess.Popen, str]:
    flags = ["--port", "0", "--api-key", KEY, "--max-tokens", str(LONG), "--slots", "4", "--max-n", "2", "--chunk", "2"]
    cmd = [sys.executable, "-m", "jaxrl.cli", "serve", str(run), "--model-name", "tiny", *flags]
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert server.stdout is not None
    line = server.stdout.readline()  # blocks until the server prints its URL (or exits)
    found = re.search(r"at (http://127\.0\.0\.1:\d+/v1)", line)
    if found is None:
        server.kill()
        pytest.fail(f"no URL from jaxrl serve: {line!r} {server.stderr.read() if server.stderr else ''}")
    return server, found.group(1)


def _stats(url: str) -> dict:
    return httpx.get(url.removesuffix("/v1") + "/stats", headers={"Authorization": f"Bearer {KEY}"}).json()


def _wait_idle(url: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = _stats(url)
        if (stats["active"] == 0 and stats["queued"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def _check_completions(client: openai.OpenAI) -> str:
    """-> the greedy text of "12+34=" (the other checks build on it)."""
    assert [m.id for m in client.models.list()] == ["tiny"]
    greedy = client.completions.create(model="tiny", prompt="12+34=", max_tokens=8, temperature=0, n=2, logprobs=1)
    first, second = greedy.choices
    extra = first.model_extra or {}
    assert first.text == second.text and first.logprobs is not None and greedy.usage is not None
    assert len(extra["token_ids"]) == len(first.logprobs.token_logprobs or []) == greedy.usage.completion_tokens // 2
    assert "".join(first.logprobs.tokens or []) == first.text
    seeded = [
        client.completions.create(model="tiny", prompt="7+8=", max_tokens=8, temperature=1.0, seed=5, n=2)
        for _ in range(2)
    ]
    ids = [[(c.model_extra or {})["token_ids"] for c in s.choices] for s in seeded]
    assert ids[0] == ids[1], "the same seed draws the same tokens"
    text = first.text
    if len(text) >= 2:  # cut before the first occurrence of its second character
        cut = client.completions.create(model="tiny", prompt="12+34=", max_tokens=8, temperature=0, stop=[text[1]])
        assert (cut.choices[0].text, cut.choices[0].finish_reason) == (text[: text.index(text[1])], "stop")
    streamed = client.completions.create(model="tiny", prompt="12+34=", max_tokens=8, temperature=0, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == first.finish_reason
    return text


def _check_errors(client: openai.OpenAI, url: str) -> None:
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1+1="}])
    assert chat.value.body["param"] == "messages" and chat.value.body["code"] == "no_chat_template"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="1", max_tokens=LONG + 1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong").models.list()


def _leave_mid_stream(url: str) -> None:
    before = _wait_idle(url)
    body = {"model": "tiny", "prompt": "12+34=", "max_tokens": LONG, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{url}/completions", json=body, headers=headers, timeout=30) as response:
        first = json.loads(next(line for line in response.iter_lines() if line.startswith("data: "))[6:])
        assert first["choices"][0]["finish_reason"] is None  # still decoding when the client goes
    after = _wait_idle(url)
    assert after["active"] == 0 and after["free_slots"] == before["free_slots"]
    assert after["cancelled"] == before["cancelled"] + 1, (before, after)


def _sigterm_drains(server: subprocess.Popen, url: str) -> None:
    """SIGTERM while a long request streams: the request still completes, new connections are refused,
    the process exits 0."""
    body = {"model": "tiny", "prompt": "12+34=", "max_tokens": LONG, "temperature": 0, "stream": True}
    headers, events, started = {"Authorization": f"Bearer {KEY}"}, [], threading.Event()

    def read():
        with httpx.stream("POST", f"{url}/completions", json=body, headers=headers, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(30)
    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=60) == 0
    reader.join(timeout=30)
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    tokens = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    reason = chunks[-1]["choices"][0]["finish_reason"]
    assert events[-1] == "[DONE]" and chunks[0]["choices"][0]["finish_reason"] is None
    assert (reason == "length" and len(tokens) == LONG) or (reason == "stop" and tokens[-1] == EOS), (reason, tokens)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/models", headers=headers)


def test_idle_connections_outlive_the_clients_pools():
    """The server keeps an idle connection open longer than httpx (the openai client's pool) keeps it, so
    a pooled connection is never reused just as the server closes it (a request lost in transit)."""
    from openai._constants import DEFAULT_CONNECTION_LIMITS  # the limits the openai client's pool gets

    from jaxrl.serve.server import uvicorn_config

    config = uvicorn_config(object(), "127.0.0.1", 0, 5.0)
    expiries = [httpx.Limits().keepalive_expiry, DEFAULT_CONNECTION_LIMITS.keepalive_expiry]
    assert all(e is not None and config.timeout_keep_alive > e for e in expiries), (config.timeout_keep_alive, expiries)


@pytest.mark.slow
def test_jaxrl_serve_with_the_openai_client(tmp_path, cache_env):
    env = child_env(cache_env)
    run = tmp_path / "run"
    _train(run, env)
    server, url = _start(run, env)
    try:
        client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)
        _check_completions(client)
        _check_errors(client, url)
        _leave_mid_stream(url)
        _sigterm_drains(server, url)
    finally:
        if server.poll() is None:
            server.kill()
    assert "drained" in (server.stderr.read() if server.stderr else "")


@pytest.mark.slow
def test_chat_with_a_checkpoints_template(tmp_path, cache_env):
    """A Hugging Face checkpoint with a chat template (a tiny Qwen2, ChatML BPE, Qwen2.5's template): the
    prompt is transformers' own rendering of the messages, tokenized as the run would, and the reply is
    the text of the tokens the model drew."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from hf_stand_in import CHATML_SPECIALS, QWEN25, save_bpe_tokenizer, save_tiny_qwen2

    from jaxrl.data.hf_tokenizer import load_tokenizer

    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": QWEN25}
    corpus = ["You are Qwen, created by Alibaba Cloud. You are a helpful assistant. 12+34=46 user system"] * 5
    save_bpe_tokenizer(tmp_path, corpus, 300, CHATML_SPECIALS, config)
    save_tiny_qwen2(tmp_path, 300, eos_token_id=2, pad_token_id=0)
    flags = ["--port", "0", "--max-prompt-tokens", "256", "--max-tokens", "6", "--slots", "2", "--max-n", "1"]
    server = subprocess.Popen(
        [sys.executable, "-m", "jaxrl.cli", "serve", str(tmp_path), "--model-name", "qwen", *flags],
        env=child_env(cache_env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        found = re.search(r"at (http://127\.0\.0\.1:\d+/v1)", line)
        assert found, (line, server.stderr.read() if server.stderr else "")
        client = openai.OpenAI(base_url=found.group(1), api_key="unused", max_retries=0)
        messages: list = [{"role": "user", "content": "12+34="}]
        reply = client.chat.completions.create(model="qwen", messages=messages, temperature=0, logprobs=True)
        extra = reply.model_extra or {}
        rendered = transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        tok = load_tokenizer(tmp_path)  # the run's tokenizer (no BOS for this one)
        assert extra["prompt_token_ids"] == tok.encode(rendered) and tok.add_bos is False
        choice = reply.choices[0]
        ids = (choice.model_extra or {})["token_ids"]
        assert choice.message.content == tok.decode(ids) and 1 <= len(ids) <= 6
        assert choice.logprobs is not None and len(choice.logprobs.content or []) == len(ids)
    finally:
        server.terminate()
        assert server.wait(timeout=60) == 0
