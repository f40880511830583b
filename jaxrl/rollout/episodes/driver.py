"""Multi-turn episodes on the slot engine: environment steps run on the host while the slots keep decoding.

    engine = EpisodeEngine(model_cfg, cfg.rollout.engine, cfg.agent, make_env=suite.make, tokenizer=tok,
                           end_of_turn="]", prompt_len=P, sampling=SamplingParams(max_new_tokens=T, ...))
    groups = engine.run(params, version, requests, group_size, seed)  # requests: [(tag, record), ...]
    groups = engine.run(params, version, requests, group_size, seed, first=j0)  # a block of a larger draw
    engine.stats  # chunks, place_calls, env_steps, env_seconds, env_exposed_seconds, decode_seconds, place_seconds

`run` plays group_size episodes per request and returns one `EpisodeGroup` per request, in request order
(never completion order). Episode (j, g) resets its environment with
np.random.default_rng([*seed, j, g]) and samples with its own key (`episode_keys`; `seed` an int or a
sequence of ints): its tokens depend on that key, the params and its history only, never on the slot,
the other episodes or the environments' timing. j counts from `first` (default 0): a process of a
multi-process run plays requests first, first+1, ... of the step's draw as one process would. With
agent.overlap an episode leaves its slot when its turn ends, `env.step` runs in a thread pool meanwhile,
and the episode comes back through `place` with its whole history prefilled; agent.overlap=False is
turn-synchronous, with the same episodes. docs/agents.md describes an episode's lifecycle (turn text,
observations, how it ends).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxrl.config import ModelConfig
from jaxrl.config.agent import AgentConfig
from jaxrl.config.rollout import EngineConfig
from jaxrl.models.parallel import Parallel
from jaxrl.rollout.engine.groups import left_pad
from jaxrl.rollout.engine.slots import SlotPool
from jaxrl.rollout.engine.state import EngineSpec, init_state, split_params
from jaxrl.rollout.episodes.records import Episode, StepOutcome, env_step, episode_group, episode_keys
from jaxrl.rollout.episodes.state import place
from jaxrl.rollout.sampler import SamplingParams, check_temperature


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
        sampling: SamplingParams,
        speculative=None,
        park_batch: int = 4,
        place_rows: int = 4,
        parallel: Parallel | None = None,
    ):
        """sampling: eos_id and pad_id the tokenizer's; parallel (MoE): the experts' mesh axis, as
        the update's (None: one device)."""
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
        for field in ("eos_id", "pad_id"):
            if getattr(sampling, field) != getattr(tokenizer, field):
                raise ValueError(
                    f"sampling.{field}: got {getattr(sampling, field)}, the tokenizer's is {getattr(tokenizer, field)}"
                )
        check_temperature(sampling.temperature)
        self.ecfg, self.agent, self.tokenizer, self.make_env = engine_cfg, agent_cfg, tokenizer, make_env
        self.temperature, self.eot_id, self.park_batch = float(sampling.temperature), eot[0], max(1, int(park_batch))
        self.place_rows = min(int(place_rows), engine_cfg.slots)
        self.spec = EngineSpec.of_sampling(
            model_cfg,
            sampling,
            slots=engine_cfg.slots,
            prompt_len=prompt_len,
            group_size=1,
            stop_ids=(eot[0],),
            slot_keys=True,
            parallel=parallel,
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

    def _start(self, requests: list, group_size: int, seed, first: int) -> list:
        """One Episode per (request j, member g), environments reset, in order j*G+g; request j is the
        step's first + j (its environment seed and key)."""
        P, T, tok = self.spec.prompt_len, self.spec.max_new_tokens, self.tokenizer
        keys = episode_keys(seed, len(requests), group_size, first)
        seed = [int(s) for s in np.atleast_1d(seed)]
        bos = [tok.bos_id] if getattr(tok, "add_bos", True) else []
        episodes = []
        for j, (_, record) in enumerate(requests):
            for g in range(group_size):
                env = self.make_env()
                ids = bos + list(tok.encode(env.reset(record, np.random.default_rng([*seed, first + j, g]))))
                if not 0 < len(ids) <= P:
                    raise ValueError(
                        f"record {record.get('id')!r}: prompt of {len(ids)} tokens, expected 1..prompt_len={P}"
                    )
                prompt_P, mask_P = left_pad(ids, P, self.spec.pad_id)
                episodes.append(
                    Episode(
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

    def _end_turn(self, ep: Episode, row: dict, pool, pending: dict) -> None:
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
        pending[pool.submit(env_step, ep.env, self.tokenizer, action.tolist(), final)] = (ep, final)

    def _after_step(self, ep: Episode, final: bool, out: StepOutcome) -> bool:
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
            free = run.slots.free()[: len(part)]
            slot_R = np.full(R, S, np.int32)
            slot_R[: len(part)] = free

            def pad(xs, fill):
                return np.stack(xs + [np.full_like(xs[0], fill)] * (R - len(xs)))

            run.slots.state = place(
                run.params,
                self.spec,
                run.slots.state,
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
                run.slots.hold(slot, run.index[id(ep)])
            self.stats["place_calls"] += 1
        self.stats["place_seconds"] += time.perf_counter() - start

    def _decode(self, run: _Run, stop_at: int, pool, pending: dict) -> None:
        """One chunk of decode steps, then every parked slot's turn handed to `_end_turn`."""
        start = time.perf_counter()
        run.slots.decode(run.lparams, self.ecfg.chunk, run.version, self.temperature, stop_at)
        host, retired = run.slots.retire()
        self.stats["chunks"] += 1
        self.stats["decode_seconds"] += time.perf_counter() - start
        for slot, i in retired:
            ep = run.episodes[i]
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

    def run(self, params, version: int, requests: list, group_size: int, seed, first: int = 0) -> list:
        """group_size episodes per (tag, record) request -> one EpisodeGroup per request, in request
        order; first: the index of requests[0] in the step's draw (a process's block of it)."""
        episodes = self._start(list(requests), group_size, seed, first)
        run = _Run(
            SlotPool(self.spec, init_state(self.spec, jax.random.PRNGKey(0))),
            params,
            split_params(params, self.spec.cfg),
            version,
            episodes,
            {id(ep): i for i, ep in enumerate(episodes)},
        )
        with cf.ThreadPoolExecutor(self.agent.env_workers) as pool:
            (self._overlapped if self.agent.overlap else self._synchronous)(run, episodes, pool)
        return [
            episode_group(tag, episodes[j * group_size : (j + 1) * group_size]) for j, (tag, _) in enumerate(requests)
        ]

    def _overlapped(self, run: _Run, episodes: list, pool) -> None:
        ready, pending = deque(episodes), {}
        while ready or pending or len(run.slots.free()) < self.spec.slots:
            n_free = len(run.slots.free())
            if ready and n_free:
                self._place(run, [ready.popleft() for _ in range(min(n_free, len(ready)))])
                n_free = len(run.slots.free())
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
                while len(run.slots.free()) < S:
                    self._decode(run, S, pool, pending)
                start = time.perf_counter()
                cf.wait(list(pending))
                self.stats["env_exposed_seconds"] += time.perf_counter() - start
                active = [ep for fut, (ep, final) in pending.items() if self._after_step(ep, final, fut.result())]


@dataclasses.dataclass
class _Run:
    slots: SlotPool  # a slot's owner: the index of its episode in `episodes`
    params: Any
    lparams: Any
    version: int
    episodes: list
    index: dict  # id(episode) -> its index in `episodes`
