"""A step's metrics row, once its update has run: pull the device metrics, write the row, stop on
a non-finite loss, move the progress bar."""

from __future__ import annotations

import time

import jax
import numpy as np

from jaxrl.config.errors import NonFiniteError
from jaxrl.runlog.metrics import MetricsLog


def emit(log: MetricsLog, bar, row: dict, metrics, t0: float) -> None:
    """Pull the device metrics of a dispatched step, write its row and update the progress bar."""
    row = dict(row)
    row.update({k: float(v) for k, v in jax.device_get(metrics).items()})
    row["clip_frac"] = row.get("clipped_low", 0.0) + row.get("clipped_high", 0.0)
    row["grad_norm_spike"] = grad_norm_spike(log.rows, row.get("grad_norm"))
    row["step_seconds"] = time.perf_counter() - t0  # to this row's pull: it includes the next step's dispatch
    row["wall_time"] = time.time()  # when the row was written; differences between rows time whole steps
    log.write(row)
    stop_if_not_finite(row)
    bar.update(row["step"] - bar.n)
    post = {"reward": f"{row['reward/mean']:.3f}", "tok/s": f"{row['rollout/tokens_per_s']:.0f}"}
    if row.get("eval/accuracy") is not None:
        post["acc"] = f"{row['eval/accuracy']:.3f}"
    bar.set_postfix(post)


def stop_if_not_finite(row: dict) -> None:
    """A NaN/inf loss or gradient norm stops the run before anything after it is saved (every save
    first pulls its step's row): the newest checkpoint stays the last finite one."""
    bad = {k: row.get(k) for k in ("loss", "grad_norm") if not np.isfinite(row.get(k, 0.0))}
    if bad:
        raise NonFiniteError(
            f"step {row['step']}: "
            + ", ".join(f"{k} is {v}" for k, v in bad.items())
            + "; stopped without saving this or any later step (the newest checkpoint is the "
            "last finite one). Lower optim.learning_rate, or check the rewards"
        )


def grad_norm_spike(rows: list[dict], grad_norm, window: int = 10):
    """grad_norm over the median of the previous `window` steps' (None until 3 are known): a spike
    (well above 1) after a quiet stretch is one sign of RL collapse, the multi-turn "echo trap" among them."""
    history = [r["grad_norm"] for r in rows[-window:] if r.get("grad_norm") is not None]
    if grad_norm is None or len(history) < 3:
        return None
    return float(grad_norm) / max(float(np.median(history)), 1e-12)
