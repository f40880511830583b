"""The Python-execution tool: model code runs in a limited child interpreter; every failure is an
error observation, counted, and the trainer process never runs the code."""

import os
import socket
import time

import pytest

from jaxrl.agents.sandbox import network_isolated, python_tool, run_python
from jaxrl.agents.tools import TagFormat, ToolRegistry, ToolUse

# A wall-clock limit generous enough for a child interpreter to start on a loaded 2-core machine (a
# tight one turned a memory error into a timeout in CI). The hang test's limit must also let the child
# start and print its grandchild's pid before the clock runs out (1 s did not, once, in CI).
LIMITS = dict(timeout_s=20.0, memory_mb=256, max_output=200)
HANG_LIMITS = dict(LIMITS, timeout_s=6.0)


def _respond(code, **limits):
    limits = {**LIMITS, **limits}
    tools = ToolUse(ToolRegistry([python_tool(**limits)], max_output=limits["max_output"]), TagFormat())
    return tools.respond(f"[python {code}]")


def test_normal_code_returns_its_stdout_and_runs_elsewhere():
    result = run_python("import os\nprint(6*7)\nprint(os.getpid(), os.getcwd())", **LIMITS)
    assert not result.error and not result.timed_out
    answer, pid_cwd = result.output.splitlines()
    pid, cwd = pid_cwd.split()
    assert answer == "42" and int(pid) != os.getpid()
    assert os.path.basename(cwd).startswith("jaxrl_sandbox_") and not os.path.exists(cwd)  # scratch, removed


def test_child_sees_no_trainer_environment(monkeypatch):
    monkeypatch.setenv("JAXRL_TEST_SECRET", "hunter2")
    assert run_python("import os; print(sorted(os.environ))", **LIMITS).output.strip() == "['LANG', 'PATH']"


def test_code_that_raises_is_a_counted_error():
    out = _respond("print(1); 1/0")
    # what it printed, then the last line of its traceback (lower-cased into the tag alphabet)
    assert out.observation == ">error: 1\nzerodivisionerror: division by zero\n"
    assert out.info == {"tool_calls": 1, "tool_errors": 1, "tool_truncated": 0}


def test_hanging_code_is_killed_at_the_timeout_with_its_process_group():
    code = (
        "import os, sys, time\n"
        "try:\n    pid = os.fork()\nexcept OSError:\n    print('nofork', flush=True); time.sleep(60)\n"
        "if pid == 0:\n    time.sleep(60)\n"
        "print(pid, flush=True); time.sleep(60)\n"
    )
    start = time.monotonic()
    result = run_python(code, **HANG_LIMITS)
    assert time.monotonic() - start < HANG_LIMITS["timeout_s"] + 2.0
    assert result.error and result.timed_out and result.output.endswith("timeout after 6s")
    first = result.output.splitlines()[0]
    if first == "nofork":  # RLIMIT_NPROC = 0 binds every user but root
        assert os.geteuid() != 0
        return
    grandchild = int(first)
    for _ in range(100):  # reparented to init once its parent died, then reaped
        if not _alive(grandchild):
            break
        time.sleep(0.01)
    assert not _alive(grandchild)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_memory_past_the_limit_is_an_error():
    result = run_python("x = bytearray(1 << 30)\nprint('allocated')", **LIMITS)  # 1 GiB > 256 MiB
    assert result.error and "allocated" not in result.output and result.output.endswith("MemoryError")
    small = run_python("x = bytearray(64 << 20)\nprint(len(x))", **LIMITS)  # 64 MiB fits
    assert not small.error and small.output == f"{64 << 20}\n"


def test_a_megabyte_of_output_is_cut_and_counted():
    start = time.monotonic()
    out = _respond("print('a' * (1 << 20))")
    assert time.monotonic() - start < 5
    assert out.observation == ">" + "a" * LIMITS["max_output"] + "...\n"
    assert out.info == {"tool_calls": 1, "tool_errors": 0, "tool_truncated": 1}
    endless = run_python("while True: print('b' * 1000)", **LIMITS)  # stopped by the file-size limit, not the clock
    assert not endless.error and endless.output.startswith("b" * 200)
    assert endless.seconds < LIMITS["timeout_s"] / 2


def test_sockets_are_not_importable():
    out = _respond("import socket")
    assert "modulenotfounderror: import of socket halted" in out.observation
    assert out.info["tool_errors"] == 1


def test_network_namespace_blocks_even_a_determined_connection():
    if not network_isolated():
        pytest.skip("no network namespace here (unshare fails): only the module block holds")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    code = (
        "import sys\ndel sys.modules['_socket']\nimport _socket\n"
        f"s = _socket.socket()\ns.settimeout(0.5)\ns.connect(('127.0.0.1', {port}))\nprint('connected')"
    )
    try:
        result = run_python(code, **LIMITS)
    finally:
        server.close()
    assert result.error and "connected" not in result.output and "OSError" in result.output


def test_calls_from_many_threads_keep_their_own_output():
    """Environments step from a thread pool; each call has its own child, scratch directory and files."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: run_python(f"print({i} * 1000)", **LIMITS), range(8)))
    assert [r.output for r in results] == [f"{i * 1000}\n" for i in range(8)]
