"""The teacher of configs/distill_arithmetic.py: a 4-layer, d_model 256 decoder on 2-digit addition.

    jaxrl train configs/distill_teacher.py --workdir runs/distill_teacher_arithmetic

Twice the depth and width of the default 2-layer student (3.1M matmul parameters to its 0.39M, both
besides the embedding), warm-started on demonstrations from a teacher that makes no mistakes
(`warmstart.teacher_error=0`, where the student's warm start forgets 60% of the carries), then 20 GRPO
steps, which give the run its checkpoint (held-out greedy accuracy: 0.996 after the warm start, 0.994
after the 20 steps). The warm start has its own fixed seed (`warmstart.seed=0`), so the command above
makes the same teacher whatever `train.seed` is. The distillation config reads the workdir's newest
checkpoint.
"""

import dataclasses
import pathlib

from jaxrl.config import Config, ModelConfig, load_config


def get_config() -> Config:
    cfg = load_config(pathlib.Path(__file__).with_name("grpo_arithmetic.py"))
    return dataclasses.replace(
        cfg,
        model=ModelConfig(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, mlp_dim=768, max_seq_len=32),
        warmstart=dataclasses.replace(cfg.warmstart, teacher_error=0.0, seed=0),
        train=dataclasses.replace(cfg.train, steps=20, eval_every=20),
        checkpoint=dataclasses.replace(cfg.checkpoint, every=20, keep=1),
    )
