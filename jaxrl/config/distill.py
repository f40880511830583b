"""Config section of on-policy distillation (`distill.*`), re-exported by `jaxrl.config`.

A run with a teacher scores every rollout batch's completion tokens under the teacher once per step
(`teacher_logp_BxT`, jaxrl.train.teacher); the `distill` loss preset (jaxrl.losses.distill) turns
the per-token reverse KL into the advantage. The teacher is frozen, never saved in the run's
checkpoints, and must share the student's tokenizer (checked when the run starts)."""

from __future__ import annotations

import dataclasses

from jaxrl.config.checks import _check


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    # The teacher: a jaxrl run directory (its newest checkpoint, its model from its config.json), a
    # Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json) or a
    # `jaxrl convert --from-hf` output. "" = no teacher.
    teacher: str = ""
    # The command that makes the teacher, quoted by the error when `teacher` does not exist yet
    # (e.g. "jaxrl train configs/distill_teacher_arithmetic.py --workdir runs/...").
    teacher_command: str = ""

    def validate(self, prefix: str = "distill") -> None:
        _check(isinstance(self.teacher, str), f"{prefix}.teacher", "a directory path (a string)", self.teacher)
        _check(
            isinstance(self.teacher_command, str),
            f"{prefix}.teacher_command",
            "a shell command (a string)",
            self.teacher_command,
        )
        _check(
            not self.teacher_command or bool(self.teacher),
            f"{prefix}.teacher_command",
            "empty when distill.teacher is (it says how to make the teacher)",
            self.teacher_command,
        )
