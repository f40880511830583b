"""Multi-turn GRPO on a slippery text grid game (data.task `agent_gridworld`, jaxrl/agents/gridworld.py).

Each turn the model reads the rendered 4x4 grid and answers with a move word ended by `]` (`left]`); a
move slips sideways 10% of the time; the goal gives reward 1 and ends the episode, a hole ends it with 0;
at most 6 turns. The warm start imitates a teacher whose error is systematic: in 60% of its episodes
(warmstart.teacher_error) it walks straight at the goal and into any hole on the way, and 75% of the maps
are traps, so greedy decoding of the imitator walks into the hole while samples at temperature 1 still
go around in some episodes. A uniformly random per-turn error would be noise that greedy decoding
already removes, leaving RL little to fix. GRPO on whole episodes (StarPO: trajectory reward,
group-normalised advantages; Wang et al. 2025, RAGEN, arXiv:2504.20073) shifts the policy to the path
around; the per-turn shaping is off (agent.shaping_weight=0). Results: docs/agents.md and
benchmarks/README.md.
"""

from jaxrl.config import (
    AgentConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    EngineConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    TrainConfig,
    WarmStartConfig,
)


def get_config() -> Config:
    return Config(
        # prompt: the first grid, 20 characters + BOS; an episode: <= 6 turns of a move word and a grid
        model=ModelConfig(d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, mlp_dim=384, max_seq_len=160),
        data=DataConfig(task="agent_gridworld", num_train=4000, num_test=200, max_prompt_len=24),
        rollout=RolloutConfig(
            group_size=8, prompts_per_step=16, max_new_tokens=136, temperature=1.0, engine=EngineConfig(slots=64)
        ),
        agent=AgentConfig(max_turns=6, max_obs_tokens=24),
        # rewards: the return, and the shaping (0 unless agent.shaping_weight > 0)
        loss=LossConfig(preset="grpo", kl_beta=0.0, reward_weights=(1.0, 1.0)),
        optim=OptimConfig(learning_rate=2e-4, warmup_steps=5),
        warmstart=WarmStartConfig(steps=500, batch_size=64, learning_rate=1e-3, teacher_error=0.6),
        train=TrainConfig(steps=30, ppo_epochs=1, microbatches=1, eval_every=5, eval_prompts=200),
        checkpoint=CheckpointConfig(every=10, keep=3),
    )
