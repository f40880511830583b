"""Where a step's scored groups come from: the loop's one call into the rollout side.

    produced = source.produce(params, stream, rng, step)   # -> Produced: host batch, metrics, stream
    source.checkpoint_state()                              # the host state for the checkpoint's JSON item

  StaticSource  the step's `prompts_per_step` prompts from the stream, one static B x T rollout
                (`SamplerSource`: the sampler, or the speculative sampler), scored row by row.
  EngineSource  the slot engine (`rollout.engine.enabled=true`): prompts pulled as slots free up, the
                step gets the first `prompts_per_step` groups that complete; partial rollouts, dynamic
                sampling, the prompt filter and VIGOR allocation are its options (docs/engine.md).
Both return a RolloutBatch (jaxrl.rollout.batch); the engine's also carries `group_id_B` and `stale_BxT`,
and its state (samples in flight, KV caches, RNG) is checkpointed so a resumed run continues exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterator

import jax
import numpy as np

from jaxrl.config import Config, ConfigError
from jaxrl.data.stream import StreamState, from_arrays, next_batch
from jaxrl.data.tokenizer import encode_prompts
from jaxrl.multihost import gather_objects
from jaxrl.rollout.batch import RolloutBatch
from jaxrl.rollout.engine.driver import Engine
from jaxrl.rollout.engine.groups import Group, batch_of_groups
from jaxrl.rollout.speculative.draft_vocab import task_draft_ids
from jaxrl.sources.base import ARRAYS, Produced
from jaxrl.sources.filters import ScoredGroup, select_informative, selection_metrics
from jaxrl.sources.processes import PROCESSES, LocalLayout, ProcessShare, combine_metrics
from jaxrl.sources.prompt_filter import BetaPromptFilter
from jaxrl.sources.prompts import next_prompts
from jaxrl.sources.sampler import SamplerSource
from jaxrl.sources.scoring import RowLayout, reward_metrics, score_completions, score_groups
from jaxrl.sources.vigor import collect_vigor, group_rewards

_ENGINE_ITEM = "engine"  # its key in the checkpoint's JSON item and in the arrays item

# Bumps the engine's key away from the state's (both start from train.seed).
_ENGINE_KEY_SALT = 0x656E67
# The prompt filter's state in the checkpoint's JSON item (posteriors, generator, counters).
_FILTER_KEY = "prompt_filter"


class StaticSource:
    """The step's prompts -> one static rollout (`SamplerSource`) -> scores."""

    def __init__(self, cfg: Config, sampler: SamplerSource, task, tokenizer, rows: RowLayout):
        """rows: the update's; the sampler's (under its own layout, rollout.mesh) must give this
        process the same rows, which it scores and feeds to the update."""
        if sampler.rows != rows.mine:
            raise ConfigError(
                f"rollout.mesh.preset={cfg.rollout.mesh.preset!r}: this process's devices hold rows {sampler.rows} "
                f"of the rollout's batch but {rows.mine} of the update's; choose a rollout layout whose batch "
                "axis splits the rows over the processes as training's does (e.g. a smaller rollout.mesh.tensor)"
            )
        self.cfg, self.sampler, self.task, self.tokenizer, self.rows = cfg, sampler, task, tokenizer, rows

    def produce(self, params, stream: StreamState, rng, step: int) -> Produced:
        cfg, t0 = self.cfg, time.perf_counter()
        records, prompt_BxP, pmask_BxP, stream, n_skipped = next_prompts(
            self.task.train, stream, cfg.rollout.prompts_per_step, self.tokenizer, cfg.data, cfg.data.seed
        )
        # Every process walks the same stream; each scores only its own completion rows.
        rollout, rollout_row = self.sampler.produce(params, prompt_BxP, pmask_BxP, rng, step)
        seconds = time.perf_counter() - t0
        scored = score_groups(
            rollout,
            records,
            prompt_BxP,
            pmask_BxP,
            n_skipped,
            tokenizer=self.tokenizer,
            verifier=self.task.verifier,
            rows=self.rows,
            group_size=cfg.rollout.group_size,
            reward_weights=cfg.loss.reward_weights,
        )
        metrics = {
            **scored.metrics,
            "rollout/tokens_per_s": scored.n_tokens / max(seconds, 1e-9),
            "rollout/seconds": seconds,
            **rollout_row,
        }
        return Produced(scored.host_batch, rollout.routing_BxSxLxK, metrics, stream)

    def checkpoint_state(self) -> dict:
        return self.sampler.checkpoint_state()


