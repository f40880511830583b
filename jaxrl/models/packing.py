"""Packed scoring: the live tokens of a padded B x (P + T) batch packed into N sequences of L slots.

    plan = plan_packs(prompt_mask_BxP, completion_mask_BxT, n_packs=N, pack_len=L)
    logp_BxT, entropy_BxT = packed_token_logprobs(params, cfg, prompt_BxP, tokens_BxT, plan, temperature,
                                                  n_packs=N, pack_len=L)

A row's live tokens are its real prompt tokens (prompt_mask 1, left-padded) and its completion up to
its last live token (completion_mask > 0; masked tokens before it, such as an agent's tool output,
stay: they are context). Tokens after the last live one, and every token of a row with no live
completion token, influence nothing the loss reads and are left out. Each row becomes one segment of
one pack (first-fit-decreasing, `assign_packs`), its positions 0.. restarting at its first real token
exactly as the padded forward's `positions_from_mask`, and attention sees only its own segment
(`cache_kinds.SegmentIds`). The forward runs on the N x L packs, the head on every slot, and each
completion token's log-prob and entropy are gathered back to the B x T layout every loss reads (zeros
where the token is not live); the gather's transpose carries the gradients back.

The plan is computed inside the jitted step, not on the host, from the masks each forward sees:
microbatches, mini-batches, the old-policy and reference forwards then all pack their own rows, a
mask `loss.prepare` changed is the one packed, and the batch carries nothing new (so no loop, source
or sharding code changes, and `train.microbatches=0` may choose the count after the batch exists).
Its cost is a `lax.scan` over the B rows with an N-wide state and a few B x (P + T) scatters. N and
L are static: one compile serves every step. When the rows do not fit (`fits` False: a row longer
than L, or first-fit-decreasing runs out of packs) the caller runs the padded forward instead
(`train.packed_steps`, counted by the `packing/fallback` metric), so results never depend on the
fit. Values match the padded forward to float32 reordering; gradients likewise. Dense models only:
MoE routing with expert capacity depends on which tokens share a forward.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl.config import ModelConfig
from jaxrl.models.cache_kinds import SegmentIds
from jaxrl.models.decoder import head_weights, run_decoder
from jaxrl.models.logprobs import chunked_token_logprobs, logprob_and_entropy
from jaxrl.models.parallel import Parallel

PACKING = ("off", "auto", "on")  # train.packing


class PackPlan(NamedTuple):
    """Where each live token of the padded batch sits in the N x L packs (S = P + T, the padded width)."""

    slot_BxS: jax.Array  # int32: flat slot n * L + j of token (b, s); N * L where the token is not packed
    source_NL: jax.Array  # int32: flat b * S + s of the token in each slot; B * S for an empty slot
    segment_NL: jax.Array  # int32: each slot's segment (its row + 1), 0 when empty
    position_NL: jax.Array  # int32: each slot's position within its row (0 at the row's first real token)
    fits: jax.Array  # bool scalar: every row with a live completion token was placed


class PackSpec(NamedTuple):
    """How the update packs (train.packing, pack_len, pack_budget, pack_sizes); hashable, static.
    mode "on": every dense update forward packs; "auto": packs unless the shared-prefix forward
    applies (`shared_prefix`, contiguous groups with one prompt) and the prompt is at least as wide
    as the completion, where sharing the prompt saves as much as packing does. pack_len: L, 0 for one
    padded row's width P + T. budget: the largest packing's slots as a share of the padded B x (P + T);
    sizes: how many packings are compiled, at budget x k / sizes for k = 1..sizes (the smallest that
    fits runs)."""

    mode: str = "auto"
    pack_len: int = 0
    budget: float = 0.5
    sizes: int = 1

    def use(self, shared: bool, prompt_len: int, completion_len: int) -> bool:
        """Whether a forward of this shape packs (`shared`: the shared-prefix forward would run)."""
        return self.mode == "on" or not shared or prompt_len < completion_len

    def counts(self, rows: int, width: int, multiple: int = 1) -> tuple[tuple[int, ...], int]:
        """((N of each packing, ascending, distinct), L) of a forward over `rows` padded rows `width`
        = P + T wide (`pack_count`)."""
        L = self.pack_len or width
        ns = {pack_count(rows, width, L, self.budget * k / self.sizes, multiple) for k in range(1, self.sizes + 1)}
        return tuple(sorted(ns)), L


def pack_count(rows: int, width: int, pack_len: int, budget: float, multiple: int = 1) -> int:
    """N, the static number of packs for `rows` padded rows of `width` slots: enough packs of
    `pack_len` slots for `budget` (a share, 0 < budget <= 1) of the padded B x width slots, at least
    one, rounded up to a `multiple` (the devices the rows split over)."""
    n = max(1, math.ceil(rows * width * budget / pack_len))
    return -(-n // multiple) * multiple


def row_extent(prompt_mask_BxP: jax.Array, completion_mask_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(live_BxS: the tokens a row packs, length_B: how many), S = P + T. A row packs nothing when its
    completion has no live token."""
    T = completion_mask_BxT.shape[1]
    live_BxT = completion_mask_BxT > 0
    extent_B = jnp.max(jnp.where(live_BxT, jnp.arange(1, T + 1), 0), axis=1)  # 1 + the last live index
    prompt_BxP = (prompt_mask_BxP > 0) & (extent_B > 0)[:, None]
    live_BxS = jnp.concatenate([prompt_BxP, jnp.arange(T)[None, :] < extent_B[:, None]], axis=1)
    return live_BxS, jnp.sum(live_BxS, axis=1, dtype=jnp.int32)


