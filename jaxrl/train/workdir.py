"""The run directory (`--workdir`): what may be used as one, who holds it, and which config it belongs to.

A jaxrl run is a directory whose `config.json` has `Config`'s layout, next to `checkpoints/`,
`metrics.jsonl` and the lock file. `open_run` checks, before anything is written, that `--workdir` is
(or can be made) a writable directory; that it is new, empty, or a jaxrl run (any other non-empty
directory is refused); that the config agrees with the saved one (a difference is refused naming each
field: `model.*` always, anything else unless `allow_change`, except FREE_FIELDS and `log.*`; an allowed change goes
to `config_history.jsonl`, and `config.json` is rewritten once the checkpoint restored,
`RunRecord.commit`); and that no other `jaxrl train` holds it (an exclusive `flock` on `jaxrl.lock`,
taken by process 0 only). docs/runs.md ("Workdir rules") has the reasons.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pathlib
import socket
import sys
from collections.abc import Iterator

from jaxrl.config import Config, to_dict
from jaxrl.config.errors import WorkdirError
from jaxrl.config.saved import CONFIG, config_changes, read_run_config

HISTORY = "config_history.jsonl"
LOCK = "jaxrl.lock"
# Nothing the run computes depends on these: they may change on any rerun (and are recorded).
FREE_FIELDS = frozenset(
    {"train.progress", "train.log_every", "checkpoint.every", "checkpoint.keep", "checkpoint.async_save"}
)
FREE_PREFIX = "log."  # where the metrics go (log.backends, trackers' names): free as FREE_FIELDS


def _free(field: str) -> bool:
    return field in FREE_FIELDS or field.startswith(FREE_PREFIX)


FIXED_PREFIX = "model."  # the checkpoints hold this model: its fields never change within a run


def check_directory(workdir: pathlib.Path) -> None:
    """`workdir` is an existing writable directory, or can be created: else a WorkdirError."""
    shown = repr(str(workdir))
    if workdir.exists() and not workdir.is_dir():
        raise WorkdirError(f"--workdir {shown} is a file, not a directory")
    existing = next(p for p in (workdir, *workdir.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise WorkdirError(f"--workdir {shown}: {str(existing)!r} is a file, so the directory cannot be made")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise WorkdirError(f"--workdir {shown}: {str(existing)!r} is not writable")
    entries = sorted(p.name for p in workdir.iterdir() if not _ignorable(p)) if workdir.is_dir() else []
    if entries and not (workdir / CONFIG).is_file():
        shown_entries = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        hint = (
            " (a Hugging Face checkpoint: to start from it, --set model.hf_path=DIR)"
            if any(e.endswith(".safetensors") for e in entries)
            else ""
        )
        raise WorkdirError(
            f"--workdir {shown} is not empty and is not a jaxrl run (no {CONFIG}; it holds "
            f"{shown_entries}){hint}; use a new or empty directory"
        )


def _ignorable(entry: pathlib.Path) -> bool:
    """Our lock file, or an empty checkpoints/ (an Orbax manager opened on a new workdir makes one)."""
    return entry.name == LOCK or (entry.name == "checkpoints" and entry.is_dir() and not any(entry.iterdir()))


def _describe(changes: dict) -> str:
    return ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items())


def check_changes(workdir: pathlib.Path, changes: dict, allow_change: bool) -> None:
    """Refuse (WorkdirError) what a resume must not change; see the module docstring."""
    fixed = {k: v for k, v in changes.items() if k.startswith(FIXED_PREFIX)}
    if fixed:
        raise WorkdirError(
            f"--workdir {str(workdir)!r} holds a run of another model ({_describe(fixed)}; "
            f"saved -> new): its checkpoints cannot be resumed as this model. Use a new --workdir, "
            f"or rerun without changing model.* to resume"
        )
    refused = {k: v for k, v in changes.items() if not _free(k)}
    if refused and not allow_change:
        steps = (
            "; train.steps also reshapes the learning-rate schedule when optim.decay_steps=0"
            if "train.steps" in refused
            else ""
        )
        raise WorkdirError(
            f"--workdir {str(workdir)!r}: this config differs from the run's {CONFIG} "
            f"({_describe(refused)}; saved -> new{steps}). Rerun with the saved settings to "
            f"resume, use a new --workdir, or pass --allow-config-change to resume under the new "
            f"values (the old ones are kept in {HISTORY})"
        )


def has_checkpoint(workdir: pathlib.Path) -> bool:
    """A finished checkpoint: a step-numbered folder (an unfinished save is `<step>.orbax-...-tmp-...`)."""
    d = workdir / "checkpoints"
    return d.is_dir() and any(p.name.isdigit() and p.is_dir() for p in d.iterdir())


def _write_atomic(path: pathlib.Path, text: str) -> None:
    """A kill mid-write leaves the old file whole (a reader never sees half a config)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class RunRecord:
    """What a run writes about its config: `config.json` (and a history line when it changes)."""

    def __init__(self, workdir: pathlib.Path, cfg: Config, saved: dict | None, changes: dict, primary: bool):
        self.workdir, self.cfg, self.saved, self.changes, self.primary = workdir, cfg, saved, changes, primary

    def write_config(self) -> None:
        if self.primary:
            _write_atomic(self.workdir / CONFIG, json.dumps(to_dict(self.cfg), indent=1))

    def commit(self, start_step: int) -> None:
        """After the restore: record an allowed change (the saved config applied to steps <= start_step)."""
        if not self.changes or not self.primary:
            return
        entry = {
            "until_step": start_step,
            "changed": {k: list(v) for k, v in self.changes.items()},
            "time": datetime.datetime.now().isoformat(timespec="seconds"),
            "config": self.saved,
        }
        with (self.workdir / HISTORY).open("a") as f:
            f.write(json.dumps(entry) + "\n")
        self.write_config()
        print(
            f"jaxrl: resuming {self.workdir} from step {start_step} with a changed config: "
            f"{_describe(self.changes)} (saved -> new); the previous config is in {self.workdir / HISTORY}",
            file=sys.stderr,
        )
        self.changes = {}