class PromptFeed:
    """An iterator of (record, prompt tokens) over the task's stream, one usable prompt at a time;
    `stream` is the position after the last prompt taken, `skipped` the over-long prompts passed.
    stride > 1 (process p of P in a multi-process run, started at position p): each prompt taken
    passes over the P - 1 that the other processes take."""

    def __init__(self, records, stream: StreamState, tokenizer, cfg: Config, stride: int = 1):
        self.records, self.stream, self.tokenizer, self.cfg, self.skipped = records, stream, tokenizer, cfg, 0
        self.stride = stride

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        data = self.cfg.data
        if self.stride > 1:
            return self._next_strided()
        recs, tok_1xP, mask_1xP, self.stream, n_skipped = next_prompts(
            self.records, self.stream, 1, self.tokenizer, data, data.seed
        )
        self.skipped += n_skipped
        return recs[0], tok_1xP[0][mask_1xP[0] > 0]

    def _next_strided(self):
        data = self.cfg.data
        for _ in range(100):  # as next_prompts: a stream of nearly only over-long prompts is an error
            recs, self.stream = next_batch(self.records, self.stream, 1, data.seed)
            _, self.stream = next_batch(self.records, self.stream, self.stride - 1, data.seed)
            tok_1xP, mask_1xP, kept, _ = encode_prompts(
                self.tokenizer,
                [recs[0]["prompt"]],
                data.max_prompt_len,
                skip_long=data.skip_long_prompts,
                record_ids=[recs[0]["id"]],
                pad_to=data.max_prompt_len,
            )
            if kept:
                return recs[0], tok_1xP[0][mask_1xP[0] > 0]
            self.skipped += 1
        raise ConfigError(f"data.max_prompt_len={data.max_prompt_len}: nearly every prompt is longer; 100 skipped")


