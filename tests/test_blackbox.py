"""Black-box agents (jaxrl.serve.recorder, jaxrl.sources.blackbox) against a fake engine: episodes kept
as the engine's tokens (never re-tokenized), extension vs a new segment, the budget, the seeds and
sampling the recorder fixes, the recorder as the app's Service driven by the official openai client,
agents run concurrently (threads and asyncio), rewards and their errors, and Task.agent's checks."""

import asyncio
import dataclasses
import threading

import httpx2 as httpx
import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient

from jaxrl.config import ConfigError
from jaxrl.data.registry import Task, register_task
from jaxrl.serve.app import create_app
from jaxrl.serve.recorder import Budget, EpisodeRecorder, kept_prefix, request_seed
from jaxrl.serve.requests import Done, Request, RequestError, Token
from jaxrl.serve.schema import Limits
from jaxrl.sources import blackbox


class MergingTokenizer:
    """Characters, plus one merged token for "ab": encoding "ab" gives MERGED, so a recorder that
    re-tokenized the model's "a", "b" would change its tokens."""

    pad_id, bos_id, eos_id = 0, 1, 2
    chars = "abcdefghijklmnopqrstuvwxyz0123456789[]>*= \n"
    MERGED = 3 + len(chars)
    vocab_size = MERGED + 1

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            if text.startswith("ab", i):
                ids.append(self.MERGED)
                i += 2
            else:
                ids.append(3 + self.chars.index(text[i]))
                i += 1
        return ids

    def decode(self, ids) -> str:
        out = []
        for i in ids:
            if i == self.eos_id:
                break
            out.append("ab" if i == self.MERGED else "" if i < 3 else self.chars[i - 3])
        return "".join(out)


TOK = MergingTokenizer()


class FakeHandle:
    """A finished request: its scripted tokens (log-prob -(i+1)/10, version 7) and Done."""

    def __init__(self, hid: int, request: Request, tokens: list[int], reason: str):
        self.id, self.request = hid, request
        self._events = [Token(0, t, -(i + 1) / 10, 7) for i, t in enumerate(tokens)] + [Done(0, reason)]
        self.finished, self.cancelled = True, False

    def cancel(self):
        self.cancelled = True

    def events(self, timeout=None):
        yield from self._events

    async def aevents(self):
        for e in self._events:
            yield e


class FakeEngine:
    """Answers each request with the next scripted completion text (tokenized char by char: the model
    may emit "a", "b" as two tokens), cut to its max_tokens ("length"), else EOS ("stop")."""

    def __init__(self, script: list[str]):
        self.script, self.requests = list(script), []
        self.lock = threading.Lock()

    def submit(self, request: Request):
        with self.lock:
            self.requests.append(request)
            text = self.script.pop(0)
        tokens = [3 + TOK.chars.index(c) for c in text]
        if len(tokens) > request.max_tokens:
            return FakeHandle(len(self.requests), request, tokens[: request.max_tokens], "length")
        return FakeHandle(len(self.requests), request, [*tokens, TOK.eos_id][: request.max_tokens], "stop")

    def stats(self):
        return {"requests": len(self.requests)}


def _request(text: str, **kw) -> tuple[str, tuple[int, ...], Request]:
    ids = (TOK.bos_id, *TOK.encode(text))
    return text, ids, Request(prompt=ids, max_tokens=kw.pop("max_tokens", 16), **kw)


def _drain(handle) -> list:
    return list(handle.events())


BUDGET = Budget(8, 40)


def _recorder(script, budget=BUDGET, sampling=(0.7, 0.9)):
    engine = FakeEngine(script)
    return engine, EpisodeRecorder(engine, TOK, "policy", budget, sampling)


def test_kept_prefix_keeps_what_the_next_prompt_repeats():
    chars = [3 + TOK.chars.index(c) for c in "[calc 1]xy"]
    assert kept_prefix("q=", chars, "q=[calc 1]>1\n", TOK.decode) == 8  # the unseen "xy" dropped
    assert kept_prefix("q=", chars, "q=[calc 1]xy!", TOK.decode) == 10
    assert kept_prefix("q=", chars, "q=zzz", TOK.decode) == 0  # the completion discarded, the prompt extended
    assert kept_prefix("q=", chars, "other", TOK.decode) is None  # history rewritten: a new segment


