"""The update's packed forward (`train.packing`, jaxrl.models.packing) as the steps use it.

    logp_fn = packed_logp(model_cfg, temperature, spec, unpacked, shared=..., ...)
    grad_one = value_and_grad_of(logp_fn, loss_of)

`PackedLogp` is a logp function (params, batch) -> (logp_BxT, entropy_BxT, scalars) that packs the
batch's live tokens where `PackSpec.use` says (a trace-time choice, from the shapes): into the
smallest of the `PackSpec.counts` packings whose plan fits, unpacked (the shared-prefix or one-pass
forward it replaces, padded) when none does. Called, it is one
`lax.switch` over those forwards (the old-policy and reference forwards, which take no gradient). A
gradient must not differentiate through the switch: JAX keeps the residuals of every arm (each arm
fills the others' with zeros), so the update would hold and write a padded forward's activations on
every packed step. `value_and_grad_of` puts the switch around each arm's own `value_and_grad`
instead. scalars: {"packing/fallback": 1.0 in the padded arm, else 0.0; "packing/fill": the chosen
plan's share of pack slots holding a live token (the largest plan's when none fits)}; none where the
forward does not pack.
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
    """applies(batch): whether this batch's shapes pack (static); choose(batch) -> (arm index,
    scalars); arms(batch): the forwards for this batch's shapes, the packed ones smallest packing
    first, then the unpacked one (the fallback); unpacked: the forward where packing does not apply (the shared-prefix
    or one-pass forward, as without packing)."""

    applies: Callable[[dict], bool]
    choose: Callable[[dict], tuple]
    arms: Callable[[dict], tuple[LogpFn, ...]]
    unpacked: LogpFn

    def __call__(self, params, batch):
        if not self.applies(batch):
            return self.unpacked(params, batch)
        return lax.switch(self.choose(batch)[0], self.arms(batch), params, batch)

    def map(self, wrap: Callable[[LogpFn], LogpFn]) -> PackedLogp:
        """The same choice over wrap(arm) for each forward (LoRA: the arms on the merged params)."""
        arms = self.arms
        return dataclasses.replace(
            self, arms=lambda batch: tuple(wrap(a) for a in arms(batch)), unpacked=wrap(self.unpacked)
        )


def packed_logp(
    model_cfg: ModelConfig,
    temperature: float,
    spec: PackSpec,
    unpacked: LogpFn,
    *,
    shared: Callable[[dict], bool],
    logits_chunk: int = 0,
    remat: str = "none",
    parallel: Parallel | None = None,
) -> PackedLogp:
    """The `PackedLogp` of a dense model: `unpacked` is the forward make_logp_fn runs without packing
    (the shared-prefix or the one-pass one), also the fallback when no packing fits; `shared(batch)`:
    whether it shares each group's prompt (`PackSpec.use` keeps it where the prompt is the wider
    part). One packed arm per pack count of `PackSpec.counts`; the first whose plan fits runs."""

    def counts(batch) -> tuple[tuple[int, ...], int]:
        (B, P), T = batch["prompt_tokens_BxP"].shape, batch["tokens_BxT"].shape[1]
        return spec.counts(B, P + T, 1 if parallel is None else parallel.n_rows_devices)

    def applies(batch) -> bool:
        return spec.use(shared(batch), batch["prompt_tokens_BxP"].shape[1], batch["tokens_BxT"].shape[1])

    def plan_of(batch, n_packs: int):
        pack_len = counts(batch)[1]
        return plan_packs(batch["prompt_mask_BxP"], batch["completion_mask_BxT"], n_packs=n_packs, pack_len=pack_len)

    def choose(batch):
        plans = [plan_of(batch, n) for n in counts(batch)[0]]
        fits_K = jnp.stack([p.fits for p in plans])
        fill_K = jnp.stack([jnp.mean((p.segment_NL > 0).astype(jnp.float32)) for p in plans])
        first = jnp.argmax(fits_K)  # the smallest packing that fits
        index = jnp.where(jnp.any(fits_K), first, len(plans))
        return index, {"packing/fill": jnp.where(jnp.any(fits_K), fill_K[first], fill_K[-1])}

    def packed_arm(n_packs: int) -> LogpFn:
        def packed(params, batch):
            logp_BxT, entropy_BxT = packed_token_logprobs(
                params,
                model_cfg,
                batch["prompt_tokens_BxP"],
                batch["tokens_BxT"],
                plan_of(batch, n_packs),
                temperature,
                n_packs=n_packs,
                pack_len=counts(batch)[1],
                logits_chunk=logits_chunk,
                remat=remat,
                parallel=parallel,
            )
            return logp_BxT, entropy_BxT, {"packing/fallback": jnp.zeros((), jnp.float32), **choose(batch)[1]}

        return packed

    def fallback(params, batch):  # what runs without packing: the shared-prefix forward where it applies
        logp_BxT, entropy_BxT = unpacked(params, batch)[:2]
        return logp_BxT, entropy_BxT, {"packing/fallback": jnp.ones((), jnp.float32), **choose(batch)[1]}

    def arms_for(batch) -> tuple[LogpFn, ...]:
        return (*(packed_arm(n) for n in counts(batch)[0]), fallback)

    return PackedLogp(applies, choose, arms_for, unpacked)


def value_and_grad_of(logp_fn: LogpFn, loss_of: Callable[[LogpFn], Callable]) -> Callable:
    """jax.value_and_grad(loss_of(logp_fn), has_aux=True), where loss_of(f) is the microbatch loss
    (params, mb) -> (value, aux) computed with the logp function f; for a `PackedLogp` the switch
    chooses between the arms' own value_and_grads (see the module docstring)."""
    if not isinstance(logp_fn, PackedLogp):
        return jax.value_and_grad(loss_of(logp_fn), has_aux=True)
    unpacked = jax.value_and_grad(loss_of(logp_fn.unpacked), has_aux=True)

    def grad_one(params, mb):
        if not logp_fn.applies(mb):
            return unpacked(params, mb)
        arms = [jax.value_and_grad(loss_of(arm), has_aux=True) for arm in logp_fn.arms(mb)]
        return lax.switch(logp_fn.choose(mb)[0], arms, params, mb)

    return grad_one
