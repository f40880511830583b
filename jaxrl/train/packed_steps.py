"""The update's packed forward (`train.packing`, jaxrl.models.packing) as the steps use it.

    logp_fn = packed_logp(model_cfg, temperature, spec, unpacked, padded, shared=..., ...)
    grad_one = value_and_grad_of(logp_fn, loss_of)

`PackedLogp` is a logp function (params, batch) -> (logp_BxT, entropy_BxT, scalars) that packs the
batch's live tokens where `PackSpec.use` says (a trace-time choice, from the shapes) and runs padded
when the rows do not fit the static N packs. Called, it is one `lax.cond` over the two forwards (the
old-policy and reference forwards, which take no gradient). A gradient must not differentiate
through that cond: JAX keeps the residuals of both arms (each arm fills the other's with zeros), so
the update would hold and write a padded forward's activations on every packed step.
`value_and_grad_of` puts the cond around each arm's own `value_and_grad` instead. scalars:
{"packing/fallback": 1.0 in the padded arm, else 0.0; "packing/fill": the plan's share of pack slots
holding a live token}; none where the forward does not pack.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl.config import ModelConfig
from jaxrl.models.packing import PackSpec, packed_token_logprobs, plan_packs
from jaxrl.models.parallel import Parallel

LogpFn = Callable[[Any, dict], tuple]


@dataclasses.dataclass(frozen=True)
class PackedLogp:
    """applies(batch): whether this batch's shapes pack (static); plan(batch) -> (fits, scalars);
    packed / padded: the two arms; unpacked: the forward where packing does not apply (the
    shared-prefix or one-pass forward, as without packing)."""

    applies: Callable[[dict], bool]
    plan: Callable[[dict], tuple]
    packed: LogpFn
    padded: LogpFn
    unpacked: LogpFn

    def __call__(self, params, batch):
        if not self.applies(batch):
            return self.unpacked(params, batch)
        return lax.cond(self.plan(batch)[0], self.packed, self.padded, params, batch)

    def map(self, wrap: Callable[[LogpFn], LogpFn]) -> PackedLogp:
        """The same choice over wrap(arm) for each forward (LoRA: the arms on the merged params)."""
        return dataclasses.replace(
            self, packed=wrap(self.packed), padded=wrap(self.padded), unpacked=wrap(self.unpacked)
        )


def packed_logp(
    model_cfg: ModelConfig,
    temperature: float,
    spec: PackSpec,
    unpacked: LogpFn,
    padded: LogpFn,
    *,
    shared: Callable[[dict], bool],
    logits_chunk: int = 0,
    remat: str = "none",
    parallel: Parallel | None = None,
) -> PackedLogp:
    """The `PackedLogp` of a dense model: `unpacked` and `padded` are make_logp_fn's forwards without
    packing (the one it would run, and the one-pass one); `shared(batch)`: whether `unpacked` shares
    each group's prompt (`PackSpec.use` keeps that forward where the prompt is the wider part)."""

    def sizes(batch) -> tuple[int, int]:
        (B, P), T = batch["prompt_tokens_BxP"].shape, batch["tokens_BxT"].shape[1]
        return spec.sizes(B, P + T, 1 if parallel is None else parallel.n_rows_devices)

    def applies(batch) -> bool:
        return spec.use(shared(batch), batch["prompt_tokens_BxP"].shape[1], batch["tokens_BxT"].shape[1])

    def plan_of(batch):
        n_packs, pack_len = sizes(batch)
        return plan_packs(batch["prompt_mask_BxP"], batch["completion_mask_BxT"], n_packs=n_packs, pack_len=pack_len)

    def plan(batch):
        p = plan_of(batch)
        return p.fits, {"packing/fill": jnp.mean((p.segment_NL > 0).astype(jnp.float32))}

    def packed(params, batch):
        n_packs, pack_len = sizes(batch)
        logp_BxT, entropy_BxT = packed_token_logprobs(
            params,
            model_cfg,
            batch["prompt_tokens_BxP"],
            batch["tokens_BxT"],
            plan_of(batch),
            temperature,
            n_packs=n_packs,
            pack_len=pack_len,
            logits_chunk=logits_chunk,
            remat=remat,
            parallel=parallel,
        )
        return logp_BxT, entropy_BxT, {"packing/fallback": jnp.zeros((), jnp.float32), **plan(batch)[1]}

    def fallback(params, batch):
        logp_BxT, entropy_BxT = padded(params, batch)[:2]
        return logp_BxT, entropy_BxT, {"packing/fallback": jnp.ones((), jnp.float32), **plan(batch)[1]}

    return PackedLogp(applies, plan, packed, fallback, unpacked)


def value_and_grad_of(logp_fn: LogpFn, loss_of: Callable[[LogpFn], Callable]) -> Callable:
    """jax.value_and_grad(loss_of(logp_fn), has_aux=True), where loss_of(f) is the microbatch loss
    (params, mb) -> (value, aux) computed with the logp function f; for a `PackedLogp` the cond
    chooses between the arms' own value_and_grads (see the module docstring)."""
    if not isinstance(logp_fn, PackedLogp):
        return jax.value_and_grad(loss_of(logp_fn), has_aux=True)
    arms = {name: jax.value_and_grad(loss_of(getattr(logp_fn, name)), has_aux=True) for name in ("packed", "padded")}
    unpacked = jax.value_and_grad(loss_of(logp_fn.unpacked), has_aux=True)

    def grad_one(params, mb):
        if not logp_fn.applies(mb):
            return unpacked(params, mb)
        return lax.cond(logp_fn.plan(mb)[0], arms["packed"], arms["padded"], params, mb)

    return grad_one
