"""Experiment trackers beside metrics.jsonl: Weights & Biases and MLflow, each through its own library.

`check_backends(log_cfg)` says, before any work, that every backend `log.backends` names can be imported
(a ConfigError naming the field and the pip command otherwise). `open_trackers` makes one `Tracker` per
backend for process 0; each is opened lazily, at the first row, so rerunning a finished run creates no
tracker run. The libraries are imported only there: nothing imports wandb or mlflow unless configured.

What every tracker gets: each metrics.jsonl row's keys as numbers (`None`, a value with nothing to measure,
as NaN: every key arrives every step; strings are left out), the row's `step` as the step; the run's
config once, flattened as config.json has it (`model.d_model`, ...), when the tracker run is created.
The tracker run's id is kept in `<workdir>/trackers.json`, so a resumed run (or any later session in the
workdir) continues the same run: W&B with `resume="allow"`, MLflow by its run_id.
W&B's x-axis is the row's `step` metric (`define_metric`), not W&B's own `_step`: a resume from a
checkpoint older than the last logged row logs those steps again, which W&B's `_step` would drop.

A tracker that raises (opening, logging or closing) is reported once on stderr and logs nothing more
this run; training and metrics.jsonl go on.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import sys
import time
import uuid
from typing import Any

from jaxrl.config.errors import ConfigError
from jaxrl.config.schema import LogConfig

IDS = "trackers.json"
# backend -> (the module it imports, the pip command that installs it)
LIBRARIES = {
    "wandb": ("wandb", "pip install 'jaxrl[wandb]' (or: pip install wandb)"),
    "mlflow": ("mlflow", "pip install 'jaxrl[mlflow]' (or: pip install mlflow-skinny)"),
}
MLFLOW_BATCH = 100  # MLflow's log_batch takes at most 100 params and 1000 metrics per call


def check_backends(log_cfg: LogConfig, field: str = "log.backends") -> None:
    """ConfigError naming `field` and the pip command for a backend whose library is not installed."""
    for name in log_cfg.backends:
        if name in LIBRARIES and importlib.util.find_spec(LIBRARIES[name][0]) is None:
            raise ConfigError(
                f"{field}: {name!r} needs the {LIBRARIES[name][0]!r} package, which is not installed: "
                f"{LIBRARIES[name][1]}, or drop {name!r} from {field}"
            )


def flat_config(config: dict, prefix: str = "") -> dict:
    """config.json's nested sections as one level of dotted names, lists and tuples as JSON text."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict) and v:
            out.update(flat_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, (list, tuple, dict)) else v
    return out


def numbers(row: dict) -> dict[str, float]:
    """A metrics row's values for a tracker: numbers as floats, None as NaN; strings left out."""
    out = {}
    for k, v in row.items():
        if v is None:
            out[k] = math.nan
        elif isinstance(v, (bool, int, float)):
            out[k] = float(v)
    return out


def _read_ids(workdir: pathlib.Path) -> dict:
    path = workdir / IDS
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or torn by a kill: a new tracker run
        return {}
    return saved if isinstance(saved, dict) else {}


def _write_ids(workdir: pathlib.Path, backend: str, entry: dict) -> None:
    saved = _read_ids(workdir)
    saved[backend] = entry
    tmp = workdir / f".{IDS}.tmp"
    tmp.write_text(json.dumps(saved, indent=1))
    os.replace(tmp, workdir / IDS)


