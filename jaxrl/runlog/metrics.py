"""Where metrics go: `metrics.jsonl` (one object per step), TensorBoard events (tb_events.py), the
trackers `log.backends` names (W&B, MLflow: trackers.py) and a PNG plot."""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl.runlog.tb_events import ScalarEventWriter
from jaxrl.runlog.trackers import Tracker


def _plain(v: Any) -> Any:
    if isinstance(v, (np.generic, np.ndarray)):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsLog:
    """Appends one JSON object per step; on resume it first drops the steps after the checkpoint,
    so the file reads exactly as an uninterrupted run's. With `write=False` (every process but the
    first of a multi-process run) it only keeps this session's rows in memory: no file, no events.
    `tensorboard`: write the events too (log.backends); `trackers`: each row also goes to these
    (jaxrl.runlog.trackers.open_trackers), after it is in the file."""

    def __init__(
        self,
        workdir: pathlib.Path,
        resume_step: int | None,
        write: bool = True,
        *,
        tensorboard: bool = True,
        trackers: Sequence[Tracker] = (),
    ):
        self.path = pathlib.Path(workdir) / "metrics.jsonl"
        self.rows: list[dict] = []
        self._write = write
        self._trackers = tuple(trackers) if write else ()
        self._tb: ScalarEventWriter | None = None
        self._tb_dir: pathlib.Path | None = None
        if not write:
            return
        if self.path.exists():
            for line in self.path.read_text(errors="replace").splitlines():  # a garbled line is skipped
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a torn last line from a kill
                    continue
                if resume_step is not None and row.get("step", 0) <= resume_step:
                    self.rows.append(row)
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
        if tensorboard:
            self._tb_dir = pathlib.Path(workdir) / "tensorboard"  # the event file opens with the first row:
            # a session that logs nothing (a finished run rerun) leaves no empty one behind

    def write(self, row: dict) -> None:
        row = {k: _plain(v) for k, v in row.items()}
        self.rows.append(row)
        if not self._write:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is None and self._tb_dir is not None:
            self._tb = ScalarEventWriter(self._tb_dir)
        if self._tb is not None:
            numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            numbers.pop("step", None)
            self._tb.add_scalars(row["step"], numbers)
            self._tb.flush()  # a step is rare and its record small: TensorBoard sees every step as it ends
        for tracker in self._trackers:
            tracker.write(row)

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        for tracker in self._trackers:
            tracker.close()


def _nan_if_none(x: float | None) -> float:
    return float("nan") if x is None else x  # a gap in the line, as matplotlib draws a None


def plot(rows: list[dict], path: pathlib.Path, title: str = "") -> None:
    """Reward (every step) and held-out accuracy (eval steps) against the step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows if r.get("reward/mean") is not None]
    ax.plot(
        steps,
        [r["reward/mean"] for r in rows if r.get("reward/mean") is not None],
        color="tab:blue",
        alpha=0.6,
        label="train reward (mean)",
    )
    if any(r.get("reward/correctness") not in (None, r.get("reward/mean")) for r in rows):
        ax.plot(
            steps,
            [_nan_if_none(r.get("reward/correctness")) for r in rows if r.get("reward/mean") is not None],
            color="tab:green",
            alpha=0.6,
            label="train correctness",
        )
    ev = [(r["step"], r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") is not None]
    if ev:
        ax.plot(*zip(*ev), "o-", color="tab:red", label="held-out accuracy")
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, max(1.02, max((r.get("reward/mean") or 0) for r in rows) + 0.05) if rows else 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    tmp = pathlib.Path(str(path) + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
