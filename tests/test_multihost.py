"""Two processes x 4 fake CPU devices (gloo collectives over localhost) train exactly like one process
x 8 devices; a run whose peer never arrives exits nonzero within its --init-timeout instead of hanging.

All runs start at once (they are mostly compile time on a small machine) and each is killed at its
own deadline.
"""

import time

import pytest
from conftest import DEFAULT_CONFIG
from multihost_helpers import assert_same_metrics, device_env, finish, free_port, metric_rows, run_args, start_train

STEPS = 3
ARGS = run_args(STEPS)
RUN_TIMEOUT_S = 300
INIT_TIMEOUT_S = 10


@pytest.mark.slow
def test_two_processes_match_one_process_and_a_missing_peer_fails(tmp_path, cache_env):
    port, lonely_port = free_port(), free_port()

    def start(args, env):
        return start_train(args, env, tmp_path / f"stderr_{len(list(tmp_path.glob('stderr_*')))}.txt")

    multi = ["--coordinator", f"localhost:{port}", "--num-processes", "2", "--init-timeout", "120"]
    procs = {
        "one_x8": start([*ARGS, "--workdir", str(tmp_path / "one")], device_env(cache_env, 8)),
        "p0": start(
            [*ARGS, "--workdir", str(tmp_path / "two"), *multi, "--process-id", "0"],
            device_env(cache_env, 4, tmp_path / "cache2"),
        ),
        "p1": start(
            [*ARGS, "--workdir", str(tmp_path / "two"), *multi, "--process-id", "1"],
            device_env(cache_env, 4, tmp_path / "cache2"),
        ),
        # process 0 of 2 whose peer never starts
        "lonely": start(
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
            device_env(cache_env, 4, tmp_path / "cache3"),
        ),
    }
    done = finish(procs, time.time() + RUN_TIMEOUT_S)

    code, err, seconds = done["lonely"]
    assert code != 0, err[-2000:]
    assert seconds < INIT_TIMEOUT_S + 60, seconds
    assert "jaxrl: process 0 of 2 joining" in err
    assert not (tmp_path / "lonely").exists(), "nothing may be written before every process joined"
    for name in ("one_x8", "p0", "p1"):
        assert done[name][0] == 0, (name, done[name][1][-3000:])

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
