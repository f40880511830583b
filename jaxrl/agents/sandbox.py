"""A Python-execution tool: model-written code runs in a child interpreter, never in the trainer.

    tool = python_tool(timeout_s=2.0, memory_mb=512, max_output=2000)   # a tools.Tool named "python"
    run_python("print(6*7)", ...)  -> SandboxResult(output="42\\n", error=False, ...)

Each call runs `python -I -S` in a fresh scratch directory and its own process group, with memory, CPU,
file-size and process limits, network modules blocked and, where `unshare` works (`network_isolated()`),
no network at all; the whole group is SIGKILLed at `timeout_s`. These are limits for honest-but-buggy
model code, not a boundary against an adversary: docs/agents.md lists exactly what is and is not
guaranteed.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

from jaxrl.agents.tools import Tool, ToolError

NOBODY = 65534

# Runs in the child before the model's code: limits, privileges, network modules, then main.py.
_PRELUDE = r"""
import os, resource, sys
memory, cpu, fsize, drop = (int(v) for v in sys.argv[1:5])
for limit, value in ((resource.RLIMIT_CORE, 0), (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_CPU, cpu)):
    resource.setrlimit(limit, (value, value))
if drop:
    os.setgroups([]); os.setgid(drop); os.setuid(drop)
resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
for name in ("socket", "_socket", "ssl", "_ssl", "ctypes", "_ctypes"):
    sys.modules[name] = None
del sys.argv[1:], os, resource, memory, cpu, fsize, drop, limit, value, name
with open("main.py") as _f:
    _code = compile(_f.read(), "main.py", "exec")
del _f
exec(_code)
"""


class SandboxResult(NamedTuple):
    output: str  # stdout, then (on an error) the last line of stderr
    error: bool  # the code raised, was killed, or exited non-zero
    timed_out: bool
    seconds: float


@functools.cache
def _unshare_prefix() -> tuple:
    """The command prefix that runs a program in a new network namespace, () if none works here."""
    exe = shutil.which("unshare")
    if exe is None:
        return ()
    prefix = (exe, "-n") if os.geteuid() == 0 else (exe, "-r", "-n")
    try:
        ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return prefix if ok else ()


def network_isolated() -> bool:
    """True when the child runs in its own network namespace (see the module docstring)."""
    return bool(_unshare_prefix())


@functools.cache
def _drop_to() -> int:
    """The uid the child drops to: nobody when we are root and nobody can read the interpreter, else 0."""
    if os.geteuid() != 0:
        return 0
    paths = [os.path.realpath(sys.executable), os.path.dirname(os.__file__)]
    return NOBODY if all(_world_readable(p) for p in paths) else 0


def _world_readable(path: str) -> bool:
    parts = os.path.abspath(path).split(os.sep)
    for i in range(2, len(parts) + 1):
        mode = os.stat(os.sep.join(parts[:i]) or os.sep).st_mode
        if not mode & (stat.S_IXOTH if stat.S_ISDIR(mode) else stat.S_IROTH):
            return False
    return True


def run_python(code: str, timeout_s: float, memory_mb: int, max_output: int) -> SandboxResult:
    """Run `code` in a limited child interpreter (see the module docstring); never raises for the code."""
    fsize = 4 * max_output + 4096
    drop = _drop_to()
    scratch = tempfile.mkdtemp(prefix="jaxrl_sandbox_")
    try:
        if drop:
            os.chmod(scratch, 0o777)
        with open(os.path.join(scratch, "main.py"), "w") as f:
            f.write(code)
        os.chmod(os.path.join(scratch, "main.py"), 0o644)
        argv = [
            *_unshare_prefix(),
            sys.executable,
            "-I",
            "-S",
            "-c",
            _PRELUDE,
            str(memory_mb << 20),
            str(math.ceil(timeout_s) + 1),
            str(fsize),
            str(drop),
        ]
        out_path, err_path = os.path.join(scratch, "stdout"), os.path.join(scratch, "stderr")
        start = time.monotonic()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                argv,
                cwd=scratch,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                start_new_session=True,
            )
        timed_out = _wait_or_kill(proc, timeout_s)
        seconds = time.monotonic() - start
        output, errors = _read(out_path, max_output + 1), _read(err_path, fsize)
        output_limited = os.path.getsize(out_path) >= fsize
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if output_limited:  # its writes failed past the limit; the text (cut downstream) is the answer
        return SandboxResult(output, False, False, seconds)
    return _result(proc.returncode, output, errors, timed_out, seconds, timeout_s)


def _wait_or_kill(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for the child (at most timeout_s), then SIGKILL its whole process group, whatever the child
    left running, before reaping it: an unreaped leader keeps the group's id ours. -> whether it timed out."""
    deadline = time.monotonic() + timeout_s
    timed_out = True
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            timed_out = False
            break
        time.sleep(0.005)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    return timed_out


def _read(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(4 * limit).decode("utf-8", errors="replace")[:limit]


def _result(
    returncode: int, output: str, errors: str, timed_out: bool, seconds: float, timeout_s: float
) -> SandboxResult:
    if timed_out:
        reason = f"timeout after {timeout_s:g}s"
    elif returncode == -signal.SIGXCPU:
        reason = "cpu time limit"
    elif returncode < 0:
        reason = f"killed by {signal.Signals(-returncode).name}"
    elif returncode != 0:
        lines = errors.strip().splitlines()
        reason = lines[-1] if lines else f"exit status {returncode}"
    else:
        return SandboxResult(output, False, False, seconds)
    return SandboxResult(
        output + ("\n" if output and not output.endswith("\n") else "") + reason, True, timed_out, seconds
    )


def python_tool(timeout_s: float = 2.0, memory_mb: int = 512, max_output: int = 2000, name: str = "python") -> Tool:
    """A Tool running its argument (code) in the sandbox; a failed run is an error observation.
    An environment that offers it passes its limits (max_output: e.g. agent.tool_max_output)."""

    def run(code: str) -> str:
        result = run_python(code, timeout_s, memory_mb, max_output)
        if result.error:
            raise ToolError(result.output)
        return result.output

    return Tool(name, run, "run Python code (standard library only, no network); returns what it prints")
