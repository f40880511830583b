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
from jaxrl.data.stream import StreamState
from jaxrl.rollout.batch import RolloutBatch
from jaxrl.rollout.engine.driver import Engine
from jaxrl.rollout.engine.groups import Group, batch_of_groups
from jaxrl.rollout.speculative.draft_vocab import task_draft_ids
from jaxrl.sources.base import ARRAYS, Produced
from jaxrl.sources.filters import ScoredGroup, select_informative, selection_metrics
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
    `stream` is the position after the last prompt taken, `skipped` the over-long prompts passed."""

    def __init__(self, records, stream: StreamState, tokenizer, cfg: Config):
        self.records, self.stream, self.tokenizer, self.cfg, self.skipped = records, stream, tokenizer, cfg, 0

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        data = self.cfg.data
        recs, tok_1xP, mask_1xP, self.stream, n_skipped = next_prompts(
            self.records, self.stream, 1, self.tokenizer, data, data.seed
        )
        self.skipped += n_skipped
        return recs[0], tok_1xP[0][mask_1xP[0] > 0]


class EngineSource:
    """The step's groups from the slot engine, scored. One process only (the engine's slots are not
    split over processes); params may be laid out over the process's devices by any mesh preset.
    parallel (MoE): the run's `sharding.parallel_for(mesh, preset)`, as the update's."""

    def __init__(self, cfg: Config, model_cfg, tokenizer, task, host: dict, parallel=None):
        if jax.process_count() > 1:
            raise ConfigError(
                f"rollout.engine.enabled: the engine runs in one process; this run has "
                f"{jax.process_count()} (set rollout.engine.enabled=false)"
            )
        self.cfg, self.tokenizer, self.task = cfg, tokenizer, task
        rng = jax.random.fold_in(jax.random.key(cfg.train.seed), _ENGINE_KEY_SALT)
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
        if _ENGINE_ITEM in host:  # resumed: the samples in flight continue where the save left them
            self.engine.load_state(host[_ENGINE_ITEM], host.get(ARRAYS, {}).get(_ENGINE_ITEM))
        self.prompt_filter = BetaPromptFilter.from_config(cfg.rollout.engine, cfg.train.seed, host.get(_FILTER_KEY))

    def produce(self, params, stream: StreamState, rng, step: int) -> Produced:
        """`rng` is unused: the engine draws with its own key (its state), so that samples carried
        between steps keep one stream of noise. With dynamic sampling the reward/* metrics describe
        the groups in the batch; engine/dyn_* count the ones drawn and dropped."""
        del rng
        cfg, t0, counts0 = self.cfg, time.perf_counter(), dict(self.engine.counts)
        version = step - 1  # the number of updates the policy has had
        feed = PromptFeed(self.task.train, stream, self.tokenizer, cfg)
        pf = self.prompt_filter
        filter0 = (pf.n_filtered, pf.n_forced) if pf else (0, 0)
        prompts = pf.admitted(feed) if pf else feed  # the engine sees only the prompts the filter admits
        n_failed, picked, extra_metrics = self._draw(params, version, prompts)
        seconds = time.perf_counter() - t0
        host_batch = _batch_of(picked, version)
        mask_BxT, finished_B = host_batch.completion_mask_BxT, host_batch.truncated_B == 0
        metrics = reward_metrics(
            host_batch.rewards_BxK, mask_BxT, finished_B, n_failed, feed.skipped, cfg.loss.reward_weights
        )
        metrics.update({"rollout/tokens_per_s": float(mask_BxT.sum()) / max(seconds, 1e-9), "rollout/seconds": seconds})
        metrics.update(engine_metrics(self.engine, counts0, [s.group for s in picked], version))
        metrics.update({**extra_metrics, **(pf.metrics(filter0) if pf else {})})
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
        prompt filter's posteriors and generator."""
        host, arrays = self.engine.to_state()
        out = {_ENGINE_ITEM: host, ARRAYS: {_ENGINE_ITEM: arrays}}
        if self.prompt_filter:
            out[_FILTER_KEY] = self.prompt_filter.to_state()
        return out


def _batch_of(picked: list[ScoredGroup], version: int) -> RolloutBatch:
    """The step's groups as the update's batch (group_id_B included), rewards_BxK from their scores,
    stale_BxT from their tokens' versions (`version`: the step's; the update splits its log-prob
    mismatch by it)."""
    batch = batch_of_groups([s.group for s in picked]).with_staleness(version)
    return batch._replace(rewards_BxK=np.concatenate([s.rewards_GxK for s in picked]))


def engine_metrics(engine: Engine, counts_before: dict, groups: list[Group], version: int) -> dict:
    """The engine's part of a step's metrics: its work since `counts_before`, what it carries to the
    next step, and the staleness of the step's tokens (version - the version that drew each token)."""
    version_BxT = np.concatenate([g.version_GxT for g in groups])
    drawn_BxT = version_BxT >= 0
    stale = (version - version_BxT)[drawn_BxT]
    spans_B = [len(np.unique(v[v >= 0])) > 1 for v in version_BxT]
    # restarted_samples: samples dropped by the staleness bound and redrawn from their prompt;
    # reprefilled_samples: carried samples whose caches were recomputed under the new params;
    # drafted / accepted: speculation's draft tokens offered and kept.
    out = {
        f"engine/{k}": engine.counts[k] - counts_before.get(k, 0)
        for k in ("chunks", "prefill_calls", "restarted_samples", "reprefilled_samples", "drafted", "accepted")
        if k in engine.counts
    }
    out.update(
        {
            "engine/in_flight_groups": engine.groups_in_flight,
            "engine/partial_frac": float(np.mean(spans_B)),
            "engine/staleness_mean": float(stale.mean()) if stale.size else 0.0,
            "engine/staleness_max": int(stale.max()) if stale.size else 0,
        }
    )
    for k in range(3):  # the staleness histogram: share of tokens 0, 1, >= 2 versions old
        share = (stale >= k).mean() if k == 2 else (stale == k).mean()
        out[f"engine/staleness_{k}{'+' if k == 2 else ''}"] = float(share) if stale.size else 0.0
    return out
