"""Request-level streaming on the slot engine: requests admitted as they arrive, tokens published
after every chunk, each request drawing with its own temperature, top_p, token limit, stop ids and
seed (docs/engine.md, "Serving: per-request sampling").

    engine = ServingEngine(params, cfg, eos_id=EOS, pad_id=PAD, max_prompt_tokens=64, max_new_tokens=128)
    engine.start()                                       # the decode thread
    handle = engine.submit(Request(prompt=(5, 9, 2), max_tokens=16, temperature=0.7, n=2))
    for event in handle.events():                        # Token(choice, token, logprob, version)..., Done(choice, why)
        ...
    engine.set_params(new_params, version=1)             # a new policy version from the next chunk on
    engine.drain(timeout=30.0); engine.stop()

Continuous batching: one decode thread loops admit -> one chunk of at most `chunk` decode steps over
all slots (OPEN_CHUNK while a slot is free) -> publish. A request's n choices take n free slots at
once (first come, first served) and share one prefill of its prompt; they decode alongside whatever
else is in flight. How each slot draws lives in the device state (`draws.SlotSampling`, written by
`state.place_sampling`), so one compiled chunk serves every mix of requests. While requests wait, a
chunk ends as soon as enough slots are free for the first of them. Every token carries its log-prob
under softmax(logits / T) (untruncated by top_p, as the trainer's `token_logprobs` recomputes it;
temperature 0 is greedy, the first argmax, with the T -> 0 limit's log-prob) and the version of the
params that drew it.

Noise: choice i of a request draws column c with fold_in(fold_in(base, i), c), base = the raw key
(seed >> 32, seed & 0xffffffff) of `seed` (jax.random.PRNGKey's form; seeds are taken modulo 2**64),
or, without a seed, fold_in(engine rng stream, request id). A seeded request therefore draws the same
tokens whatever its slots, its arrival time and the other requests (same params and version).

The decode thread holds every device call; `submit`, `cancel`, `set_params`, `stats` and the
handles' event streams are safe from any thread and from asyncio.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time

import jax
import numpy as np

from jaxrl.config import ModelConfig
from jaxrl.models.parallel import Parallel
from jaxrl.rollout.engine.draws import SlotSampling
from jaxrl.rollout.engine.groups import left_pad
from jaxrl.rollout.engine.partial import release_slots
from jaxrl.rollout.engine.slots import SlotPool
from jaxrl.rollout.engine.state import EngineSpec, admit, init_state, place_sampling, split_params
from jaxrl.serve.requests import (
    CANCELLED,
    LENGTH,
    STOP,
    Done,
    Draining,
    Event,
    Handle,
    QueueFull,
    Request,
    RequestError,
    Token,
    check_int,
)

log = logging.getLogger(__name__)

# Decode steps per chunk while a slot is free: a request arriving mid-chunk waits at most this many
# steps for admission. Clients that send their next request when the last one ends would otherwise
# wait out a whole `chunk` (about 10% of their throughput at chunk 8: benchmarks/serve.py).
OPEN_CHUNK = 2


@dataclasses.dataclass
class _Choice:
    """Host bookkeeping of one decoding slot: whose choice it is and how many tokens went out."""

    handle: Handle
    choice: int
    sent: int = 0


def seed_key(seed: int) -> np.ndarray:
    """The raw uint32 key of a seed (jax.random.PRNGKey's form), taken modulo 2**64."""
    seed %= 2**64
    return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)