class EngineSource:
    """The step's groups from the slot engine, scored. With several processes each runs its own engine
    on its own devices (`processes.LocalLayout.of_rollout`: the rollout's preset on `jax.local_devices()`)
    over its share of the step: prompts_per_step / P groups from stream positions p, p+P, ... and
    rollout.engine.slots / P slots (both must divide); the step's batch is every process's rows, the
    metrics are over all of them. parallel (one process): the rollout layout's `sharding.parallel_for`
    (training's unless rollout.mesh sets one); param_sh: the params' shardings under that layout
    (needed with several processes)."""

    def __init__(self, cfg: Config, model_cfg, tokenizer, task, host: dict, parallel=None, param_sh=None):
        self.share, rc = ProcessShare.current(), cfg.rollout
        self.local, self.stream = None, None  # several processes: the local layout, this process's position
        rng = jax.random.fold_in(jax.random.key(cfg.train.seed), _ENGINE_KEY_SALT)
        if self.share.count > 1:
            if param_sh is None:
                raise ValueError("EngineSource: param_sh (the params' shardings) is needed with several processes")
            cfg = dataclasses.replace(cfg, rollout=self.share.rollout(rc, group_slots=True))
            self.local = LocalLayout.of_rollout(cfg, param_sh)
            parallel, rng = self.local.parallel, jax.random.fold_in(rng, self.share.index)
        self.cfg, self.tokenizer, self.task = cfg, tokenizer, task
        # model_cfg: the resolved model (the tokenizer's vocabulary, or the HF checkpoint's architecture)
        spec = cfg.rollout.speculative  # a reduced draft head: ids ranked over the task's training records
        draft_ids = (
            task_draft_ids(task.train, tokenizer, spec.draft_vocab, model_cfg.vocab_size)
            if spec.enabled and spec.draft_vocab
            else None
        )
        self.engine = Engine.from_config(
            dataclasses.replace(cfg, model=model_cfg),
            prompt_len=cfg.data.max_prompt_len,
            eos_id=tokenizer.eos_id,
            pad_id=tokenizer.pad_id,
            rng=rng,
            draft_ids=draft_ids,
            parallel=parallel,
        )
        saved, arrays = self._saved(host)
        if _ENGINE_ITEM in saved:  # resumed: the samples in flight continue where the save left them
            self.engine.load_state(saved[_ENGINE_ITEM], arrays.get(_ENGINE_ITEM))
        if self.local is not None and "stream" in saved:  # one process: the loop's own stream, not ours
            self.stream = from_arrays(saved["stream"])
        self.prompt_filter = BetaPromptFilter.from_config(
            cfg.rollout.engine, cfg.train.seed, saved.get(_FILTER_KEY), process=self.share.index
        )

    def _saved(self, host: dict) -> tuple[dict, dict]:
        """(this process's saved source state, its arrays) from the checkpoint's host item ({} fresh):
        the item itself for one process, its own entry of `processes.PROCESSES` for several."""
        if self.share.count == 1 and PROCESSES not in host:
            return host, host.get(ARRAYS, {})
        return self.share.restored(host, _ENGINE_ITEM) or ({}, {})

    def produce(self, params, stream: StreamState, rng, step: int) -> Produced:
        """`rng` is unused: the engine draws with its own key (its state), so that samples carried
        between steps keep one stream of noise. With dynamic sampling the reward/* metrics describe
        the groups in the batch; engine/dyn_* count the ones drawn and dropped. Several processes: each
        walks its own stream position (the loop's `stream` is process 0's)."""
        del rng
        cfg, t0, counts0 = self.cfg, time.perf_counter(), dict(self.engine.counts)
        version = step - 1  # the number of updates the policy has had
        if self.local is not None:
            if self.stream is None:
                self.stream = self.share.first_position(self.task.train, stream, cfg.data.seed)
            stream, params = self.stream, self.local.params(params)
        feed = PromptFeed(self.task.train, stream, self.tokenizer, cfg, stride=self.share.count)
        pf = self.prompt_filter
        filter0 = (pf.n_filtered, pf.n_forced) if pf else (0, 0)
        prompts = pf.admitted(feed) if pf else feed  # the engine sees only the prompts the filter admits
        n_failed, picked, extra_metrics = self._draw(params, version, prompts)
        seconds = time.perf_counter() - t0
        rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size  # this process's share of the step
        host_batch = _batch_of(picked, version, first_id=self.share.index * rows)
        if self.local is not None and len(host_batch.tokens_BxT) != rows:
            raise RuntimeError(
                f"process {self.share.index}: the engine gave {len(host_batch.tokens_BxT)} rows, not {rows}"
            )
        mask_BxT, finished_B = host_batch.completion_mask_BxT, host_batch.truncated_B == 0
        metrics = reward_metrics(
            host_batch.rewards_BxK, mask_BxT, finished_B, n_failed, feed.skipped, cfg.loss.reward_weights
        )
        metrics.update({"rollout/tokens_per_s": float(mask_BxT.sum()) / max(seconds, 1e-9), "rollout/seconds": seconds})
        metrics.update(engine_metrics(self.engine, counts0, [s.group for s in picked], version))
        metrics.update({**extra_metrics, **(pf.metrics(filter0) if pf else {})})
        if self.local is not None:
            self.stream = feed.stream
            version_BxT = np.concatenate([s.group.version_GxT for s in picked])
            counts = (n_failed, feed.skipped)
            metrics = _over_processes(metrics, host_batch, version_BxT, counts, version, cfg.loss.reward_weights)
        return Produced(host_batch, None, metrics, feed.stream)

    def _draw(self, params, version: int, prompts) -> tuple[int, list[ScoredGroup], dict]:
        """(verifier failures, the step's scored groups, metrics: rollout/samples = completions drawn
        and scored, dropped ones included, and engine/dyn_* or engine/vigor_*): the first
        prompts_per_step groups, with dynamic sampling the informative ones (group_filters.py), or
        with allocation=vigor one group per prompt, of unequal sizes (vigor.py)."""
        cfg, n_failed, n_samples = self.cfg, [0], [0]

        def draw(n: int) -> list[ScoredGroup]:
            scored, failed = self._scored(self.engine.collect(params, version, prompts, n))
            n_failed[0] += failed
            n_samples[0] += sum(len(s.rewards_GxK) for s in scored)
            return scored

        if cfg.rollout.engine.allocation == "vigor":  # groups of unequal size, B samples in all
            rewards_of = functools.partial(
                group_rewards,
                tokenizer=self.tokenizer,
                verifier=self.task.verifier,
                reward_weights=cfg.loss.reward_weights,
            )
            groups, allocated = collect_vigor(self.engine, params, version, prompts, cfg.rollout, rewards_of)
            picked, failed = self._scored(groups)
            return failed, picked, {"rollout/samples": sum(len(g.tokens_GxT) for g in groups), **allocated}
        if not cfg.rollout.engine.dynamic_sampling:
            picked = draw(cfg.rollout.prompts_per_step)
            return n_failed[0], picked, {"rollout/samples": n_samples[0]}
        sel = select_informative(
            draw, cfg.rollout.prompts_per_step, cfg.rollout.engine.max_extra_groups, cfg.loss.reward_weights
        )
        return n_failed[0], sel.groups, {"rollout/samples": n_samples[0], **selection_metrics(sel)}

    def _scored(self, groups: list[Group]) -> tuple[list[ScoredGroup], int]:
        """Each group with its rewards (one verifier call for all), and the verifier's failures; the
        prompt filter, if any, learns from every group scored."""
        if not groups:
            return [], 0
        records = [g.tag for g in groups for _ in range(len(g.tokens_GxT))]
        tokens_BxT = np.concatenate([g.tokens_GxT for g in groups])
        finished_B = np.concatenate([g.finished_G for g in groups])
        rewards_BxK, n_failed = score_completions(
            tokens_BxT, finished_B, records, tokenizer=self.tokenizer, verifier=self.task.verifier
        )
        splits = np.cumsum([len(g.tokens_GxT) for g in groups])[:-1]
        scored = [ScoredGroup(g, r_GxK) for g, r_GxK in zip(groups, np.split(rewards_BxK, splits))]
        if self.prompt_filter:
            for s in scored:
                self.prompt_filter.update(s.group.tag["id"], s.rewards_GxK)
        return scored, n_failed

    def checkpoint_state(self) -> dict:
        """The engine's bookkeeping (JSON; tags are the data records) and its device state copied to
        the host (the checkpoint's arrays item): slots in flight, ready groups, counters, RNG; and the
        prompt filter's posteriors and generator. Several processes: every process's, with its stream
        position, one entry each (`processes.ProcessShare.checkpoint_item`; a collective)."""
        host, arrays = self.engine.to_state()
        out = {_ENGINE_ITEM: host}
        if self.prompt_filter:
            out[_FILTER_KEY] = self.prompt_filter.to_state()
        if self.local is None:
            return {**out, ARRAYS: {_ENGINE_ITEM: arrays}}
        if self.stream is not None:
            out["stream"] = self.stream._asdict()
        return self.share.checkpoint_item(out, {_ENGINE_ITEM: arrays})


