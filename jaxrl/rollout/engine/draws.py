"""How each slot of the engine draws its next token from its own noise: slot s's Gumbel noise at
column c comes from fold_in(key_S[s], c), so a slot's tokens depend only on its own key, the params
and its history (`EngineSpec.slot_keys`), whatever the other slots and the admission pattern.

    choose_tokens_per_row   one temperature / top_k / top_p for every slot (the spec's)
    choose_tokens_per_slot  each slot its own temperature and top_p (`SlotSampling`: the serving engine)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl.rollout.sampler import first_argmax, nucleus_logits, scaled_logits, truncate_logits

if TYPE_CHECKING:
    from jaxrl.rollout.engine.state import EngineSpec


class SlotSampling(NamedTuple):
    """How each slot draws (`EngineSpec.per_slot`): arrays over slots, traced, so every mix of
    requests runs the same compiled chunk."""

    temperature_S: jax.Array | np.ndarray  # float32 >= 0; 0 = greedy (first argmax, T -> 0 log-probs)
    top_p_S: jax.Array | np.ndarray  # float32 in (0, 1]; 1 = no nucleus truncation
    max_tokens_S: jax.Array | np.ndarray  # int32 in 1..T: the slot is done after this many tokens
    stop_SxK: jax.Array | np.ndarray  # int32: token ids that end the slot (like EOS; eos_S stays False); -1 = none


def slot_gumbel(key_S, col_S, like_SxV):
    """Gumbel noise of every slot at its column: row s from fold_in(key_S[s], col_S[s])."""
    V = like_SxV.shape[-1]
    return jax.vmap(lambda k, c: jax.random.gumbel(jax.random.fold_in(k, c), (V,), like_SxV.dtype))(key_S, col_S)


def choose_tokens_per_row(key_S, col_S, logits_SxV, temperature, spec: EngineSpec):
    """`choose_tokens` with row s's Gumbel noise drawn from fold_in(key_S[s], col_S[s]): a row's draw
    at a column depends on its own key only (spec.slot_keys)."""
    if spec.greedy:
        return first_argmax(logits_SxV)
    scaled_SxV = truncate_logits(scaled_logits(logits_SxV, temperature), spec.top_k, spec.top_p)
    return first_argmax(scaled_SxV + slot_gumbel(key_S, col_S, scaled_SxV))


def choose_tokens_per_slot(key_S, col_S, logits_SxV, sampling_S: SlotSampling):
    """`choose_tokens_per_row` with each slot's own temperature and top_p (`spec.per_slot`): a slot
    at temperature 0 takes the first argmax (the greedy sampler's token); the others draw by
    Gumbel-max from fold_in(key_S[s], col_S[s]) over their truncated, scaled logits."""
    temperature_Sx1 = sampling_S.temperature_S[:, None]
    top_p_Sx1 = sampling_S.top_p_S[:, None]
    scaled_SxV = scaled_logits(logits_SxV, temperature_Sx1)
    # The nucleus sorts every row's vocabulary: skipped (cond) in the steps where no slot truncates.
    scaled_SxV = lax.cond(
        jnp.any(top_p_Sx1 < 1.0),
        lambda x: jnp.where(top_p_Sx1 < 1.0, nucleus_logits(x, top_p_Sx1), x),
        lambda x: x,
        scaled_SxV,
    )
    drawn_S = first_argmax(scaled_SxV + slot_gumbel(key_S, col_S, scaled_SxV))
    return jnp.where(sampling_S.temperature_S > 0, drawn_S, first_argmax(logits_SxV))
