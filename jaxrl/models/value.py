"""A scalar value head on the decoder's final hidden states: the critic of PPO (jaxrl.train.critic).

    head = init_value_head(cfg)                                   # {"w_D": zeros, "b": 0}
    values_BxT = token_values(trunk_params, head, cfg, prompt_BxP, prompt_mask_BxP, tokens_BxT)

values_BxT[:, t] is V of the state before completion token t: the final-normed hidden state at slot
P-1+t (the one whose logits predict token t) times w_D, plus b, in float32. The trunk is any params
of `cfg`'s decoder (the policy's own, or the critic's copy); a zero head makes every value 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.config import ModelConfig
from jaxrl.models.decoder import positions_from_mask, run_decoder
from jaxrl.models.parallel import Parallel


def init_value_head(cfg: ModelConfig) -> dict:
    """The zero head: every value starts at 0 whatever the trunk."""
    return {"w_D": jnp.zeros((cfg.d_model,), jnp.float32), "b": jnp.zeros((), jnp.float32)}


def token_values(
    trunk_params,
    head: dict,
    cfg: ModelConfig,
    prompt_BxP: jax.Array,
    prompt_mask_BxP: jax.Array,
    tokens_BxT: jax.Array,
    remat: str = "none",
    parallel: Parallel | None = None,
) -> jax.Array:
    """values_BxT (float32) of every completion position (module docstring); one forward over
    concat(prompt, completion), like `transformer.token_logprobs`. Dense models only."""
    if cfg.n_experts:
        raise ValueError("token_values: the value head supports dense models only (model.n_experts=0)")
    T = tokens_BxT.shape[1]
    tokens_BxS = jnp.concatenate([prompt_BxP, tokens_BxT], axis=1).astype(jnp.int32)
    mask_BxS = jnp.concatenate([prompt_mask_BxP.astype(bool), jnp.ones(tokens_BxT.shape, bool)], axis=1)
    hidden_BxTxD, _, _ = run_decoder(
        trunk_params,
        cfg,
        tokens_BxS,
        positions_from_mask(mask_BxS),
        mask_BxS,
        num_logits=T + 1,
        return_hidden=True,
        remat=remat,
        parallel=parallel,
    )
    hidden_BxTxD = hidden_BxTxD[:, :-1].astype(jnp.float32)
    return jnp.einsum("btd,d->bt", hidden_BxTxD, head["w_D"]) + head["b"]