def _batch_of(picked: list[ScoredGroup], version: int, first_id: int = 0) -> RolloutBatch:
    """The step's groups as the update's batch (group_id_B included, counted from `first_id`: a
    process's ids differ from every other's), rewards_BxK from their scores, stale_BxT from their
    tokens' versions (`version`: the step's; the update splits its log-prob mismatch by it)."""
    batch = batch_of_groups([s.group for s in picked]).with_staleness(version)
    assert batch.group_id_B is not None  # from_groups numbers the groups
    return batch._replace(
        rewards_BxK=np.concatenate([s.rewards_GxK for s in picked]), group_id_B=batch.group_id_B + np.int32(first_id)
    )


# The engine's per-step counts (engine_metrics), summed over processes.
_ENGINE_COUNTS = tuple(
    f"engine/{k}"
    for k in ("chunks", "prefill_calls", "restarted_samples", "reprefilled_samples", "drafted", "accepted")
)


def _over_processes(metrics: dict, host_batch: RolloutBatch, version_BxT, counts: tuple, version: int, weights):
    """One process's metrics row -> the step's over every process (a collective): the reward, length
    and staleness metrics recomputed over all rows, counts summed, rates averaged (combine_metrics).
    counts: this process's (verifier failures, skipped prompts)."""
    mine = (metrics, host_batch.rewards_BxK, host_batch.completion_mask_BxT, host_batch.truncated_B)
    everyone = gather_objects((*mine, version_BxT, *counts))
    out = combine_metrics([e[0] for e in everyone], counts=_ENGINE_COUNTS)

    def cat(i):
        return np.concatenate([e[i] for e in everyone])

    mask_BxT = cat(2)
    n_failed_all, n_skipped_all = sum(e[5] for e in everyone), sum(e[6] for e in everyone)
    out.update(reward_metrics(cat(1), mask_BxT, cat(3) == 0, n_failed_all, n_skipped_all, weights))
    out["rollout/tokens_per_s"] = float(mask_BxT.sum()) / max(out["rollout/seconds"], 1e-9)
    out.update(staleness_metrics(cat(4), version))
    return out


