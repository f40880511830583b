"""The default run (configs/grpo_arithmetic.py) with a mixture-of-experts decoder and routing replay.

Both layers are MoE: 4 SwiGLU experts of width 192, top-2 with softmax gates renormalised over the
chosen two (Qwen3-MoE), dropless dispatch (`lax.ragged_dot`), load-balancing loss 0.01 and router
z-loss 0.001. The active expert width per token is 2 x 192 = 384, the dense default's mlp_dim. The
update forward replays the experts the sampler chose for every token (R3 / ESRL routing replay);
`moe/routing_mismatch` reports how often the trainer's own router would have chosen otherwise.
40 GRPO steps instead of 100, to keep the CPU run short; the dense run makes most of its gain in the
first 10-40 steps.
"""

import dataclasses
import pathlib

from jaxrl.config import Config, load_config


def get_config() -> Config:
    base = load_config(pathlib.Path(__file__).with_name("grpo_arithmetic.py"))
    model = dataclasses.replace(
        base.model,
        n_experts=4,
        moe_every=1,
        experts_per_token=2,
        expert_mlp_dim=192,
        router="softmax",
        moe_dispatch="dropless",
        moe_aux_coef=0.01,
        moe_z_coef=0.001,
    )
    train = dataclasses.replace(base.train, steps=40, eval_every=10, routing_replay=True)
    return dataclasses.replace(base, model=model, train=train)
