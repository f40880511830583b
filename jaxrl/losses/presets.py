"""Loss presets: the registry of named compositions (`PRESETS`, `register_preset`), and `make_loss`
from a config.

The built-in presets live in `presets_grpo.py` (advantage / normaliser / row-selection family),
`presets_ratio.py` (ratio level / objective / trust-region family) and `presets_critic.py` (PPO
with a value model), each docstring naming its paper
and writing its formula. `PRESETS[name]` is a `Preset`: callable like the factory, plus the paper, the
composition (`.parts`) and what `rollout.group_size` means for it. Built-ins and user presets register
the same way:

    register_preset("my_loss", my_factory, paper="...")    # e.g. in the user's own config file
    LossConfig(preset="my_loss", options={"tis_cap": 2.0})  # or preset="my_pkg.losses:my_factory"

`make_loss` checks every field and option name against the preset and the built loss against the
`Loss` contract, and raises `ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
from collections.abc import Callable
from typing import Any, cast

from jaxrl.config import ConfigError, parse_loss_options
from jaxrl.losses import distill as distill_family
from jaxrl.losses import presets_critic as critic_family
from jaxrl.losses import presets_grpo as grpo_family
from jaxrl.losses import presets_ratio as ratio_family
from jaxrl.losses.compose import Loss, check_loss
from jaxrl.losses.options import EXTRAS


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


PRESETS: dict[str, Preset] = {}


def _fixed(loss: Loss) -> Callable[[], Loss]:
    """A factory without parameters for a ready-made `Loss`."""

    def factory() -> Loss:
        return loss

    factory.__name__ = factory.__qualname__ = loss.name
    return factory


def _same_definition(a: Callable, b: Callable) -> bool:
    """The same function defined again: a config file loaded twice re-registers its presets."""
    return (getattr(a, "__module__", None), getattr(a, "__qualname__", None)) == (
        getattr(b, "__module__", None),
        getattr(b, "__qualname__", None),
    )


def register_preset(
    name: str,
    factory: Callable[..., Loss] | Loss,
    *,
    paper: str = "",
    group: str = "G >= 2",
    min_group_size: int = 2,
    odd_group_size: bool = False,
    replace: bool = False,
) -> Preset:
    """Add `factory` to `PRESETS` as `name` (what `loss.preset` and `--set loss.preset=` select) and
    return its `Preset`. `factory(**kwargs) -> Loss` takes the preset's parameters as keywords: the
    `LossConfig` fields it names (kl_beta, reward_weights, eps_low, ...) and its options (its own, and
    `**extras` for `options.option_parts`' EXTRAS); a ready-made `Loss` is a preset without parameters.
    `group` / `min_group_size` / `odd_group_size`: what rollout.group_size it needs. An existing name
    is a ConfigError unless `replace` or the factory is the same definition (same module and qualified
    name: a config file that registers is run again by every load)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ConfigError(f"register_preset: name {name!r} is not an identifier (e.g. 'my_grpo')")
    if not callable(factory):
        factory = _fixed(check_loss(factory, f"register_preset({name!r})"))
    if name in PRESETS and not replace and not _same_definition(PRESETS[name].factory, factory):
        raise ConfigError(f"register_preset: {name!r} is already a preset ({PRESETS[name].paper}); pass replace=True")
    preset = Preset(factory, paper, group, min_group_size, odd_group_size)
    PRESETS[name] = preset
    return preset


register_preset("grpo", grpo_family.grpo, paper="Shao et al. 2024, DeepSeekMath (GRPO), arXiv:2402.03300")
register_preset(
    "dr_grpo",
    grpo_family.dr_grpo,
    paper="Liu et al. 2025, Understanding R1-Zero-Like Training (Dr.GRPO), arXiv:2503.20783",
)
register_preset("bnpo", grpo_family.bnpo, paper="GRPO with the batch token-mean (the trainers' bnpo loss type)")
register_preset("dapo", grpo_family.dapo, paper="Yu et al. 2025, DAPO, arXiv:2503.14476")
register_preset(
    "gspo", ratio_family.gspo, paper="Zheng et al. 2025, Group Sequence Policy Optimization, arXiv:2507.18071"
)
register_preset("gspo_token", ratio_family.gspo_token, paper="Zheng et al. 2025, GSPO-token, arXiv:2507.18071")
register_preset(
    "gmpo", ratio_family.gmpo, paper="Zhao et al. 2025, Geometric-Mean Policy Optimization, arXiv:2507.20673"
)
register_preset("cispo", ratio_family.cispo, paper="MiniMax 2025, MiniMax-M1 (CISPO), arXiv:2506.13585")
register_preset(
    "sapo",
    ratio_family.sapo,
    paper="Gao et al. (Qwen) 2025, Soft Adaptive Policy Optimization (SAPO), arXiv:2511.20347",
)
register_preset(
    "mc_grpo",
    grpo_family.mc_grpo,
    paper="Kim 2026, Median-Centered GRPO (MC-GRPO), arXiv:2601.22582",
    group="an odd G+1 >= 3 (G + 1 pivot)",
    min_group_size=3,
    odd_group_size=True,
)
register_preset(
    "gdpo", grpo_family.gdpo, paper="Liu et al. 2026, Group reward-Decoupled Normalization PO (GDPO), arXiv:2601.05242"
)
register_preset(
    "gd2po",
    grpo_family.gd2po,
    paper="Liu et al. 2026, Group-Dynamic reward-Decoupled PO (GD2PO), arXiv:2606.16771; our reading",
)
register_preset(
    "m2po", ratio_family.m2po, paper="Zheng et al. 2025, Prosperity before Collapse (M2PO), arXiv:2510.01161"
)
register_preset(
    "mu_grpo",
    ratio_family.mu_grpo,
    paper="Tian et al. 2026, How Off-Policy Can GRPO Be? (Mu-GRPO), arXiv:2605.17570; our reading",
)
register_preset(
    "sao",
    ratio_family.sao,
    paper="Hou et al. 2026, Single-Rollout Asynchronous Optimization (SAO), arXiv:2607.07508; batch baseline",
    group="G >= 1 (single rollout: 1)",
    min_group_size=1,
)
register_preset("pnpo", ratio_family.pnpo, paper="PNPO 2026, Reusing Rollouts under Policy Lag, arXiv:2608.01418")
register_preset("rloo", grpo_family.rloo, paper="Ahmadian et al. 2024, Back to Basics (RLOO), arXiv:2402.14740")
register_preset(
    "reinforce_pp", grpo_family.reinforce_pp, paper="Hu et al. 2025, REINFORCE++ (baseline), arXiv:2501.03262"
)
register_preset(
    "async_const_norm",
    grpo_family.async_const_norm,
    paper="Bai et al. 2026, AsyncWebRL (constant 1/k normaliser), arXiv:2606.05597",
)
register_preset(
    "distill",
    distill_family.distill,
    paper="On-policy distillation: GKD, Agarwal et al. 2023, arXiv:2306.13649; MiniLLM, Gu et al. 2023, "
    "arXiv:2306.08543; Qwen3 report, arXiv:2505.09388 (needs distill.teacher)",
    group="G >= 1 (G >= 2 when reward_weight > 0)",
    min_group_size=1,
)
register_preset(
    "tbpo", ratio_family.tbpo, paper="Gu et al. 2026, QaRL (Trust-Band PO, TBPO), arXiv:2604.07853; our reading"
)

register_preset(
    "ppo",
    critic_family.ppo,
    paper="Schulman et al. 2017, PPO, arXiv:1707.06347, with GAE (arXiv:1506.02438) from a value model",
    group="G >= 1 (the critic is the baseline)",
    min_group_size=1,
)

# LossConfig fields passed to the factory when set (None = the preset's default).
_FIELDS = ("eps_low", "eps_high", "adv_eps")


def _imported(spec: str) -> Preset:
    """The preset "module:attr" names: a `Preset`, a factory, or a `Loss` (a preset without parameters)."""
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"loss.preset: {spec!r}: cannot import {module_name!r} ({e}); is it on PYTHONPATH?") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"loss.preset: {spec!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if isinstance(obj, Preset):
        return obj
    if callable(obj):
        return Preset(cast(Callable[..., Loss], obj), spec)
    return Preset(_fixed(check_loss(obj, f"loss.preset={spec!r}")), spec)


