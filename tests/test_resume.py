"""Checkpoints: a run killed with SIGKILL and restarted ends exactly like an uninterrupted run;
SIGTERM and Ctrl-C save and exit cleanly; an unreadable newest checkpoint is set aside and the run resumes from
the one before."""

import gc
import json
import os
import pathlib
import shutil
import signal
import subprocess
import threading
import time

import pytest
from conftest import DEFAULT_CONFIG, TINY, jaxrl_cmd

pytestmark = pytest.mark.usefixtures("persistent_compile_cache")  # training runs repeat programs

# Steps are cheap (tens of milliseconds once compiled); a run's cost is starting it. Six steps leave four
# after the kill's checkpoint, each saved (two more checkpoints to write), so the kill lands mid-run.
STEPS = 6
ARGS = [
    str(DEFAULT_CONFIG),
    *sum((["--set", t] for t in TINY), []),
    "--set",
    f"train.steps={STEPS}",
    "--set",
    "checkpoint.every=2",
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
        time.sleep(0.02)


def train_in_process(args: list, workdir: pathlib.Path, cache_env: dict) -> dict[int, dict]:
    """`jaxrl train ARGS --workdir WORKDIR` in this process, with `cache_env`'s data and warm-start caches
    (the XLA cache is conftest's, the same as the children's): its rows. Same compile policy as a child
    (tests/harness.py), so the same metrics, bit for bit; the SIGKILL tests compare the two."""
    from jaxrl import cli

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXRL_DATA_DIR", cache_env["JAXRL_DATA_DIR"])
        mp.setenv("JAXRL_CACHE_DIR", cache_env["JAXRL_CACHE_DIR"])
        assert cli.main(["train", *args, "--workdir", str(workdir)]) == 0
    return _rows(workdir)


def killed_and_resumed_runs(
    args: list, workdir: pathlib.Path, cache_env: dict, steps: int, kill_at: int, resume_in_process: bool = False
):
    """In `workdir`, SIGKILL `jaxrl train args` (a child) once checkpoint `kill_at` exists, then rerun it
    to the end: another child, or with `resume_in_process` this process (train_in_process: the same
    metrics bit for bit, and the programs an uninterrupted in-process run of `args` traced and compiled
    are reused; only the kill needs a process of its own). -> (rows as the kill left them, rows after the
    resume, the step the resume restored)."""
    proc = subprocess.Popen(jaxrl_cmd("train", *args, "--workdir", str(workdir)), env=cache_env)
    try:
        _wait_for(lambda: any(s >= kill_at for s in _finished_checkpoints(workdir)), proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    restored = max(_finished_checkpoints(workdir))
    assert restored < steps, "the kill came too late to test resumption"
    before = _rows(workdir)
    if resume_in_process:
        resumed = train_in_process(args, workdir, cache_env)
    else:
        subprocess.run(jaxrl_cmd("train", *args, "--workdir", str(workdir)), env=cache_env, check=True, timeout=600)
        resumed = _rows(workdir)
    assert sorted(resumed) == list(range(steps + 1))
    return before, resumed, restored


def straight_and_killed_runs(args: list, tmp_path: pathlib.Path, cache_env: dict, steps: int, kill_at: int):
    """Run `jaxrl train args` to the end in one workdir (in this process); in another, SIGKILL it once
    checkpoint `kill_at` exists, then rerun it to the end (children). -> (rows of the straight run, rows
    of the killed run as the kill left them, rows after the resume, the step the resume restored); both
    runs logged every step."""
    reference = train_in_process(args, tmp_path / "straight", cache_env)
    assert sorted(reference) == list(range(steps + 1))
    return (reference, *killed_and_resumed_runs(args, tmp_path / "killed", cache_env, steps, kill_at))


_STRAIGHT_RUNS: dict[tuple, tuple[pathlib.Path, dict[int, dict]]] = {}


def straight_run_once(args: list, tmp_path_factory, cache_env: dict) -> tuple[pathlib.Path, dict[int, dict]]:
    """The uninterrupted run of `args`, trained in this process the first time a test asks for it and
    kept for the session: a module fixture is torn down whenever xdist runs another module's test in
    between; under xdist, tests on other workers train their own. -> (its workdir, which no test may
    change, its rows by step)."""
    key = tuple(args)
    if key not in _STRAIGHT_RUNS:
        workdir = tmp_path_factory.mktemp("straight") / "run"
        _STRAIGHT_RUNS[key] = workdir, train_in_process(args, workdir, cache_env)
    return _STRAIGHT_RUNS[key]


@pytest.fixture()
def straight_run(tmp_path_factory, cache_env):
    """The uninterrupted run of ARGS: the SIGKILL test's reference, and the run whose copy the
    corrupt-checkpoint test damages. -> (its workdir, its rows by step)."""
    workdir, rows = straight_run_once(ARGS, tmp_path_factory, cache_env)
    assert sorted(rows) == list(range(STEPS + 1))
    return workdir, rows


@pytest.mark.slow
def test_sigkill_and_restart_matches_uninterrupted_run(tmp_path, cache_env, straight_run):
    _, reference = straight_run
    _, resumed, restored = killed_and_resumed_runs(
        ARGS, tmp_path / "killed", cache_env, STEPS, kill_at=2, resume_in_process=True
    )
    assert restored < STEPS - 1  # at least two steps are trained again after the restore
    for step in range(1, STEPS + 1):
        for key in DETERMINISTIC:
            if key in reference[step]:
                assert resumed[step][key] == reference[step][key], (step, key)


def _signal_mid_run(tmp_path, capsys, signum) -> tuple[int, str, str, pathlib.Path, set]:
    """A real `signum` to this process while `jaxrl train` runs in it (cli.main, as `python -m jaxrl.cli`
    runs it): the signal comes from another thread once three rows are on disk, at whatever point the
    loop is then. No child Python: its start, imports and traces cost more than the run itself.
    -> (exit code, stdout, stderr, the workdir, the non-daemon threads before the run)."""
    from jaxrl import cli

    workdir = tmp_path / signal.Signals(signum).name.lower()
    args = [a.replace(f"train.steps={STEPS}", "train.steps=400") for a in ARGS]
    args = [a.replace("checkpoint.every=2", "checkpoint.every=1000") for a in args]
    # The learning-rate schedule of the STEPS-step runs (max(6, warmup 5 + 1) = 6 updates): the update is
    # the program they compiled, found in the shared XLA cache.
    args += ["--set", f"optim.decay_steps={STEPS}", "--set", "train.progress=true"]  # the summary line
    done, sent = threading.Event(), threading.Event()

    def signal_after_three_rows():
        while not done.is_set():
            rows = workdir / "metrics.jsonl"  # whole lines only: the loop may be writing one now
            if rows.exists() and rows.read_text().count("\n") >= 3:
                os.kill(os.getpid(), signum)
                sent.set()
                return
            time.sleep(0.02)

    threads_before = {t for t in threading.enumerate() if not t.daemon}
    # A signal that lands after train() restored this handler is caught here (the asserts below fail),
    # not by the default action, which would end pytest.
    previous = signal.signal(signum, lambda signum, frame: None)
    killer = threading.Thread(target=signal_after_three_rows, daemon=True)
    killer.start()
    capsys.readouterr()
    try:
        code = cli.main(["train", *args, "--workdir", str(workdir)])
    finally:
        done.set()
        killer.join(timeout=60)
        signal.signal(signum, previous)
    captured = capsys.readouterr()
    assert sent.is_set(), "the signal was never sent"
    return code, captured.out, captured.err, workdir, threads_before


@pytest.mark.slow
def test_sigterm_saves_and_exits_cleanly(tmp_path, capsys, in_process_cache):
    code, out, _, workdir, threads_before = _signal_mid_run(tmp_path, capsys, signal.SIGTERM)
    assert code == 0
    # What would keep a `jaxrl train` process from exiting once main returns: no thread of the run is left.
    assert {t for t in threading.enumerate() if not t.daemon} <= threads_before, threading.enumerate()
    saved = _finished_checkpoints(workdir)
    assert saved, ("SIGTERM did not leave a checkpoint", sorted(p.name for p in workdir.rglob("*")))
    assert saved[-1] == max(_rows(workdir)), "the checkpoint must cover every logged step"
    assert saved[-1] < 400
    summary = json.loads(out.strip().splitlines()[-1])  # the run says how far it got, not its target
    assert summary["steps_done"] == saved[-1] and summary["steps"] == 400, summary
    assert summary["status"].startswith(f"stopped by SIGTERM after step {saved[-1]}"), summary
    evals = {s: r["eval/accuracy"] for s, r in _rows(workdir).items() if "eval/accuracy" in r}
    assert summary["final_eval"]["step"] == max(evals), summary  # the newest eval, not {}
    assert summary["final_eval"]["eval/accuracy"] == evals[max(evals)], summary


@pytest.mark.slow
def test_ctrl_c_saves_the_step_and_exits_130_with_one_line(tmp_path, capsys, in_process_cache):
    """Ctrl-C is SIGTERM's clean stop (no step lost, no thread left), but exits 130 with one line
    on stderr after the progress lines, and no traceback."""
    code, out, err, workdir, threads_before = _signal_mid_run(tmp_path, capsys, signal.SIGINT)
    assert code == 130, err
    assert {t for t in threading.enumerate() if not t.daemon} <= threads_before, threading.enumerate()
    saved = _finished_checkpoints(workdir)
    assert saved and saved[-1] == max(_rows(workdir)) and saved[-1] < 400, saved
    last = err.strip().splitlines()[-1]
    expected = f"jaxrl: SIGINT received; saved step {saved[-1]} to {workdir / 'checkpoints'}; rerun the same command"
    assert last.startswith(expected), err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["status"].startswith(f"stopped by SIGINT after step {saved[-1]}"), summary


def test_stop_flag_second_ctrl_c_aborts_at_once():
    """The first SIGTERM / SIGINT asks for a save and a stop; a second SIGINT raises at once (SIGTERM
    never does: a scheduler may send it twice)."""
    from jaxrl.train.loop import _StopFlag

    flag = _StopFlag()
    flag(signal.SIGINT, None)
    assert flag.requested and flag.signal == "SIGINT"
    with pytest.raises(KeyboardInterrupt):
        flag(signal.SIGINT, None)
    term = _StopFlag()
    term(signal.SIGTERM, None)
    term(signal.SIGTERM, None)
    assert term.signal == "SIGTERM"
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C after a SIGTERM: the user insists
        term(signal.SIGINT, None)


def test_rerunning_a_finished_run_says_so_and_reports_its_last_eval(tmp_path, capsys, in_process_cache, straight_run):
    from jaxrl import cli

    finished, first = straight_run
    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir)
    capsys.readouterr()
    assert cli.main(["train", *ARGS, "--set", "train.progress=true", "--workdir", str(workdir)]) == 0
    captured = capsys.readouterr()
    assert f"is already complete (step {STEPS} of {STEPS}); nothing to train" in captured.err, captured.err
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["status"] == "complete" and summary["steps_done"] == STEPS, summary
    assert summary["final_eval"] == {"step": STEPS, **{k: v for k, v in first[STEPS].items() if k.startswith("eval/")}}
    assert _rows(workdir) == first  # nothing trained, nothing rewritten


# Orbax leaves the cancelled reads of a failed restore as never-awaited coroutines: noise, not a fault.
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_newest_checkpoint_is_set_aside_and_the_run_finishes(tmp_path, capsys, in_process_cache, straight_run):
    from jaxrl import cli

    finished, first = straight_run
    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir)  # the finished run's copy: the module's reference stays intact
    assert _finished_checkpoints(workdir) == [2, 4, 6]
    data = [p for p in (workdir / "checkpoints" / "6" / "state").glob("ocdbt.process_*/d/*")]
    victim = max(data, key=lambda p: p.stat().st_size)  # the biggest array file: the params
    victim.write_bytes(victim.read_bytes()[:100])
    capsys.readouterr()

    assert (
        cli.main(["train", *ARGS, "--workdir", str(workdir)]) == 0
    )  # before: a page of tensorstore error on every rerun
    err = capsys.readouterr().err
    assert "checkpoint step 6 could not be restored" in err and "resuming from step 4" in err, err
    assert f"jaxrl: resuming {workdir} from step 4 of 6" in err, err
    assert (workdir / "checkpoints.unreadable" / "6" / "state").is_dir()  # kept for inspection
    assert _finished_checkpoints(workdir) == [2, 4, 6]  # steps 5 and 6 were trained again
    again = _rows(workdir)
    assert sorted(again) == list(range(7))
    for step in (5, 6):  # the redone steps are the same steps (loss alone is often 0: no reward spread)
        for key in DETERMINISTIC:
            if key in first[step]:
                assert again[step][key] == first[step][key], (step, key)
    gc.collect()  # those coroutines go now, under this test's filter, not in whichever test collects next
