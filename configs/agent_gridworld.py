"""Multi-turn GRPO on a slippery text grid game (data.task `agent_gridworld`, jaxrl/agents/gridworld.py).

Each turn the model reads the rendered 4x4 grid (`.` floor, `#` hole, `g` goal, `p` the player) and
answers with a move word ended by `]` (`left]`); a move slips to a perpendicular side 20% of the time.
The goal gives reward 1 and ends the episode, a hole ends it with 0; at most 6 turns. The warm start
imitates a fallible breadth-first-search teacher that takes a random move on a share of its turns, so
the base policy walks towards the goal but stumbles; GRPO on whole episodes (StarPO: trajectory
reward, group-normalised advantages; Wang et al. 2025, RAGEN, arXiv:2504.20073) raises the success
rate. The environment's per-turn shaping (closer / farther from the goal) is off by default
(agent.shaping_weight=0): the reward is the trajectory's only.
"""

from jaxrl.config import (AgentConfig, CheckpointConfig, Config, DataConfig, EngineConfig, LossConfig, ModelConfig,
                          OptimConfig, RolloutConfig, TrainConfig, WarmStartConfig)


def get_config() -> Config:
    return Config(
        # prompt: the first grid, 20 characters + BOS; an episode: <= 6 turns of a move word and a grid
        model=ModelConfig(d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, mlp_dim=384,
                          max_seq_len=160),
        data=DataConfig(task="agent_gridworld", num_train=4000, num_test=200, max_prompt_len=24),
        rollout=RolloutConfig(group_size=8, prompts_per_step=16, max_new_tokens=136, temperature=1.0,
                              engine=EngineConfig(slots=64)),
        agent=AgentConfig(max_turns=6, max_obs_tokens=24),
        loss=LossConfig(preset="grpo", kl_beta=0.0),
        optim=OptimConfig(learning_rate=1e-4, warmup_steps=5),
        warmstart=WarmStartConfig(steps=800, batch_size=64, learning_rate=1e-3, teacher_error=0.4),
        train=TrainConfig(steps=40, ppo_epochs=1, microbatches=1, eval_every=5, eval_prompts=200),
        checkpoint=CheckpointConfig(every=10, keep=3),
    )
