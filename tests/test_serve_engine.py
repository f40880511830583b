"""The serving engine (jaxrl/serve/engine.py): greedy equal to the static sampler and log-probs equal to
the trainer's under continuous batching, seeded draws independent of slots and company, per-request
limits / stop ids / cancel / versions, one compiled chunk for every mix of requests, the event streams
(threads and asyncio), and every user mistake named."""

import asyncio
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import ModelConfig
from jaxrl.models import transformer as tf
from jaxrl.rollout.engine import state as es
from jaxrl.rollout.sampler import SamplingParams, sample
from jaxrl.serve.engine import ServingEngine
from jaxrl.serve.requests import Done, Draining, EngineError, QueueFull, Request, RequestError, Token

CFG = ModelConfig(vocab_size=29, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)
EOS, PAD = 28, 0
P, T, S, MAX_N = 6, 7, 4, 2
PROMPTS = ((3, 9, 4), (7,), (1, 2, 3, 4, 5, 6), (11, 5), (20, 21, 22, 23))


@functools.cache
def _params(seed=0):
    return tf.init_params(CFG, jax.random.PRNGKey(seed))


def _engine(**kw) -> ServingEngine:
    args: dict = dict(slots=S, max_prompt_tokens=P, max_new_tokens=T, max_n=MAX_N, chunk=3, rng=jax.random.PRNGKey(1))
    return ServingEngine(_params(), CFG, eos_id=EOS, pad_id=PAD, **(args | kw))


def _choices(events) -> tuple[dict, dict]:
    """-> ({choice: [Token]}, {choice: reason}); checks each choice's Tokens come before its one Done."""
    tokens, reasons = {}, {}
    for e in events:
        assert e.choice not in reasons, "a Token or Done after the choice's Done"
        if isinstance(e, Token):
            tokens.setdefault(e.choice, []).append(e)
        else:
            reasons[e.choice] = e.reason
    return tokens, reasons


def _left_pad(prompt):
    out, mask = np.full((1, P), PAD, np.int32), np.zeros((1, P), np.int32)
    out[0, P - len(prompt) :], mask[0, P - len(prompt) :] = prompt, 1
    return out, mask


def _greedy_reference(prompt) -> list[int]:
    prompt_1xP, mask_1xP = _left_pad(prompt)
    sp = SamplingParams(max_new_tokens=T, temperature=1.0, eos_id=EOS, pad_id=PAD, greedy=True)
    out = sample(_params(), CFG, prompt_1xP, mask_1xP, jax.random.PRNGKey(0), sampling=sp, group_size=1)
    return [int(t) for t in np.asarray(out.tokens_BxT)[0, : int(out.length_B[0])]]


def _trainer_logprobs(prompt, tokens, temperature) -> np.ndarray:
    prompt_1xP, mask_1xP = _left_pad(prompt)
    tokens_1xT = np.full((1, T), PAD, np.int32)
    tokens_1xT[0, : len(tokens)] = tokens
    cmask_1xT = (np.arange(T) < len(tokens)).astype(np.float32)[None]
    logp_1xT, _ = tf.token_logprobs(_params(), CFG, prompt_1xP, mask_1xP, tokens_1xT, cmask_1xT, temperature)
    return np.asarray(logp_1xT)[0, : len(tokens)]


