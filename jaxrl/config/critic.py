"""`critic.*`: the value model a PPO run trains beside the policy (jaxrl.train.critic, docs/ppo.md).

The critic is the policy's own architecture (model.*), its trunk a copy of the warm-started policy
with a zero-initialised scalar head per token, so its first values are exactly 0. With `share_trunk`
it has no trunk of its own: the head reads the policy's final hidden states and the value loss's
gradient reaches the policy's weights scaled by `trunk_grad_scale`. It has its own AdamW (the fields
below; constant learning rate after `warmup_steps`, global-norm clip `grad_clip`).
"""

import dataclasses

from jaxrl.config.checks import _check, _check_learning_rate


@dataclasses.dataclass(frozen=True)
class CriticConfig:
    enabled: bool = False  # train a value model; a preset that reads values (`ppo`) requires it
    share_trunk: bool = False  # the head sits on the policy's trunk instead of a copy of it
    trunk_grad_scale: float = 0.1  # share_trunk: the value loss's gradient into the policy is scaled by this
    value_clip: float = 0.2  # V clipped to V_old +- value_clip in the clipped value loss; 0 = unclipped
    learning_rate: float = 1e-4
    warmup_steps: int = 0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.99
    grad_clip: float = 1.0

    def validate(self, prefix: str = "critic") -> None:
        _check_learning_rate(self.learning_rate, f"{prefix}.learning_rate")
        _check(self.trunk_grad_scale >= 0, f"{prefix}.trunk_grad_scale", "a non-negative number", self.trunk_grad_scale)
        _check(self.value_clip >= 0, f"{prefix}.value_clip", "a non-negative number (0 = unclipped)", self.value_clip)
        _check(self.warmup_steps >= 0, f"{prefix}.warmup_steps", "a non-negative integer", self.warmup_steps)
        _check(self.weight_decay >= 0, f"{prefix}.weight_decay", "a non-negative number", self.weight_decay)
        _check(0 <= self.b1 < 1, f"{prefix}.b1", "a number in [0, 1)", self.b1)
        _check(0 <= self.b2 < 1, f"{prefix}.b2", "a number in [0, 1)", self.b2)
        _check(self.grad_clip > 0, f"{prefix}.grad_clip", "a positive number", self.grad_clip)
