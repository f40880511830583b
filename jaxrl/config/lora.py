"""`model.lora.*`: low-rank adapters on a frozen base (jaxrl.models.lora). rank=0 is full fine-tuning."""

import dataclasses

from jaxrl.config.checks import _check

# The projections an adapter can sit on: attention q/k/v/o and the MLP's gate/up/down (dense layers and
# MoE shared experts; the routed experts' own gate/up/down only with `experts=True`).
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
BASE_DTYPES = ("float32", "bfloat16", "int8")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685): every
    target weight W is used as W + (alpha / rank) * A @ B with A (in x rank) drawn at random and
    B (rank x out) zero, so training starts from the base policy exactly. Only A and B are trained;
    the base is frozen, stored in `base_dtype` (int8: weight-only, one scale per output column per
    layer, as QLoRA-style training does with 4-bit NF4 in Dettmers et al., arXiv:2305.14314), and with
    the adapters switched off it IS the reference policy, so a KL term needs no copy of the weights."""

    rank: int = 0  # 0: no adapters (full fine-tuning)
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # only 0: dropout would make the sampler's policy differ from the trainer's
    targets: tuple[str, ...] = LORA_TARGETS
    experts: bool = False  # also adapt the routed experts of MoE layers (one A, B per expert)
    base_dtype: str = "float32"  # float32 | bfloat16 | int8: how the frozen base weights are held

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank if self.rank else 0.0

    def validate(self, prefix: str = "model.lora") -> None:
        _check(self.rank >= 0, f"{prefix}.rank", "0 (no adapters) or a positive integer", self.rank)
        _check(self.alpha > 0, f"{prefix}.alpha", "a positive number", self.alpha)
        _check(
            self.dropout == 0.0,
            f"{prefix}.dropout",
            "0 (adapter dropout would make the rollout's policy differ from the one the update scores)",
            self.dropout,
        )
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        _check(
            bool(self.targets) and not unknown,
            f"{prefix}.targets",
            f"a non-empty subset of {', '.join(LORA_TARGETS)}",
            self.targets,
        )
        _check(self.base_dtype in BASE_DTYPES, f"{prefix}.base_dtype", " | ".join(BASE_DTYPES), self.base_dtype)
