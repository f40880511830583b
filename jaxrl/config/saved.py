"""The config a run directory saved (`config.json`): read it back, and say which fields differ from
a new config. Shared by `jaxrl train` (resume), `jaxrl eval` and policy loading."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from jaxrl.config.errors import WorkdirError
from jaxrl.config.load import to_dict
from jaxrl.config.schema import Config

CONFIG = "config.json"
RUN_SECTIONS = frozenset({"model", "data", "rollout", "loss", "optim", "train"})  # in every jaxrl config.json


def read_run_config(workdir: pathlib.Path) -> dict | None:
    """The run's saved config (a dict), None if there is no config.json; a torn or foreign file is a
    WorkdirError naming it."""
    path = pathlib.Path(workdir) / CONFIG
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise WorkdirError(
            f"{path}: not valid JSON ({e}); it records the run's settings: restore it from a "
            "copy, or use a new --workdir"
        ) from None
    if not isinstance(saved, dict) or not RUN_SECTIONS <= saved.keys():
        hint = ""
        if isinstance(saved, dict) and ("model_type" in saved or "architectures" in saved):
            hint = " (a Hugging Face checkpoint: to start from it, --set model.hf_path=DIR)"
        raise WorkdirError(
            f"{str(workdir)!r} is not a jaxrl run directory: its {CONFIG} has no "
            f"{'/'.join(sorted(RUN_SECTIONS))} sections{hint}; use a new or empty directory"
        )
    return saved


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# Defaults an older jaxrl wrote that a newer one spells differently, field -> (old default, new default):
# a run saved with the old one matches a config with the new one. 2 GiB was the automatic microbatch
# budget; 0 now takes it from the device, which on a CPU (where it reports no limit) is that 2 GiB.
# remat "none" was the default; "auto" keeps it wherever the budget is that CPU stand-in.
SUPERSEDED_DEFAULTS = {"train.memory_budget_gib": (2.0, 0.0), "train.remat": ("none", "auto")}


def config_changes(saved: dict, cfg: Config) -> dict[str, tuple[Any, Any]]:
    """field -> (saved, new) for every field that differs. A field the saved file lacks (written by an
    older jaxrl) counts as its default, a superseded default as its new spelling
    (`SUPERSEDED_DEFAULTS`); a field jaxrl no longer has is ignored."""
    new = _flatten(json.loads(json.dumps(to_dict(cfg))))  # tuples -> lists, as the file has them
    default = _flatten(json.loads(json.dumps(to_dict(Config()))))
    old = _flatten(json.loads(json.dumps(saved)))
    for k, (was, now) in SUPERSEDED_DEFAULTS.items():
        if old.get(k) == was:
            old[k] = now
    return {k: (old.get(k, default.get(k)), v) for k, v in new.items() if old.get(k, default.get(k)) != v}
