"""The static sampler's side of the training loop: `SamplerSource`.

`SamplerSource` draws a step's B x T block with one jitted call of the static sampler
(jaxrl.rollout.sampler, or jaxrl.rollout.speculative.sample when rollout.speculative.enabled) for the
step's prompts. It owns how completions are drawn (the sampler, speculative drafters, the reuse draft
store, the speculation control and its cost estimates) and the host state they keep between steps:
`checkpoint_state()` returns it for the checkpoint's JSON item and the constructor takes it back
(`host`, {} for a fresh run). The loop reaches it through `jaxrl.sources.groups.StaticSource`.
"""

from __future__ import annotations

import pathlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.config import Config
from jaxrl.multihost import gather_rows, local_rows, process_rows, put_rows
from jaxrl.rollout.sampler import SamplingParams, sample
from jaxrl.rollout.speculative.control import (
    control_state,
    restored_control,
    rollout_inputs,
    speculate_now,
    speculative_costs,
    updated,
)
from jaxrl.rollout.speculative.drafters import check_self_drafter
from jaxrl.rollout.speculative.reuse import DraftStore, spec_metrics
from jaxrl.rollout.speculative.sample import sample_speculative
from jaxrl.sharding import batch_devices, batch_sharding, named_shardings, parallel_for, replicated


class Rollout(NamedTuple):
    """One step's completions, G per prompt (row i*G + g is completion g of prompt i): this
    process's rows (`process_rows` of the batch sharding), on the host."""

    tokens_BxT: np.ndarray  # int32; pad_id after EOS
    completion_mask_BxT: np.ndarray  # float32; 1 on real completion tokens including EOS
    logp_BxT: np.ndarray  # float32; log-prob under the sampling (behaviour) distribution, 0 where masked
    finished_B: np.ndarray  # bool; the row emitted EOS
    routing_BxSxLxK: jax.Array | None = None  # MoE only: the global array, laid out by its name


def prompt_sharding(mesh, preset, n_prompts: int):
    """The step's prompts split over the batch axes when they divide (else replicated); the completion
    rows always are (`rollout.prompts_per_step*group_size` is checked to divide)."""
    return batch_sharding(mesh, preset) if n_prompts % batch_devices(mesh, preset) == 0 else replicated(mesh)


def jit_plain_rollout(model_cfg, sample_kw: dict, mesh, preset, param_sh, prompt_sh, args: tuple):
    """The static sampler jitted on the run's layout: (params, prompt_BxP, prompt_mask_BxP, rng) ->
    SampleOutput laid out by field name; `args` (abstract is enough) give the output's shapes.
    `jaxrl plan` compiles this same program."""
    ep = parallel_for(mesh, preset)  # MoE: the experts' mesh axis, as the update's (`make_logp_fn`)

    def rollout(p, t, m, r):
        return sample(p, model_cfg, t, m, r, **sample_kw, parallel=ep)

    out_sh = named_shardings(mesh, preset, jax.eval_shape(rollout, *args))
    return jax.jit(rollout, in_shardings=(param_sh, prompt_sh, prompt_sh, replicated(mesh)), out_shardings=out_sh)


