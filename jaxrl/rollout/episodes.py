"""Multi-turn episodes on the slot engine: environment steps run on the host while the slots keep decoding.

    engine = EpisodeEngine(model_cfg, cfg.rollout.engine, cfg.agent, make_env=suite.make, tokenizer=tok,
                           end_of_turn="]", prompt_len=P, max_new_tokens=T, temperature=1.0)
    groups = engine.run(params, version, requests, group_size, seed)  # requests: [(tag, record), ...]
    engine.stats  # chunks, place_calls, env_steps, env_seconds, env_exposed_seconds, decode_seconds, place_seconds

`run` plays group_size episodes per request and returns one `EpisodeGroup` per request, in request
order (never completion order: a batch's order must not depend on timing). Episode (j, g) of request
j: env = make_env(); its prompt is [BOS] + encode(env.reset(record, np.random.default_rng([*seed, j, g])))
(no BOS for a tokenizer with `add_bos` False), left-padded to prompt_len (longer: ValueError naming
record["id"]); its token noise key is fold_in(fold_in(K, j), g) with K = PRNGKey(seed[0]) folded
with seed[1], seed[2], ... in turn (`episode_keys`). `seed` is an int or a sequence of ints (e.g. (run seed,
step)): a run replayed with the same seed draws the same episodes (the engine samples with per-slot
keys, `EngineSpec.slot_keys`: a token depends on its episode's key, the params and its history only,
never on the slot, the other episodes, or how long environment steps took).

Lifecycle (agent.overlap=True). An episode decodes in a slot until it draws the end-of-turn token,
EOS, or reaches the token budget T = max_new_tokens (observation tokens included). Then it leaves the
slot at once: its state (tokens, log-probs, loss mask, versions: host numpy) waits on the host while
`env.step(turn text)` runs in a thread pool of agent.env_workers threads, and the slot goes to the
next ready episode (a new one, or one whose observation came back), placed with its whole history
prefilled (episode_state.place). The engine blocks on the environment only when no slot can decode
(stats["env_exposed_seconds"]); with more episodes than slots the environments' latency is hidden.
A chunk of decode steps ends as soon as `park_batch` more slots have parked, so their environment
steps start early and the freed slots are refilled by one `place` call (benchmarks/agents.py on the
2-core CPU, 16 slots, 128 episodes: park_batch 4 ran 1.9x faster than 1, whose extra chunk round
trips and one-row place calls cost more than the slots it refills sooner; 8 was slower than 4).
`place` always runs on `place_rows` rows (padded), so an episode's numbers are bit-identical
whichever episodes it was placed with.

Turn text = the tokens of that turn decoded (from the end of the last observation), end-of-turn
string included, EOS excluded. EOS: the text goes to a final env.step, then the episode ends
(finished). End of turn: the step's observation is encoded, cut to agent.max_obs_tokens (obs_cut) and
to the tokens left in the budget, and appended (loss mask 0, logp 0, version -1) unless the step said
done (finished), or agent.max_turns model turns were taken or the budget ran out (truncated). A turn
cut by the budget (no end of turn) gets no step: truncated. A step (or its observation's encoding)
that raises ends the episode with reward 0 for that step and env_errors 1 (neither finished nor truncated).

agent.overlap=False: turn-synchronous, for comparison. Up to `slots` episodes at a time, each in a
slot: all decode their turn, then all their environment steps run in the pool and everyone waits for
all, then all resume. Same episodes as the overlapped mode (same keys, same placements).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxrl.config import ModelConfig
from jaxrl.config_agent import AgentConfig
from jaxrl.config_rollout import EngineConfig
from jaxrl.rollout.engine import left_pad
from jaxrl.rollout.engine_state import EngineSpec, decode_chunk, host_slots, init_state, split_params
from jaxrl.rollout.episode_state import place
from jaxrl.rollout.sampler import check_temperature


class EpisodeGroup(NamedTuple):
    """The G episodes of one request (numpy). tokens hold model and observation tokens; loss_mask 1 on model tokens."""

    tag: Any
    prompt_P: np.ndarray  # int32, left-padded
    prompt_mask_P: np.ndarray  # int32
    tokens_GxT: np.ndarray  # int32; pad after the episode's last token
    loss_mask_GxT: np.ndarray  # float32: 1 on model tokens (EOS / end of turn included), 0 on observations
    logp_GxT: np.ndarray  # float32: log-prob under softmax(logits / temperature); 0 off the loss mask
    version_GxT: np.ndarray  # int32; -1 off the loss mask
    finished_G: np.ndarray  # bool: ended by the environment (done) or EOS
    truncated_G: np.ndarray  # bool: ended by a limit (max_turns, the token budget)
    return_G: np.ndarray  # float32: sum of the step rewards
    shaping_G: np.ndarray  # float32: sum of info["shaping"]
    turns_G: np.ndarray  # int32: model turns
    tool_calls_G: np.ndarray  # int32
    tool_errors_G: np.ndarray  # int32
    env_errors_G: np.ndarray  # int32: steps that raised
    obs_cut_G: np.ndarray  # int32: observations cut to agent.max_obs_tokens
    success_G: np.ndarray  # bool: info["success"] of the last step, else return > 0
    routing_GxCxLxK: np.ndarray | None = None  # MoE: experts per cache slot (C = P + T), for replay


@dataclasses.dataclass
class _Episode:
    j: int
    g: int
    env: Any
    prompt_P: np.ndarray
    mask_P: np.ndarray
    key: np.ndarray
    tokens_T: np.ndarray
    logp_T: np.ndarray
    loss_T: np.ndarray
    version_T: np.ndarray
    n: int = 0  # tokens so far (model + observation)
    turn_start: int = 0  # where the current turn began
    turns: int = 0
    ret: float = 0.0
    shaping: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0
    env_errors: int = 0
    obs_cut: int = 0
    success: bool | None = None
    finished: bool = False
    truncated: bool = False
    routing: np.ndarray | None = None


class _StepOutcome(NamedTuple):
    result: Any  # StepResult, or None when the step raised
    obs_ids: list
    error: BaseException | None
    seconds: float


def _env_step(env, tokenizer, action_ids, final: bool) -> _StepOutcome:
    """Runs in a worker thread: decode the turn, step the environment, encode its observation."""
    start = time.perf_counter()
    try:
        result = env.step(tokenizer.decode(action_ids))
        seconds = time.perf_counter() - start
        obs_ids = [] if final or result.done else list(tokenizer.encode(result.observation))
        return _StepOutcome(result, obs_ids, None, seconds)
    except Exception as err:  # an environment must not crash the run: the episode ends, counted
        return _StepOutcome(None, [], err, time.perf_counter() - start)


def episode_keys(seed, n_requests: int, group_size: int) -> np.ndarray:
    """(n_requests * group_size, key) raw keys: row j*G+g = fold_in(fold_in(K, j), g), K = the seed folded."""
    seed = [int(s) for s in np.atleast_1d(seed)]
    base = jax.random.PRNGKey(seed[0])
    for s in seed[1:]:
        base = jax.random.fold_in(base, s)
    j, g = np.divmod(np.arange(n_requests * group_size), group_size)
    fold = jax.vmap(lambda a, b: jax.random.fold_in(jax.random.fold_in(base, a), b))
    return np.asarray(fold(j.astype(np.uint32), g.astype(np.uint32)))


class EpisodeEngine:
    """Multi-turn episodes over the slots of the decode engine (see the module docstring)."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        engine_cfg: EngineConfig,
        agent_cfg: AgentConfig,
        *,
        make_env: Callable,
        tokenizer,
        end_of_turn: str,
        prompt_len: int,
        max_new_tokens: int,
        temperature: float,
        top_k: int = 0,
        top_p: float = 1.0,
        greedy: bool = False,
        speculative=None,
        park_batch: int = 4,
        place_rows: int = 4,
    ):
        engine_cfg.validate()
        agent_cfg.validate()
        if speculative is not None and speculative.enabled:
            raise ValueError(
                "rollout.speculative.enabled: speculative decoding is not supported with multi-turn "
                "episodes (agent environments); set it to false"
            )
        try:
            eot = list(tokenizer.encode(end_of_turn))
        except ValueError as err:
            raise ValueError(f"end_of_turn {end_of_turn!r}: not encodable by the tokenizer ({err})") from None
        if len(eot) != 1:
            raise ValueError(
                f"end_of_turn {end_of_turn!r}: must be exactly one token of the tokenizer, got {len(eot)} tokens {eot}"
            )
        check_temperature(temperature)
        self.ecfg, self.agent, self.tokenizer, self.make_env = engine_cfg, agent_cfg, tokenizer, make_env
        self.temperature, self.eot_id, self.park_batch = float(temperature), eot[0], max(1, int(park_batch))
        self.place_rows = min(int(place_rows), engine_cfg.slots)
        self.spec = EngineSpec(
            model_cfg,
            engine_cfg.slots,
            prompt_len,
            max_new_tokens,
            1,
            tokenizer.eos_id,
            tokenizer.pad_id,
            top_k,
            top_p,
            greedy,
            stop_ids=(eot[0],),
            slot_keys=True,
        )
        self.stats = dict(
            chunks=0,
            place_calls=0,
            env_steps=0,
            env_seconds=0.0,
            env_exposed_seconds=0.0,
            decode_seconds=0.0,
            place_seconds=0.0,
        )

    # ---- episodes

    def _start(self, requests: list, group_size: int, seed) -> list:
        """One _Episode per (request j, member g), environments reset, in order j*G+g."""
        P, T, tok = self.spec.prompt_len, self.spec.max_new_tokens, self.tokenizer
        keys = episode_keys(seed, len(requests), group_size)
        seed = [int(s) for s in np.atleast_1d(seed)]
        bos = [tok.bos_id] if getattr(tok, "add_bos", True) else []
        episodes = []
        for j, (_, record) in enumerate(requests):
            for g in range(group_size):
                env = self.make_env()
                ids = bos + list(tok.encode(env.reset(record, np.random.default_rng([*seed, j, g]))))
                if not 0 < len(ids) <= P:
                    raise ValueError(
                        f"record {record.get('id')!r}: prompt of {len(ids)} tokens, expected 1..prompt_len={P}"
                    )
                prompt_P, mask_P = left_pad(ids, P, self.spec.pad_id)
                episodes.append(
                    _Episode(
                        j,
                        g,
                        env,
                        prompt_P,
                        mask_P,
                        keys[j * group_size + g],
                        np.full(T, self.spec.pad_id, np.int32),
                        np.zeros(T, np.float32),
                        np.zeros(T, np.float32),
                        np.full(T, -1, np.int32),
                    )
                )
        return episodes

    def _end_turn(self, ep: _Episode, row: dict, pool, pending: dict) -> None:
        """A slot's turn is over: take its buffers back, then submit the step or end the episode."""
        col = int(row["col"])
        ep.tokens_T, ep.logp_T, ep.loss_T, ep.version_T = row["tokens"], row["logp"], row["mask"], row["version"]
        ep.routing = row["routing"]
        ep.turns += 1
        last = int(ep.tokens_T[col - 1])
        action = ep.tokens_T[ep.turn_start : col - 1 if last == self.spec.eos_id else col]
        ep.n = col
        if last not in (self.spec.eos_id, self.eot_id):  # the budget cut the turn: no step
            ep.truncated = True
            return
        final = last == self.spec.eos_id
        pending[pool.submit(_env_step, ep.env, self.tokenizer, action.tolist(), final)] = (ep, final)

    def _after_step(self, ep: _Episode, final: bool, out: _StepOutcome) -> bool:
        """Apply a step's outcome -> whether the episode goes on (its observation appended)."""
        self.stats["env_steps"] += 1
        self.stats["env_seconds"] += out.seconds
        if out.error is not None:
            ep.env_errors += 1
            ep.success = None  # the last step gave no info
            return False
        res, info = out.result, out.result.info or {}
        ep.ret += float(res.reward)
        ep.shaping += float(info.get("shaping", 0.0))
        ep.tool_calls += int(info.get("tool_calls", 0))
        ep.tool_errors += int(info.get("tool_errors", 0))
        ep.success = bool(info["success"]) if "success" in info else None
        if final or res.done:
            ep.finished = True
            return False
        if ep.turns >= self.agent.max_turns:
            ep.truncated = True
            return False
        ids = out.obs_ids
        if len(ids) > self.agent.max_obs_tokens:
            ep.obs_cut += 1
            ids = ids[: self.agent.max_obs_tokens]
        room = self.spec.max_new_tokens - ep.n
        ids = ids[:room]
        ep.tokens_T = ep.tokens_T.copy()
        ep.tokens_T[ep.n : ep.n + len(ids)] = ids  # loss mask 0, logp 0, version -1: already so past col
        ep.n += len(ids)
        ep.turn_start = ep.n
        if ep.n >= self.spec.max_new_tokens:
            ep.truncated = True
            return False
        return True

    # ---- device

    def _place(self, run: _Run, episodes: list) -> None:
        """Place episodes into free slots (enough of them), `place_rows` per call (padded): a fixed row
        count keeps each row's arithmetic, and so its log-probs, independent of the batch it came in."""
        start = time.perf_counter()
        S = self.spec.slots
        R = self.place_rows
        for lo in range(0, len(episodes), R):
            part = episodes[lo : lo + R]
            free = np.flatnonzero([o is None for o in run.owner])[: len(part)]
            slot_R = np.full(R, S, np.int32)
            slot_R[: len(part)] = free

            def pad(xs, fill):
                return np.stack(xs + [np.full_like(xs[0], fill)] * (R - len(xs)))

            run.state = place(
                run.params,
                self.spec,
                run.state,
                slot_R,
                pad([e.prompt_P for e in part], 0),
                pad([e.mask_P for e in part], 1),
                pad([e.tokens_T for e in part], 0),
                pad([e.logp_T for e in part], 0),
                pad([e.loss_T for e in part], 0),
                pad([e.version_T for e in part], -1),
                np.array([e.n for e in part] + [0] * (R - len(part)), np.int32),
                pad([e.key for e in part], 0),
            )
            for slot, ep in zip(free, part):
                run.owner[slot] = ep
            self.stats["place_calls"] += 1
        self.stats["place_seconds"] += time.perf_counter() - start

    def _decode(self, run: _Run, stop_at: int, pool, pending: dict) -> None:
        """One chunk of decode steps, then every parked slot's turn handed to `_end_turn`."""
        start = time.perf_counter()
        run.state = decode_chunk(
            run.lparams, self.spec, run.state, self.ecfg.chunk, run.version, self.temperature, stop_at
        )
        host = host_slots(run.state)
        self.stats["chunks"] += 1
        self.stats["decode_seconds"] += time.perf_counter() - start
        for slot in np.flatnonzero(host.done_S):
            ep = run.owner[slot]
            if ep is None:
                continue
            run.owner[slot] = None
            routing = None if host.routing_SxCxLxK is None else host.routing_SxCxLxK[slot]
            self._end_turn(
                ep,
                dict(
                    col=host.col_S[slot],
                    tokens=host.tokens_SxT[slot],
                    logp=host.logp_SxT[slot],
                    mask=host.mask_SxT[slot],
                    version=host.version_SxT[slot],
                    routing=routing,
                ),
                pool,
                pending,
            )

    # ---- the two schedules

    def run(self, params, version: int, requests: list, group_size: int, seed) -> list:
        """group_size episodes per (tag, record) request -> one EpisodeGroup per request, in request order."""
        episodes = self._start(list(requests), group_size, seed)
        run = _Run(
            init_state(self.spec, jax.random.PRNGKey(0)),
            params,
            split_params(params, self.spec.cfg),
            version,
            [None] * self.spec.slots,
        )
        with cf.ThreadPoolExecutor(self.agent.env_workers) as pool:
            (self._overlapped if self.agent.overlap else self._synchronous)(run, episodes, pool)
        return [_group(tag, episodes[j * group_size : (j + 1) * group_size]) for j, (tag, _) in enumerate(requests)]

    def _overlapped(self, run: _Run, episodes: list, pool) -> None:
        ready, pending = deque(episodes), {}
        while ready or pending or any(o is not None for o in run.owner):
            n_free = sum(o is None for o in run.owner)
            if ready and n_free:
                self._place(run, [ready.popleft() for _ in range(min(n_free, len(ready)))])
                n_free = sum(o is None for o in run.owner)
            if n_free < self.spec.slots:  # something decodes: never wait for an environment
                self._decode(run, n_free + self.park_batch, pool, pending)
                finished = [f for f in pending if f.done()]
            else:
                start = time.perf_counter()
                finished, _ = cf.wait(list(pending), return_when=cf.FIRST_COMPLETED)
                self.stats["env_exposed_seconds"] += time.perf_counter() - start
            for fut in [f for f in pending if f in set(finished)]:  # submission order
                ep, final = pending.pop(fut)
                if self._after_step(ep, final, fut.result()):
                    ready.append(ep)

    def _synchronous(self, run: _Run, episodes: list, pool) -> None:
        S = self.spec.slots
        for lo in range(0, len(episodes), S):
            active = episodes[lo : lo + S]
            while active:
                self._place(run, active)
                pending = {}
                while any(o is not None for o in run.owner):
                    self._decode(run, S, pool, pending)
                start = time.perf_counter()
                cf.wait(list(pending))
                self.stats["env_exposed_seconds"] += time.perf_counter() - start
                active = [ep for fut, (ep, final) in pending.items() if self._after_step(ep, final, fut.result())]


@dataclasses.dataclass
class _Run:
    state: Any
    params: Any
    lparams: Any
    version: int
    owner: list  # slot -> the _Episode in it, or None


def _group(tag, eps: list) -> EpisodeGroup:
    def col(f, dtype):
        return np.array([f(e) for e in eps], dtype)

    routing = None if eps[0].routing is None else np.stack([e.routing for e in eps])
    return EpisodeGroup(
        tag,
        eps[0].prompt_P,
        eps[0].mask_P,
        np.stack([e.tokens_T for e in eps]),
        np.stack([e.loss_T for e in eps]),
        np.stack([e.logp_T for e in eps]),
        np.stack([e.version_T for e in eps]),
        col(lambda e: e.finished, bool),
        col(lambda e: e.truncated, bool),
        col(lambda e: e.ret, np.float32),
        col(lambda e: e.shaping, np.float32),
        col(lambda e: e.turns, np.int32),
        col(lambda e: e.tool_calls, np.int32),
        col(lambda e: e.tool_errors, np.int32),
        col(lambda e: e.env_errors, np.int32),
        col(lambda e: e.obs_cut, np.int32),
        col(lambda e: e.ret > 0 if e.success is None else e.success, bool),
        routing,
    )
