"""The jitted steps of the pipeline: policy log-probs, gradients over microbatches, the update.

`update_step(state, batch) -> (state, metrics)` is pure. Aggregation weights come from the whole
batch before it is split, so the `lax.scan` over microbatches sums to exactly the full-batch loss
and gradient.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxrl.config import ModelConfig
from jaxrl.losses import Loss
from jaxrl.losses.regularizers import kl_k3
from jaxrl.models.transformer import token_logprobs
from jaxrl.train.state import TrainState

LogpFn = Callable[[Any, dict], tuple[jax.Array, jax.Array]]


def make_logp_fn(model_cfg: ModelConfig, temperature: float) -> LogpFn:
    """(params, batch) -> (logp_BxT, entropy_BxT) of the batch's completions at the sampling temperature."""

    def logp_fn(params, batch):
        return token_logprobs(params, model_cfg, batch["prompt_tokens_BxP"], batch["prompt_mask_BxP"],
                              batch["tokens_BxT"], batch["completion_mask_BxT"], temperature)

    return logp_fn


def split_microbatches(batch: dict, n: int) -> dict:
    """B-leading arrays -> (n, B/n, ...): rows stay in order, so groups stay adjacent."""
    return jax.tree.map(lambda x: x.reshape((n, x.shape[0] // n) + x.shape[1:]), batch)


def merge_microbatches(x):
    return jax.tree.map(lambda a: a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:]), x)


def microbatched_logp(logp_fn: LogpFn, params, batch: dict, n: int):
    """Log-probs of the whole batch computed n rows-chunks at a time (bounded activation memory)."""
    _, out = lax.scan(lambda c, mb: (c, logp_fn(params, mb)), None, split_microbatches(batch, n))
    return merge_microbatches(out)


def make_grad_fn(logp_fn: LogpFn, loss: Loss, *, microbatches: int, old_logp_recorded: bool):
    """(params, batch with weights_BxT) -> (loss, grads, stat_sums). Exact full-batch gradient.

    When the batch carries no recorded old log-probs (one PPO epoch on fresh samples), the old
    policy IS the current one, so old = stop_gradient(current): the ratio is 1 with the PPO gradient.
    """

    def microbatch_loss(params, mb):
        logp_BxT, entropy_BxT = logp_fn(params, mb)
        mb = dict(mb, entropy_BxT=entropy_BxT)
        if not old_logp_recorded:
            mb["old_logp_BxT"] = lax.stop_gradient(logp_BxT)
        loss_BxT, stats = loss.token_loss(logp_BxT, mb)
        mask_BxT = mb["completion_mask_BxT"]
        live_BxT = mask_BxT > 0

        def masked_sum(v_BxT):  # select, not multiply: garbage at padding must not turn into NaN
            return jnp.sum(jnp.where(live_BxT, v_BxT, 0.0))

        sums = {k: masked_sum(v) for k, v in stats.items() if v.shape == mask_BxT.shape}
        sums["entropy"] = masked_sum(entropy_BxT)
        if "ref_logp_BxT" in mb:  # drift from the reference, reported whether or not the loss uses it
            sums["kl"] = masked_sum(kl_k3(lax.stop_gradient(logp_BxT), mb["ref_logp_BxT"]))
        return jnp.sum(mb["weights_BxT"] * loss_BxT), sums

    grad_one = jax.value_and_grad(microbatch_loss, has_aux=True)

    def grad_fn(params, batch):
        def accumulate(carry, mb):
            (value, sums), grads = grad_one(params, mb)
            g_acc, v_acc, s_acc = carry
            return (jax.tree.map(jnp.add, g_acc, grads), v_acc + value,
                    jax.tree.map(jnp.add, s_acc, sums)), None

        mbs = split_microbatches(batch, microbatches)
        first = jax.tree.map(lambda x: x[0], mbs)
        sums_shape = jax.eval_shape(lambda p, mb: microbatch_loss(p, mb)[1], params, first)
        init = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32),
                jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape))
        (grads, value, sums), _ = lax.scan(accumulate, init, mbs)
        return value, grads, sums

    return grad_fn


def make_update_step(logp_fn: LogpFn, loss: Loss, optimizer: optax.GradientTransformation, *,
                     ppo_epochs: int, microbatches: int, max_new_tokens: int, use_ref: bool):
    """Returns the pure update_step(state, batch) -> (state, metrics); jit it with donation."""
    grad_fn = make_grad_fn(logp_fn, loss, microbatches=microbatches, old_logp_recorded=ppo_epochs > 1)

    def update_step(state: TrainState, batch: dict):
        batch = dict(batch)
        mask_BxT = batch["completion_mask_BxT"]
        batch["weights_BxT"] = loss.weights(mask_BxT, max_new_tokens)
        if ppo_epochs > 1:  # old log-probs recorded once, before the first epoch
            batch["old_logp_BxT"] = lax.stop_gradient(
                microbatched_logp(logp_fn, state.params, batch, microbatches)[0])
        if use_ref:
            batch["ref_logp_BxT"] = lax.stop_gradient(
                microbatched_logp(logp_fn, state.ref_params, batch, microbatches)[0])

        def epoch(carry, _):
            params, opt_state = carry
            value, grads, sums = grad_fn(params, batch)
            grad_norm = optax.tree.norm(grads)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), (value, grad_norm, sums)

        (params, opt_state), (values, grad_norms, sums) = lax.scan(
            epoch, (state.params, state.opt_state), None, length=ppo_epochs)
        n_tokens = jnp.maximum(jnp.sum(mask_BxT), 1.0)
        metrics = {"loss": jnp.mean(values), "grad_norm": grad_norms[0]}
        for k, v in sums.items():  # masked token means, averaged over epochs
            metrics[k.removesuffix("_BxT")] = jnp.mean(v) / n_tokens
        new_state = state._replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, metrics

    return update_step
