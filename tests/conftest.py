"""Shared fixtures: a tiny run configuration and an isolated data/warm-start cache per session."""

import os
import pathlib
import signal
import sys

from harness import child_env, compile_policy

os.environ.update(compile_policy(os.environ.get("XLA_FLAGS", "")))  # before anything imports jax: see harness.py
# torch (the HF reference models, the PyTorch peers) on one OpenMP thread in every test process and child:
# its models here are tiny, and with two pytest workers on two cores a second thread only spins
# (test_hf.py 59 -> 48 CPU-s).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax  # noqa: E402
import pytest
from jax.experimental.compilation_cache import compilation_cache as cc

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "grpo_arithmetic.py"

# Small enough that a run of a dozen steps takes seconds on 2 cores.
TINY = [
    "model.d_model=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.head_dim=16",
    "model.mlp_dim=64",
    "data.num_train=600",
    "data.num_test=60",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "warmstart.steps=10",
    "warmstart.batch_size=16",
    "train.eval_prompts=20",
    "train.eval_every=4",
    "train.progress=false",
]


@pytest.fixture(scope="session")
def cache_env(tmp_path_factory):
    """Environment for subprocess runs: data and warm-start caches shared across this session's tests."""
    root = tmp_path_factory.mktemp("jaxrl_cache")
    env = child_env()
    env["JAXRL_DATA_DIR"] = str(root / "tfds")
    env["JAXRL_CACHE_DIR"] = str(root / "warmstart")
    # Subprocess runs compile the same functions; a persistent cache shared by both pytest workers and
    # all their children compiles each once. (An entry read while another process is still writing it
    # fails to decompress, and JAX then compiles the program itself.)
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the session's directory, above each worker's own
    env["JAX_COMPILATION_CACHE_DIR"] = str(shared / "xla_cache")
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env


@pytest.fixture()
def in_process_cache(cache_env, monkeypatch):
    monkeypatch.setenv("JAXRL_DATA_DIR", cache_env["JAXRL_DATA_DIR"])
    monkeypatch.setenv("JAXRL_CACHE_DIR", cache_env["JAXRL_CACHE_DIR"])
    return cache_env


@pytest.fixture(scope="module")
def persistent_compile_cache(cache_env):
    """For the modules that ask for it (`pytestmark = pytest.mark.usefixtures(...)`): the persistent
    XLA cache the children use, in this process too, restored after the module. It pays where training
    runs repeat programs (the same tiny model's rollout, update and eval; a child resuming a run this
    process trained); elsewhere writing every program to disk costs more than it saves (~17% on the
    compile-bound exactness tests)."""
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    before = {n: getattr(jax.config, n) for n in names}
    jax.config.update("jax_compilation_cache_dir", cache_env["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    cc.reset_cache()  # make JAX re-read the cache settings
    yield
    for n, v in before.items():
        jax.config.update(n, v)
    cc.reset_cache()


def jaxrl_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "jaxrl.cli", *args]


@pytest.fixture(autouse=True)
def fresh_registries():
    """Each test starts from the built-in presets and tasks: a config file a test loads registers its own
    loss or task into the process-wide tables, which must not leak into the next test."""
    from jaxrl.data import registry
    from jaxrl.losses import presets

    saved = dict(presets.PRESETS), dict(registry._TASKS)
    yield
    presets.PRESETS.clear()
    presets.PRESETS.update(saved[0])
    registry._TASKS.clear()
    registry._TASKS.update(saved[1])


@pytest.fixture(autouse=True)
def restored_sigint():
    """`jaxrl.cli.main` ignores SIGINT once a Ctrl-C has ended a run (the process is about to exit); a test
    that calls it in this process gets pytest's own handler back afterwards."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)