def test_continuous_batching_matches_sampler_and_trainer():
    """10 greedy and 5 sampled choices through 4 slots (admitted as slots free, decoded side by side,
    the thread running, every handle read from its own thread): greedy tokens are the static
    sampler's; every recorded log-prob is the trainer's `token_logprobs` at the request's temperature."""
    engine = _engine()
    engine.start()
    greedy = [engine.submit(Request(prompt=p, max_tokens=T, temperature=0.0, n=2)) for p in PROMPTS]
    drawn = [engine.submit(Request(prompt=p, max_tokens=T, temperature=0.7, top_p=0.9)) for p in PROMPTS]
    results = {}

    def read(h):
        results[h.id] = list(h.events(timeout=120))

    readers = [threading.Thread(target=read, args=(h,)) for h in greedy + drawn]
    for r in readers:
        r.start()
    for r in readers:
        r.join()
    engine.stop()
    for prompt, h in zip(PROMPTS, greedy):
        tokens, reasons = _choices(results[h.id])
        want = _greedy_reference(prompt)
        for choice in (0, 1):
            assert [t.token for t in tokens[choice]] == want
            assert reasons[choice] == ("stop" if want[-1] == EOS else "length")
            # temperature 0: the T -> 0 limit's log-prob of the (untied) maximum is log 1
            np.testing.assert_array_equal([t.logprob for t in tokens[choice]], 0.0)
    for prompt, h in zip(PROMPTS, drawn):
        tokens, _ = _choices(results[h.id])
        got = tokens[0]
        want = _trainer_logprobs(prompt, [t.token for t in got], 0.7)
        np.testing.assert_allclose([t.logprob for t in got], want, rtol=1e-5, atol=1e-5)
        assert {t.version for t in got} == {0}
    stats = engine.stats()
    assert stats["completed"] == 10 and stats["active"] == stats["queued"] == 0 and stats["free_slots"] == S
    assert stats["tokens"] == sum(isinstance(e, Token) for r in results.values() for e in r)


def test_seeded_request_draws_the_same_tokens_anywhere():
    """A seeded request's choices draw the same tokens alone and behind other requests (other slots,
    other chunk boundaries); its two choices differ, and so does another seed."""
    req = Request(prompt=(3, 9, 4), max_tokens=T, temperature=1.0, n=2, seed=1234)

    def run(requests):
        engine = _engine()
        handles = [engine.submit(r) for r in requests]
        while any(not h.finished for h in handles):
            engine.step()
        return [_choices(h.events(timeout=0))[0] for h in handles]

    alone = run([req])[0]
    crowded = run([Request(prompt=(7,), max_tokens=2, n=1), Request(prompt=(5, 5), max_tokens=T, n=2), req])[2]
    other = run([Request(prompt=(3, 9, 4), max_tokens=T, temperature=1.0, n=2, seed=99)])[0]

    def seq(choices, i):
        return [t.token for t in choices[i]]

    assert [seq(crowded, i) for i in (0, 1)] == [seq(alone, i) for i in (0, 1)]
    assert seq(alone, 0) != seq(alone, 1)
    assert [seq(other, i) for i in (0, 1)] != [seq(alone, i) for i in (0, 1)]


def test_max_tokens_stop_ids_cancel_and_versions():
    """Per-request limits in one engine: max_tokens ends a choice at "length", a stop id ends it at
    "stop" with the id kept; a cancel frees the slots at the next chunk; tokens keep the version that
    drew them across `set_params`."""
    greedy = _greedy_reference(PROMPTS[0])
    engine = _engine(chunk=2)
    short = engine.submit(Request(prompt=PROMPTS[0], max_tokens=3, temperature=0.0))
    stop_at = greedy[1]  # drawn (by the first params) within the first chunk
    stopped = engine.submit(Request(prompt=PROMPTS[0], max_tokens=T, temperature=0.0, stop_ids=(stop_at,)))
    doomed = engine.submit(Request(prompt=PROMPTS[1], max_tokens=T, n=2))
    engine.step()  # all three admitted (4 slots); a chunk of 2 tokens ends `stopped`
    assert stopped.finished and engine.stats()["active"] == 2
    doomed.cancel()
    engine.set_params(_params(1), version=5)
    engine.step()
    assert engine.stats()["free_slots"] >= 2 and engine.stats()["cancelled"] == 1
    while not (short.finished and stopped.finished):
        engine.step()

    tokens, reasons = _choices(short.events(timeout=0))
    assert [t.token for t in tokens[0]][:2] == greedy[:2] and reasons == {0: "length"}
    assert [t.version for t in tokens[0]] == [0, 0, 5]  # the third token drawn by the new params
    tokens, reasons = _choices(stopped.events(timeout=0))
    assert [t.token for t in tokens[0]] == greedy[: greedy.index(stop_at) + 1] and reasons == {0: "stop"}
    tokens, reasons = _choices(doomed.events(timeout=0))
    assert reasons == {0: "cancelled", 1: "cancelled"} and all(len(tokens[i]) == 2 for i in (0, 1))
    assert engine.stats() | {"tokens": 0} == {
        "completed": 2,
        "cancelled": 1,
        "failed": 0,
        "tokens": 0,
        "chunks": engine.stats()["chunks"],
        "prefill_calls": 3,
        "queued": 0,
        "active": 0,
        "free_slots": S,
        "version": 5,
    }


