"""The slot engine in multi-process runs, and its state's explicit layout.

* The engine's programs (`_admit`, `decode_chunk`, `reprefill`, `release_slots`) compile once each on
  a mesh of 8 fake devices: every one of them leaves the state laid out by `state_shardings`.
* Two processes x 4 fake devices: EngineSource (exact and fill admission with partial rollouts; top_k=1,
  so every prompt's completion is its greedy one) draws for every prompt what one process x 8 devices
  draws, and the step's prompts are the same ones; dynamic sampling with the prompt filter, and
  VIGOR, run; a checkpoint's round trip resumes each process's engine exactly
  (engine_processes_script.py).
* `jaxrl train` with the engine on two processes: SIGKILL one process mid-run (partial rollouts in
  flight): the other exits with one error line well before its timeout; both resumed reach the
  metrics of an uninterrupted two-process run.
"""

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import REPO
from harness import child_env
from multihost_helpers import (
    device_env,
    finish,
    free_port,
    metric_rows,
    run_args,
    start_train,
    without_cluster_vars,
)

COMPILE_SCRIPT = r"""
import logging
import jax, numpy as np
from jax.sharding import PartitionSpec as P
from jaxrl.config import EngineConfig, MeshConfig, ModelConfig
from jaxrl.models import transformer as tf
from jaxrl.rollout.engine import partial, state as es
from jaxrl.rollout.engine.driver import Engine
from jaxrl.rollout.sampler import SamplingParams
from jaxrl.sharding import make_mesh, param_shardings, parallel_for

compiled = []
class Count(logging.Handler):
    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("Compiling jit("):
            compiled.append(msg[len("Compiling jit("):].split(")")[0])
handler = Count()
logging.getLogger("jax").addHandler(handler)
jax.config.update("jax_log_compiles", True)

cfg = ModelConfig(vocab_size=29, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64)
for name in ("data", "fsdp"):
    mesh, preset = make_mesh(MeshConfig(preset=name))
    params = tf.init_params(cfg, jax.random.key(0))
    params = jax.device_put(params, param_shardings(mesh, preset, tf.param_logical_axes(cfg), params))
    engine = Engine(
        cfg, EngineConfig(slots=8, chunk=2, admit_groups=2, admission="fill"),
        sampling=SamplingParams(max_new_tokens=6, eos_id=1, pad_id=0), group_size=2, prompt_len=5,
        rng=jax.random.key(1), parallel=parallel_for(mesh, preset),
    )
    prompts = iter([(i, np.arange(2, 3 + i % 4)) for i in range(60)])
    del compiled[:]
    S = engine.spec.slots
    for version in range(3):  # each kernel twice or more, each feeding the state to the others
        engine.collect(params, version, prompts, 3)
        engine.pool.state = partial.release_slots(engine.spec, engine.pool.state, np.zeros(S, bool))
        engine.pool.state = partial.reprefill(
            params, engine.spec, engine.pool.state, np.zeros((S, 5), np.int32), np.ones((S, 5), np.int32),
            np.zeros(S, bool),
        )
    counts = {f: compiled.count(f) for f in ("_admit", "decode_chunk", "reprefill", "release_slots", "init_state")}
    assert engine.counts["prefill_calls"] > 2 and engine.counts["chunks"] > 2, engine.counts
    once = {"_admit": 1, "decode_chunk": 1, "reprefill": 1, "release_slots": 1, "init_state": 0}
    assert counts == once, (name, counts)
    # the compiled program's state out: slots split over the batch axis (8 slots / 8 devices), RNG replicated
    lparams = es.split_params(params, cfg)
    out = es.decode_chunk.lower(lparams, engine.spec, engine.pool.state, 2, 0, 1.0).compile().output_shardings
    assert out.tokens_SxT.spec == P(name) and out.cache.kv[0][0].spec == P(name) and out.rng.spec == P(), out
    assert out == es.state_shardings(engine.spec, engine.pool.state), out
    print(name, counts, flush=True)
print("compiles OK", flush=True)
"""


@pytest.mark.slow
def test_engine_programs_compile_once_under_a_mesh(tmp_path):
    env = child_env(devices=8)
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=240, cwd=REPO
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("compiles OK"), proc.stderr[-3000:]


SCRIPT = REPO / "tests" / "engine_processes_script.py"


