"""Checkpoints: a run killed with SIGKILL and restarted ends exactly like an uninterrupted run;
SIGTERM saves and exits cleanly; an unreadable newest checkpoint is set aside and the run resumes from
the one before."""

import json
import pathlib
import signal
import subprocess
import time

import pytest
from conftest import DEFAULT_CONFIG, TINY, jaxrl_cmd

STEPS = 12
ARGS = [
    str(DEFAULT_CONFIG),
    *sum((["--set", t] for t in TINY), []),
    "--set",
    f"train.steps={STEPS}",
    "--set",
    "checkpoint.every=3",
]
DETERMINISTIC = (
    "reward/mean",
    "reward/correctness",
    "loss",
    "kl",
    "entropy",
    "clip_frac",
    "response_len/mean",
    "eval/accuracy",
    "grad_norm",
)


def _rows(workdir: pathlib.Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())}


def _finished_checkpoints(workdir: pathlib.Path) -> list[int]:
    d = workdir / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


def _wait_for(pred, proc, timeout=300):
    t0 = time.time()
    while not pred():
        assert proc.poll() is None, "the run ended before the event the test waits for"
        assert time.time() - t0 < timeout, "timed out"
        time.sleep(0.05)


def straight_and_killed_runs(args: list, tmp_path: pathlib.Path, cache_env: dict, steps: int, kill_at: int):
    """Run `jaxrl train args` to the end in one workdir; in another, SIGKILL it once checkpoint `kill_at`
    exists, then rerun it to the end. -> (rows of the straight run, rows of the killed run as the kill
    left them, rows after the resume, the step the resume restored); both runs logged every step."""
    straight = tmp_path / "straight"
    subprocess.run(jaxrl_cmd("train", *args, "--workdir", str(straight)), env=cache_env, check=True, timeout=600)
    reference = _rows(straight)
    assert sorted(reference) == list(range(steps + 1))
    killed = tmp_path / "killed"
    proc = subprocess.Popen(jaxrl_cmd("train", *args, "--workdir", str(killed)), env=cache_env)
    try:
        _wait_for(lambda: any(s >= kill_at for s in _finished_checkpoints(killed)), proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    restored = max(_finished_checkpoints(killed))
    assert restored < steps, "the kill came too late to test resumption"
    before = _rows(killed)
    subprocess.run(jaxrl_cmd("train", *args, "--workdir", str(killed)), env=cache_env, check=True, timeout=600)
    resumed = _rows(killed)
    assert sorted(resumed) == list(range(steps + 1))
    return reference, before, resumed, restored


@pytest.mark.slow
def test_sigkill_and_restart_matches_uninterrupted_run(tmp_path, cache_env):
    reference, _, resumed, _ = straight_and_killed_runs(ARGS, tmp_path, cache_env, STEPS, kill_at=6)
    for step in (STEPS, STEPS - 1):
        for key in DETERMINISTIC:
            if key in reference[step]:
                assert resumed[step][key] == reference[step][key], (step, key)


@pytest.mark.slow
def test_sigterm_saves_and_exits_cleanly(tmp_path, cache_env):
    workdir = tmp_path / "term"
    args = [a.replace(f"train.steps={STEPS}", "train.steps=400") for a in ARGS]
    args = [a.replace("checkpoint.every=3", "checkpoint.every=1000") for a in args]
    proc = subprocess.Popen(jaxrl_cmd("train", *args, "--workdir", str(workdir)), env=cache_env)
    try:
        _wait_for(lambda: (workdir / "metrics.jsonl").exists() and len(_rows(workdir)) >= 3, proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
    saved = _finished_checkpoints(workdir)
    assert saved, ("SIGTERM did not leave a checkpoint", sorted(p.name for p in workdir.rglob("*")))
    assert saved[-1] == max(_rows(workdir)), "the checkpoint must cover every logged step"
    assert saved[-1] < 400


# Orbax leaves the cancelled reads of a failed restore as never-awaited coroutines: noise, not a fault.
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_newest_checkpoint_is_set_aside_and_the_run_finishes(tmp_path, capsys, in_process_cache):
    from jaxrl import cli

    workdir = tmp_path / "run"
    args = [
        "train",
        *[a.replace(f"train.steps={STEPS}", "train.steps=6") for a in ARGS],
        "--set",
        "checkpoint.every=2",
        "--workdir",
        str(workdir),
    ]
    assert cli.main(args) == 0
    assert _finished_checkpoints(workdir) == [2, 4, 6]
    first = _rows(workdir)
    data = [p for p in (workdir / "checkpoints" / "6" / "state").glob("ocdbt.process_*/d/*")]
    victim = max(data, key=lambda p: p.stat().st_size)  # the biggest array file: the params
    victim.write_bytes(victim.read_bytes()[:100])
    capsys.readouterr()

    assert cli.main(args) == 0  # before: a page of tensorstore error on every rerun
    err = capsys.readouterr().err
    assert "checkpoint step 6 could not be restored" in err and "resuming from step 4" in err, err
    assert (workdir / "checkpoints.unreadable" / "6" / "state").is_dir()  # kept for inspection
    assert _finished_checkpoints(workdir) == [2, 4, 6]  # steps 5 and 6 were trained again
    again = _rows(workdir)
    assert sorted(again) == list(range(7))
    assert again[6]["loss"] == first[6]["loss"]  # the redone steps are the same steps
