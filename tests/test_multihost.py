"""Two processes x 4 fake CPU devices (gloo collectives over localhost) train exactly like one process
x 8 devices; a run whose peer never arrives exits with one error line within its --init-timeout.

The two processes join by both launch paths at once: process 0 with explicit --coordinator /
--num-processes / --process-id, process 1 with `--cluster auto` and the SLURM variables of the second
task of a 2-node job whose node list names this machine (JAX_COORDINATOR_PORT picks the port instead of
JAX's 61440 + job id % 4096). Each path must find the same coordinator, process count and a distinct
process id, or the join fails; one two-process run and one reference cover both (the job
scripts/slurm_train.sbatch starts).

All runs start at once (they are mostly compile time on a small machine) and each is killed at its
own deadline.
"""

import time

import pytest
from conftest import DEFAULT_CONFIG
from multihost_helpers import (
    assert_same_metrics,
    device_env,
    finish,
    free_port,
    metric_rows,
    run_args,
    start_train,
    without_cluster_vars,
)

STEPS = 3
ARGS = run_args(STEPS)
RUN_TIMEOUT_S = 300
INIT_TIMEOUT_S = 10


def slurm_task(port: int, task: int) -> dict[str, str]:
    """The variables SLURM gives task `task` of a 2-task, 2-node job on this machine."""
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": str(task),
        "SLURM_LOCALID": "0",  # one task per node
        "SLURM_NNODES": "2",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NODELIST": "127.0.0.1",
        "SLURM_NODELIST": "127.0.0.1",
        "JAX_COORDINATOR_PORT": str(port),
    }


@pytest.mark.slow
def test_two_processes_by_flags_and_by_slurm_match_one_process_and_a_missing_peer_fails(tmp_path, cache_env):
    port, lonely_port = free_port(), free_port()
    clean = without_cluster_vars(cache_env)  # whatever cluster or launch this test itself runs under

    def start(name, args, env):
        return start_train(args, env, tmp_path / f"stderr_{name}.txt")

    two = [*ARGS, "--workdir", str(tmp_path / "two"), "--init-timeout", "120"]
    task_env = device_env(clean, 4, tmp_path / "cache2")
    procs = {
        "one_x8": start("one_x8", [*ARGS, "--workdir", str(tmp_path / "one")], device_env(clean, 8)),
        "p0": start(
            "p0", [*two, "--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", "0"], task_env
        ),
        "p1": start("p1", [*two, "--cluster", "auto"], {**task_env, **slurm_task(port, 1)}),
        # process 0 of 2 whose peer never starts
        "lonely": start(
            "lonely",
            [
                *ARGS,
                "--workdir",
                str(tmp_path / "lonely"),
                "--coordinator",
                f"localhost:{lonely_port}",
                "--num-processes",
                "2",
                "--process-id",
                "0",
                "--init-timeout",
                str(INIT_TIMEOUT_S),
            ],
            device_env(clean, 4, tmp_path / "cache3"),
        ),
    }
    done = finish(procs, time.time() + RUN_TIMEOUT_S)

    code, err, seconds = done["lonely"]
    assert code == 1, err[-2000:]  # one line saying what to do, not XLA's abort (134) blaming "another task"
    assert seconds < INIT_TIMEOUT_S + 60, seconds
    assert "jaxrl: process 0 of 2 joining" in err
    assert err.strip().splitlines()[-1] == (
        f"jaxrl: error: process 0 of 2: not all 2 processes joined localhost:{lonely_port} within --init-timeout "
        f"{INIT_TIMEOUT_S} s; start each with the same --coordinator and --num-processes and its own --process-id "
        "(0 serves the coordinator), or raise --init-timeout"
    ), err[-2000:]
    assert "Check failure" not in err, err[-2000:]
    assert not (tmp_path / "lonely").exists(), "nothing may be written before every process joined"
    for name in ("one_x8", "p0", "p1"):
        assert done[name][0] == 0, (name, done[name][1][-3000:])
    assert f"jaxrl: process 0 of 2 joining localhost:{port}" in done["p0"][1]
    assert f"jaxrl: process 1 of 2 joined 127.0.0.1:{port} (slurm)\n" in done["p1"][1]

    assert_same_metrics(metric_rows(tmp_path / "two"), metric_rows(tmp_path / "one"), STEPS)
    # one checkpoint, saved by both processes together, restorable like any other
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir() if p.name.isdigit()) == [str(STEPS)]


def test_bad_multiprocess_flags_are_one_line_errors(capsys, monkeypatch):
    from jaxrl.cli import main

    for name in ("JAXRL_COORDINATOR", "JAXRL_NUM_PROCESSES", "JAXRL_PROCESS_ID", "JAXRL_INIT_TIMEOUT", "JAXRL_CLUSTER"):
        monkeypatch.delenv(name, raising=False)
    cases = [
        (
            ["--coordinator", "localhost:1", "--num-processes", "2", "--process-id", "2"],
            "--process-id 2: expected 0..1 for --num-processes 2",
        ),
        (
            ["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"],
            "--coordinator 'localhost': expected host:port",
        ),
        (
            ["--num-processes", "2"],
            "--coordinator, --num-processes and --process-id go together (or "
            "JAXRL_COORDINATOR, JAXRL_NUM_PROCESSES, JAXRL_PROCESS_ID); got coordinator=None, num_processes=2, "
            "process_id=None",
        ),
    ]
    for flags, message in cases:
        assert main(["train", str(DEFAULT_CONFIG), *flags]) == 2
        assert capsys.readouterr().err == f"jaxrl: error: {message}\n"
    monkeypatch.setenv("JAXRL_COORDINATOR", "localhost:1")
    monkeypatch.setenv("JAXRL_NUM_PROCESSES", "two")
    assert main(["train", str(DEFAULT_CONFIG)]) == 2
    assert capsys.readouterr().err == "jaxrl: error: JAXRL_NUM_PROCESSES='two' (--num-processes): expected an integer\n"