class WandbTracker:
    """A W&B run (offline files under <workdir>/wandb, or online), its id kept in trackers.json."""

    name = "wandb"

    def __init__(self, log_cfg: LogConfig, workdir: pathlib.Path, config: dict):
        import wandb  # pyright: ignore[reportMissingImports] (an optional extra)

        saved = _read_ids(workdir).get("wandb", {})
        run_id = saved.get("id") or uuid.uuid4().hex[:12]  # W&B ids: letters and digits
        self.run = wandb.init(
            project=log_cfg.project,
            entity=log_cfg.wandb_entity or None,
            name=log_cfg.run_name or workdir.name,
            id=run_id,
            resume="allow",
            mode=log_cfg.wandb_mode,  # type: ignore[arg-type]
            dir=str(workdir),
            config=None if saved else flat_config(config),  # once: when the W&B run is created
            settings=wandb.Settings(console="off", silent=True),
        )
        if not saved:
            _write_ids(workdir, "wandb", {"id": run_id})
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({**values, "step": step})

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An MLflow run in experiment `log.project` at `log.mlflow_tracking_uri`, its run_id in trackers.json
    (reused while the URI is the same)."""

    name = "mlflow"

    def __init__(self, log_cfg: LogConfig, workdir: pathlib.Path, config: dict):
        from mlflow.entities import Param  # pyright: ignore[reportMissingImports]
        from mlflow.tracking import MlflowClient  # pyright: ignore[reportMissingImports]

        uri = log_cfg.mlflow_tracking_uri or None
        self.client = MlflowClient(uri)
        saved = _read_ids(workdir).get("mlflow", {})
        if saved.get("run_id") and saved.get("tracking_uri") == log_cfg.mlflow_tracking_uri:
            self.run_id = saved["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            return
        experiment = self.client.get_experiment_by_name(log_cfg.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(log_cfg.project)
        self.run_id = self.client.create_run(experiment_id, run_name=log_cfg.run_name or workdir.name).info.run_id
        _write_ids(workdir, "mlflow", {"run_id": self.run_id, "tracking_uri": log_cfg.mlflow_tracking_uri})
        params = [Param(k, str(v)) for k, v in flat_config(config).items()]
        for i in range(0, len(params), MLFLOW_BATCH):  # the config, once: when the MLflow run is created
            self.client.log_batch(self.run_id, params=params[i : i + MLFLOW_BATCH])

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric  # pyright: ignore[reportMissingImports]

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 10 * MLFLOW_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 10 * MLFLOW_BATCH])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def mlflow_key(key: str) -> str:
    """MLflow allows letters, digits, `_ - . / space` in a name; anything else becomes `_`
    (`engine/staleness_2+` -> `engine/staleness_2_`, as its TensorBoard tag)."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in key)


OPENERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


class Tracker:
    """One backend, opened at its first row; the first exception it raises is reported (one stderr line
    naming the backend and the step) and it is dropped for the rest of the run."""

    def __init__(self, name: str, log_cfg: LogConfig, workdir: pathlib.Path, config: dict):
        self.name, self._args = name, (log_cfg, workdir, config)
        self._impl: Any = None
        self.failed = False

    def _guard(self, what: str, fn, *args) -> None:
        if self.failed:
            return
        try:
            fn(*args)
        except Exception as e:  # a tracker never stops training: metrics.jsonl keeps every step
            self.failed = True
            line = (str(e).strip().splitlines() or [""])[0][:300]
            print(
                f"jaxrl: warning: log.backends {self.name!r} failed {what} ({type(e).__name__}: {line}); "
                "it logs nothing more this run, training and metrics.jsonl go on",
                file=sys.stderr,
            )

    def _open(self) -> None:
        self._impl = OPENERS[self.name](*self._args)

    def write(self, row: dict) -> None:
        if self._impl is None:
            self._guard("to start", self._open)
        if self._impl is not None:
            self._guard(f"at step {row['step']}", self._impl.log, row["step"], numbers(row))

    def close(self) -> None:
        if self._impl is not None:
            self._guard("to close", self._impl.close)


def open_trackers(log_cfg: LogConfig, workdir: pathlib.Path, config: dict) -> list[Tracker]:
    """One Tracker per W&B / MLflow backend in `log_cfg.backends` (none: the default), for process 0.
    `config`: the run's config as config.json holds it."""
    return [Tracker(name, log_cfg, pathlib.Path(workdir), config) for name in log_cfg.backends if name in OPENERS]
