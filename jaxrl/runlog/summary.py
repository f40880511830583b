"""What `jaxrl train` says about the run as a whole: where it starts (fresh, resumed, already complete)
and, at the end, one JSON line with how far it got and why it stopped."""

from __future__ import annotations

import pathlib


def start_line(workdir: pathlib.Path, start: int, steps: int) -> str | None:
    """The line a resumed or finished run prints before any work; None for a fresh run."""
    if start == 0:
        return None
    if start >= steps:
        return (
            f"jaxrl: {workdir} is already complete (step {start} of {steps}); nothing to train. To train "
            f"further, raise train.steps with --allow-config-change, or use a new --workdir"
        )
    return f"jaxrl: resuming {workdir} from step {start} of {steps}"


def last_eval(rows: list[dict]) -> dict:
    """The newest evaluation in the run's metric rows (this session's or a previous one's), with its step;
    {} when the run has none."""
    for row in reversed(rows):
        evals = {k: v for k, v in row.items() if k.startswith("eval/")}
        if evals:
            return {"step": row.get("step", 0), **evals}
    return {}


def stopped_line(workdir: pathlib.Path, step: int, signal_name: str) -> str:
    """What a run stopped by a signal says on stderr (after "jaxrl: ")."""
    return f"{signal_name} received; saved step {step} to {workdir / 'checkpoints'}; rerun the same command to resume"


def summary(workdir: pathlib.Path, base_path, done: int, steps: int, stopped_by: str | None, rows: list[dict]) -> dict:
    """The run's closing JSON line. done: the last step finished and saved; stopped_by: the signal that
    ended it (SIGTERM, SIGINT), None if none did."""
    if done >= steps:
        status = "complete"
    elif stopped_by:
        status = f"stopped by {stopped_by} after step {done}; rerun the same command to resume"
    else:
        status = f"ended after step {done}"
    return {
        "workdir": str(workdir),
        "base_policy": str(base_path),
        "status": status,
        "steps_done": done,
        "steps": steps,
        "final_eval": last_eval(rows),
    }