def _script(out, n, pid, port, variants, env):
    env = {**env, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
    cmd = [sys.executable, str(SCRIPT), str(out), str(n), str(pid), str(port), *variants]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _by_prompt(rows) -> dict:
    """prompt tokens -> the completions drawn for it (each prompt's group: G identical greedy rows)."""
    out = {}
    for prompt, tokens, _ in rows:
        out.setdefault(tuple(prompt), []).append(tokens)
    return out


@pytest.mark.slow
def test_two_processes_draw_what_one_process_draws(tmp_path, cache_env):
    clean, port = without_cluster_vars(cache_env), free_port()
    variants = ["exact", "fill", "dynamic", "vigor"]
    procs = [
        _script(tmp_path / "two.json", 2, p, port, variants, device_env(clean, 4, tmp_path / "cache2")) for p in (0, 1)
    ]
    procs.append(_script(tmp_path / "one.json", 1, 0, 0, variants[:2], device_env(clean, 8)))
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=400)[0])
        finally:
            proc.kill()
        assert proc.returncode == 0 and outs[-1].rstrip().endswith("engine processes OK"), outs[-1][-3000:]
    one, two = json.loads((tmp_path / "one.json").read_text()), json.loads((tmp_path / "two.json").read_text())
    for name in ("exact", "fill"):
        for step, (a, b) in enumerate(zip(one[name], two[name], strict=True)):
            want, got = _by_prompt(a["rows"]), _by_prompt(b["rows"])
            assert len(b["rows"]) == 8 and len(got) == 4, (name, step)
            # the same prompts (stream positions p, p+2, ... of process p), each with the same completions
            assert got == want, (name, step)
            # group ids: process 1's counted from its first row (4), never colliding with process 0's
            assert sorted({g for _, _, g in b["rows"]}) == [0, 1, 4, 5], (name, step)
            for key in ("reward/mean", "response_len/mean", "engine/staleness_mean", "engine/partial_frac"):
                assert b["metrics"][key] == pytest.approx(a["metrics"][key], abs=1e-6), (name, step, key)
    # fill carries groups from one step into the next (drawn at version 0, returned at version 1)
    assert [s["metrics"]["engine/staleness_max"] for s in two["fill"]] == [0, 1, 0]
    for name in ("dynamic", "vigor"):
        for step in two[name]:
            assert len(step["rows"]) == 8 and np.isfinite(step["metrics"]["reward/mean"])
    assert two["dynamic"][0]["metrics"]["engine/dyn_extra"] == 8  # max_extra_groups=4 on each process
    assert two["vigor"][0]["metrics"]["engine/vigor_draws"] >= 2


def _train_args(workdir, steps: int) -> list[str]:
    return [
        *run_args(steps),
        "--workdir",
        str(workdir),
        "--set",
        "rollout.engine.enabled=true",
        "--set",
        "rollout.engine.slots=16",
        "--set",
        "rollout.engine.chunk=2",
        "--set",
        "rollout.engine.admission=fill",
        "--set",
        "rollout.engine.reprefill=true",
        "--set",
        "checkpoint.every=1",
        "--set",
        "checkpoint.async_save=false",
    ]


def _start_pair(tmp_path, tag, workdir, steps, env, port):
    return {
        f"{tag}{p}": start_train(
            [
                *_train_args(workdir, steps),
                "--coordinator",
                f"localhost:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(p),
                "--init-timeout",
                "120",
            ],
            env,
            tmp_path / f"stderr_{tag}{p}.txt",
        )
        for p in (0, 1)
    }


STEPS = 4
RUN_TIMEOUT_S = 420


