"""The scalar reward model as pure functions: a decoder (the policy's architecture) whose final normed
hidden state at the last live token goes through a linear head to one score per sequence, and the
Bradley-Terry loss of a preference pair (Ouyang et al. 2022, InstructGPT, arXiv:2203.02155, eq. 1):

    score_B = hidden_BxSxD[b, last live slot of b] . w_D + b
    loss    = mean_b -log sigmoid(score(chosen_b) - score(rejected_b))

    params = init_reward_model(cfg, rng)                 # {"backbone": decoder params, "head": {...}}
    score_B = sequence_scores(params, cfg, tokens_BxS, mask_BxS)

Sequences are BOS + prompt + completion + EOS, left-padded (`encode_sequences`): the EOS is the token
whose hidden state is scored, so the head sees the whole text through attention. The backbone is any
jaxrl decoder (`init="base"` starts it from the run's base policy or a Hugging Face checkpoint).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.config import ModelConfig
from jaxrl.models.decoder import positions_from_mask, run_decoder
from jaxrl.models.transformer import init_params


def init_head(cfg: ModelConfig, rng: jax.Array) -> dict:
    """The score head: w_D ~ N(0, 1/D) (the normed hidden has O(1) entries, so scores start O(1)), bias 0."""
    D = cfg.d_model
    return {"w_D": jax.random.normal(rng, (D,), jnp.float32) * D**-0.5, "b": jnp.zeros((), jnp.float32)}


def init_reward_model(cfg: ModelConfig, rng: jax.Array, backbone=None) -> dict:
    """{"backbone": decoder params (`backbone`, else freshly initialised), "head": the score head}."""
    backbone_key, head_key = jax.random.split(rng)
    if backbone is None:
        backbone = init_params(cfg, backbone_key)
    return {"backbone": backbone, "head": init_head(cfg, head_key)}


def last_live_index_B(mask_BxS: jax.Array) -> jax.Array:
    """The slot of each row's last real token (0 for a row with none)."""
    S = mask_BxS.shape[1]
    return S - 1 - jnp.argmax(jnp.flip(mask_BxS.astype(bool), axis=1), axis=1)


@functools.partial(jax.jit, static_argnames="cfg")
def sequence_scores(params: dict, cfg: ModelConfig, tokens_BxS: jax.Array, mask_BxS: jax.Array) -> jax.Array:
    """score_B (float32): the head applied to the final normed hidden state at each row's last live token."""
    mask_BxS = mask_BxS.astype(bool)
    hidden_BxSxD, _, _ = run_decoder(
        params["backbone"], cfg, tokens_BxS, positions_from_mask(mask_BxS), mask_BxS, return_hidden=True
    )
    last_B = last_live_index_B(mask_BxS)
    hidden_BxD = jnp.take_along_axis(hidden_BxSxD, last_B[:, None, None], axis=1)[:, 0].astype(jnp.float32)
    return hidden_BxD @ params["head"]["w_D"] + params["head"]["b"]


def bradley_terry_loss(chosen_B: jax.Array, rejected_B: jax.Array) -> tuple[jax.Array, dict]:
    """(mean -log sigmoid(chosen - rejected), metrics: pair accuracy, mean margin)."""
    margin_B = chosen_B - rejected_B
    loss = -jnp.mean(jax.nn.log_sigmoid(margin_B))
    return loss, {"accuracy": jnp.mean((margin_B > 0).astype(jnp.float32)), "margin": jnp.mean(margin_B)}


def pair_loss(params: dict, cfg: ModelConfig, pairs: dict) -> tuple[jax.Array, dict]:
    """The Bradley-Terry loss of a batch of pairs {"chosen_BxS", "chosen_mask_BxS", "rejected_BxS",
    "rejected_mask_BxS"}: both sides scored in one forward over 2B rows."""
    B = pairs["chosen_BxS"].shape[0]
    tokens_2BxS = jnp.concatenate([pairs["chosen_BxS"], pairs["rejected_BxS"]], axis=0)
    mask_2BxS = jnp.concatenate([pairs["chosen_mask_BxS"], pairs["rejected_mask_BxS"]], axis=0)
    score_2B = sequence_scores(params, cfg, tokens_2BxS, mask_2BxS)
    return bradley_terry_loss(score_2B[:B], score_2B[B:])


def encode_sequences(tokenizer, prompts: list[str], completions: list[str], width_S: int, *, truncate: bool):
    """(tokens_BxS int32, mask_BxS bool): BOS + prompt + completion + EOS of each row, LEFT-padded to
    width_S. A longer sequence keeps its last width_S tokens with `truncate`; else it raises ValueError
    naming the row (the caller names the file and line)."""
    B = len(prompts)
    tokens_BxS = np.full((B, width_S), tokenizer.pad_id, np.int32)
    mask_BxS = np.zeros((B, width_S), bool)
    bos = [tokenizer.bos_id] if getattr(tokenizer, "add_bos", True) else []
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        ids = bos + tokenizer.encode(prompt) + tokenizer.encode(completion) + [tokenizer.eos_id]
        if len(ids) > width_S:
            if not truncate:
                raise ValueError(f"row {row} has {len(ids)} tokens, more than the model's {width_S}")
            ids = ids[-width_S:]
        tokens_BxS[row, width_S - len(ids) :] = ids
        mask_BxS[row, width_S - len(ids) :] = True
    return tokens_BxS, mask_BxS
