"""A rollout source's share of a multi-process run: each process rolls out on its own devices.

    share = ProcessShare.current()                             # (index p, count P)
    n = share.split(cfg.rollout.prompts_per_step, "rollout.prompts_per_step")  # P must divide it
    rc = share.rollout(cfg.rollout, group_slots=True)          # prompts_per_step / P, engine.slots / P
    mine = records[share.block(len(records))]                  # a contiguous block of a list all share
    local = LocalLayout.of_rollout(cfg, param_sh)              # the rollout's preset on jax.local_devices()
    local_params = local.params(params)                        # once per policy version
    stream = share.first_position(records, stream, seed)       # process p starts at stream position p
    saved = share.checkpoint_item(state, arrays)               # every process's state, on every process
    state, arrays = share.restored(host)                       # this process's part of a checkpoint
    metrics = combine_metrics(rows, SUMMED, MAXED)             # one step's metrics over processes

Process p of P consumes global stream positions p, p+P, p+2P, ... (`PromptFeed(stride=P)`), so with
synchronous admission the union of a step's prompts over the processes is the one-process step's.
Multi-turn episodes (sources/agents.py), whose step draws a fixed number of records, instead split that
draw into contiguous blocks (`block`): process p plays the p-th block, so the step's rows in process
order are the one-process step's rows. A process's rollout needs no other process within a step; the
step's rows meet in one global array (`multihost.put_rows`). What a process keeps between steps (the
engine's slots, the prompt filter, its stream position) is checkpointed as one entry per process under
`PROCESSES`; a resume checks that the process count is the one that saved it. One process: `count == 1`
and none of this changes anything.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxrl.config import Config, ConfigError, MeshConfig, RolloutConfig
from jaxrl.data.stream import StreamState, next_batch
from jaxrl.multihost import gather_objects, process_local
from jaxrl.sharding import make_mesh, parallel_for, rollout_mesh_config, rollout_mesh_prefix
from jaxrl.sources.base import ARRAYS

PROCESSES = "processes"  # the checkpoint's JSON key: one entry per process, in process order


class ProcessShare(NamedTuple):
    index: int  # p
    count: int  # P

    @classmethod
    def current(cls) -> ProcessShare:
        return cls(jax.process_index(), jax.process_count())

    def split(self, n: int, field: str) -> int:
        """Each process's share of `n` (the config `field`); ConfigError naming it when P does not divide it."""
        if n % self.count:
            raise ConfigError(
                f"{field}={n} does not divide over the run's {self.count} processes (each process rolls out "
                f"its own share); use a multiple of {self.count}"
            )
        return n // self.count

    def rollout(self, rc: RolloutConfig, group_slots: bool) -> RolloutConfig:
        """This process's share of the rollout config: prompts_per_step / P prompts and
        rollout.engine.slots / P slots (P must divide each; ConfigError naming the field). group_slots:
        each share of slots must hold a group (the slot engine draws a group's samples together)."""
        n_prompts = self.split(rc.prompts_per_step, "rollout.prompts_per_step")
        slots = self.split(rc.engine.slots, "rollout.engine.slots")
        if group_slots and slots < rc.group_size:
            raise ConfigError(
                f"rollout.engine.slots={rc.engine.slots}: {slots} per process over {self.count} processes, "
                f"expected at least group_size={rc.group_size} each"
            )
        return dataclasses.replace(rc, prompts_per_step=n_prompts, engine=dataclasses.replace(rc.engine, slots=slots))

    def block(self, n: int) -> slice:
        """This process's contiguous block of n items (blocks in process order, sizes differing by at
        most one; all of them for one process)."""
        return slice(n * self.index // self.count, n * (self.index + 1) // self.count)

    def first_position(self, records, stream: StreamState, seed: int) -> StreamState:
        """The stream position this process starts at: `stream` moved on by p records."""
        if self.index == 0:
            return stream
        return next_batch(records, stream, self.index, seed)[1]

    def checkpoint_item(self, state: dict, arrays: dict) -> dict:
        """{PROCESSES: [every process's JSON-able `state`], ARRAYS: {"process_<p>": its `arrays`}}, on
        every process (a collective: every process saves at the same step)."""
        everyone = gather_objects((state, arrays))
        return {
            PROCESSES: [s for s, _ in everyone],
            ARRAYS: {f"process_{p}": a for p, (_, a) in enumerate(everyone) if a},
        }

    def restored(self, host: dict, field: str) -> tuple[dict, dict] | None:
        """(this process's saved state, its arrays) from a checkpoint's host item; None from a fresh
        run's ({}). ConfigError naming the counts when the checkpoint was written by another number
        of processes (`field`: what the state is, for the message)."""
        if PROCESSES not in host:
            if host.get(field) is None:
                return None
            raise ConfigError(
                f"{field}: the checkpoint was written by a one-process run; this run has {self.count} "
                "processes, whose rollout state cannot be split from it (resume with 1 process, or use a "
                "new --workdir)"
            )
        saved = host[PROCESSES]
        if len(saved) != self.count:
            raise ConfigError(
                f"{field}: the checkpoint was written by {len(saved)} processes, this run has {self.count}; "
                f"each process resumes its own rollout state (resume with {len(saved)} processes, or use a "
                "new --workdir)"
            )
        return saved[self.index], host.get(ARRAYS, {}).get(f"process_{self.index}", {})


class LocalLayout(NamedTuple):
    """The run's mesh preset restricted to this process's devices: where its rollout runs."""

    parallel: Any  # `sharding.parallel_for` of the local mesh (None on one device)
    param_sh: Any  # the params' shardings: the run's partition specs on the local mesh

    @classmethod
    def of(cls, mesh_cfg: MeshConfig, param_sh, prefix: str = "mesh") -> LocalLayout:
        """`mesh_cfg`'s preset on this process's devices, the params laid out by `param_sh`'s specs
        (shardings on the global mesh of that preset); errors name `prefix`'s fields."""
        mesh, preset = make_mesh(mesh_cfg, jax.local_devices(), prefix)
        local_sh = jax.tree.map(lambda s: NamedSharding(mesh, s.spec), param_sh)
        return cls(parallel_for(mesh, preset), local_sh)

    @classmethod
    def of_rollout(cls, cfg: Config, param_sh) -> LocalLayout:
        """The rollout's layout (`sharding.rollout_mesh_config`: training's, or rollout.mesh's own) on
        this process's devices; `param_sh`: the params' shardings under that layout."""
        return cls.of(rollout_mesh_config(cfg), param_sh, rollout_mesh_prefix(cfg))

    def params(self, params):
        """The run's params (global arrays) on this process's devices, laid out by `param_sh`."""
        return process_local(params, self.param_sh)


# How combine_metrics reduces a metric over processes: summed (counts), maxed, else averaged.
SUMMED = frozenset(
    {
        "rollout/samples",
        "engine/in_flight_groups",
        "engine/dyn_dropped",
        "engine/dyn_filled",
        "engine/dyn_extra",
        "engine/filtered_prompts",
        "engine/filter_forced",
        "engine/filter_prompts_seen",
        "agent/env_steps",  # multi-turn episodes: environment steps and time, every process's
        "agent/env_seconds",
        "agent/env_exposed_seconds",
        "agent/env_hidden_seconds",
    }
)
MAXED = frozenset({"engine/dyn_cap_hit", "engine/vigor_max_group", "engine/vigor_draws", "rollout/seconds"})
MINNED = frozenset({"engine/vigor_min_group"})


def combine_metrics(rows: list[dict], summed=SUMMED, maxed=MAXED, minned=MINNED, counts=()) -> dict:
    """One metrics row from every process's (same keys, in the first row's order): a key in `summed`
    or starting with one of `counts` (prefixes) is summed, one in `maxed` / `minned` reduced so, any
    other averaged (the processes hold equal shares of the step's rows). None stays None."""
    out = {}
    for key in rows[0]:
        values = [r[key] for r in rows]
        if values[0] is None:
            out[key] = None
        elif key in summed or key.startswith(tuple(counts)):
            out[key] = type(values[0])(sum(values))
        elif key in maxed:
            out[key] = max(values)
        elif key in minned:
            out[key] = min(values)
        else:
            out[key] = float(np.mean(values))
    return out
