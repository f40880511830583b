"""Host-side speculation control of a training run: what the next speculative rollout starts from.

`SpecControl` is the explicit state carried from one rollout to the next: the two acceptance
estimates (self-drafted and reused tokens) and the step costs, fixed for the run. After a rollout
`updated` is a pure function of the control and the rollout's SpecStats; `speculate_now` decides,
before a rollout, whether it speculates at all. The control goes into every checkpoint's JSON item
(`control_state`), so a resumed run speculates exactly where an uninterrupted one would.
"""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.config import Config, SpeculativeConfig
from jaxrl.multihost import is_primary
from jaxrl.rollout.speculative.calibrate import (
    StepCosts,
    cached_step_costs,
    constant_costs,
    costs_from_json,
    costs_to_json,
    widest_draft,
)
from jaxrl.rollout.speculative.sample import worth_speculating
from jaxrl.rollout.speculative.steps import SpecStats


class SpecControl(NamedTuple):
    prior: float  # the self-draft acceptance estimate the next rollout starts from
    reuse_prior: float  # the reused-token acceptance estimate the next rollout starts from
    costs: StepCosts | None  # measured step costs (None: the configured constants); never change in a run


def restored_control(host: dict, spec: SpeculativeConfig, costs: StepCosts | None) -> SpecControl:
    """The control of a checkpoint's JSON item `host` ({} for a fresh run: the configured prior)."""
    return SpecControl(
        float(host.get("spec_prior", spec.initial_acceptance)),
        float(host.get("spec_reuse_prior", spec.initial_acceptance)),
        costs,
    )


def updated(control: SpecControl, stats: SpecStats | None) -> SpecControl:
    """After a rollout: its final acceptance estimates become the next one's priors. A plain
    (non-speculative) rollout measured nothing (stats None) and leaves the control as it was."""
    if stats is None:
        return control
    return control._replace(prior=float(stats.acceptance), reuse_prior=float(stats.reuse_acceptance))


def control_state(control: SpecControl) -> dict:
    """The control's part of the checkpoint's JSON item (keys read by `restored_control` and
    `speculative_costs`; the same keys in every checkpoint written so far)."""
    saved: dict[str, Any] = {"spec_prior": control.prior, "spec_reuse_prior": control.reuse_prior}
    if control.costs is not None:
        saved["spec_costs"] = costs_to_json(control.costs)
    return saved


def rollout_inputs(control: SpecControl) -> dict:
    """The speculative sampler's host inputs besides the drafts: the priors and (measured) costs."""
    out: dict[str, Any] = {
        "acceptance_prior": np.float32(control.prior),
        "reuse_acceptance_prior": np.float32(control.reuse_prior),
    }
    if control.costs is not None:
        out["costs"] = control.costs
    return out


def speculate_now(
    control: SpecControl,
    spec: SpeculativeConfig,
    step: int,
    all_draft_lengths: Callable[[], np.ndarray | None] = lambda: None,
) -> bool:
    """Every probe_every-th rollout speculates (fresh acceptance counts); the others only when
    speculation can gain at the control's estimates. all_draft_lengths() (reuse only): every row's
    reused draft length; called only when needed, as it gathers across processes, which must all
    decide alike."""
    if (step - 1) % spec.probe_every == 0:
        return True
    costs = control.costs if control.costs is not None else constant_costs(spec)
    return worth_speculating(costs, spec, control.prior, control.reuse_prior, all_draft_lengths())


def speculative_costs(cfg: Config, model_cfg, params, host: dict, n_rows: int, cache_dir: pathlib.Path):
    """The step costs the speculation control uses (None: the configured constants): a resumed run's
    checkpointed ones, else this machine's cached measurement in `cache_dir` for the rollout shape
    (measured now if missing). Never re-timed within a run, so the wall clock does not pick the
    sampled tokens."""
    spec = cfg.rollout.speculative
    if not (spec.enabled and spec.calibrate):
        return None
    if "spec_costs" in host:
        costs, where = costs_from_json(host["spec_costs"]), "from the checkpoint"
    else:
        cache_len = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens + widest_draft(spec) + 1
        costs, where = constant_costs(spec), ""
        if is_primary():  # the other processes take process 0's costs
            costs, path, measured = cached_step_costs(params, model_cfg, spec, n_rows, cache_len, cache_dir)
            where = f"{'measured now, saved to' if measured else 'cached in'} {path}"
        if jax.process_count() > 1:  # every process must feed the rollout the same (replicated) costs
            from jax.experimental import multihost_utils

            costs = jax.tree.map(jnp.asarray, multihost_utils.broadcast_one_to_all(jax.tree.map(np.asarray, costs)))
    if is_primary():
        verify = ", ".join(f"{float(c):.2f}" for c in np.asarray(costs.verify_K))
        print(
            f"jaxrl: speculative costs on this machine ({where}), in plain decode steps: "
            f"verify k=1..{widest_draft(spec)} drafts [{verify}], one drafted token {float(costs.draft):.2f}"
            + ("" if can_ever_pay(costs, spec) else f"; {stays_off(spec)}"),
            file=sys.stderr,
        )
    return costs


def can_ever_pay(costs: StepCosts, spec: SpeculativeConfig) -> bool:
    """Could any speculative step beat a plain one at these costs with every draft accepted?"""
    whole_reuse_drafts_N = np.full((1,), spec.reuse_width) if spec.drafter == "reuse" else None
    return bool(worth_speculating(costs, spec, 0.999, 0.999, whole_reuse_drafts_N))


def stays_off(spec: SpeculativeConfig) -> str:
    """What a run does when the costs say speculation never pays."""
    never = "even with every draft accepted no speculative step beats a plain one here"
    if spec.probe_every <= 1:
        return f"{never}, yet rollout.speculative.probe_every=1 makes every rollout speculate"
    return (
        f"{never}, so rollouts run the plain sampler except one in {spec.probe_every} "
        "(rollout.speculative.probe_every), which speculates to re-measure acceptance"
    )