def test_one_compiled_chunk_serves_every_mix():
    """Requests with different temperatures, top_p, limits, stop ids, n and seeds run one compiled
    decode chunk, one admission and one placement program (slots=3: a spec no other test compiles)."""
    engine = _engine(slots=3)
    programs = (es.decode_chunk, es._admit, es.place_sampling)
    before = [f._cache_size() for f in programs]  # pyright: ignore[reportAttributeAccessIssue]
    mix = [
        Request(prompt=(1, 2), max_tokens=2, temperature=0.0),
        Request(prompt=(4,), max_tokens=T, temperature=1.3, top_p=0.5, n=2, seed=5),
        Request(prompt=(1, 2, 3, 4, 5), max_tokens=4, temperature=0.2, stop_ids=(3, 4, 7)),
        Request(prompt=(9, 9), max_tokens=T, top_p=0.99),
    ]
    handles = [engine.submit(r) for r in mix]
    while any(not h.finished for h in handles):
        engine.step()
    after = [f._cache_size() for f in programs]  # pyright: ignore[reportAttributeAccessIssue]
    assert [a - b for a, b in zip(after, before)] == [1, 1, 1]
    assert engine.stats()["completed"] == len(mix)


def test_aevents_streams_for_asyncio():
    """`aevents` yields the same events as `events` without blocking the loop."""
    engine = _engine()
    engine.start()

    async def consume():
        handle = engine.submit(Request(prompt=(3, 9, 4), max_tokens=5, temperature=0.0, n=2))
        return handle, [e async for e in handle.aevents()]

    handle, got = asyncio.run(consume())
    engine.stop()
    assert got == list(handle.events(timeout=0))
    assert sum(isinstance(e, Done) for e in got) == 2 and sum(isinstance(e, Token) for e in got) == 10


def test_abatches_hands_over_a_chunk_at_a_time():
    """`abatches` gives, per wake-up, every event published since the last: driven by `step`, one chunk's
    tokens of both choices together (chunk=3, max_tokens=5: 3 + 3 tokens, then 2 + 2 and both Dones)."""
    engine = _engine()
    handle = engine.submit(Request(prompt=(3, 9, 4), max_tokens=5, temperature=0.0, n=2))

    async def batches():
        got, stream = [], handle.abatches()
        while not handle.finished or len(got) < 2:
            engine.step()
            got.append(await anext(stream))
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        return got

    got = asyncio.run(batches())
    assert [e for b in got for e in b] == list(handle.events(timeout=0))
    kinds = [[(type(e).__name__, e.choice) for e in b] for b in got]
    assert kinds[0] == [("Token", 0)] * 3 + [("Token", 1)] * 3
    assert kinds[1] == [("Token", 0)] * 2 + [("Done", 0)] + [("Token", 1)] * 2 + [("Done", 1)]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"prompt": ()}, "prompt"),
        ({"prompt": (1, "a")}, "prompt"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_bad_request_names_its_field(kwargs, param):
    with pytest.raises(RequestError, match=f"^{param}: ") as err:
        Request(**({"prompt": (1,), "max_tokens": 1} | kwargs))
    assert err.value.param == param


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"prompt": tuple(range(1, P + 2))}, "prompt"),
        ({"prompt": (1, CFG.vocab_size)}, "prompt"),
        ({"max_tokens": T + 1}, "max_tokens"),
        ({"n": MAX_N + 1}, "n"),
        ({"stop_ids": (1, 2, 3)}, "stop_ids"),
        ({"stop_ids": (-1,)}, "stop_ids"),
    ],
)
def test_request_over_engine_limits_names_its_field(kwargs, param):
    engine = _engine(max_stop_ids=2)
    with pytest.raises(RequestError, match=f"^{param}: ") as err:
        engine.submit(Request(**({"prompt": (1,), "max_tokens": 1} | kwargs)))
    assert err.value.param == param


