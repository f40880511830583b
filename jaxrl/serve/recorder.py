"""Token-exact trajectories of black-box agents: the `Service` a training run serves its engine through.

    recorder = EpisodeRecorder(engine, tokenizer, "policy", budget=Budget(prompt_len=P, tokens=T),
                               sampling=(temperature, top_p))
    recorder.open("3.0.1", seed=(train_seed, step, 0, 1))   # before the agent's first request
    ...the agent's requests arrive at /episodes/3.0.1/v1/completions (app.py calls `submit`)...
    trace = recorder.close("3.0.1")                         # -> EpisodeTrace: the episode's row

Each episode's context is kept as TOKENS. A request whose prompt text extends the episode's context
text (its previous prompt text followed by the text of what the model sampled for it) is submitted as
the context's exact tokens + the new suffix tokenized alone: the suffix is an observation (loss mask
0), the model's tokens are never re-tokenized. Of the previous completion only the tokens the new prompt
repeats are kept: the longest k such that the previous prompt text + decode(sampled[:k]) is a prefix of
the new prompt text (a client that cut the completion at a stop string, or never read its last chunk,
continues from what it saw; the tokens it did not see are dropped, counted in `dropped_tokens`). An EOS
is never kept inside the context: a turn the model ended with EOS continues from its text before it.

A prompt that does not extend the previous prompt text (the agent rewrote its history) starts a new
SEGMENT: its prompt is tokenized as the server tokenized it. The episode's row is its LAST segment
(the one the final completion, and so the reward, belongs to); the model tokens of earlier segments are
not trained on (`dropped_tokens`, `segments` count them). One row per episode keeps the update's batch
B = prompts_per_step x group_size whatever the agents do.

What the recorder fixes, whatever the agent asks (docs/agents.md):
- sampling: the run's temperature and top_p (the update's log-prob ratios are the run's); n must be 1;
- the token budget: prompt + every later token fit the row (prompt_len + tokens, the left-padded prompt
  width + rollout.max_new_tokens); max_tokens is cut to what is left, and a request with nothing left
  is refused (a 400 naming `max_tokens`) and marks the episode truncated;
- noise: every request is seeded from the episode's seed and the request's number in the episode (and
  the agent's own seed, when it gives one), so a replayed step draws the same tokens whatever the
  timing of the other episodes.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import NamedTuple, cast

import numpy as np

from jaxrl.data.tokenizer import Tokenizer
from jaxrl.serve.requests import Done, Handle, Request, RequestError, Token

STOP = "stop"


class Budget(NamedTuple):
    """The row an episode must fit: a left-padded prompt of `prompt_len`, then `tokens` more."""

    prompt_len: int  # data.max_prompt_len
    tokens: int  # rollout.max_new_tokens

    def used(self, first_prompt: int, context: int) -> int:
        """Tokens of the row's completion part a context of `context` tokens fills (a first prompt longer
        than prompt_len spills into it)."""
        return context - min(first_prompt, self.prompt_len)


class EpisodeTrace(NamedTuple):
    """One episode's row (numpy) and its counters."""

    prompt_P: np.ndarray  # int32, left-padded first prompt of the last segment
    prompt_mask_P: np.ndarray  # int32
    tokens_T: np.ndarray  # int32: observation and model tokens after the prompt, pad after the last
    loss_mask_T: np.ndarray  # float32: 1 on the model's tokens
    logp_T: np.ndarray  # float32: their log-probs under softmax(logits / T); 0 off the loss mask
    version_T: np.ndarray  # int32: the params version that drew them; -1 off the loss mask
    truncated: bool  # the budget refused a request, or the last completion ended by its length
    requests: int  # requests the episode made
    segments: int  # 1 + history rewrites
    dropped_tokens: int  # model tokens not in the row (unseen by the agent, or in an earlier segment)
    final_text: str  # the text of the last completion (what a verifier scores)