@pytest.mark.slow
def test_sigkill_of_one_process_stops_the_run_and_a_resume_matches(tmp_path, cache_env):
    env = device_env(without_cluster_vars(cache_env), 4, tmp_path / "cache")
    whole = _start_pair(tmp_path, "whole", tmp_path / "whole", STEPS, env, free_port())
    cut_dir = tmp_path / "cut"
    cut = _start_pair(tmp_path, "cut", cut_dir, STEPS, env, free_port())
    deadline = time.time() + RUN_TIMEOUT_S
    while not (cut_dir / "checkpoints" / "2").is_dir() and time.time() < deadline:
        time.sleep(0.2)
    cut["cut1"][0].send_signal(signal.SIGKILL)  # process 1 dies with samples in flight
    killed_at = time.time()
    done = finish(cut, deadline)
    code, err, _ = done["cut0"]
    assert code not in (0, None) and time.time() - killed_at < 150, (code, err[-3000:])
    last = err.strip().splitlines()[-1]
    assert last.startswith("jaxrl: error: ") and "process" in last, err[-3000:]
    saved = sorted(int(p.name) for p in (cut_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert 2 <= saved[-1] < STEPS, saved
    host = json.loads((cut_dir / "checkpoints" / str(saved[-1]) / "host" / "metadata").read_text())
    assert [len(p["engine"]["flights"]) + len(p["engine"]["ready"]) > 0 for p in host["processes"]] == [True] * 2

    resumed = _start_pair(tmp_path, "resumed", cut_dir, STEPS, env, free_port())
    done.update(finish({**whole, **resumed}, time.time() + RUN_TIMEOUT_S))
    for name in ("whole0", "whole1", "resumed0", "resumed1"):
        assert done[name][0] == 0, (name, done[name][1][-3000:])
    want, got = metric_rows(tmp_path / "whole"), metric_rows(cut_dir)
    assert sorted(got) == sorted(want) == list(range(STEPS + 1))
    assert any(want[s]["engine/partial_frac"] > 0 for s in range(1, STEPS + 1)), "no partial rollouts: proves nothing"
    for step in range(1, STEPS + 1):
        for key in ("reward/mean", "loss", "grad_norm", "response_len/mean", "engine/staleness_mean"):
            np.testing.assert_allclose(got[step][key], want[step][key], rtol=0, atol=1e-6, err_msg=f"{step} {key}")


def test_a_checkpoint_of_another_process_count_is_refused():
    from jaxrl.config import ConfigError
    from jaxrl.sources.base import ARRAYS
    from jaxrl.sources.processes import PROCESSES, ProcessShare

    two = {PROCESSES: [{"engine": {"next_id": 0}}, {"engine": {"next_id": 5}}], ARRAYS: {"process_1": {"engine": 1}}}
    assert ProcessShare(1, 2).restored(two, "engine") == ({"engine": {"next_id": 5}}, {"engine": 1})
    assert ProcessShare(1, 2).restored({}, "engine") is None  # a fresh run
    with pytest.raises(ConfigError, match="engine: the checkpoint was written by 2 processes, this run has 3"):
        ProcessShare(0, 3).restored(two, "engine")
    with pytest.raises(ConfigError, match="engine: the checkpoint was written by a one-process run; this run has 2"):
        ProcessShare(1, 2).restored({"engine": {}}, "engine")


def test_process_metrics_combine_counts_rates_and_extremes():
    from jaxrl.sources.processes import combine_metrics

    rows = [
        {"reward/mean": 0.5, "engine/chunks": 3, "engine/dyn_cap_hit": 0, "engine/vigor_min_group": 2, "x": None},
        {"reward/mean": 1.0, "engine/chunks": 4, "engine/dyn_cap_hit": 1, "engine/vigor_min_group": 1, "x": None},
    ]
    got = combine_metrics(rows, counts=("engine/chunks",))
    assert got == {
        "reward/mean": 0.75,
        "engine/chunks": 7,
        "engine/dyn_cap_hit": 1,
        "engine/vigor_min_group": 1,
        "x": None,
    }
    assert isinstance(got["engine/chunks"], int)


def test_prompt_feeds_of_two_processes_interleave_into_the_one_process_stream(in_process_cache):
    from jaxrl.config import load_config
    from jaxrl.data.stream import StreamState
    from jaxrl.data.tasks import load_task
    from jaxrl.data.tokenizer import CharTokenizer
    from jaxrl.sources.groups import PromptFeed
    from jaxrl.sources.processes import ProcessShare

    cfg = load_config(REPO / "configs" / "grpo_arithmetic.py", ["data.num_train=10"])
    task, tok = load_task(cfg.data), CharTokenizer()
    one = PromptFeed(task.train, StreamState(), tok, cfg)
    want = [next(one)[0]["id"] for _ in range(16)]  # crosses an epoch (10 records)
    feeds = [
        PromptFeed(task.train, ProcessShare(p, 2).first_position(task.train, StreamState(), cfg.data.seed), tok, cfg, 2)
        for p in (0, 1)
    ]
    got = [next(feeds[i % 2])[0]["id"] for i in range(16)]
    assert got == want
    # each passes over the other's next prompt: process 0 stands where one process does, process 1 one on
    assert (feeds[0].stream, feeds[1].stream) == (one.stream, StreamState(1, 7)) and one.stream == StreamState(1, 6)
