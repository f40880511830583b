"""GRPO on GSM8K from a local Qwen2.5-0.5B-Instruct checkpoint (a GPU/TPU recipe; see docs/huggingface.md).

Nothing is downloaded. Point the run at local files, with environment variables or --set:
  model.hf_path     $JAXRL_HF_PATH      a Hugging Face checkpoint dir (config.json, *.safetensors,
                                        tokenizer.json, tokenizer_config.json), or a `jaxrl convert` output
  data.train_file   $JAXRL_GSM8K_TRAIN  GSM8K-style JSONL: {"question": ..., "answer": "... #### 72"}
  data.test_file    $JAXRL_GSM8K_TEST   the same for held-out accuracy ("" holds out train lines)

The prompt is written in Qwen's ChatML (the instruct model's chat format) and asks for the final
answer after "####"; the reward is the math-answer verifier's correctness (jaxrl.data.math_jsonl:
the final number equals the reference), format logged only. GRPO: Shao et al. 2024, DeepSeekMath,
arXiv:2402.03300. Memory per device (`jaxrl plan`, bfloat16 compute, float32 params and Adam;
benchmarks/plan_sizes.py, docs/accelerators.md): on 8 devices (fsdp) the update holds 0.7 GiB of state
and 21.5 GiB of temporaries, so it fits 8 GPUs of 40 GB or more. On one device the plain update needs
142 GiB of temporaries, more than one 80 GB accelerator; train.remat=auto (the default) then chooses
full remat and logits chunks of 1024 from the device's budget (half of an 80 GB GPU's 59.5 GiB
bytes_limit: 29.8 GiB), 26.4 GiB of temporaries beside 5.5 GiB of state (`jaxrl plan ... --set
train.memory_budget_gib=29.8`, docs/accelerators.md).
"""

import os

from jaxrl.config import (
    CheckpointConfig,
    Config,
    DataConfig,
    LossConfig,
    MeshConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    TrainConfig,
    WarmStartConfig,
)

PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{question}\n"
    "Reason step by step, then give the final answer as a number after '####'.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            hf_path=os.environ.get("JAXRL_HF_PATH", "checkpoints/Qwen2.5-0.5B-Instruct"),
            dtype="bfloat16",
            max_seq_len=1024,
        ),
        data=DataConfig(
            task="math_jsonl",
            train_file=os.environ.get("JAXRL_GSM8K_TRAIN", "data/gsm8k/train.jsonl"),
            test_file=os.environ.get("JAXRL_GSM8K_TEST", "data/gsm8k/test.jsonl"),
            prompt_template=PROMPT,
            num_train=7473,
            num_test=1319,
            max_prompt_len=320,
            skip_long_prompts=True,
        ),
        rollout=RolloutConfig(group_size=8, prompts_per_step=32, max_new_tokens=512, temperature=1.0),
        loss=LossConfig(preset="grpo", kl_beta=0.0, reward_weights=(1.0, 0.0)),
        optim=OptimConfig(learning_rate=1e-6, warmup_steps=10, weight_decay=0.0, grad_clip=1.0),
        warmstart=WarmStartConfig(steps=0),  # the checkpoint is the base policy
        train=TrainConfig(steps=200, ppo_epochs=1, microbatches=8, eval_every=25, eval_prompts=500),
        checkpoint=CheckpointConfig(every=25, keep=2),
        mesh=MeshConfig(preset="fsdp"),
    )
