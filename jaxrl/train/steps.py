"""The jitted steps of the pipeline: policy log-probs, gradients over microbatches, the update.

`update_step(state, batch) -> (state, metrics)` is pure. On the whole batch it records the old
log-probs (several PPO epochs, or `needs_old_logp`) and the reference log-probs (`needs_ref`), then runs
`jaxrl.losses.evaluate.prepare_batch` (advantages, `loss.prepare`, weights); only then does it split
into microbatches, each evaluated by `weighted_loss`. So the `lax.scan` over microbatches sums to
exactly the full-batch loss and gradient, the ones `jaxrl.losses.evaluate_loss` gives, and the metrics
are reduced as `evaluate_loss`'s are. MoE models: the logp function also returns the router losses
(added with the model's coefficients) and replays the rollout's `routing_BxSxLxK` when the batch
carries it (`moe/routing_mismatch`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxrl.config import ModelConfig
from jaxrl.losses import Loss
from jaxrl.losses.aggregation import (
    empty_stat_partials,
    finalize_stats,
    mean_stat_partials,
    merge_stat_partials,
    stat_partials,
)
from jaxrl.losses.evaluate import prepare_batch, weighted_loss
from jaxrl.losses.regularizers import kl_k3
from jaxrl.models.moe import routing_mismatch
from jaxrl.models.packing import PackSpec
from jaxrl.models.parallel import Parallel
from jaxrl.models.shared_prefix import token_logprobs_shared
from jaxrl.models.transformer import token_logprobs
from jaxrl.train.packed_steps import PackedLogp, packed_logp, value_and_grad_of
from jaxrl.train.state import TrainState

# (params, batch) -> (logp_BxT, entropy_BxT) or, for MoE, (logp_BxT, entropy_BxT, extras dict).
LogpFn = Callable[[Any, dict], tuple]
MOE_SCALARS = ("moe/aux_loss", "moe/z_loss", "moe/dropped_frac")  # per-microbatch scalars, averaged
PACKING_SCALARS = ("packing/fallback", "packing/fill")  # likewise, from a packed forward


def make_logp_fn(
    model_cfg: ModelConfig,
    temperature: float,
    routing_replay: bool = False,
    prompt_groups: int = 0,
    *,
    logits_chunk: int = 0,
    remat: str = "none",
    parallel: Parallel | None = None,
    packing: PackSpec | None = None,
) -> LogpFn:
    """(params, batch) -> (logp_BxT, entropy_BxT) of the batch's completions at the sampling temperature.
    `logits_chunk` and `remat`: the forward's memory options (`transformer.token_logprobs`).

    `prompt_groups` = G > 1 promises that rows g*G .. g*G+G-1 of every batch this function sees hold
    one identical prompt (tokens and mask): a dense model then forwards each prompt once
    (`shared_prefix.token_logprobs_shared`, same values and gradients) whenever the batch (or
    microbatch: rows stay in order) is a whole number of groups; otherwise, and for MoE, the one-pass
    forward. 0 (or 1): no promise, the one-pass forward.

    MoE: a third output, {"penalty": aux_coef * aux + z_coef * z, MOE_SCALARS..., and with a recorded
    routing "moe/routing_mismatch_BxT"}; with `routing_replay` the batch's routing is replayed.
    `parallel`: the experts' mesh axis (`sharding.parallel`), the one the rollout is given.

    `packing` (dense models; None: off): a `packed_steps.PackedLogp`, the live tokens packed into N
    sequences of L slots (`models.packing`) wherever `PackSpec.use` says, unpacked where they do not
    fit, with a third output of `PACKING_SCALARS`."""
    if packing is not None and model_cfg.n_experts:
        raise ValueError("train.packing: dense models only (MoE routing with capacity depends on the packs); use 'off'")

    def shared(batch) -> bool:  # shapes are static: a trace-time choice
        return prompt_groups > 1 and batch["prompt_tokens_BxP"].shape[0] % prompt_groups == 0

    def padded(params, batch, replay=None, return_moe=False):  # the one-pass forward
        return token_logprobs(
            params,
            model_cfg,
            batch["prompt_tokens_BxP"],
            batch["prompt_mask_BxP"],
            batch["tokens_BxT"],
            batch["completion_mask_BxT"],
            temperature,
            replay,
            logits_chunk=logits_chunk,
            remat=remat,
            parallel=parallel,
            return_moe=return_moe,
        )

    if not model_cfg.n_experts:

        def logp_fn(params, batch):
            if shared(batch):
                return token_logprobs_shared(
                    params,
                    model_cfg,
                    batch["prompt_tokens_BxP"],
                    batch["prompt_mask_BxP"],
                    batch["tokens_BxT"],
                    temperature,
                    group_size=prompt_groups,
                    logits_chunk=logits_chunk,
                    remat=remat,
                    parallel=parallel,
                )
            return padded(params, batch)

        if packing is None:
            return logp_fn
        return packed_logp(
            model_cfg,
            temperature,
            packing,
            logp_fn,
            shared=shared,
            logits_chunk=logits_chunk,
            remat=remat,
            parallel=parallel,
        )

    def moe_logp_fn(params, batch):
        routing = batch.get("routing_BxSxLxK")
        logp_BxT, entropy_BxT, moe = padded(params, batch, routing if routing_replay else None, return_moe=True)
        extras = {
            "penalty": model_cfg.moe_aux_coef * moe.aux_loss + model_cfg.moe_z_coef * moe.z_loss,
            "moe/aux_loss": moe.aux_loss,
            "moe/z_loss": moe.z_loss,
            "moe/dropped_frac": moe.dropped_frac,
        }
        if routing is not None:
            P, T = batch["prompt_tokens_BxP"].shape[1], batch["tokens_BxT"].shape[1]
            extras["moe/routing_mismatch_BxT"] = routing_mismatch(routing, moe.topk_LxBxTxK, P - 1, T)
        return logp_BxT, entropy_BxT, extras

    return moe_logp_fn


def split_microbatches(batch: dict, n: int, parallel: Parallel | None = None) -> dict:
    """B-leading arrays -> (n, B/n, ...): rows stay in order, so groups stay adjacent. With `parallel`,
    each microbatch's rows are split over the batch devices (`Parallel.rows_of`): the one exchange of
    the batch's rows that keeps every device on its own share of every microbatch (a contiguous split
    of a batch already split by devices would leave each microbatch on B/n of them)."""
    mbs = jax.tree.map(lambda x: x.reshape((n, x.shape[0] // n) + x.shape[1:]), batch)
    return mbs if parallel is None else parallel.rows_of(mbs, leading=1)


def merge_microbatches(x):
    return jax.tree.map(lambda a: a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:]), x)


def microbatched_logp(logp_fn: LogpFn, params, batch: dict, n: int, parallel: Parallel | None = None):
    """Log-probs of the whole batch computed n rows-chunks at a time (bounded activation memory)."""
    mbs = split_microbatches(batch, n, parallel)
    _, out = lax.scan(lambda c, mb: (c, tuple(logp_fn(params, mb)[:2])), None, mbs)
    return merge_microbatches(out)


def make_grad_fn(
    logp_fn: LogpFn,
    loss: Loss,
    *,
    microbatches: int,
    old_logp_recorded: bool,
    detailed_stats: bool = False,
    parallel: Parallel | None = None,
):
    """(params, batch with weights_BxT) -> (loss, grads, stat partials). Exact full-batch gradient.

    When the batch carries no recorded old log-probs (one PPO epoch on fresh samples), the old
    policy IS the current one, so old = stop_gradient(current): the ratio is 1 with the PPO gradient.

    stat partials (`aggregation.stat_partials`, merged exactly across microbatches): every per-token
    stat of the loss, plus "entropy" and (with ref_logp_BxT) "kl"; with `detailed_stats` and a batch
    with rollout_logp_BxT, "mismatch_abs_logp" = |rollout_logp - old_logp| (and, with stale_BxT, its
    share on stale tokens "mismatch_abs_logp_stale" and "stale_tokens"); for MoE the router scalars
    (counted once per microbatch) and, with a recorded routing, "moe/routing_mismatch"; for a packed
    forward the `PACKING_SCALARS` (likewise once per microbatch).
    """

    def loss_of(logp_fn: LogpFn):
        return lambda params, mb: microbatch_loss(params, mb, logp_fn)

    def microbatch_loss(params, mb, logp_fn=logp_fn):
        out = logp_fn(params, mb)
        logp_BxT, entropy_BxT = out[0], out[1]
        extras = out[2] if len(out) > 2 else {}
        mb = dict(mb, entropy_BxT=entropy_BxT)
        if not old_logp_recorded:
            mb["old_logp_BxT"] = lax.stop_gradient(logp_BxT)
        value, stats = weighted_loss(loss, logp_BxT, mb)
        mask_BxT = mb["completion_mask_BxT"]
        own = {"entropy": entropy_BxT}
        if "ref_logp_BxT" in mb:  # drift from the reference, reported whether or not the loss uses it
            own["kl"] = kl_k3(lax.stop_gradient(logp_BxT), mb["ref_logp_BxT"])
        if detailed_stats and "rollout_logp_BxT" in mb:  # sampler vs trainer (old) policy on the sampled tokens
            gap_BxT = jnp.abs(mb["rollout_logp_BxT"] - lax.stop_gradient(mb["old_logp_BxT"]))
            own["mismatch_abs_logp"] = gap_BxT
            if "stale_BxT" in mb:  # partial rollouts: the same over tokens drawn by an older version
                own["mismatch_abs_logp_stale"] = jnp.where(mb["stale_BxT"] > 0, gap_BxT, 0.0)
                own["stale_tokens"] = (mb["stale_BxT"] > 0).astype(jnp.float32)
        if "penalty" in extras:  # MoE router losses: the mean over microbatches joins the loss
            value = value + extras["penalty"] / microbatches
        own.update({k: extras[k] for k in (*MOE_SCALARS, *PACKING_SCALARS) if k in extras})
        if "moe/routing_mismatch_BxT" in extras:
            own["moe/routing_mismatch"] = extras["moe/routing_mismatch_BxT"]
        token_stats = {k: v for k, v in stats.items() if v.shape == mask_BxT.shape}
        return value, stat_partials({**own, **token_stats}, mask_BxT)

    grad_one = value_and_grad_of(logp_fn, loss_of)  # a PackedLogp: its switch outside each arm's gradient

    def grad_fn(params, batch):
        def accumulate(carry, mb):
            (value, partials), grads = grad_one(params, mb)
            g_acc, v_acc, p_acc = carry
            return (jax.tree.map(jnp.add, g_acc, grads), v_acc + value, merge_stat_partials(p_acc, partials)), None

        mbs = split_microbatches(batch, microbatches, parallel)
        first = jax.tree.map(lambda x: x[0], mbs)
        partials_shape = jax.eval_shape(lambda p, mb: microbatch_loss(p, mb)[1], params, first)
        init = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32), empty_stat_partials(partials_shape))
        (grads, value, partials), _ = lax.scan(accumulate, init, mbs)
        return value, grads, partials

    return grad_fn


def mismatch_by_staleness(metrics: dict) -> dict:
    """Token means over all live tokens (sum / n) -> the mismatch split: mismatch_abs_logp_stale /
    _fresh = mean |rollout - old logp| over the tokens an older (the current) version drew, 0 where
    there are none, and stale_tokens = their share."""
    share, all_mean = metrics["stale_tokens"], metrics["mismatch_abs_logp"]
    stale_mean = metrics["mismatch_abs_logp_stale"]

    def safe(num, den):
        return jnp.where(den > 0, num / jnp.maximum(den, 1e-12), 0.0)

    return {
        "mismatch_abs_logp_stale": safe(stale_mean, share),
        "mismatch_abs_logp_fresh": safe(all_mean - stale_mean, 1.0 - share),
        "stale_tokens": share,
    }


def _epochs(
    grads_of: Callable,
    optimizer,
    carry: tuple,
    batch: dict,
    ppo_epochs: int,
    minibatches: int,
    split,
    critic_step: Callable | None = None,
):
    """`ppo_epochs` passes over the prepared batch, each taking one optimizer step per mini-batch: a
    contiguous 1/minibatches of the rows (DAPO's and verl's mini-batches; `split` makes them), whose
    advantages and `loss.prepare` saw the whole batch and whose normaliser `loss.weights` sees its own
    mask; `grads_of` splits each into microbatches for gradient accumulation. carry: (params,
    opt_state, critic state or None); with `critic_step` (`critic.CriticUpdate.step`) the critic is
    stepped on the same mini-batch at the same policy params (its policy gradient, under a shared
    trunk, added to the policy's). -> (carry, (loss per epoch, mean gradient norm per epoch, stat
    partials per epoch))."""

    def optimizer_step(carry, minibatch):
        params, opt_state, critic = carry
        value, grads, partials = grads_of(params, minibatch)
        if critic_step is not None:
            critic, trunk_grads, critic_partials = critic_step(critic, params, minibatch)
            partials = {**partials, **critic_partials}
            if trunk_grads is not None:
                grads = jax.tree.map(jnp.add, grads, trunk_grads)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, critic), (value, grad_norm, partials)

    def merging_step(carry, minibatch):  # the mini-batches' partials merge as the steps go
        carry, partials = carry
        carry, (value, grad_norm, part) = optimizer_step(carry, minibatch)
        return (carry, merge_stat_partials(partials, part)), (value, grad_norm)

    def epoch(carry, _):
        if minibatches == 1:
            return optimizer_step(carry, batch)
        minibatches_M = split(batch)
        first = jax.tree.map(lambda x: x[0], minibatches_M)
        empty = empty_stat_partials(jax.eval_shape(optimizer_step, carry, first)[1][2])
        (carry, partials), (values_M, norms_M) = lax.scan(merging_step, (carry, empty), minibatches_M)
        return carry, (jnp.mean(values_M), jnp.mean(norms_M), partials)

    return lax.scan(epoch, carry, None, length=ppo_epochs)


def _check_critic(loss: Loss, critic: Any) -> None:
    if loss.needs_critic and critic is None:
        raise ValueError(f"loss {loss.name!r} needs a value model (GAE): pass critic=make_critic_update(...)")


def _with_old_values(critic: Any, state: TrainState, batch: dict) -> dict:
    """The critic's values of the rollout's states (old_values_BxT), once, before GAE reads them."""
    critic_state: Any = state.critic
    if critic is None:
        return batch
    return dict(batch, old_values_BxT=critic.old_values(critic_state.params, state.params, batch))


def _with_critic_targets(critic: Any, batch: dict) -> tuple[dict, dict]:
    """(the prepared batch with the critic's targets, the critic's once-per-batch metrics); no critic:
    the batch as it is, no metrics."""
    return (batch, {}) if critic is None else critic.targets(batch)


def _on_merged(logp_fn: LogpFn, merge: Callable, base: Any) -> LogpFn:
    """(adapters, batch) -> logp_fn(merge(base, adapters), batch): LoRA's policy, differentiable in the
    adapters only."""
    if isinstance(logp_fn, PackedLogp):
        return logp_fn.map(lambda arm: _on_merged(arm, merge, base))
    return lambda adapters, batch: logp_fn(merge(base, adapters), batch)


def make_update_step(
    logp_fn: LogpFn,
    loss: Loss,
    optimizer: optax.GradientTransformation,
    *,
    ppo_epochs: int,
    microbatches: int,
    max_new_tokens: int,
    group_size: int,
    use_ref: bool | None = None,
    merge: Callable | None = None,
    minibatches: int = 1,
    parallel: Parallel | None = None,
    critic: Any = None,
):
    """Returns the pure update_step(state, batch) -> (state, metrics); jit it with donation.

    `batch`: the rollout's rows (rewards_BxK, not advantages: `prepare_batch` computes them), B a
    multiple of `group_size` (any B when the batch carries `group_id_B`: groups by id) and completions
    `max_new_tokens` wide (a ValueError naming both otherwise, at trace time). Old log-probs (and the old
    policy's entropies, `old_entropy_BxT`) are recorded for the whole batch before anything else when
    ppo_epochs > 1, minibatches > 1 or `loss.needs_old_logp`. Mini-batches: see `_epochs`.
    The reference forward (on `state.ref_params`) runs when `use_ref`, by default `loss.needs_ref`;
    `use_ref=True` without a KL term only adds the `kl` metric.
    LoRA (`merge` given: (base, adapters or None) -> params, `jaxrl.train.lora_state.merge_fn`): the
    state's params are the adapters, gradients and optimizer cover them only, every policy forward
    reads merge(state.base, adapters) and the reference forward merge(state.base, None).
    `critic` (`jaxrl.train.critic.CriticUpdate`, with `state.critic` its state): the critic's old
    values on the whole batch before `prepare_batch` (old_values_BxT), its targets after it, and one
    critic optimizer step beside each policy step (`_epochs`); a loss with `needs_critic` requires it.

    metrics: docs/metrics.md ("The update", "The loss's per-token stats", "Mixture of experts") lists
    them. Means are over the live tokens of the PREPARED mask, averaged over epochs; min / max over all.
    """
    record_old = ppo_epochs > 1 or minibatches > 1 or bool(getattr(loss, "needs_old_logp", False))
    if use_ref is None:
        use_ref = loss.needs_ref
    elif loss.needs_ref and not use_ref:
        raise ValueError(f"use_ref=False, but loss {loss.name!r} needs the reference log-probs (a KL term)")
    _check_critic(loss, critic)

    def grad_fn_for(policy_logp_fn: LogpFn):
        return make_grad_fn(
            policy_logp_fn,
            loss,
            microbatches=microbatches,
            old_logp_recorded=record_old,
            detailed_stats=True,
            parallel=parallel,
        )

    grad_fn = grad_fn_for(logp_fn)

    def split_minibatches(batch):  # each mini-batch normalised over its own live tokens
        mbs = split_microbatches(batch, minibatches, parallel)
        return dict(mbs, weights_BxT=jax.vmap(loss.weights, (0, None))(mbs["completion_mask_BxT"], max_new_tokens))

    def update_step(state: TrainState, batch: dict):
        batch = dict(batch)
        live_before_B = jnp.any(batch["completion_mask_BxT"] > 0, axis=1)
        policy_logp_fn, grads_of = logp_fn, grad_fn
        if merge is not None:  # LoRA: params are the adapters; the base is frozen state, not a variable
            policy_logp_fn = _on_merged(logp_fn, merge, state.base)
            grads_of = grad_fn_for(policy_logp_fn)
        if record_old:  # old log-probs recorded once, before the first epoch
            old_logp_BxT, old_entropy_BxT = microbatched_logp(
                policy_logp_fn, state.params, batch, microbatches, parallel
            )
            batch["old_logp_BxT"] = lax.stop_gradient(old_logp_BxT)
            batch["old_entropy_BxT"] = lax.stop_gradient(old_entropy_BxT)
        if use_ref:
            ref_params = state.ref_params if merge is None else merge(state.base, None)
            if ref_params is None:
                raise ValueError(
                    "the update uses a reference policy but state.ref_params is None: create the "
                    "state with ref_params (jaxrl.train.state.init_state)"
                )
            batch["ref_logp_BxT"] = lax.stop_gradient(
                microbatched_logp(logp_fn, ref_params, batch, microbatches, parallel)[0]
            )
        batch = _with_old_values(critic, state, batch)
        batch = prepare_batch(loss, batch, group_size=group_size, max_new_tokens=max_new_tokens)
        mask_BxT = batch["completion_mask_BxT"]
        batch, critic_metrics = _with_critic_targets(critic, batch)
        carry = (state.params, state.opt_state, state.critic)  # the critic's state is stepped only when given

        carry, (values, grad_norms, partials_E) = _epochs(
            grads_of,
            optimizer,
            carry,
            batch,
            ppo_epochs,
            minibatches,
            split_minibatches,
            None if critic is None else critic.step,
        )
        params, opt_state = carry[0], carry[1]
        metrics = {"loss": jnp.mean(values), "grad_norm": grad_norms[0], **critic_metrics}
        metrics.update(finalize_stats(mean_stat_partials(partials_E)))
        if "stale_tokens" in metrics:
            metrics.update(mismatch_by_staleness(metrics))
        live_after_B = jnp.any(mask_BxT > 0, axis=1)
        metrics["rows_dropped"] = jnp.sum((live_before_B & ~live_after_B).astype(jnp.float32)) / jnp.maximum(
            jnp.sum(live_before_B.astype(jnp.float32)), 1.0
        )
        new_state = state._replace(step=state.step + 1, params=params, opt_state=opt_state, critic=carry[-1])
        return new_state, metrics

    return update_step