class _Lock:
    """An exclusive flock on `<workdir>/jaxrl.lock`, released when the file closes (also on a crash)."""

    def __init__(self, workdir: pathlib.Path):
        import fcntl

        path = workdir / LOCK
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise WorkdirError(f"--workdir {str(workdir)!r}: cannot create {LOCK} ({e.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "an unknown process"
            os.close(fd)
            raise WorkdirError(
                f"--workdir {str(workdir)!r} is in use by another jaxrl train ({holder}; lock "
                f"file {path}); wait for it to end or stop it, or use another --workdir"
            ) from None
        except OSError as e:  # a file system without flock (some network mounts): run, but say so
            print(
                f"jaxrl: warning: cannot lock {path} ({e.strerror}); nothing stops a second run here", file=sys.stderr
            )
        os.ftruncate(fd, 0)
        os.pwrite(
            fd,
            f"pid {os.getpid()} on host {socket.gethostname()}, since "
            f"{datetime.datetime.now().isoformat(timespec='seconds')}".encode(),
            0,
        )
        self.fd = fd

    def release(self) -> None:
        os.close(self.fd)  # closing drops the flock


def _make_directory(workdir: pathlib.Path) -> None:
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # e.g. a read-only file system, a race with another process
        raise WorkdirError(f"--workdir {str(workdir)!r}: cannot create it ({e.strerror})") from None


@contextlib.contextmanager
def open_run(cfg: Config, workdir: pathlib.Path, allow_change: bool = False) -> Iterator[RunRecord]:
    """Check `workdir` for this config, lock it (process 0) and yield its RunRecord; see the module doc."""
    import jax

    from jaxrl.multihost import any_process, is_primary

    workdir = pathlib.Path(workdir)
    check_directory(workdir)
    saved = read_run_config(workdir) if workdir.is_dir() else None
    resuming = saved is not None and has_checkpoint(workdir)
    changes = config_changes(saved, cfg) if saved is not None and resuming else {}
    check_changes(workdir, changes, allow_change)
    if jax.process_count() > 1:  # every process has checked before process 0 writes anything
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("jaxrl: workdir checked")
    _make_directory(workdir)
    lock, failure = None, None
    if is_primary():
        try:
            lock = _Lock(workdir)
        except WorkdirError as e:
            failure = e
    if any_process(failure is not None):
        raise failure or WorkdirError(f"--workdir {str(workdir)!r}: process 0 could not lock it")
    record = RunRecord(workdir, cfg, saved, changes, is_primary())
    if not resuming or all(map(_free, changes)):  # a new run, or nothing that needs the restore first
        record.write_config()
        record.changes = {}
    try:
        yield record
    finally:
        if lock is not None:
            lock.release()
