"""The small validators every config section uses; each raises `ConfigError` naming the field."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxrl.config.errors import ConfigError


def _check(cond: bool, field: str, allowed: str, value: Any) -> None:
    if not cond:
        raise ConfigError(f"{field}: got {value!r}, expected {allowed}")


def _check_learning_rate(value: float, field: str) -> None:
    # inf passes `> 0` and turns the first update into NaN parameters; NaN fails every comparison.
    _check(math.isfinite(value) and value > 0, field, "a positive finite number", value)


def _check_finite_floats(section: Any, prefix: str) -> None:
    """inf / nan in any float field is a typo or an overflow, never a setting (loss.eps_low /
    eps_high excepted: there inf means no clip on that side)."""
    for f in dataclasses.fields(section):
        v = getattr(section, f.name)
        if dataclasses.is_dataclass(v):
            _check_finite_floats(v, f"{prefix}.{f.name}")
        elif isinstance(v, float) and f"{prefix}.{f.name}" not in ("loss.eps_low", "loss.eps_high"):
            _check(math.isfinite(v), f"{prefix}.{f.name}", "a finite number", v)