def assign_packs(length_B: jax.Array, n_packs: int, pack_len: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """First-fit-decreasing: the rows longest first (ties in row order), each into the first pack with
    room. -> (pack_B, start_B: the row's first slot in its pack, placed_B); empty rows (length 0) are
    placed nowhere and count as placed. A `lax.scan` over the B rows, O(B * N)."""
    order_B = jnp.argsort(-length_B, stable=True)

    def place(free_N, b):
        n = length_B[b]
        room_N = free_N >= n
        pack = jnp.argmax(room_N)  # the first pack with room (0 when none: then not placed)
        placed = room_N[pack] & (n > 0)
        start = pack_len - free_N[pack]
        return free_N.at[pack].add(jnp.where(placed, -n, 0)), (pack, start, placed | (n == 0))

    free_N = jnp.full((n_packs,), pack_len, jnp.int32)
    _, (pack_sorted, start_sorted, placed_sorted) = lax.scan(place, free_N, order_B)

    def unsort(x):
        return jnp.zeros_like(x).at[order_B].set(x)

    return unsort(pack_sorted), unsort(start_sorted), unsort(placed_sorted)


def plan_packs(prompt_mask_BxP, completion_mask_BxT, *, n_packs: int, pack_len: int) -> PackPlan:
    """The `PackPlan` of a padded batch (see the module docstring); pure, jittable, N and L static."""
    B, P = prompt_mask_BxP.shape
    S, NL = P + completion_mask_BxT.shape[1], n_packs * pack_len
    live_BxS, length_B = row_extent(prompt_mask_BxP, completion_mask_BxT)
    pack_B, start_B, placed_B = assign_packs(length_B, n_packs, pack_len)
    rank_BxS = jnp.cumsum(live_BxS, axis=1, dtype=jnp.int32) - 1  # the position: count of real tokens before
    packed_BxS = live_BxS & (placed_B & (length_B > 0))[:, None]
    slot_BxS = jnp.where(packed_BxS, pack_B[:, None] * pack_len + start_B[:, None] + rank_BxS, NL)
    flat = slot_BxS.reshape(-1)
    source_NL = jnp.full((NL,), B * S, jnp.int32).at[flat].set(jnp.arange(B * S, dtype=jnp.int32), mode="drop")
    row_BxS = jnp.broadcast_to(jnp.arange(1, B + 1, dtype=jnp.int32)[:, None], (B, S))
    segment_NL = jnp.zeros((NL,), jnp.int32).at[flat].set(row_BxS.reshape(-1), mode="drop")
    position_NL = jnp.zeros((NL,), jnp.int32).at[flat].set(rank_BxS.reshape(-1), mode="drop")
    return PackPlan(slot_BxS, source_NL, segment_NL, position_NL, jnp.all(placed_B))


@functools.partial(jax.jit, static_argnames=("cfg", "n_packs", "pack_len", "logits_chunk", "remat", "parallel"))
def packed_token_logprobs(
    params,
    cfg: ModelConfig,
    prompt_BxP,
    tokens_BxT,
    plan: PackPlan,
    temperature,
    *,
    n_packs: int,
    pack_len: int,
    logits_chunk: int = 0,
    remat: str = "none",
    parallel: Parallel | None = None,
):
    """(logp_BxT, entropy_BxT) of `transformer.token_logprobs` (dense) computed on the N = n_packs
    packs of L = pack_len slots `plan` (`plan_packs` of the batch's masks) lays out; zeros at the
    tokens after a row's last live one. Where `plan.fits` is False some rows were not packed and
    their values are zeros: the caller must not use them."""
    if cfg.n_experts:
        raise ValueError("train.packing: dense models only (MoE routing with capacity depends on the packs)")
    B, P = prompt_BxP.shape
    T, NL = tokens_BxT.shape[1], n_packs * pack_len
    tokens_BS = jnp.concatenate([prompt_BxP, tokens_BxT], axis=1).astype(jnp.int32).reshape(-1)
    tokens_NL = jnp.concatenate([tokens_BS, jnp.zeros((1,), jnp.int32)])[plan.source_NL]
    tokens_NxL = tokens_NL.reshape(n_packs, pack_len)
    out_NxLxX, _, _ = run_decoder(
        params,
        cfg,
        tokens_NxL,
        plan.position_NL.reshape(n_packs, pack_len),
        SegmentIds(plan.segment_NL.reshape(n_packs, pack_len)),
        return_hidden=logits_chunk > 0,
        remat=remat,
        parallel=parallel,
    )
    # Slot j predicts the token in slot j + 1 (the next token of its row when the row goes on).
    next_NxL = jnp.concatenate([tokens_NxL[:, 1:], jnp.zeros((n_packs, 1), jnp.int32)], axis=1)
    if logits_chunk > 0:
        logp_NxL, entropy_NxL = chunked_token_logprobs(
            out_NxLxX, head_weights(params, cfg), next_NxL, temperature, logits_chunk, parallel
        )
    else:
        logp_NxL, entropy_NxL = logprob_and_entropy(out_NxLxX, next_NxL, temperature)
    # Completion token t of row b is predicted by the slot before its own (row b's previous token).
    slot_BxT = plan.slot_BxS[:, P:]
    has_before_BxT = jnp.concatenate(
        [jnp.any(plan.slot_BxS[:, :P] < NL, axis=1)[:, None], jnp.ones((B, T - 1), bool)], axis=1
    )
    valid_BxT = (slot_BxT < NL) & has_before_BxT
    before_BxT = jnp.clip(slot_BxT - 1, 0, NL - 1)

    def back(x_NxL):
        return jnp.where(valid_BxT, x_NxL.reshape(-1)[before_BxT], 0.0)

    return back(logp_NxL), back(entropy_NxL)
