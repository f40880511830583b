"""Multi-turn GRPO with a calculator tool: 3-digit x 3-digit products the tiny model cannot compute.

data.task `agent_calculator` (jaxrl/agents/calculator.py): the prompt is `123*456=`; the model may
call the calculator (`[calc 123*456]`, `]` ends the turn), reads its result (`>56088`, an
observation: context, no loss) and answers (`56088`, EOS ends the episode); reward 1 for the right
product. The 0.4 M-parameter character model cannot multiply 3-digit numbers in its head but can copy
digits: the tool call is the skill. The warm start imitates a fallible teacher that answers with a
wrong guess instead of calling the tool 60% of the time, so the base policy calls the tool only
sometimes; GRPO on whole episodes (StarPO: the trajectory reward, group-normalised advantages; Wang
et al. 2025, RAGEN, arXiv:2504.20073) learns from the reward alone to call it every time.
Environment steps run in a thread pool while other slots keep decoding (jaxrl.rollout.episodes.driver).
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
        # prompt `123*456=` + BOS = 9 tokens; an episode `[calc 123*456]>56088\n56088` + EOS ~ 30 tokens
        model=ModelConfig(d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, mlp_dim=384, max_seq_len=64),
        data=DataConfig(task="agent_calculator", num_train=8000, num_test=500, max_prompt_len=9),
        rollout=RolloutConfig(
            group_size=8, prompts_per_step=16, max_new_tokens=40, temperature=1.0, engine=EngineConfig(slots=64)
        ),
        agent=AgentConfig(max_turns=3, max_obs_tokens=16),
        # rewards: the return, and the shaping (0 unless agent.shaping_weight > 0)
        loss=LossConfig(preset="grpo", kl_beta=0.0, reward_weights=(1.0, 1.0)),
        optim=OptimConfig(learning_rate=1e-4, warmup_steps=5),
        warmstart=WarmStartConfig(steps=800, batch_size=64, learning_rate=1e-3, teacher_error=0.6),
        train=TrainConfig(steps=30, ppo_epochs=1, microbatches=1, eval_every=5, eval_prompts=200),
        checkpoint=CheckpointConfig(every=10, keep=3),
    )
