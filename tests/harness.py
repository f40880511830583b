"""The tests' one policy for compiling cheaply, and one way to run a child Python.

Tiny models spend their test time compiling, not running, so every test process (pytest's workers and
each child they start) compiles with JAX_DISABLE_MOST_OPTIMIZATIONS=1 (XLA's backend optimisation level
0, no expensive LLVM passes), XLA:CPU's classic fusion emitters instead of its MLIR ones, and no Python
tracebacks in the IR's op locations. The programs mean the same thing and compile in about a third of
the time (the whole suite: 1196 s -> 643 s on 2 cores). Set JAXRL_TEST_OPTIMIZED=1 to run the suite
with XLA's defaults instead.

Both pytest workers and all their children share one persistent compilation cache (conftest's
`cache_env`), so a program that several child runs compile is compiled once. This module imports no
JAX: conftest sets the policy before anything imports it.
"""

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


# XLA:CPU's MLIR fusion emitters cost about a third of a tiny program's compile; the classic emitters
# compile the same fusions faster (test_steps 26 -> 14 CPU-s, test_loss_groups 57 -> 36).
CHEAP_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)


def compile_policy(xla_flags: str = "") -> dict[str, str]:
    """The environment variables that make compiles cheap, given the XLA_FLAGS already set (whose other
    flags are kept); empty under JAXRL_TEST_OPTIMIZED=1."""
    if os.environ.get("JAXRL_TEST_OPTIMIZED") == "1":
        return {}
    names = {flag.split("=")[0] for flag in CHEAP_XLA_FLAGS}
    kept = [flag for flag in xla_flags.split() if flag.split("=")[0] not in names]
    return {
        "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
        "XLA_FLAGS": " ".join(kept + list(CHEAP_XLA_FLAGS)),
        "JAX_TRACEBACK_IN_LOCATIONS_LIMIT": "0",  # no Python stack per op in the IR: a cheaper lowering
    }


def child_env(base: dict | None = None, devices: int | None = None, **extra: str) -> dict[str, str]:
    """Environment for a child Python: this repository importable, the compile policy, and either
    `devices` fake CPU devices or none of the parent's XLA_FLAGS (a parent may have forced 8)."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("XLA_FLAGS", None)
    if devices is not None:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
        env["JAX_PLATFORMS"] = "cpu"
    env.update(compile_policy(env.get("XLA_FLAGS", "")))
    env.update(extra)
    return env


def run_python(args: list[str], env: dict, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    """`python ARGS` from the repository root, output captured; with `check`, a nonzero exit fails the
    test showing the end of the child's stderr."""
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    return proc


def worker_result(script: str, cache_env: dict, devices: int = 8, timeout: float = 600) -> tuple[dict, str]:
    """`python SCRIPT worker` with `devices` fake CPU devices (XLA_FLAGS must be set before jax is
    imported, so such checks run in a child): (its last `RESULT {json}` line, its stderr)."""
    proc = run_python([script, "worker"], child_env(cache_env, devices=devices), timeout)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :]), proc.stderr


def last_json_line(stdout: str, min_lines: int = 1) -> dict:
    """A benchmark's result: its last nonblank line, after at least `min_lines - 1` readable lines."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert len(lines) >= min_lines, stdout
    return json.loads(lines[-1])


def run_benchmark(script: str, *flags: str, env: dict | None = None, timeout: float = 300, min_lines: int = 2) -> dict:
    """benchmarks/SCRIPT FLAGS in a child Python; its JSON line."""
    proc = run_python([str(REPO / "benchmarks" / script), *flags], env or child_env(), timeout)
    return last_json_line(proc.stdout, min_lines)


def run_benchmark_here(script: str, *flags: str, capsys, min_lines: int = 2) -> dict:
    """benchmarks/SCRIPT's `main(FLAGS)` in this process; its JSON line, from what pytest's `capsys`
    captured. For smoke runs where a separate interpreter is not the point: no interpreter start and
    JAX import per run, and programs this worker already compiled (random keys, tiny params) are
    reused. The scripts' own children (the torch peer, the 8-device expert-parallel worker, training
    runs) still run as children."""
    import importlib

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # `benchmarks` is a plain folder at the repository root
    module = importlib.import_module("benchmarks." + script.removesuffix(".py"))
    capsys.readouterr()  # drop what earlier code printed
    module.main(list(flags))
    return last_json_line(capsys.readouterr().out, min_lines)
