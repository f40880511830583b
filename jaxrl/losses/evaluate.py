"""A `Loss` evaluated on a batch, by the same functions the update step calls.

    prepare_batch(loss, batch, group_size=G, max_new_tokens=L)   once, on the WHOLE batch: shapes checked,
        advantages_B from rewards_BxK (+ shaping), Loss.prepare, weights_BxT
    weighted_loss(loss, logp_BxT, batch) -> (value, stats)       on a (micro)batch of the prepared batch
    evaluate_loss(loss, logp_BxT, batch, group_size=G, max_new_tokens=L) -> LossEvaluation

`make_update_step` runs `prepare_batch` on its whole batch and `weighted_loss` per microbatch, so
`evaluate_loss(...).loss` is the update's loss (its first PPO epoch) and its `jax.grad` the update's
gradient. The batch carries `rewards_BxK`, never `advantages_B`. Groups are `group_id_B` when present
(id < 0, or an all-0 completion mask, = padding: advantage 0, in no statistic), else group_size
adjacent rows; a batch that fits neither is an error naming both.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.losses import segments as seg
from jaxrl.losses.aggregation import reduce_stats, weighted_sum
from jaxrl.losses.compose import Loss


class LossEvaluation(NamedTuple):
    loss: jax.Array  # scalar: sum_{i,t} weights_it * loss_it, what the update minimises
    metrics: dict  # "loss" and the masked token means of the loss's stats (ratio_min / _max, ...)
    batch: dict  # the prepared batch: advantages_B, weights_BxT and whatever prepare added


def check_batch(batch: dict, group_size: int, max_new_tokens: int) -> None:
    """ValueError naming group_size / max_new_tokens / group_id_B and the batch's shape when they do not
    fit it: without group_id_B, B rows are whole groups of `group_size` adjacent rows; with it, it is
    an int [B] array; completions are `max_new_tokens` wide (the sampler's T). Shapes are static, so
    this runs once, at trace time."""
    if "completion_mask_BxT" not in batch:
        raise KeyError("the batch has no completion_mask_BxT")
    B, T = batch["completion_mask_BxT"].shape
    for name, value in (("group_size", group_size), ("max_new_tokens", max_new_tokens)):
        try:
            ok = operator.index(value) > 0
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"{name}: got {value!r}, expected a positive (static) int")
    if "group_id_B" in batch:
        _check_group_ids(batch["group_id_B"], B, T)
    elif B % group_size:
        raise ValueError(
            f"group_size={group_size} does not divide the batch's B={B} rows (completion_mask_BxT "
            f"{(B, T)}): a batch is whole groups of group_size adjacent rows (or give group_id_B)"
        )
    if T != max_new_tokens:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} but the batch's completions are T={T} wide "
            f"(completion_mask_BxT {(B, T)}); the rollout makes T = max_new_tokens"
        )
    for key, x in batch.items():
        rows_ok = key.split("_")[-1][:1] != "B" or x.shape[0] == B  # every *_B..., e.g. rewards_BxK
        width_ok = not key.endswith("_BxT") or x.shape[1] == T
        if not (rows_ok and width_ok):
            raise ValueError(f"batch[{key!r}] has shape {tuple(x.shape)}, but completion_mask_BxT is {(B, T)}")


def _check_group_ids(ids, B: int, T: int) -> None:
    shape, dtype = tuple(getattr(ids, "shape", ())), getattr(ids, "dtype", None)
    if shape != (B,):
        raise ValueError(
            f"batch['group_id_B'] has shape {shape}, expected ({B},): one group id per row "
            f"(completion_mask_BxT is {(B, T)})"
        )
    if dtype is None or not jnp.issubdtype(dtype, jnp.signedinteger):
        raise ValueError(f"batch['group_id_B'] has dtype {dtype}, expected int32 group ids (id < 0 = padding)")


def batch_advantages(loss: Loss, batch: dict, group_size: int, max_new_tokens: int) -> jax.Array:
    """adv_B of the batch: `loss.advantages(rewards_BxK, groups)`, with the bonus_B of the loss's
    reward shaping (DAPO's overlong penalty, KL in the reward) added to the combined reward first.
    groups: `segments.Groups` from the batch's group_id_B (padding marked: run `segments.mark_padding`
    first, as `prepare_batch` does), else the static group_size."""
    if "advantages_B" in batch:
        raise ValueError(
            "the batch carries advantages_B, but the loss computes the advantages from rewards_BxK "
            "(Loss.advantages with its reward shaping) inside the update; drop advantages_B"
        )
    if "rewards_BxK" not in batch:
        raise KeyError(
            "the batch has no rewards_BxK (B x K rewards, one column per reward function): the "
            "advantages are computed from them"
        )
    rewards_BxK, groups = batch["rewards_BxK"], seg.batch_groups(batch, group_size)
    if not loss.reward_shaping:
        return jax.lax.stop_gradient(loss.advantages(rewards_BxK, groups))
    bonus_B = sum(shaper(batch, max_new_tokens) for shaper in loss.reward_shaping)
    return jax.lax.stop_gradient(loss.advantages(rewards_BxK, groups, bonus_B))


def prepare_batch(loss: Loss, batch: dict, *, group_size: int, max_new_tokens: int) -> dict:
    """The whole-batch stage of the update: check the shapes, then advantages_B, `loss.prepare`
    (row / token masks) and weights_BxT from the prepared mask. Needs the keys the loss reads
    (old_logp_BxT / old_entropy_BxT with `needs_old_logp`, ref_logp_BxT with `needs_ref`). With
    group_id_B, the prepared batch's group_id_B is -1 on padding rows (`segments.mark_padding`)."""
    check_batch(batch, group_size, max_new_tokens)
    batch = seg.mark_padding(batch)
    if loss.needs_ref and "ref_logp_BxT" not in batch:
        raise KeyError(f"loss {loss.name!r} needs_ref (a KL term) but the batch has no ref_logp_BxT")
    batch = dict(batch, advantages_B=batch_advantages(loss, batch, group_size, max_new_tokens))
    batch = dict(loss.prepare(batch, group_size, max_new_tokens))
    batch["weights_BxT"] = loss.weights(batch["completion_mask_BxT"], max_new_tokens)
    return batch


def weighted_loss(loss: Loss, logp_BxT: jax.Array, batch: dict) -> tuple[jax.Array, dict]:
    """(sum_{i,t} weights_it * loss_it, per-token stats) on a prepared (micro)batch. Summed over the
    microbatches of a prepared batch it is exactly the whole batch's value."""
    loss_BxT, stats = loss.token_loss(logp_BxT, batch)
    return weighted_sum(batch["weights_BxT"], loss_BxT), stats


def evaluate_loss(
    loss: Loss,
    logp_BxT: jax.Array,
    batch: dict,
    *,
    group_size: int,
    max_new_tokens: int,
    entropy_BxT: jax.Array | None = None,
) -> LossEvaluation:
    """The update step's loss on `batch` for the current policy's log-probs `logp_BxT`.

    `batch`: completion_mask_BxT, rewards_BxK and what the loss reads (truncated_B, rollout_logp_BxT,
    ref_logp_BxT, ...). Without old_logp_BxT the old policy is the current one (stop_gradient(logp_BxT),
    as in the update's first epoch on fresh samples); `entropy_BxT` (the current policy's entropies)
    feeds an entropy bonus and, as the old entropies, top-entropy masking. Differentiable in logp_BxT.
    """
    batch = dict(batch)
    batch.setdefault("old_logp_BxT", jax.lax.stop_gradient(logp_BxT))
    if entropy_BxT is not None:
        batch["entropy_BxT"] = entropy_BxT
        batch.setdefault("old_entropy_BxT", jax.lax.stop_gradient(entropy_BxT))
    batch = prepare_batch(loss, batch, group_size=group_size, max_new_tokens=max_new_tokens)
    value, stats = weighted_loss(loss, logp_BxT, batch)
    mask_BxT = batch["completion_mask_BxT"]
    metrics = {"loss": value, **reduce_stats({k: v for k, v in stats.items() if v.shape == mask_BxT.shape}, mask_BxT)}
    return LossEvaluation(loss=value, metrics=metrics, batch=batch)
