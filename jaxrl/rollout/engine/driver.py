"""The decode engine's host driver: samples with lifecycles over S slots (`state.py` is the jitted
device side; docs/engine.md describes admission, the staleness bound, re-prefill and speculation).

    engine = Engine.from_config(cfg, prompt_len=P, eos_id=..., pad_id=..., rng=key)
    engine = Engine(model_cfg, engine_cfg, sampling=SamplingParams(...), group_size=G, prompt_len=P, rng=key)
    groups = engine.collect(params, version, prompts, n_groups)   # prompts: iterable of (tag, tokens)
    groups = engine.sample(params, version, [(tag, tokens, k), ...])  # k samples of each prompt
    batch  = batch_of_groups(groups)                               # the trainer's RolloutBatch

`collect` admits prompts into free slots, decodes chunks of at most `chunk` steps and retires the
samples that finished (EOS or max_new_tokens) until n_groups groups are complete; a group is returned
once all G of its samples are retired. Every token records its log-prob and the version that drew it.
`pool` (a `SlotPool`, slots.py) and `host` (an `EngineHostState`, host.py) hold all of the engine's
state; `to_state()` / `load_state()` capture both for a checkpoint (checkpoint.py).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator

import jax
import numpy as np

from jaxrl.config import ConfigError, EngineConfig, ModelConfig, SpeculativeConfig
from jaxrl.models.parallel import Parallel
from jaxrl.rollout.engine.checkpoint import engine_to_state, load_engine_state
from jaxrl.rollout.engine.groups import (
    Flight,
    Group,
    concat_groups,
    first_version,
    flight_group,
    left_pad,
)
from jaxrl.rollout.engine.host import EngineHostState
from jaxrl.rollout.engine.partial import release_slots, reprefill
from jaxrl.rollout.engine.slots import SlotPool
from jaxrl.rollout.engine.state import (
    EngineSpec,
    admit,
    init_state,
    read_host_slots,
    split_params,
)
from jaxrl.rollout.sampler import SamplingParams, check_temperature
from jaxrl.rollout.speculative import engine as engine_speculative


class Engine:
    """Host side of the engine: `pool` the slots (device state and owners), `host` the rest of the
    bookkeeping (`EngineHostState`); nothing outside this class writes either."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        engine_cfg: EngineConfig,
        *,
        sampling: SamplingParams,
        group_size: int,
        prompt_len: int,
        rng,
        speculative: SpeculativeConfig | None = None,
        draft_ids=None,
        parallel: Parallel | None = None,
    ):
        """parallel (MoE): the experts' mesh axis (`sharding.parallel`), the one the
        update is given; every engine forward dispatches with it (None: one device)."""
        engine_cfg.validate()
        if engine_cfg.slots < group_size:
            raise ConfigError(
                f"rollout.engine.slots: got {engine_cfg.slots}, expected at least "
                f"group_size={group_size} (a group is admitted into free slots at once)"
            )
        check_temperature(sampling.temperature)
        self.ecfg, self.temperature = engine_cfg, float(sampling.temperature)
        self.spec = EngineSpec.of_sampling(
            model_cfg,
            sampling,
            slots=engine_cfg.slots,
            prompt_len=prompt_len,
            group_size=group_size,
            parallel=parallel,
        )
        toggle = None  # the speculative chunk strategy the slots run
        self.tail_rows = 0  # slots decoding at or below which chunks speculate (0: never)
        if speculative is not None and speculative.enabled:  # early-exit drafting: speculative/engine.py
            # draft_ids: ranked token ids for a reduced draft head (rollout.speculative.draft_vocab)
            self.spec = engine_speculative.speculative_spec(self.spec, speculative, draft_ids)
            self.tail_rows = engine_speculative.tail_rows(speculative, engine_cfg.slots)
            toggle = engine_speculative.ToggleChunk(self.tail_rows)
        self.pool = SlotPool(self.spec, init_state(self.spec.without_drafter(), rng), toggle)
        self.host = EngineHostState.fresh(() if toggle is None else toggle.COUNTS)

    @classmethod
    def from_config(
        cls,
        cfg,
        *,
        prompt_len: int,
        eos_id: int,
        pad_id: int,
        rng,
        greedy: bool = False,
        draft_ids=None,
        parallel: Parallel | None = None,
    ) -> Engine:
        """The engine a run's `Config` describes (model, rollout.* and rollout.engine.*); MoE: with
        the run's `parallel_for(mesh, preset)`."""
        rc = cfg.rollout
        return cls(
            cfg.model,
            rc.engine,
            sampling=SamplingParams.of_rollout(rc, eos_id=eos_id, pad_id=pad_id, greedy=greedy),
            group_size=rc.group_size,
            prompt_len=prompt_len,
            rng=rng,
            speculative=rc.speculative,
            draft_ids=draft_ids,
            parallel=parallel,
        )

    def to_state(self) -> tuple[dict, dict]:
        """(JSON-able bookkeeping, {name: numpy copy}) for a checkpoint (checkpoint.py)."""
        return engine_to_state(self.pool, self.host)

    def load_state(self, host: dict, arrays: dict | None) -> None:
        """Continue from `to_state()`'s output: samples in flight, ready groups, counters, RNG."""
        self.host = load_engine_state(self.pool, host, arrays, self.host.counts)

    @property
    def counts(self) -> dict[str, int]:
        """The engine's counters (chunks, prefill calls, admitted / restarted groups, ...; drafted /
        accepted tokens and speculative chunks when speculating)."""
        return self.host.counts

    @property
    def version(self) -> int | None:
        """The version of the latest collect (None before the first)."""
        return self.host.version

    @property
    def groups_in_flight(self) -> int:
        return len(self.host.flight)

    def _chunk(self, lparams, version: int, stop_at=None) -> None:
        """One chunk of at most `chunk` decode steps over all slots (the speculative strategy's, if any)."""
        counted = self.pool.decode(lparams, self.ecfg.chunk, version, self.temperature, stop_at)
        for name, n in counted.items():
            self.host.counts[name] += n
        self.host.counts["chunks"] += 1

    def collect(self, params, version: int, prompts: Iterable, n_groups: int) -> list[Group]:
        """The next n_groups complete groups (fewer only when `prompts` runs out and nothing is left
        in flight). `prompts` yields (tag, tokens) pairs: tokens a 1-D sequence of real tokens."""
        prompts = iter(prompts)
        self._restart_stale(version)
        self._reprefill_carried(params, version)
        self.host.version = version
        lparams = split_params(params, self.spec.cfg)  # once per collect, not once per chunk
        while len(self.host.ready) < n_groups:
            more = self._admit_free(params, prompts, n_groups, version)
            if not self.host.flight:  # prompts ran out and every admitted group is back
                break
            # While another group may still be admitted, the chunk ends as soon as G slots are free.
            stop_at = self.spec.group_size if more else self.spec.slots
            self._chunk(lparams, version, stop_at)
            self._retire()
        out, self.host.ready = self.host.ready[:n_groups], self.host.ready[n_groups:]
        return out

    def _restart_stale(self, version: int) -> None:
        """Drop the groups whose first token is more than max_staleness versions older than
        `version` (in flight: their slots are released) and queue them for re-admission."""
        bound = self.ecfg.max_staleness
        if bound < 0:
            return

        def stale(first):
            return version - first > bound

        n_queued = len(self.host.restart)
        restart = [g for g in self.host.ready if stale(first_version(g))]
        self.host.ready = [g for g in self.host.ready if not stale(first_version(g))]
        self.host.restart.extend((g.tag, g.prompt_P, g.prompt_mask_P) for g in restart)
        free_S = np.zeros(self.spec.slots, bool)
        for gid in [gid for gid, f in self.host.flight.items() if stale(f.born)]:
            flight = self.host.flight.pop(gid)
            mine = self.pool.owner_S == gid  # members already retired left their slots (maybe to others)
            free_S |= mine
            self.pool.owner_S[mine] = -1
            self.host.restart.append((flight.tag, flight.prompt_P, flight.mask_P))
        if free_S.any():
            self.pool.state = release_slots(self.spec, self.pool.state, free_S)
        n_restarted = len(self.host.restart) - n_queued
        self.host.counts["restarted_groups"] += n_restarted
        self.host.counts["restarted_samples"] += n_restarted * self.spec.group_size

    def _reprefill_carried(self, params, version: int) -> None:
        """reprefill: at a version change, recompute the caches of the samples still decoding."""
        if not self.ecfg.reprefill or version == self.host.version or not self.host.flight:
            return
        S, P = self.spec.slots, self.spec.prompt_len
        prompt_SxP, mask_SxP = np.full((S, P), self.spec.pad_id, np.int32), np.zeros((S, P), np.int32)
        for gid, flight in self.host.flight.items():
            mine = self.pool.owner_S == gid
            prompt_SxP[mine], mask_SxP[mine] = flight.prompt_P, flight.mask_P
        redo_S = self.pool.owner_S >= 0
        self.pool.state = reprefill(params, self.spec, self.pool.state, prompt_SxP, mask_SxP, redo_S)
        self.host.counts["reprefilled_samples"] += int(redo_S.sum())

    def _next_prompt(self, prompts: Iterator):
        """(tag, prompt_P, mask_P): a restarted group first, else the next prompt (None: none left)."""
        if self.host.restart:
            return self.host.restart.pop(0)
        item = next(prompts, None)
        if item is None:
            return None
        tag, tokens = item
        return (tag, *left_pad(tokens, self.spec.prompt_len, self.spec.pad_id))

    def _admit_free(self, params, prompts: Iterator, n_groups: int, version: int) -> bool:
        """Admit prompts into free slots as far as the admission policy allows (flights born at
        `version`). -> whether the next chunk should end as soon as G slots are free (`exact`, with
        prompts and room left)."""
        G = self.spec.group_size
        free = self.pool.free()
        room = len(free) // G
        if self.ecfg.admission == "exact":
            room = min(room, n_groups - len(self.host.ready) - len(self.host.flight))
        batch, exhausted = [], False
        for _ in range(max(room, 0)):
            item = self._next_prompt(prompts)
            if item is None:
                exhausted = True
                break
            batch.append(item)
        self._admit_rows(params, [(tag, prompt_P, mask_P, G, None) for tag, prompt_P, mask_P in batch], free, version)
        # Only `exact` ends chunks early: there chunk boundaries are invisible in what a collect
        # returns, while under `fill` they decide which samples a collect leaves in flight.
        return (
            self.ecfg.admission == "exact"
            and not exhausted
            and n_groups - len(self.host.ready) - len(self.host.flight) > 0
        )

    def _admit_rows(self, params, rows: list, free: np.ndarray, version: int) -> None:
        """Admit rows (tag, prompt_P, mask_P, n <= G samples, sink or None) into the free slots `free` (enough
        for all), `admit_groups` rows per prefill call; each row becomes one flight of n samples, born
        at `version`."""
        G, A, S = self.spec.group_size, self.ecfg.admit_groups, self.spec.slots
        for start in range(0, len(rows), A):
            chunk = rows[start : start + A]
            dest_N = np.full(A * G, S, np.int32)  # S: dropped (padding prompts, or a row's unused samples)
            for a, (tag, prompt_P, mask_P, n, sink) in enumerate(chunk):
                slots_n, free = free[:n], free[n:]
                dest_N[a * G : a * G + n] = slots_n
                self.pool.hold(slots_n, self.host.next_id)
                self.host.flight[self.host.next_id] = Flight(tag, prompt_P, mask_P, slots_n, {}, sink, version)
                self.host.next_id += 1
            pad = [chunk[0]] * (A - len(chunk))
            prompt_AxP = np.stack([c[1] for c in chunk + pad])
            mask_AxP = np.stack([c[2] for c in chunk + pad])
            self.pool.state = admit(params, self.spec, self.pool.state, prompt_AxP, mask_AxP, dest_N)
            self.host.counts["prefill_calls"] += 1
            self.host.counts["admitted_groups"] += len(chunk)

    def sample(self, params, version: int, requests: list) -> list[Group]:
        """`requests`: (tag, tokens, k) triples -> one Group of k samples per request, in order (k = 0:
        an empty Group), decoded to the end. A request is admitted in pieces of at most G samples
        (one prefill each), as free slots allow; asking again for a prompt already sampled prefills it
        again. Every sample is drawn by the same kernels as `collect`'s, with its own noise (its
        slot and decode steps), so samples from different calls are independent draws of the policy.
        Flights of an earlier `collect` still decoding (admission=fill) keep decoding meanwhile."""
        G = self.spec.group_size
        prompts = [left_pad(tokens, self.spec.prompt_len, self.spec.pad_id) for _, tokens, _ in requests]
        # piece j: (request i, n samples); its flight's tag is (j, i)
        pieces = [(i, min(G, k - start)) for i, (_, _, k) in enumerate(requests) for start in range(0, k, G)]
        done: list[Group] = []
        next_j = 0
        lparams = split_params(params, self.spec.cfg)  # once per call, not once per chunk
        while len(done) < len(pieces):
            free, rows = self.pool.free(), []
            room = len(free)
            while next_j < len(pieces) and pieces[next_j][1] <= room:
                i, n = pieces[next_j]
                rows.append(((next_j, i), *prompts[i], n, done))
                room -= n
                next_j += 1
            self._admit_rows(params, rows, free, version)
            self._chunk(lparams, version)
            self._retire()
        by_piece = sorted(done, key=lambda g: g.tag[0])
        return [
            concat_groups([g for g in by_piece if g.tag[1] == i], tag, *prompts[i])
            for i, (tag, _, _) in enumerate(requests)
        ]

    def _retire(self) -> None:
        """Read the finished samples out, free their slots, move complete flights to their sink."""
        # One round trip per chunk: every slot's fields come back (the arrays are small), the
        # finished ones are kept.
        host, retired = self.pool.retire()
        if not retired:
            return
        out = read_host_slots(self.spec, host, np.arange(self.spec.slots))
        for slot, gid in retired:
            flight = self.host.flight[gid]
            member = int(np.flatnonzero(flight.slots_G == slot)[0])
            flight.rows[member] = jax.tree.map(operator.itemgetter(slot), out)  # None (no MoE) stays None
            if len(flight.rows) == len(flight.slots_G):
                (self.host.ready if flight.sink is None else flight.sink).append(flight_group(flight))
                del self.host.flight[gid]