class SamplerSource:
    """The static sampler; speculative (with its host-side control) when configured.
    `produce(params, prompt_BxP, prompt_mask_BxP, rng, step) -> (Rollout, metrics)`: completions for
    the step's prompts (every process passes all prompt rows) and the rollout's metrics, in order."""

    def __init__(
        self,
        cfg: Config,
        model_cfg,
        tokenizer,
        mesh,
        preset,
        param_sh,
        params,
        rng,
        host: dict,
        cost_cache_dir: pathlib.Path,
    ):
        """params/rng: the state's (shapes for the jitted rollouts, and the policy the step costs are
        measured with when not cached); host: the restored checkpoint's JSON item ({} when fresh)."""
        rc, self.spec = cfg.rollout, cfg.rollout.speculative
        self.G, self.T, self.pad_id = rc.group_size, rc.max_new_tokens, tokenizer.pad_id
        self.n_prompts, self.B = rc.prompts_per_step, rc.prompts_per_step * rc.group_size
        self.rows_sh = batch_sharding(mesh, preset)
        self.prompt_sh = prompt_sharding(mesh, preset, self.n_prompts)
        self.drafts = None
        if self.spec.enabled and self.spec.drafter == "reuse":  # the store is checkpointed: a resume drafts alike
            self.drafts = DraftStore.from_state(host["spec_drafts"]) if "spec_drafts" in host else DraftStore()
        if self.spec.enabled:
            check_self_drafter(model_cfg, self.spec)  # before the costs are measured with it
        costs = speculative_costs(cfg, model_cfg, params, host, self.B, cost_cache_dir)
        self.control = restored_control(host, self.spec, costs)
        sample_kw = dict(
            sampling=SamplingParams.of_rollout(rc, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id),
            group_size=self.G,
        )
        self._jit(model_cfg, sample_kw, mesh, preset, param_sh, params, rng, cfg.data.max_prompt_len)
        self.prompt_rows, self.rows = process_rows(self.prompt_sh, self.n_prompts), process_rows(self.rows_sh, self.B)

    def _jit(self, model_cfg, sample_kw: dict, mesh, preset, param_sh, params, rng, width: int) -> None:
        """The jitted rollout (speculative when enabled) and, with speculation on, the plain sampler
        for rollouts that cannot gain (speculate_now); both on the state's (sharded) params."""
        spec, rep = self.spec, replicated(mesh)
        ep = parallel_for(mesh, preset)  # MoE: the experts' mesh axis, as the update's (`make_logp_fn`)

        def rollout_fn(params, prompt_BxP, prompt_mask_BxP, rng, spec_in):
            """spec_in (speculative only): the acceptance priors and the reuse drafts; -> (SampleOutput, SpecStats)."""
            if not spec.enabled:
                return sample(params, model_cfg, prompt_BxP, prompt_mask_BxP, rng, **sample_kw, parallel=ep), None
            return sample_speculative(
                params,
                model_cfg,
                prompt_BxP,
                prompt_mask_BxP,
                rng,
                spec=spec,
                **sample_kw,
                **spec_in,
                parallel=ep,
            )

        prompts_spec = jax.ShapeDtypeStruct((self.n_prompts, width), jnp.int32)
        spec_abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
            self._spec_inputs(np.zeros((self.n_prompts, 1), np.int32), np.zeros((self.n_prompts, 1), bool)),
        )
        self.spec_sh = {k: self.rows_sh if k.startswith("draft") else rep for k in spec_abstract}
        out_abstract, _ = jax.eval_shape(rollout_fn, params, prompts_spec, prompts_spec, rng, spec_abstract)
        out_sh = named_shardings(mesh, preset, out_abstract)
        self._rollout = jax.jit(
            rollout_fn,
            in_shardings=(param_sh, self.prompt_sh, self.prompt_sh, rep, self.spec_sh),
            out_shardings=(out_sh, rep if spec.enabled else None),
        )
        self._rollout_plain = jit_plain_rollout(
            model_cfg, sample_kw, mesh, preset, param_sh, self.prompt_sh, (params, prompts_spec, prompts_spec, rng)
        )

    def _spec_inputs(self, prompt_BxP, prompt_mask_BxP) -> dict:
        """The speculative rollout's host inputs (all rows): the control's priors and costs, and the
        reuse drafts looked up for these prompts. {} without speculation."""
        if not self.spec.enabled:
            return {}
        out = rollout_inputs(self.control)
        if self.drafts is not None:
            d, n, lp = self.drafts.lookup(prompt_BxP, prompt_mask_BxP, self.G, self.T, self.pad_id)
            out.update(draft_NxT=d, draft_len_N=n, draft_logp_NxT=lp)
        return out

    def produce(self, params, prompt_BxP, prompt_mask_BxP, rng, step: int) -> tuple[Rollout, dict]:
        # Every process walks the same prompts; each feeds the devices only its own rows.
        spec_host = self._spec_inputs(prompt_BxP, prompt_mask_BxP)
        prompts_in = (
            put_rows(self.prompt_sh, prompt_BxP[self.prompt_rows], self.n_prompts),
            put_rows(self.prompt_sh, prompt_mask_BxP[self.prompt_rows], self.n_prompts),
        )

        # The rows' draft lengths (reuse), gathered from the process that holds each: only when needed.
        def all_draft_lengths():
            return (
                None if self.drafts is None else gather_rows(self.rows_sh, spec_host["draft_len_N"][self.rows], self.B)
            )

        if self.spec.enabled and not speculate_now(self.control, self.spec, step, all_draft_lengths):
            out, stats = self._rollout_plain(params, *prompts_in, rng), None
        else:
            spec_in = {
                k: put_rows(self.spec_sh[k], v[self.rows], self.B) if k.startswith("draft") else v
                for k, v in spec_host.items()
            }
            out, stats = self._rollout(params, *prompts_in, rng, spec_in)
        rollout = Rollout(
            local_rows(out.tokens_BxT),
            local_rows(out.completion_mask_BxT),
            local_rows(out.logp_BxT),
            local_rows(out.finished_B),
            out.routing_BxSxLxK,
        )
        metrics = {"rollout/decode_steps": int(out.num_steps)}
        metrics.update(self._observe(stats, prompt_BxP, prompt_mask_BxP, rollout))
        return rollout, metrics

    def _observe(self, stats, prompt_BxP, prompt_mask_BxP, rollout: Rollout) -> dict:
        """After a rollout: its spec/* metrics, the control's update, the reuse drafts' update."""
        metrics = {}
        if stats is not None:
            metrics.update(spec_metrics(stats))
        elif self.spec.enabled:
            metrics["spec/speculated_frac"] = 0.0
        self.control = updated(self.control, stats)
        if self.drafts is not None:  # every process stores all rows, so process 0's checkpoint holds them

            def all_rows(x_B):
                return gather_rows(self.rows_sh, x_B, self.B)

            self.drafts.update(
                prompt_BxP,
                prompt_mask_BxP,
                all_rows(rollout.tokens_BxT),
                all_rows(rollout.completion_mask_BxT.sum(1).astype(np.int32)),
                all_rows(rollout.logp_BxT),
                self.G,
            )
        return metrics

    def checkpoint_state(self) -> dict:
        saved = control_state(self.control)  # spec_prior, spec_reuse_prior[, spec_costs]
        if self.drafts is not None:
            saved["spec_drafts"] = self.drafts.to_state()
        return saved