def request_seed(seed: tuple[int, ...], k: int, agent_seed: int | None) -> int:
    """The engine seed of request k of an episode seeded `seed` (a 64-bit int)."""
    entropy = [int(s) % 2**32 for s in seed] + [k, 0 if agent_seed is None else 1, (agent_seed or 0) % 2**32]
    hi, lo = np.random.SeedSequence(entropy).generate_state(2, np.uint32)
    return (int(hi) << 32) | int(lo)


def kept_prefix(prev_text: str, sampled: list[int], prompt_text: str, decode: Callable) -> int | None:
    """How many of the sampled tokens the new prompt repeats: the largest k with prev_text +
    decode(sampled[:k]) a prefix of prompt_text; None when prompt_text does not even start with
    prev_text (a new segment)."""
    if not prompt_text.startswith(prev_text):
        return None
    rest = prompt_text[len(prev_text) :]
    for k in range(len(sampled), 0, -1):
        if rest.startswith(decode(sampled[:k])):
            return k
    return 0


@dataclasses.dataclass
class _Turn:
    """One request of an episode: the model tokens the client consumed, in order."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    logp: list[float] = dataclasses.field(default_factory=list)
    version: list[int] = dataclasses.field(default_factory=list)
    reason: str | None = None
    seen: int = 0  # events recorded (a handle's stream replays from the start when read again)


@dataclasses.dataclass
class _Episode:
    """One episode's context (its last segment's) between requests."""

    seed: tuple[int, ...]
    first_prompt: int = 0  # tokens of the segment's first prompt
    context: list[int] = dataclasses.field(default_factory=list)  # the segment's tokens, prompt first
    loss: list[float] = dataclasses.field(default_factory=list)  # per context token
    logp: list[float] = dataclasses.field(default_factory=list)
    version: list[int] = dataclasses.field(default_factory=list)
    prompt_text: str = ""  # the last request's prompt text
    turn: _Turn | None = None  # the last request's
    handles: list = dataclasses.field(default_factory=list)
    requests: int = 0
    segments: int = 0
    dropped: int = 0
    truncated: bool = False

    def fold_in_turn(self, k: int) -> None:
        """Append the first k tokens of the last completion to the context as model tokens; the rest dropped."""
        turn = self.turn
        assert turn is not None
        self.context += turn.tokens[:k]
        self.loss += [1.0] * k
        self.logp += turn.logp[:k]
        self.version += turn.version[:k]
        self.dropped += len(turn.tokens) - k

    def start_segment(self, prompt_ids: tuple[int, ...]) -> None:
        """Drop the segment so far (its model tokens counted) and start one at `prompt_ids`."""
        self.dropped += int(sum(self.loss)) + (len(self.turn.tokens) if self.turn is not None else 0)
        self.first_prompt, self.context = len(prompt_ids), list(prompt_ids)
        n = len(prompt_ids)
        self.loss, self.logp, self.version = [0.0] * n, [0.0] * n, [-1] * n
        self.segments += 1

    def observe(self, ids: list[int]) -> None:
        self.context += ids
        self.loss += [0.0] * len(ids)
        self.logp += [0.0] * len(ids)
        self.version += [-1] * len(ids)


class _Plan(NamedTuple):
    ids: list[int]  # the token ids the request is submitted as
    k: int | None  # tokens of the previous completion kept; None: a new segment
    suffix: list[int]  # the observation tokens after them


class RecordedHandle:
    """An engine Handle whose events, as the server reads them, are recorded into the episode's turn.
    It has no `abatches` on purpose: the app then reads it an event at a time and stops at a stop
    string, so the turn holds exactly the tokens the client's answer was made of (a chunk's batch would
    also hold the tokens drawn past the stop string)."""

    def __init__(self, handle, turn: _Turn, lock: threading.Lock):
        self._handle, self._turn, self._lock = handle, turn, lock
        self.id, self.request = handle.id, handle.request

    @property
    def finished(self) -> bool:
        return self._handle.finished

    @property
    def cancelled(self) -> bool:
        return self._handle.cancelled

    def cancel(self) -> None:
        self._handle.cancel()

    def _record(self, i: int, event) -> None:
        with self._lock:
            turn = self._turn
            if i != turn.seen:  # a replayed event
                return
            turn.seen += 1
            if isinstance(event, Token):
                turn.tokens.append(int(event.token))
                turn.logp.append(float(event.logprob))
                turn.version.append(int(event.version))
            elif isinstance(event, Done):
                turn.reason = event.reason

    def events(self, timeout: float | None = None) -> Iterator:
        for i, event in enumerate(self._handle.events(timeout)):
            self._record(i, event)
            yield event

    async def aevents(self) -> AsyncIterator:
        i = 0
        async for event in self._handle.aevents():
            self._record(i, event)
            i += 1
            yield event


class EpisodeRecorder:
    """The `Service` (app.py) of a training run: requests routed by episode, recorded as tokens (see
    the module docstring). engine: a `ServingEngine` (or anything with its `submit`); sampling: the
    run's (temperature, top_p), or None to take each request's own (a greedy evaluation passes (0, 1))."""

    def __init__(
        self,
        engine,
        tokenizer: Tokenizer,
        model_name: str,
        budget: Budget,
        sampling: tuple[float, float] | None,
        chat_template: Callable[[list[dict]], str] | None = None,
    ):
        self.engine, self.tokenizer, self.model_name, self.chat_template = engine, tokenizer, model_name, chat_template
        self.budget, self.sampling = budget, sampling
        self._lock = threading.Lock()
        self._episodes: dict[str, _Episode] = {}

    def set_sampling(self, sampling: tuple[float, float] | None) -> None:
        self.sampling = sampling

    def open(self, episode: str, seed: tuple[int, ...]) -> None:
        """Accept requests for `episode` from now on (its noise seeded by `seed`)."""
        with self._lock:
            if episode in self._episodes:
                raise ValueError(f"episode {episode!r} is already open")
            self._episodes[episode] = _Episode(tuple(int(s) for s in seed))

    def stats(self) -> dict:
        with self._lock:
            open_episodes = len(self._episodes)
        return {**getattr(self.engine, "stats", dict)(), "open_episodes": open_episodes}

    def submit(self, prompt_text: str, prompt_ids: tuple[int, ...], request: Request, episode: str | None) -> Handle:
        """Route one request of `episode` to the engine as its context's tokens (see the module docstring)."""
        if episode is None:
            raise RequestError("episode", "a training run serves only /episodes/{episode}/v1/... routes")
        if request.n != 1:
            raise RequestError("n", f"got {request.n}: an episode's requests sample one choice (n=1)")
        with self._lock:
            ep = self._episodes.get(episode)
            if ep is None:
                raise RequestError("episode", f"{episode!r} is not an episode of this step (finished, or never opened)")
            if ep.turn is not None and ep.turn.seen == 0 and not ep.handles[-1].finished:  # nothing read yet
                raise RequestError(
                    "episode", f"{episode!r} has a request in flight; an episode's requests are sequential"
                )
            plan = self._plan(ep, prompt_text, prompt_ids)
            ids, first = plan.ids, (len(prompt_ids) if plan.k is None else ep.first_prompt)
            left = self.budget.tokens - self.budget.used(first, len(ids))
            if left <= 0:
                ep.truncated = True
                raise RequestError(
                    "max_tokens",
                    f"episode {episode!r} has spent its token budget ({self.budget.tokens} tokens after a "
                    f"{self.budget.prompt_len}-token prompt: rollout.max_new_tokens, data.max_prompt_len)",
                )
            temperature, top_p = self.sampling or (request.temperature, request.top_p)
            routed = dataclasses.replace(
                request,
                prompt=tuple(ids),
                max_tokens=min(request.max_tokens, left),
                temperature=temperature,
                top_p=top_p,
                seed=request_seed(ep.seed, ep.requests, request.seed),
            )
            handle = self.engine.submit(routed)  # RequestError / QueueFull / Draining: the episode is unchanged
            if plan.k is None:
                ep.start_segment(prompt_ids)
            else:
                ep.fold_in_turn(plan.k)
                ep.observe(plan.suffix)
            ep.prompt_text, ep.turn = prompt_text, _Turn()
            ep.requests += 1
            recorded = RecordedHandle(handle, ep.turn, self._lock)
            ep.handles.append(recorded)
            return cast(Handle, recorded)  # a Handle to the app: id, request, events, aevents, cancel

    def _plan(self, ep: _Episode, prompt_text: str, prompt_ids: tuple[int, ...]) -> _Plan:
        """How this request continues the episode (nothing changes until the engine accepts it)."""
        if ep.turn is None:
            return _Plan(list(prompt_ids), None, [])
        sampled = ep.turn.tokens
        if self.tokenizer.eos_id in sampled:  # the model ended its turn: what follows is no text, nor EOS
            sampled = sampled[: sampled.index(self.tokenizer.eos_id)]
        k = kept_prefix(ep.prompt_text, sampled, prompt_text, self.tokenizer.decode)
        if k is None:
            return _Plan(list(prompt_ids), None, [])
        seen_text = ep.prompt_text + self.tokenizer.decode(sampled[:k])
        suffix_text = prompt_text[len(seen_text) :]
        suffix = list(self.tokenizer.encode(suffix_text)) if suffix_text else []
        return _Plan(ep.context + ep.turn.tokens[:k] + suffix, k, suffix)

    def close(self, episode: str) -> EpisodeTrace:
        """Stop recording `episode` (its requests still in flight are cancelled) -> its row."""
        with self._lock:
            ep = self._episodes.pop(episode)
        for handle in ep.handles:
            handle.cancel()  # a no-op once finished
        with self._lock:
            turn = ep.turn
            final_text = ""
            if turn is not None:
                final_text = self.tokenizer.decode(turn.tokens)
                ep.fold_in_turn(len(turn.tokens))
                ep.truncated |= turn.reason not in (None, STOP)
            return _trace(ep, self.budget, self.tokenizer.pad_id, final_text)