def _preset(name: str) -> Preset:
    if name in PRESETS:
        return PRESETS[name]
    if ":" in name:
        return _imported(name)
    close = difflib.get_close_matches(name, PRESETS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    allowed = ", ".join(repr(n) for n in sorted(PRESETS))
    raise ConfigError(
        f"loss.preset: got {name!r}, expected one of {allowed} (or a name given to "
        f"jaxrl.losses.register_preset, or 'module:attr'){hint}"
    )


def _takes(factory: Callable) -> tuple[tuple, bool]:
    """(the factory's named keyword parameters, whether it takes **kwargs)."""
    params = inspect.signature(factory).parameters.values()
    named = tuple(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return named, any(p.kind is p.VAR_KEYWORD for p in params)


def preset_parameters(name: str) -> tuple:
    """The option names preset `name` accepts: its own keyword parameters, then `EXTRAS` (when it
    takes **kwargs: every built-in passes them on to `option_parts`)."""
    own, extras = _takes(_preset(name).factory)
    return own + tuple(e for e in EXTRAS if extras and e not in own)


def check_rollout(name: str, group_size: int) -> None:
    """ConfigError naming rollout.group_size when the preset cannot use it (MC-GRPO needs an odd G+1)."""
    _preset(name).check_group_size(group_size, name)


def make_loss(loss_cfg) -> Loss:
    """Build the preset named by `loss_cfg.preset` (a `jaxrl.config.LossConfig`) and check it against
    the `Loss` contract (`compose.check_loss`).

    eps_low / eps_high / adv_eps are passed when not None, and must then be parameters of the preset;
    kl_beta and reward_weights when the preset takes them (every built-in does; for one that does not,
    they must stay 0 / None); `options` adds any other parameter of the preset or, for a preset with
    **kwargs, any `EXTRAS` name. Every mistake is a ConfigError naming the field.
    """
    name = loss_cfg.preset
    preset = _preset(name)
    allowed = preset_parameters(name)
    own, any_kwargs = _takes(preset.factory)
    kwargs = {}
    for field, off in (("kl_beta", 0.0), ("reward_weights", None), *((f, None) for f in _FIELDS)):
        value = getattr(loss_cfg, field)
        if field in own or (any_kwargs and field in ("kl_beta", "reward_weights")):
            if value is not None or field not in _FIELDS:
                kwargs[field] = value
        elif value != off:
            raise ConfigError(
                f"loss.{field}: got {value!r}, but preset {name!r} has no {field} (set "
                f"loss.{field}={off if off is not None else 'none'}); its parameters: {', '.join(allowed) or 'none'}"
            )
    for key, value in parse_loss_options(loss_cfg.options).items():
        if key in ("kl_beta", "reward_weights", *_FIELDS):
            raise ConfigError(f"loss.options: {key!r} is a LossConfig field; set it as loss.{key}")
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"loss.options: preset {name!r} has no parameter {key!r}; allowed: {', '.join(allowed)}{hint}"
            )
        kwargs[key] = value
    try:
        loss = preset.factory(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"loss (preset {name!r}): {e}") from e
    return check_loss(loss, f"loss.preset={name!r}")
