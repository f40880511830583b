"""GRPO on long addition written out column by column: completions of 9 to 81 tokens, median ~36.

The long-tail workload: most problems have 2-4 columns, a few have 8, so a static B x T rollout runs for
the longest sample while most rows sit finished. The base policy is a supervised warm start on worked
solutions (jaxrl.data.long_addition) from a fallible teacher that forgets every carry 60% of the time
(writes `+0` where a carry is due), and GRPO learns from the correctness reward to carry (docs/runs.md,
"The long-tail task"). The reward is correctness of the final answer only (format is logged, not
rewarded; see grpo_arithmetic.py for why a small format bonus is amplified by per-group std
normalisation).
"""

from jaxrl.config import (
    CheckpointConfig,
    Config,
    DataConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    TrainConfig,
    WarmStartConfig,
)


def get_config() -> Config:
    return Config(
        # the longest prompt `99999999+99999999=` is 18 tokens + BOS; the longest solution 81 + EOS
        model=ModelConfig(d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, mlp_dim=384, max_seq_len=104),
        data=DataConfig(
            task="long_addition", digits=8, operations="+", num_train=8000, num_test=500, max_prompt_len=19
        ),
        rollout=RolloutConfig(group_size=8, prompts_per_step=8, max_new_tokens=82, temperature=1.0),
        loss=LossConfig(preset="grpo", kl_beta=0.0, reward_weights=(1.0, 0.0)),
        optim=OptimConfig(learning_rate=1e-4, warmup_steps=5),
        warmstart=WarmStartConfig(steps=600, batch_size=64, learning_rate=1e-3, teacher_error=0.6),
        train=TrainConfig(steps=100, ppo_epochs=1, microbatches=1, eval_every=10, eval_prompts=200),
        checkpoint=CheckpointConfig(every=10, keep=3),
    )