def _trace(ep: _Episode, budget: Budget, pad_id: int, final_text: str) -> EpisodeTrace:
    P, T = budget.prompt_len, budget.tokens
    prompt_P, mask_P = np.full(P, pad_id, np.int32), np.zeros(P, np.int32)
    tokens_T, loss_T = np.full(T, pad_id, np.int32), np.zeros(T, np.float32)
    logp_T, version_T = np.zeros(T, np.float32), np.full(T, -1, np.int32)
    n_prompt = min(ep.first_prompt, P)
    if n_prompt:
        prompt_P[P - n_prompt :], mask_P[P - n_prompt :] = ep.context[:n_prompt], 1
    rest = slice(n_prompt, n_prompt + T)
    n = len(ep.context[rest])
    tokens_T[:n] = ep.context[rest]
    loss_T[:n], logp_T[:n], version_T[:n] = ep.loss[rest], ep.logp[rest], ep.version[rest]
    extra = int(sum(ep.loss[n_prompt + T :]))  # cannot happen within the budget; counted if it does
    return EpisodeTrace(
        prompt_P,
        mask_P,
        tokens_T,
        loss_T,
        logp_T,
        version_T,
        bool(ep.truncated or extra),
        ep.requests,
        ep.segments,
        ep.dropped + extra,
        final_text,
    )


def episode_id(name: str, j: int, g: int) -> str:
    """The route name of episode g of record j of a set of episodes (a step's: its number): `name.j.g`."""
    return f"{name}.{j}.{g}"