def test_an_extension_is_the_exact_context_tokens_plus_the_suffix_as_an_observation():
    engine, rec = _recorder(["ab[c]zz", "ab"])
    rec.open("e", (5, 1, 0, 0))
    _drain(rec.submit(*_request("x="), "e"))
    # The agent saw "ab[c]" (a stop at "]" cut the rest) and sends back its transcript plus a tool result.
    _drain(rec.submit(*_request("x=ab[c]>ab\n"), "e"))
    trace = rec.close("e")
    model1 = [3 + TOK.chars.index(c) for c in "ab[c]"]  # "a", "b" as sampled: never merged
    obs = TOK.encode(">ab\n")
    assert obs[1] == TOK.MERGED  # the observation is tokenized alone, as the server would
    prompt = [TOK.bos_id, *TOK.encode("x=")]
    assert list(engine.requests[1].prompt) == prompt + model1 + obs
    model2 = [3, 4, TOK.eos_id]
    n = len(model1) + len(obs) + len(model2)
    assert list(trace.prompt_P[-3:]) == prompt and trace.prompt_mask_P.tolist() == [0] * 5 + [1] * 3
    assert trace.tokens_T[:n].tolist() == model1 + obs + model2
    assert (trace.tokens_T[n:] == TOK.pad_id).all()
    assert trace.loss_mask_T[:n].tolist() == [1.0] * 5 + [0.0] * len(obs) + [1.0] * 3
    assert trace.loss_mask_T[n:].sum() == 0
    assert trace.logp_T[:5].tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5])
    assert trace.logp_T[5 : 5 + len(obs)].tolist() == [0.0] * len(obs)
    assert trace.version_T[:n].tolist() == [7] * 5 + [-1] * len(obs) + [7] * 3
    assert (trace.requests, trace.segments, trace.dropped_tokens, trace.truncated) == (2, 1, 3, False)
    assert trace.final_text == "ab"  # "zz" + EOS of turn 1 were unseen: dropped (3)


def test_a_rewritten_history_starts_a_new_segment_and_the_row_is_the_last_one():
    engine, rec = _recorder(["abc", "d"])
    rec.open("e", (0,))
    _drain(rec.submit(*_request("x="), "e"))
    _drain(rec.submit(*_request("y=abc"), "e"))  # does not extend "x=...": rewritten
    trace = rec.close("e")
    ids = [TOK.bos_id, *TOK.encode("y=abc")]
    assert list(engine.requests[1].prompt) == ids  # the server's tokenization of the new prompt
    assert trace.segments == 2 and trace.dropped_tokens == 4  # "a", "b", "c", EOS of the first segment
    assert trace.prompt_P[-len(ids) :].tolist() == ids
    assert trace.tokens_T[:2].tolist() == [3 + TOK.chars.index("d"), TOK.eos_id]
    assert trace.loss_mask_T.sum() == 2


def test_the_recorder_fixes_sampling_and_seeds_each_request_from_the_episode():
    engine, rec = _recorder(["a", "b", "a"])
    rec.open("e1", (3, 1, 0, 0))
    rec.open("e2", (3, 1, 0, 1))
    _drain(rec.submit(*_request("x=", temperature=0.0, top_p=0.5), "e1"))
    _drain(rec.submit(*_request("x=a", seed=9), "e1"))
    _drain(rec.submit(*_request("x="), "e2"))
    r1, r2, r3 = engine.requests
    assert (r1.temperature, r1.top_p) == (0.7, 0.9) == (r3.temperature, r3.top_p)
    assert r1.seed == request_seed((3, 1, 0, 0), 0, None) and r2.seed == request_seed((3, 1, 0, 0), 1, 9)
    assert len({r1.seed, r2.seed, r3.seed}) == 3  # episodes and their turns draw their own noise
    assert request_seed((3, 1, 0, 0), 0, None) == r1.seed  # a replay draws the same


def test_the_budget_cuts_max_tokens_then_refuses_and_truncates():
    engine, rec = _recorder(["abcdefgh", "zz"], budget=Budget(4, 10))
    rec.open("e", (0,))
    _drain(rec.submit(*_request("x="), "e"))  # prompt of 3 tokens <= 4: the whole budget of 10 is left
    assert engine.requests[0].max_tokens == 10
    _drain(rec.submit(*_request("x=abcdefgh"), "e"))  # 8 model tokens (EOS unseen) used: 2 left
    assert engine.requests[1].max_tokens == 2
    with pytest.raises(RequestError) as err:
        rec.submit(*_request("x=abcdefghzz"), "e")
    assert err.value.param == "max_tokens" and "rollout.max_new_tokens" in str(err.value)
    trace = rec.close("e")
    assert trace.truncated and trace.loss_mask_T.sum() == 10