class ServingEngine:
    """The slot engine driven by requests (see the module docstring)."""

    def __init__(
        self,
        params,
        model_cfg: ModelConfig,
        *,
        eos_id: int,
        pad_id: int,
        slots: int = 16,
        max_prompt_tokens: int,
        max_new_tokens: int,
        max_n: int = 8,
        chunk: int = 8,
        rng=None,
        version: int = 0,
        max_queue: int = 1024,
        max_stop_ids: int = 8,
        admit_batch: int = 1,
        parallel: Parallel | None = None,
    ):
        """slots: S decoding slots; max_prompt_tokens / max_new_tokens: the engine's prompt width and completion
        limit (its cache holds their sum per slot); max_n: the most choices per request (each admission prefills
        once and copies to max_n rows); chunk: decode steps between two publications while every slot is busy
        (OPEN_CHUNK while one is free); max_stop_ids: stop ids a request may give; admit_batch: prompts per
        prefill call; rng: a raw key (jax.random.PRNGKey) for unseeded requests; parallel (MoE): the experts'
        mesh axis, as the engine's."""
        V = model_cfg.vocab_size
        for name, value, low in (
            ("slots", slots, 1),
            ("max_prompt_tokens", max_prompt_tokens, 1),
            ("max_new_tokens", max_new_tokens, 1),
            ("max_n", max_n, 1),
            ("chunk", chunk, 1),
            ("max_queue", max_queue, 1),
            ("max_stop_ids", max_stop_ids, 0),
            ("admit_batch", admit_batch, 1),
        ):
            check_int(name, value, low)
        if max_n > slots:
            raise ValueError(f"max_n: got {max_n}, expected at most slots={slots} (a request's choices decode at once)")
        for name, value in (("eos_id", eos_id), ("pad_id", pad_id)):
            check_int(name, value, 0, V - 1)
        rng = jax.random.PRNGKey(0) if rng is None else rng
        if jax.numpy.issubdtype(rng.dtype, jax.dtypes.prng_key):
            rng = jax.random.key_data(rng)
        self.max_prompt_tokens, self.max_new_tokens, self.max_n = max_prompt_tokens, max_new_tokens, max_n
        self.chunk, self.open_chunk = chunk, min(OPEN_CHUNK, chunk)
        self.max_queue, self.admit_batch = max_queue, admit_batch
        self.spec = EngineSpec(
            model_cfg,
            slots,
            max_prompt_tokens,
            max_new_tokens,
            max_n,
            eos_id,
            pad_id,
            slot_keys=True,
            parallel=parallel,
            per_slot=True,
            max_stop_ids=max_stop_ids,
        )
        self._rng = rng
        self.pool = SlotPool(self.spec, init_state(self.spec, rng))
        self._cond = threading.Condition()
        self._queue: collections.deque[Handle] = collections.deque()
        self._choices: dict[int, _Choice] = {}  # slot -> the choice decoding there
        self._pending: tuple | None = None  # (params, version) the next step switches to
        self._params = self._lparams = None
        self._version = int(version)
        self._next_id = 0
        self._thread: threading.Thread | None = None
        self._stopping = self._draining = False
        self._counts: dict[str, int] = dict.fromkeys(
            ("completed", "cancelled", "failed", "tokens", "chunks", "prefill_calls"), 0
        )
        self.set_params(params, version)

    # ---- any thread -------------------------------------------------------------------------------

    def submit(self, request: Request) -> Handle:
        """Queue a request (admitted as slots free up) -> its Handle. RequestError naming the field
        when it exceeds the engine's limits; QueueFull when max_queue requests wait; Draining after
        `drain` or `stop`."""
        self._check(request)
        with self._cond:
            if self._draining or self._stopping:
                raise Draining("the engine is draining or stopped: it admits no new requests")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"max_queue={self.max_queue} requests are already waiting for slots")
            handle = Handle(self._next_id, request, self._wake)
            self._next_id += 1
            self._queue.append(handle)
            self._cond.notify_all()
        return handle

    def _check(self, request: Request) -> None:
        if not isinstance(request, Request):
            raise TypeError(f"submit: got {type(request).__name__}, expected a Request")
        V = self.spec.cfg.vocab_size
        if len(request.prompt) > self.max_prompt_tokens:
            raise RequestError(
                "prompt", f"{len(request.prompt)} tokens, expected at most max_prompt_tokens={self.max_prompt_tokens}"
            )
        check_int("max_tokens", request.max_tokens, 1, self.max_new_tokens)
        check_int("n", request.n, 1, self.max_n)
        if len(request.stop_ids) > self.spec.max_stop_ids:
            raise RequestError(
                "stop_ids", f"{len(request.stop_ids)} ids, expected at most max_stop_ids={self.spec.max_stop_ids}"
            )
        for name, ids in (("prompt", request.prompt), ("stop_ids", request.stop_ids)):
            bad = [t for t in ids if not 0 <= t < V]
            if bad:
                raise RequestError(name, f"token id {bad[0]} outside the vocabulary 0..{V - 1}")

    def set_params(self, params, version: int) -> None:
        """A new policy version: admissions and decode steps from the next chunk boundary on use it;
        tokens already drawn keep their version. The caches of choices in flight are not recomputed."""
        check_int("version", version, -(2**31), 2**31 - 1)
        with self._cond:
            self._pending = (params, int(version))
            self._cond.notify_all()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def stats(self) -> dict:
        """queued, active (requests decoding), completed, cancelled, failed, tokens, chunks,
        prefill_calls, free_slots, version."""
        with self._cond:
            active = len({c.handle.id for c in self._choices.values()})
            free = int(np.sum(self.pool.owner_S < 0))
            return dict(self._counts, queued=len(self._queue), active=active, free_slots=free, version=self._version)

    def start(self) -> None:
        """Start the decode thread (admit, decode a chunk, publish, repeat; idle-waits when empty)."""
        with self._cond:
            if self._stopping:
                raise Draining("the engine was stopped; build a new ServingEngine")
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="jaxrl-serving-engine", daemon=True)
        self._thread.start()

    def drain(self, timeout: float) -> bool:
        """Admit no new requests (submit raises Draining) and wait up to `timeout` s for the queued
        and decoding ones to finish -> whether they all did."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._draining = True
            self._cond.notify_all()
            while self._queue or self._choices:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    return not (self._queue or self._choices)
        return True

    def stop(self) -> None:
        """End the decode thread; every unfinished request ends with Done(choice, "cancelled")."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        with self._cond:
            queued, self._queue = list(self._queue), collections.deque()
        for handle in queued:
            handle.cancel()
        self._cancel(queued, self._choices_of(lambda h: True))

    # ---- the decode thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or self._queue or self._choices or self._pending)
                if self._stopping:
                    return
            try:
                self._step()
            except Exception as err:  # the engine survives: the requests in flight fail, the state restarts
                log.exception("serving engine: a step failed; failing the requests in flight")
                self._fail_all(err)
            with self._cond:
                self._cond.notify_all()  # drain() waits on this

    def step(self) -> None:
        """One iteration of the decode thread, run by the caller: switch params if asked, free
        cancelled requests, admit, decode one chunk, publish. For driving the engine without
        `start` (tests, a caller with its own loop); a RuntimeError while the thread runs."""
        if self._thread is not None:
            raise RuntimeError("step: the engine's decode thread is running (start() was called)")
        self._step()

    def _step(self) -> None:
        self._take_params()
        with self._cond:
            queued = [h for h in self._queue if h.cancelled]
            self._queue = collections.deque(h for h in self._queue if not h.cancelled)
        self._cancel(queued, self._choices_of(lambda h: h.cancelled))
        self._admit_queued()
        if not self._choices:
            return
        with self._cond:
            # An int either way (None would compile a second chunk program).
            stop_at = self._queue[0].request.n if self._queue else self.spec.slots
        n_steps = self.open_chunk if len(self.pool.free()) else self.chunk  # traced: one compile either way
        self.pool.decode(self._lparams, n_steps, self._version, 0.0, stop_at)
        self._publish()
        with self._cond:
            self._counts["chunks"] += 1

    def _take_params(self) -> None:
        with self._cond:
            pending, self._pending = self._pending, None
        if pending is not None:
            params, version = pending
            self._params, self._lparams = params, split_params(params, self.spec.cfg)
            with self._cond:
                self._version = version

    def _choices_of(self, which) -> np.ndarray:
        """free_S: the slots whose request `which(handle)` holds."""
        free_S = np.zeros(self.spec.slots, bool)
        for slot, c in self._choices.items():
            free_S[slot] = which(c.handle)
        return free_S

    def _cancel(self, queued: list[Handle], free_S: np.ndarray) -> None:
        """End the queued handles and the choices decoding in free_S with Done(.., "cancelled")."""
        by_handle: dict[int, tuple[Handle, list[Event]]] = {h.id: (h, []) for h in queued}
        for h in queued:
            by_handle[h.id][1].extend(Done(i, CANCELLED) for i in range(h.request.n))
        if free_S.any():
            self.pool.state = release_slots(self.spec, self.pool.state, free_S)
            self.pool.owner_S[free_S] = -1
        for slot in np.flatnonzero(free_S):
            c = self._choices.pop(int(slot))
            by_handle.setdefault(c.handle.id, (c.handle, []))[1].append(Done(c.choice, CANCELLED))
        for handle, events in by_handle.values():
            handle._publish(events)
        with self._cond:
            self._counts["cancelled"] += len(by_handle)

    def _admit_queued(self) -> None:
        """Move waiting requests, first come first served, into free slots (n slots each)."""
        free = self.pool.free()
        batch: list[Handle] = []
        with self._cond:
            room = len(free)
            while self._queue and self._queue[0].request.n <= room:
                room -= self._queue[0].request.n
                batch.append(self._queue.popleft())
        for start in range(0, len(batch), self.admit_batch):
            free = self._admit_rows(batch[start : start + self.admit_batch], free)

    def _admit_rows(self, handles: list[Handle], free: np.ndarray) -> np.ndarray:
        """One prefill of up to admit_batch prompts, their choices placed in `free` -> the slots left."""
        S, G, A = self.spec.slots, self.spec.group_size, self.admit_batch
        K = self.spec.max_stop_ids
        dest_N = np.full(A * G, S, np.int32)  # S: dropped (padding prompts, unused choices)
        temperature_N, top_p_N = np.ones(A * G, np.float32), np.ones(A * G, np.float32)
        max_tokens_N, stop_NxK = np.ones(A * G, np.int32), np.full((A * G, K), -1, np.int32)
        seed_key_Nx2, seeded_N = np.zeros((A * G, 2), np.uint32), np.zeros(A * G, bool)
        stream_N, choice_N = np.zeros(A * G, np.int32), np.tile(np.arange(G, dtype=np.int32), A)
        rows = []
        for a, h in enumerate(handles):
            r, n = h.request, h.request.n
            slots_n, free = free[:n], free[n:]
            rows_n = slice(a * G, a * G + n)
            dest_N[rows_n], temperature_N[rows_n], top_p_N[rows_n] = slots_n, r.temperature, r.top_p
            max_tokens_N[rows_n], stop_NxK[rows_n, : len(r.stop_ids)] = r.max_tokens, r.stop_ids
            seeded_N[rows_n], stream_N[rows_n] = r.seed is not None, h.id % 2**31
            if r.seed is not None:
                seed_key_Nx2[rows_n] = seed_key(r.seed)
            rows.append(left_pad(r.prompt, self.spec.prompt_len, self.spec.pad_id))
            self.pool.hold(slots_n, h.id)
            for i, slot in enumerate(slots_n):
                self._choices[int(slot)] = _Choice(h, i)
        rows += [rows[0]] * (A - len(rows))
        prompt_AxP, mask_AxP = np.stack([p for p, _ in rows]), np.stack([m for _, m in rows])
        state = admit(self._params, self.spec, self.pool.state, prompt_AxP, mask_AxP, dest_N)
        sampling_N = SlotSampling(temperature_N, top_p_N, max_tokens_N, stop_NxK)
        self.pool.state = place_sampling(
            self.spec, state, dest_N, sampling_N, seed_key_Nx2, seeded_N, stream_N, choice_N
        )
        with self._cond:
            self._counts["prefill_calls"] += 1
        return free

    def _publish(self) -> None:
        """Send every decoding choice's new tokens; a finished choice gets its Done and frees its slot."""
        host, retired = self.pool.retire()
        done = {slot for slot, _ in retired}
        by_handle: dict[int, tuple[Handle, list[Event]]] = {}
        n_tokens = 0
        for slot, c in list(self._choices.items()):
            col = int(host.col_S[slot])
            tok, logp, version = host.tokens_SxT[slot], host.logp_SxT[slot], host.version_SxT[slot]
            events: list[Event] = [
                Token(c.choice, int(tok[t]), float(logp[t]), int(version[t])) for t in range(c.sent, col)
            ]
            n_tokens += col - c.sent
            c.sent = col
            if slot in done:
                last = int(host.tokens_SxT[slot, col - 1])
                stopped = last == self.spec.eos_id or last in c.handle.request.stop_ids
                events.append(Done(c.choice, STOP if stopped else LENGTH))
                del self._choices[slot]
            if events:
                by_handle.setdefault(c.handle.id, (c.handle, []))[1].extend(events)
        completed = 0
        for handle, events in by_handle.values():
            handle._publish(events)
            completed += handle.finished
        with self._cond:
            self._counts["tokens"] += n_tokens
            self._counts["completed"] += completed

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            handles = {h.id: h for h in self._queue}
            self._queue = collections.deque()
        handles.update({c.handle.id: c.handle for c in self._choices.values()})
        self._choices = {}
        self.pool = SlotPool(self.spec, init_state(self.spec, self._rng))
        for handle in handles.values():
            handle._fail(error)
        with self._cond:
            self._counts["failed"] += len(handles)