def test_queue_full_drain_stop_and_bad_engine_arguments():
    engine = _engine(max_queue=2)
    queued = [engine.submit(Request(prompt=(1,), max_tokens=1, n=2)) for _ in range(2)]
    with pytest.raises(QueueFull, match="max_queue=2"):
        engine.submit(Request(prompt=(1,), max_tokens=1))
    assert engine.drain(timeout=0.01) is False  # nothing decodes without the thread
    with pytest.raises(Draining):
        engine.submit(Request(prompt=(1,), max_tokens=1))
    engine.stop()
    for h in queued:
        assert list(h.events(timeout=0)) == [Done(0, "cancelled"), Done(1, "cancelled")]
    with pytest.raises(ValueError, match="^max_n: got 5, expected at most slots=4"):
        _engine(max_n=5)
    with pytest.raises(ValueError, match="^eos_id: "):
        ServingEngine(_params(), CFG, eos_id=CFG.vocab_size, pad_id=0, max_prompt_tokens=2, max_new_tokens=2)


def test_stop_cancels_decoding_choices_and_events_time_out():
    """`stop` ends a request mid-decode with Done(.., "cancelled") after the tokens already sent; an
    event stream with nothing to say within its timeout raises TimeoutError."""
    engine = _engine(chunk=2)
    waiting = engine.submit(Request(prompt=(3, 9), max_tokens=T, n=2))
    with pytest.raises(TimeoutError, match=f"request {waiting.id}: no event within 0.01 s"):
        next(waiting.events(timeout=0.01))
    engine.step()
    engine.stop()
    tokens, reasons = _choices(waiting.events(timeout=0))
    assert reasons == {0: "cancelled", 1: "cancelled"} and [len(tokens[i]) for i in (0, 1)] == [2, 2]
    assert engine.stats()["free_slots"] == S and engine.stats()["cancelled"] == 1
    with pytest.raises(Draining):
        engine.start()


def test_drain_waits_for_in_flight_requests():
    engine = _engine()
    engine.start()
    handle = engine.submit(Request(prompt=(3, 9), max_tokens=T, n=2))
    assert engine.drain(timeout=120) is True
    assert handle.finished and engine.stats()["completed"] == 1
    engine.stop()


def test_engine_error_fails_the_requests_not_the_engine():
    """A step that raises (here: params without the model's weights) fails the requests in flight
    with EngineError; the thread keeps serving once good params are back."""
    engine = _engine()
    engine.set_params({"embedding": jnp.zeros((CFG.vocab_size, CFG.d_model))}, version=1)
    engine.start()
    bad = engine.submit(Request(prompt=(1, 2), max_tokens=2))
    with pytest.raises(EngineError, match=f"request {bad.id}: the engine failed"):
        list(bad.events(timeout=120))
    engine.set_params(_params(), version=2)
    good = engine.submit(Request(prompt=(1, 2), max_tokens=2, temperature=0.0))
    tokens, reasons = _choices(good.events(timeout=120))
    engine.stop()
    assert [t.token for t in tokens[0]] == _greedy_reference((1, 2))[:2] and {t.version for t in tokens[0]} == {2}
    assert engine.stats()["failed"] == 1
