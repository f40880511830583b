"""Loss presets: the registry of named compositions, and `make_loss` from a config.

The contract (`Loss`, `compose`) lives in `compose.py`; the presets themselves, each a short
composition of parts whose docstring names its paper and writes its formula, in `presets_grpo.py`
(advantage / normaliser / row-selection family) and `presets_ratio.py` (ratio level / objective /
trust-region family). `PRESETS[name]` is a `Preset`: callable like the factory
(`PRESETS["dapo"](eps_high=0.3)`), plus the paper, the composition (`.parts`) and what
`rollout.group_size` means for it.

Config: `jaxrl.config.LossConfig` carries the fields most presets share (eps_low, eps_high, kl_beta,
adv_eps, reward_weights; a None means "the preset's paper default") and `options`, a string of
`name=value` pairs for everything else (a preset's own parameters such as `tau` or `delta`, and the
`options.EXTRAS` every preset accepts such as `tis_cap` or `entropy_coef`). `make_loss` checks every
name against the preset and raises `ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

from jaxrl.config import ConfigError, parse_loss_options
from jaxrl.losses.compose import Loss
from jaxrl.losses.options import EXTRAS
from jaxrl.losses.presets_grpo import (
    async_const_norm,
    bnpo,
    dapo,
    dr_grpo,
    gd2po,
    gdpo,
    grpo,
    mc_grpo,
    reinforce_pp,
    rloo,
)
from jaxrl.losses.presets_ratio import cispo, gmpo, gspo, gspo_token, m2po, mu_grpo, pnpo, sao, sapo, tbpo


@dataclasses.dataclass(frozen=True)
class Preset:
    """A registered preset: `factory(**kwargs) -> Loss`, its paper, and its group-size rule."""

    factory: Callable[..., Loss]
    paper: str
    group: str = "G >= 2"  # what rollout.group_size is for this preset (shown by `jaxrl variants`)
    min_group_size: int = 2
    odd_group_size: bool = False

    def __call__(self, **kwargs) -> Loss:
        return self.factory(**kwargs)

    @property
    def parts(self) -> tuple:
        return self.factory().parts

    def check_group_size(self, group_size: int, name: str = "") -> None:
        ok = group_size >= self.min_group_size and (not self.odd_group_size or group_size % 2 == 1)
        if not ok:
            raise ConfigError(f"rollout.group_size: got {group_size}, expected {self.group} for loss.preset={name!r}")


PRESETS: dict[str, Preset] = {
    "grpo": Preset(grpo, "Shao et al. 2024, DeepSeekMath (GRPO), arXiv:2402.03300"),
    "dr_grpo": Preset(dr_grpo, "Liu et al. 2025, Understanding R1-Zero-Like Training (Dr.GRPO), arXiv:2503.20783"),
    "bnpo": Preset(bnpo, "GRPO with the batch token-mean (the trainers' bnpo loss type)"),
    "dapo": Preset(dapo, "Yu et al. 2025, DAPO, arXiv:2503.14476"),
    "gspo": Preset(gspo, "Zheng et al. 2025, Group Sequence Policy Optimization, arXiv:2507.18071"),
    "gspo_token": Preset(gspo_token, "Zheng et al. 2025, GSPO-token, arXiv:2507.18071"),
    "gmpo": Preset(gmpo, "Zhao et al. 2025, Geometric-Mean Policy Optimization, arXiv:2507.20673"),
    "cispo": Preset(cispo, "MiniMax 2025, MiniMax-M1 (CISPO), arXiv:2506.13585"),
    "sapo": Preset(sapo, "Gao et al. (Qwen) 2025, Soft Adaptive Policy Optimization (SAPO), arXiv:2511.20347"),
    "mc_grpo": Preset(
        mc_grpo,
        "Kim 2026, Median-Centered GRPO (MC-GRPO), arXiv:2601.22582",
        group="an odd G+1 >= 3 (G + 1 pivot)",
        min_group_size=3,
        odd_group_size=True,
    ),
    "gdpo": Preset(gdpo, "Liu et al. 2026, Group reward-Decoupled Normalization PO (GDPO), arXiv:2601.05242"),
    "gd2po": Preset(gd2po, "Liu et al. 2026, Group-Dynamic reward-Decoupled PO (GD2PO), arXiv:2606.16771; our reading"),
    "m2po": Preset(m2po, "Zheng et al. 2025, Prosperity before Collapse (M2PO), arXiv:2510.01161"),
    "mu_grpo": Preset(
        mu_grpo, "Tian et al. 2026, How Off-Policy Can GRPO Be? (Mu-GRPO), arXiv:2605.17570; our reading"
    ),
    "sao": Preset(
        sao,
        "Hou et al. 2026, Single-Rollout Asynchronous Optimization (SAO), arXiv:2607.07508; batch baseline",
        group="G >= 1 (single rollout: 1)",
        min_group_size=1,
    ),
    "pnpo": Preset(pnpo, "PNPO 2026, Reusing Rollouts under Policy Lag, arXiv:2608.01418"),
    "rloo": Preset(rloo, "Ahmadian et al. 2024, Back to Basics (RLOO), arXiv:2402.14740"),
    "reinforce_pp": Preset(reinforce_pp, "Hu et al. 2025, REINFORCE++ (baseline), arXiv:2501.03262"),
    "async_const_norm": Preset(
        async_const_norm, "Bai et al. 2026, AsyncWebRL (constant 1/k normaliser), arXiv:2606.05597"
    ),
    "tbpo": Preset(tbpo, "Gu et al. 2026, QaRL (Trust-Band PO, TBPO), arXiv:2604.07853; our reading"),
}

# LossConfig fields passed to the factory when set (None = the preset's default).
_FIELDS = ("eps_low", "eps_high", "adv_eps")


def _preset(name: str) -> Preset:
    if name not in PRESETS:
        allowed = ", ".join(repr(n) for n in sorted(PRESETS))
        raise ConfigError(f"loss.preset: got {name!r}, expected one of {allowed}")
    return PRESETS[name]


def preset_parameters(name: str) -> tuple:
    """The option names preset `name` accepts: its own keyword parameters, then `EXTRAS`."""
    params = inspect.signature(_preset(name).factory).parameters
    own = tuple(p for p, v in params.items() if v.kind is not inspect.Parameter.VAR_KEYWORD)
    return own + tuple(e for e in EXTRAS if e not in own)


def check_rollout(name: str, group_size: int) -> None:
    """ConfigError naming rollout.group_size when the preset cannot use it (MC-GRPO needs an odd G+1)."""
    _preset(name).check_group_size(group_size, name)


def make_loss(loss_cfg) -> Loss:
    """Build the preset named by `loss_cfg.preset` (a `jaxrl.config.LossConfig`).

    eps_low / eps_high / adv_eps are passed when not None, and must then be parameters of the preset;
    kl_beta and reward_weights always (every preset takes them); `options` adds any other parameter
    of the preset or any `EXTRAS` name. Every mistake is a ConfigError naming the field.
    """
    name = loss_cfg.preset
    preset = _preset(name)
    allowed = preset_parameters(name)
    kwargs = {"kl_beta": loss_cfg.kl_beta, "reward_weights": loss_cfg.reward_weights}
    for field in _FIELDS:
        value = getattr(loss_cfg, field)
        if value is None:
            continue
        if field not in allowed:
            raise ConfigError(
                f"loss.{field}: got {value!r}, but preset {name!r} has no {field} (set "
                f"loss.{field}=none); its parameters: {', '.join(allowed)}"
            )
        kwargs[field] = value
    for key, value in parse_loss_options(loss_cfg.options).items():
        if key in kwargs or key in _FIELDS:
            raise ConfigError(f"loss.options: {key!r} is a LossConfig field; set it as loss.{key}")
        if key not in allowed:
            raise ConfigError(f"loss.options: preset {name!r} has no parameter {key!r}; allowed: {', '.join(allowed)}")
        kwargs[key] = value
    try:
        return preset.factory(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"loss (preset {name!r}): {e}") from e