def engine_metrics(engine: Engine, counts_before: dict, groups: list[Group], version: int) -> dict:
    """The engine's part of a step's metrics: its work since `counts_before`, what it carries to the
    next step, and the staleness of the step's tokens (version - the version that drew each token)."""
    version_BxT = np.concatenate([g.version_GxT for g in groups])
    # restarted_samples: samples dropped by the staleness bound and redrawn from their prompt;
    # reprefilled_samples: carried samples whose caches were recomputed under the new params;
    # drafted / accepted: speculation's draft tokens offered and kept.
    out = {
        f"engine/{k}": engine.counts[k] - counts_before.get(k, 0)
        for k in ("chunks", "prefill_calls", "restarted_samples", "reprefilled_samples", "drafted", "accepted")
        if k in engine.counts
    }
    out["engine/in_flight_groups"] = engine.groups_in_flight
    out.update(staleness_metrics(version_BxT, version))
    return out


def staleness_metrics(version_BxT: np.ndarray, version: int) -> dict:
    """The staleness of a step's tokens (version - the version that drew each; -1 = no token) and the
    share of rows whose tokens span versions."""
    stale = (version - version_BxT)[version_BxT >= 0]
    spans_B = [len(np.unique(v[v >= 0])) > 1 for v in version_BxT]
    out = {
        "engine/partial_frac": float(np.mean(spans_B)),
        "engine/staleness_mean": float(stale.mean()) if stale.size else 0.0,
        "engine/staleness_max": int(stale.max()) if stale.size else 0,
    }
    for k in range(3):  # the staleness histogram: share of tokens 0, 1, >= 2 versions old
        share = (stale >= k).mean() if k == 2 else (stale == k).mean()
        out[f"engine/staleness_{k}{'+' if k == 2 else ''}"] = float(share) if stale.size else 0.0
    return out
