"""The default run: GRPO on 2-digit addition with a tiny character-level decoder, on CPU.

`make train` runs this file. The base policy comes from a short supervised warm start (cached) on
demonstrations from a fallible teacher that forgets every carry 60% of the time: the base model can
produce the right answer but prefers the carry-free one. GRPO (Shao et al. 2024, DeepSeekMath,
arXiv:2402.03300) then learns from the correctness reward alone which of the two to prefer.
The reward is correctness only (format is logged, not rewarded): with per-group std normalisation a
small format bonus would be blown up to a full-size advantage inside all-wrong groups.
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
        model=ModelConfig(d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, mlp_dim=384, max_seq_len=32),
        data=DataConfig(task="arithmetic", digits=2, operations="+", num_train=8000, num_test=500, max_prompt_len=8),
        rollout=RolloutConfig(group_size=8, prompts_per_step=16, max_new_tokens=5, temperature=1.0),
        loss=LossConfig(preset="grpo", kl_beta=0.0, reward_weights=(1.0, 0.0)),  # clip: the paper default 0.2
        optim=OptimConfig(learning_rate=1e-4, warmup_steps=5),
        warmstart=WarmStartConfig(steps=800, batch_size=64, learning_rate=1e-3, teacher_error=0.6),
        train=TrainConfig(steps=100, ppo_epochs=1, microbatches=1, eval_every=10, eval_prompts=500),
        checkpoint=CheckpointConfig(every=10, keep=3),
    )
