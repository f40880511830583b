"""On-policy distillation on the default task: the default 2-layer student (configs/grpo_arithmetic.py:
same model, warm start, rollout budget, learning rate and steps) learns from a larger teacher's
per-token log-probs on its own samples instead of from the correctness reward.

The teacher is the run of configs/distill_teacher.py (4 layers, d_model 256, warm-started without
mistakes, then 20 GRPO steps); make it first:

    jaxrl train configs/distill_teacher.py --workdir runs/distill_teacher_arithmetic
    jaxrl train configs/distill_arithmetic.py

Loss: the `distill` preset (jaxrl.losses.distill): A_t = -(log pi(y_t) - log pi_teacher(y_t)), PPO clip,
token mean; `--set loss.options=reward_weight=0.5` adds half the GRPO advantage of the correctness reward.
Preset: `jaxrl.losses.presets.PRESETS["distill"]` (`jaxrl variants` lists its parts and papers).
"""

import dataclasses
import pathlib

from jaxrl.config import Config, DistillConfig, LossConfig, load_config

HERE = pathlib.Path(__file__).resolve().parent
TEACHER = HERE.parent / "runs" / "distill_teacher_arithmetic"


def get_config() -> Config:
    base = load_config(HERE / "grpo_arithmetic.py")
    return dataclasses.replace(
        base,
        loss=LossConfig(preset="distill", reward_weights=(1.0, 0.0)),
        distill=DistillConfig(
            teacher=str(TEACHER),
            teacher_command=f"jaxrl train {HERE / 'distill_teacher.py'} --workdir {TEACHER}",
        ),
    )