def test_a_first_prompt_longer_than_the_prompt_width_spills_into_the_row_as_an_observation():
    engine, rec = _recorder(["1"], budget=Budget(4, 10))
    rec.open("e", (0,))
    _drain(rec.submit(*_request("xyz12="), "e"))  # BOS + 6 tokens: 3 past the prompt width of 4
    assert engine.requests[0].max_tokens == 7  # those 3 come out of the 10-token budget
    trace = rec.close("e")
    ids = [TOK.bos_id, *TOK.encode("xyz12=")]
    assert trace.prompt_P.tolist() == ids[:4] and trace.prompt_mask_P.tolist() == [1] * 4
    assert trace.tokens_T[:5].tolist() == [*ids[4:], 3 + TOK.chars.index("1"), TOK.eos_id]
    assert trace.loss_mask_T[:5].tolist() == [0, 0, 0, 1, 1]


def test_a_second_request_while_the_first_is_unread_is_refused():
    pending = FakeHandle(0, Request(prompt=(1,), max_tokens=1), [3], "stop")
    pending.finished = False
    engine, rec = _recorder(["a"])
    engine.submit = lambda request: pending
    rec.open("e", (0,))
    rec.submit(*_request("x="), "e")  # accepted, never read
    with pytest.raises(RequestError, match="in flight") as err:
        rec.submit(*_request("x=a"), "e")
    assert err.value.param == "episode"


@pytest.mark.parametrize(
    "episode, kw, param",
    [(None, {}, "episode"), ("nope", {}, "episode"), ("e", {"n": 2}, "n")],
)
def test_requests_the_recorder_refuses_name_the_field(episode, kw, param):
    _, rec = _recorder(["a"])
    rec.open("e", (0,))
    with pytest.raises(RequestError) as err:
        rec.submit(*_request("x=", **kw), episode)
    assert err.value.param == param


def _app(script, sampling=(1.0, 1.0)):
    engine, rec = _recorder(script, sampling=sampling)
    limits = Limits(max_prompt_tokens=64, max_tokens=16, max_n=1)
    return engine, rec, TestClient(create_app(rec, limits))


def test_the_recorder_behind_the_app_records_what_the_openai_client_sends():
    engine, rec, http = _app(["[c 1]zz", "11"])
    rec.open("3.0.1", (0,))
    client = openai.OpenAI(base_url="http://testserver/episodes/3.0.1/v1", api_key="k", http_client=http)
    first = client.completions.create(model="policy", prompt="1*1=", max_tokens=16, stop=["]"])
    assert first.choices[0].text == "[c 1"  # the app cut the stop string; the recorder keeps "]" (below)
    second = client.completions.create(model="policy", prompt="1*1=[c 1]>1\n", max_tokens=16)
    assert second.choices[0].text == "11"
    trace = rec.close("3.0.1")
    n_model1 = len("[c 1]")
    assert trace.loss_mask_T[:n_model1].tolist() == [1.0] * n_model1
    assert TOK.decode(trace.tokens_T[: n_model1 + 3]) == "[c 1]>1\n"
    # The app stops reading a choice at its stop string: "zz" + EOS never reach the recorder.
    assert trace.dropped_tokens == 0 and trace.requests == 2
    with pytest.raises(openai.BadRequestError) as err:  # a closed episode
        client.completions.create(model="policy", prompt="1*1=", max_tokens=4)
    assert "episode" in str(err.value)


def test_play_runs_sync_and_async_agents_concurrently_in_order():
    barrier = threading.Barrier(4, timeout=10)

    def sync_agent(client, record):
        barrier.wait()  # four at once, or the barrier times out
        return float(record["i"])

    out = blackbox.play(sync_agent, [(f"http://x/{i}", {"i": i}) for i in range(4)], concurrency=4)
    assert [o.reward for o in out] == [0.0, 1.0, 2.0, 3.0]
    running, peaks = [], []

    async def async_agent(client, record):
        assert isinstance(client, openai.AsyncOpenAI)
        running.append(record["i"])
        peaks.append(len(running))
        await asyncio.sleep(0.05)
        running.remove(record["i"])
        if record["i"] == 2:
            raise ValueError("the agent's own bug")
        return -record["i"]

    out = blackbox.play(async_agent, [(f"http://x/{i}", {"i": i}) for i in range(6)], concurrency=3)
    assert [o.reward for o in out] == [0, -1, None, -3, -4, -5]
    assert isinstance(out[2].error, ValueError)
    assert max(peaks) == 3  # concurrent, and never more than `concurrency`


def _trace(text="7", truncated=False):
    _, rec = _recorder([text])
    rec.open("e", (0,))
    _drain(rec.submit(*_request("x="), "e"))
    return rec.close("e")._replace(truncated=truncated)


