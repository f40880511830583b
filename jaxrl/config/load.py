"""Config files and `--set` overrides for any tree of frozen dataclasses: load `get_config()` from a
file, set dotted fields from strings (parsed to each field's type), check types. Every mistake is a
ConfigError naming the field or the file. It knows no particular config class, so `jaxrl.config`
(the run's `Config`, its ranges, `load_config`) imports this module and never the other way round."""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import types
import typing
from typing import Any, TypeVar

from jaxrl.config.errors import ConfigError

T = TypeVar("T")


def _type_of(cls, name: str):
    return typing.get_type_hints(cls)[name]


def _is_tuple(typ) -> bool:
    return typ is tuple or typing.get_origin(typ) is tuple


def _parse_bool(field: str, text: str) -> bool:
    low = text.strip().lower()
    if low in ("true", "1", "yes"):
        return True
    if low in ("false", "0", "no"):
        return False
    raise ConfigError(f"{field}: got {text!r}, expected a boolean (true/false)")


def _parse_number(field: str, text: str, typ) -> Any:
    try:
        return typ(text)
    except ValueError:
        raise ConfigError(f"{field}: got {text!r}, expected {'an integer' if typ is int else 'a number'}") from None


def _parse_tuple(field: str, text: str, typ) -> tuple:
    """`1,2` or `(1.0,)` -> floats; for tuple[str, ...] names, e.g. model.lora.targets=q,v."""
    names = typing.get_args(typ)[:1] == (str,)
    inner = text.strip("()[] ")
    parts = [p.strip() for p in inner.split(",")]
    if parts[-1] == "" and len(parts) > 1:  # one trailing comma, as in (1.0,)
        parts.pop()
    if not inner or "" in parts:  # `a.b=` or `a.b=1,,2`: never silently fewer values than typed
        kind = "names" if names else "numbers"
        raise ConfigError(f"{field}: got {text!r}, expected comma-separated {kind} (an empty value is not allowed)")
    if names:
        return tuple(p.strip("'\"") for p in parts)
    try:
        return tuple(float(p) for p in parts)
    except ValueError:
        raise ConfigError(f"{field}: got {text!r}, expected comma-separated numbers") from None


def _parse_value(field: str, text: str, typ) -> Any:
    """A `--set` value's text as the field's type; ConfigError naming the field otherwise."""
    if typ is bool:
        return _parse_bool(field, text)
    if typ in (int, float):
        return _parse_number(field, text, typ)
    if typ is str:
        return text
    if _is_tuple(typ):
        return _parse_tuple(field, text, typ)
    args = typing.get_args(typ) if typing.get_origin(typ) in (typing.Union, types.UnionType) else ()
    if type(None) in args:
        inner = [a for a in args if a is not type(None)][0]
        # An empty tuple value is a mistake (e.g. `loss.reward_weights=`), not None: that is spelled `none`.
        if text.strip().lower() in ("none", "null") or (not text.strip() and not _is_tuple(inner)):
            return None
        return _parse_value(field, text, inner)
    if str in args:
        return text  # e.g. loss.options: a dict in a config file, a string from the command line
    raise ConfigError(f"{field}: cannot be set from the command line")


def _check_type(field: str, value: Any, typ) -> Any:
    """Accept ints for floats; reject everything else of the wrong type (None only for Optional)."""
    if typing.get_origin(typ) in (typing.Union, types.UnionType) and type(None) in typing.get_args(typ):
        if value is None:
            return None
        typ = [a for a in typing.get_args(typ) if a is not type(None)][0]
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is bool and not isinstance(value, bool):
        raise ConfigError(f"{field}: got {value!r}, expected a boolean")
    if typ is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise ConfigError(f"{field}: got {value!r}, expected an integer")
    if typ is float and not isinstance(value, float):
        raise ConfigError(f"{field}: got {value!r}, expected a number")
    if typ is str and not isinstance(value, str):
        raise ConfigError(f"{field}: got {value!r}, expected a string")
    if typ is tuple or typing.get_origin(typ) is tuple:
        if not isinstance(value, (tuple, list)):
            raise ConfigError(f"{field}: got {value!r}, expected a tuple")
        if typing.get_args(typ)[:1] == (str,) and not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{field}: got {value!r}, expected a tuple of names")
        return tuple(value)
    return value


def check_types(cfg: Any, prefix: str = "") -> None:
    """Walk a (nested) config and reject values of the wrong type, naming the field."""
    for f in dataclasses.fields(cfg):
        name = f"{prefix}{f.name}"
        value = getattr(cfg, f.name)
        typ = _type_of(type(cfg), f.name)
        if isinstance(typ, type) and dataclasses.is_dataclass(typ):  # a section (a class, never an instance)
            if not isinstance(value, typ):
                raise ConfigError(f"{name}: got {type(value).__name__}, expected {typ.__name__}")
            check_types(value, name + ".")
        else:
            fixed = _check_type(name, value, typ)
            if fixed is not value:
                object.__setattr__(cfg, f.name, fixed)


def override(cfg: Any, path: str, value: Any, _prefix: str = "") -> Any:
    """Return a copy of `cfg` with dotted `path` set to `value` (a string is parsed to the field's type)."""
    head, _, rest = path.partition(".")
    full = _prefix + path
    here = _prefix + head
    names = [f.name for f in dataclasses.fields(cfg)]
    if head not in names:
        raise ConfigError(f"{full}: unknown field {head!r}; allowed: {', '.join(names)}")
    typ = _type_of(type(cfg), head)
    if rest:
        if not dataclasses.is_dataclass(typ):
            raise ConfigError(f"{full}: {here!r} has no sub-fields")
        return dataclasses.replace(cfg, **{head: override(getattr(cfg, head), rest, value, here + ".")})
    if dataclasses.is_dataclass(typ):
        raise ConfigError(f"{full}: is a section; set one of its fields, e.g. {full}.{dataclasses.fields(typ)[0].name}")
    if isinstance(value, str):
        value = _parse_value(full, value, typ)
    return dataclasses.replace(cfg, **{head: _check_type(full, value, typ)})


def apply_overrides(cfg: T, overrides: list[str]) -> T:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected the form a.b=value")
        key, value = item.split("=", 1)
        cfg = override(cfg, key.strip(), value.strip())
    return cfg


def load_file(path: str | pathlib.Path, expected: type[T], overrides: list[str] | None = None) -> T:
    """Load `get_config()` from a config file, check it returns an `expected`, apply `--set` overrides
    and check field types (ranges are the caller's: `jaxrl.config.load_config` validates)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found")
    spec = importlib.util.spec_from_file_location(f"jaxrl_config_{path.stem}", path)
    if spec is None or spec.loader is None:  # e.g. a name without the .py suffix
        raise ConfigError(f"config file {str(path)!r} is not a Python file (expected a .py file)")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # a broken config file is a user mistake, not a crash
        raise ConfigError(f"config file {str(path)!r} failed to load: {type(e).__name__}: {e}") from e
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {str(path)!r} defines no get_config()")
    try:
        cfg = module.get_config()
    except Exception as e:  # any failure inside the user's get_config() is a mistake in that file
        raise ConfigError(f"config file {str(path)!r}: get_config() raised {type(e).__name__}: {e}") from e
    if not isinstance(cfg, expected):
        raise ConfigError(
            f"config file {str(path)!r}: get_config() returned {type(cfg).__name__}, expected {expected.__name__}"
        )
    cfg = apply_overrides(cfg, overrides or [])
    check_types(cfg)
    return cfg


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)
