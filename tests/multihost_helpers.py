"""Shared by the multi-process tests (test_multihost.py; test_scripts.py's cluster variables): the run
every process trains, the metrics compared with a one-process run, and a harness that starts `jaxrl
train` processes at once and kills each one that outlives its deadline."""

import json
import socket
import subprocess
import time

import numpy as np
from conftest import DEFAULT_CONFIG, TINY, jaxrl_cmd
from harness import child_env

# what a cluster or an earlier multi-process launch may have left in the environment of these tests
CLUSTER_VARS = (
    "SLURM_",
    "OMPI_",
    "KUBERNETES_SERVICE_HOST",
    "TPU_WORKER",
    "MEGASCALE_",
    "JAX_COORDINATOR",
    "JAX_LOCAL",
)
DIST_VARS = ("JAXRL_COORDINATOR", "JAXRL_NUM_PROCESSES", "JAXRL_PROCESS_ID", "JAXRL_INIT_TIMEOUT", "JAXRL_CLUSTER")


def without_cluster_vars(env: dict) -> dict:
    return {k: v for k, v in env.items() if not k.startswith(CLUSTER_VARS + DIST_VARS)}


def run_args(steps: int) -> list[str]:
    """`jaxrl train` arguments for a tiny data-parallel run whose 8 prompts split over 8 devices."""
    return [
        str(DEFAULT_CONFIG),
        *sum((["--set", t] for t in TINY), []),
        "--set",
        f"train.steps={steps}",
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def device_env(cache_env: dict, devices: int, root=None) -> dict:
    """`cache_env` with `devices` fake CPU devices (harness.child_env); `root`: caches of its own."""
    env = child_env(cache_env, devices=devices)
    if root is not None:  # its own data and warm-start caches: nothing is shared with the reference run
        env["JAXRL_DATA_DIR"], env["JAXRL_CACHE_DIR"] = str(root / "tfds"), str(root / "warmstart")
    return env


def metric_rows(workdir) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())}


def start_train(args: list[str], env: dict, log) -> tuple:
    """Start `jaxrl train ARGS` with stderr to the file `log`; the handle `finish` polls."""
    with log.open("w") as f:
        proc = subprocess.Popen(jaxrl_cmd("train", *args), env=env, stdout=subprocess.DEVNULL, stderr=f)
    return proc, time.time(), log


def finish(procs: dict, deadline: float) -> dict:
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


def assert_same_metrics(two: dict, one: dict, steps: int) -> None:
    """Every step logged once by the multi-process run, each compared metric as the one-process run's."""
    assert sorted(one) == sorted(two) == list(range(steps + 1))  # process 1 wrote no rows of its own
    assert any(one[s]["grad_norm"] > 1e-3 for s in range(1, steps + 1)), "a zero-gradient run proves nothing"
    for step in one:
        for key in COMPARED:
            if one[step].get(key) is not None:
                np.testing.assert_allclose(two[step][key], one[step][key], atol=1e-4, rtol=0, err_msg=f"{step} {key}")