def test_episode_rewards_from_the_agent_or_the_verifier_and_their_errors():
    task = Task("t", agent=lambda c, r: None, records=[{"id": "0", "prompt": "x"}])
    verified = dataclasses.replace(task, verifier=lambda text, finished, record: (float(text == "7"), 0.5))
    o = blackbox.Outcome
    assert blackbox.episode_reward(task, o(0.25, None), _trace(), {}).tolist() == [0.25, 0.0]
    assert blackbox.episode_reward(task, o(None, ValueError()), _trace(), {}).tolist() == [0.0, 0.0]
    assert blackbox.episode_reward(verified, o(None, None), _trace("7"), {}).tolist() == [1.0, 0.5]
    with pytest.raises(ConfigError, match="no verifier"):
        blackbox.episode_reward(task, o(None, None), _trace(), {"id": "r"})
    with pytest.raises(ConfigError, match="expected a float reward"):
        blackbox.episode_reward(task, o("1", None), _trace(), {"id": "r"})  # pyright: ignore[reportArgumentType]
    with pytest.raises(ConfigError, match="non-finite"):
        blackbox.episode_reward(task, o(float("nan"), None), _trace(), {"id": "r"})


def test_played_batch_and_metrics():
    traces = [_trace("7"), _trace("77", truncated=True), _trace("1"), _trace("12")]
    outcomes = [blackbox.Outcome(1.0, None), blackbox.Outcome(None, RequestError("max_tokens", "spent"))]
    outcomes += [blackbox.Outcome(0.0, None), blackbox.Outcome(None, ValueError("bug"))]
    rewards = np.array([[1, 0], [0, 0], [0, 0], [0, 0]], np.float32)
    played = blackbox.Played(traces, outcomes, rewards)
    batch = blackbox.played_batch(played, 2)
    assert (
        batch.group_id_B is not None
        and batch.group_id_B.tolist() == [0, 0, 1, 1]
        and batch.truncated_B.tolist() == [0, 1, 0, 0]
    )
    assert batch.completion_mask_BxT.sum(1).tolist() == [2, 3, 2, 3]  # the answer + EOS
    m = blackbox.played_metrics(played, 2, (1.0, 1.0))
    assert m["agent/agent_errors"] == 1  # the budget's refusal is a truncation, not the agent's error
    assert m["agent/success_rate"] == 0.25 and m["agent/zero_std_groups"] == 0.5
    assert m["agent/reward_std_mean"] == pytest.approx(0.25)
    assert blackbox.first_error(played) == "ValueError: bug"


def test_task_agent_checks_name_the_field():
    records = [{"id": "0", "prompt": "x"}]
    with pytest.raises(ConfigError, match="Task.agent"):
        register_task(Task("bb_bad", agent=3, records=records))  # pyright: ignore[reportArgumentType]
    with pytest.raises(ConfigError, match="exactly one of Task.records and Task.environment"):
        register_task(Task("bb_both", agent=lambda c, r: 1.0))
    task = register_task(Task("bb_ok", agent="jaxrl.sources.blackbox:play", records=records))
    assert task.black_box and not task.episodic and task.agent_fn is blackbox.play
    assert not Task("plain", records=records, verifier=lambda completion, finished, record: (0.0, 0.0)).black_box


@pytest.mark.parametrize(
    "override, field",
    [("rollout.top_k=5", "rollout.top_k"), ("rollout.speculative.enabled=true", "rollout.speculative.enabled")],
)
def test_what_black_box_runs_cannot_combine_with_names_the_field(override, field):
    from conftest import REPO

    from jaxrl.config import load_config

    cfg = load_config(REPO / "configs" / "agent_openai_calculator.py", [override])
    with pytest.raises(ConfigError) as err:
        blackbox.check_blackbox_config(cfg, cfg.data.task)
    assert str(err.value).startswith(field)


def test_async_http_client_against_the_app():
    """An async agent's client (httpx.AsyncClient over ASGI) records like the sync one."""
    engine, rec, http = _app(["ab", "c"])
    rec.open("e", (0,))
    transport = httpx.ASGITransport(app=http.app)

    async def agent():
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as raw:
            client = openai.AsyncOpenAI(base_url="http://t/episodes/e/v1", api_key="k", http_client=raw)
            a = await client.completions.create(model="policy", prompt="q=", max_tokens=8)
            return await client.completions.create(model="policy", prompt="q=" + a.choices[0].text + "1", max_tokens=8)

    assert asyncio.run(agent()).choices[0].text == "c"
    trace = rec.close("e")
    one, c = TOK.encode("1c")
    # The first turn's EOS is not kept: the agent continued from its text, and EOS is no text.
    assert trace.requests == 2 and trace.tokens_T[:5].tolist() == [3, 4, one, c, TOK.eos_id]
    assert trace.loss_mask_T[:5].tolist() == [1, 1, 0, 1, 1] and trace.dropped_tokens == 1
