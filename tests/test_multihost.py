"""Two processes x 4 fake CPU devices (gloo collectives over localhost) train exactly like one process
x 8 devices; a run whose peer never arrives exits nonzero within its --init-timeout instead of hanging.

All runs start at once (they are mostly compile time on a small machine) and each is killed at its
own deadline.
"""

import json
import socket
import subprocess
import time

import numpy as np
from conftest import DEFAULT_CONFIG, TINY, jaxrl_cmd
from harness import child_env

STEPS = 3
ARGS = [
    str(DEFAULT_CONFIG),
    *sum((["--set", t] for t in TINY), []),
    "--set",
    f"train.steps={STEPS}",
    "--set",
    "mesh.preset=data",
    "--set",
    "checkpoint.every=0",
    "--set",
    "train.eval_every=0",
    # 8 prompts: split over the 8 devices, so each process feeds only its own 4 (2 groups of 2 rows each)
    "--set",
    "rollout.prompts_per_step=8",
    "--set",
    "rollout.group_size=2",
    # a warm start long enough, and the format reward, so that advantages and gradients are not 0
    "--set",
    "warmstart.steps=60",
    "--set",
    "loss.reward_weights=1,1",
]
COMPARED = (
    "reward/mean",
    "reward/correctness",
    "reward/format",
    "loss",
    "grad_norm",
    "kl",
    "entropy",
    "response_len/mean",
    "eval/accuracy",
    "eval/format",
)
RUN_TIMEOUT_S = 300
INIT_TIMEOUT_S = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env(cache_env: dict, devices: int, root=None) -> dict:
    env = child_env(cache_env, devices=devices)
    if root is not None:  # its own data and warm-start caches: nothing is shared with the reference run
        env["JAXRL_DATA_DIR"], env["JAXRL_CACHE_DIR"] = str(root / "tfds"), str(root / "warmstart")
    return env


def _rows(workdir) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())}


def _finish(procs: dict, deadline: float) -> dict:
    """Poll every process until it ends or `deadline` passes (then kill it).
    name -> (returncode, stderr, seconds from start to exit)."""
    out = {}
    while len(out) < len(procs):
        for name, (proc, t0, log) in procs.items():
            if name not in out and (proc.poll() is not None or time.time() > deadline):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                out[name] = (proc.returncode, log.read_text(), time.time() - t0)
        time.sleep(0.2)
    return out


def test_two_processes_match_one_process_and_a_missing_peer_fails(tmp_path, cache_env):
    port, lonely_port = _free_port(), _free_port()

    def start(args, env):
        log = tmp_path / f"stderr_{len(list(tmp_path.glob('stderr_*')))}.txt"
        with log.open("w") as f:
            proc = subprocess.Popen(jaxrl_cmd("train", *args), env=env, stdout=subprocess.DEVNULL, stderr=f)
        return proc, time.time(), log

    multi = ["--coordinator", f"localhost:{port}", "--num-processes", "2", "--init-timeout", "120"]
    procs = {
        "one_x8": start([*ARGS, "--workdir", str(tmp_path / "one")], _env(cache_env, 8)),
        "p0": start(
            [*ARGS, "--workdir", str(tmp_path / "two"), *multi, "--process-id", "0"],
            _env(cache_env, 4, tmp_path / "cache2"),
        ),
        "p1": start(
            [*ARGS, "--workdir", str(tmp_path / "two"), *multi, "--process-id", "1"],
            _env(cache_env, 4, tmp_path / "cache2"),
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
            _env(cache_env, 4, tmp_path / "cache3"),
        ),
    }
    done = _finish(procs, time.time() + RUN_TIMEOUT_S)

    code, err, seconds = done["lonely"]
    assert code != 0, err[-2000:]
    assert seconds < INIT_TIMEOUT_S + 60, seconds
    assert "jaxrl: process 0 of 2 joining" in err
    assert not (tmp_path / "lonely").exists(), "nothing may be written before every process joined"
    for name in ("one_x8", "p0", "p1"):
        assert done[name][0] == 0, (name, done[name][1][-3000:])

    one, two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert sorted(one) == sorted(two) == list(range(STEPS + 1))  # process 1 wrote no rows of its own
    assert any(one[s]["grad_norm"] > 1e-3 for s in range(1, STEPS + 1)), "a zero-gradient run proves nothing"
    for step in one:
        for key in COMPARED:
            if one[step].get(key) is not None:
                np.testing.assert_allclose(two[step][key], one[step][key], atol=1e-4, rtol=0, err_msg=f"{step} {key}")
    # one checkpoint, saved by both processes together, restorable like any other
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir() if p.name.isdigit()) == [str(STEPS)]


def test_bad_multiprocess_flags_are_one_line_errors(capsys, monkeypatch):
    from jaxrl.cli import main

    for name in ("JAXRL_COORDINATOR", "JAXRL_NUM_PROCESSES", "JAXRL_PROCESS_ID", "JAXRL_INIT_TIMEOUT"):
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
