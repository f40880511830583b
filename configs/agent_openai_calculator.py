"""The calculator task of configs/agent_calculator.py written as a black-box agent (docs/agents.md).

The agent below is an ordinary OpenAI-client program: it sends the problem to `/v1/completions`,
stops the model's turn at `]`, runs the calculator on a tool call (`[calc 123*456]` -> `>56088\\n`),
sends the whole transcript back as the next prompt, and scores the final answer itself. The run serves
its own engine in-process (127.0.0.1, a free port); the recorder keeps each episode as the engine's
tokens, so the update trains on exactly what was sampled, with the model's log-probs and versions, and
the tool results as observations (loss mask 0). The char model has no chat template: the agent speaks
`/v1/completions`. The records and the warm start (a fallible teacher that calls the tool 40% of the
time) are the calculator environment's; GRPO learns from the agent's reward to call it every time.

    make train CONFIG=configs/agent_openai_calculator.py
"""

import numpy as np

from jaxrl.agents.calculator import CalculatorEnv
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
from jaxrl.data.registry import Task, register_task

MAX_TURNS = 3


def calculator_agent(client, record: dict) -> float:
    """One episode through the OpenAI client: the model's turns end at `]` (a tool call) or at EOS (its
    answer); the calculator answers tool calls; reward 1 for the right product."""
    env = CalculatorEnv()  # the tool and the scoring of the built-in environment, run by the agent itself
    prompt = env.reset(record, np.random.default_rng(0))  # the calculator draws nothing
    for _ in range(MAX_TURNS):
        choice = client.completions.create(model="policy", prompt=prompt, max_tokens=32, stop=["]"]).choices[0]
        action = choice.text + ("]" if "[" in choice.text else "")  # the stop string is cut from the text
        result = env.step(action)
        if result.done:
            return result.reward
        prompt += action + result.observation
    return 0.0


register_task(Task("agent_openai_calculator", agent=calculator_agent, environment="jaxrl.agents.calculator:SUITE"))


def get_config() -> Config:
    return Config(
        # prompt `123*456=` + BOS = 9 tokens; an episode `[calc 123*456]>56088\n56088` + EOS ~ 30 tokens
        model=ModelConfig(d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, mlp_dim=384, max_seq_len=64),
        data=DataConfig(task="agent_openai_calculator", num_train=8000, num_test=500, max_prompt_len=9),
        rollout=RolloutConfig(
            group_size=8, prompts_per_step=16, max_new_tokens=40, temperature=1.0, engine=EngineConfig(slots=64)
        ),
        agent=AgentConfig(max_turns=MAX_TURNS, max_obs_tokens=16),
        loss=LossConfig(preset="grpo", kl_beta=0.0, reward_weights=(1.0, 1.0)),
        optim=OptimConfig(learning_rate=1e-4, warmup_steps=5),
        warmstart=WarmStartConfig(steps=800, batch_size=64, learning_rate=1e-3, teacher_error=0.6),
        train=TrainConfig(steps=30, ppo_epochs=1, microbatches=1, eval_every=5, eval_prompts=200),
        checkpoint=CheckpointConfig(every=10, keep=3),
    )
