"""train.microbatches=0: the fewest microbatches whose compiled update fits train.memory_budget_gib."""

import jax
import jax.numpy as jnp
import pytest
from conftest import DEFAULT_CONFIG, TINY
from jax import lax

from jaxrl.config import REMAT, ConfigError, load_config
from jaxrl.models.remat import REMAT_POLICIES
from jaxrl.train import loop, memory_budget
from jaxrl.train.memory_budget import CPU_BUDGET_GIB, GIB, auto_jit, choose_microbatches, resolve_budget_gib


class _FakeCompiled:
    def __init__(self, gib):
        self.gib = gib

    def memory_analysis(self):
        return type("Analysis", (), {"temp_size_in_bytes": int(self.gib * GIB)})()


def test_choose_fewest_fitting_and_skip_the_impossible():
    # temp(n) = 0.5 + 7 / n GiB, budget 2: n = 1 -> 7.5, 2 -> 4.0, 4 -> 2.25, 8 -> 1.375. The fewest that
    # fits is 8; temp(1) / budget = 3.75, so 2 (and 3, not a divisor of 64) is never compiled.
    compiled = []

    def compile_for(n):
        compiled.append(n)
        return _FakeCompiled(0.5 + 7 / n)

    n, tried = choose_microbatches(compile_for, 64, 2.0)
    assert n == 8 and compiled == [1, 4, 8]
    assert tried == {1: 7.5, 4: 2.25, 8: 1.375}
    assert choose_microbatches(compile_for, 64, 8.0)[0] == 1
    # Divisors of 6 only: 2 -> 4.0, 3 -> 2.83, 6 -> 1.67.
    assert choose_microbatches(compile_for, 6, 3.0)[0] == 3
    assert choose_microbatches(compile_for, 6, 2.5)[0] == 6


def test_nothing_fits_names_the_field():
    with pytest.raises(ConfigError, match=r"train.memory_budget_gib=0.1: .*even 4 microbatches of 1 row"):
        choose_microbatches(lambda n: _FakeCompiled(1.0 / n), 4, 0.1)


def test_auto_jit_compiles_real_candidates_and_returns_the_chosen_one():
    # Gradient accumulation over n microbatches of a 1024-row batch: each keeps its (1024/n) x 1024
    # float32 tanh activations (4 MiB at n = 1) for the backward; the 64 x 1024 gradients do not shrink.
    x = jnp.linspace(-1.0, 1.0, 1024 * 64).reshape(1024, 64)
    w = jnp.ones((64, 1024)) * 1e-2

    def jit_for(n):
        def grads(x, w):
            one = jax.grad(lambda w, xs: jnp.sum(jnp.tanh(xs @ w) ** 2))
            return lax.scan(lambda g, xs: (g + one(w, xs), None), jnp.zeros_like(w), x.reshape(n, -1, 64))[0]

        return jax.jit(grads)

    def temp(n):
        return jit_for(n).lower(x, w).compile().memory_analysis().temp_size_in_bytes / GIB

    budget = temp(1) / 3
    lines = []
    step, n = auto_jit(jit_for, (x, w), 1024, budget, log=lines.append)
    assert n > 1 and temp(n) <= budget and all(temp(m) > budget for m in range(1, n) if 1024 % m == 0), n
    assert jnp.allclose(step(x, w), jit_for(1)(x, w), rtol=1e-5, atol=1e-6)  # the chosen, compiled update
    assert len(lines) == 1 and f"-> {n} microbatch(es)" in lines[0] and "train.memory_budget_gib" in lines[0]


def test_config_fields_validated():
    cfg = load_config(DEFAULT_CONFIG, ["train.microbatches=0"])  # 0 (auto) passes the divisibility check
    assert cfg.train.microbatches == 0
    for bad, field in [
        ("train.memory_budget_gib=-1", "train.memory_budget_gib"),
        ("train.logits_chunk=-1", "train.logits_chunk"),
        ("train.remat=some", "train.remat"),
        ("train.microbatches=-1", "train.microbatches"),
    ]:
        with pytest.raises(ConfigError, match=field):
            load_config(DEFAULT_CONFIG, [bad])
    assert set(REMAT) == set(REMAT_POLICIES)
    assert load_config(DEFAULT_CONFIG, []).train.memory_budget_gib == 0  # the default: from the device


class _FakeDevice:
    """A device as `memory_stats` reports it: an accelerator's bytes_limit, or None as XLA:CPU says."""

    def __init__(self, platform, stats):
        self.platform, self.stats = platform, stats

    def memory_stats(self):
        return self.stats


def test_budget_from_the_device():
    gpu = _FakeDevice("gpu", {"bytes_limit": 100 * GIB, "bytes_in_use": 3 * GIB})
    budget, source = resolve_budget_gib(0.0, gpu)
    assert budget == memory_budget.DEVICE_SHARE * 100 and "gpu bytes_limit 100.00 GiB" in source
    assert resolve_budget_gib(3.5, gpu) == (3.5, "train.memory_budget_gib=3.5")  # set: the device is not asked
    for cpu_stats in (None, {}, {"bytes_limit": 0}):  # nothing reported: today's CPU budget
        budget, source = resolve_budget_gib(0.0, _FakeDevice("cpu", cpu_stats))
        assert budget == CPU_BUDGET_GIB == 2.0 and "reports no limit" in source
    # The real XLA:CPU device reports no limit, so every CPU run keeps its 2 GiB.
    assert resolve_budget_gib(0.0, jax.devices()[0])[0] == (2.0 if jax.devices()[0].platform == "cpu" else budget)


def test_device_budget_picks_the_microbatches_and_is_logged_once():
    # temp(n) = 7 / n GiB: a 16 GiB device gives an 8 GiB budget -> 1 microbatch, a 4 GiB one 2 GiB -> 4.
    lines = []
    for limit_gib, expected in [(16, 1), (4, 4)]:
        budget, source = resolve_budget_gib(0.0, _FakeDevice("tpu", {"bytes_limit": limit_gib * GIB}))
        n, tried = choose_microbatches(lambda n: _FakeCompiled(7 / n), 8, budget)
        lines.append(memory_budget.report_choice(n, tried, budget, source))
        assert n == expected, (limit_gib, n)
    assert "<= 2.00 GiB (train.memory_budget_gib=0: 0.5 x tpu bytes_limit 4.00 GiB" in lines[1], lines[1]


@pytest.mark.slow
def test_training_run_with_auto_microbatches(tmp_path, in_process_cache, monkeypatch, capsys):
    # The default budget (0: from the device) on a device said to allow 128 GiB: 64 GiB, logged once.
    monkeypatch.setattr(memory_budget, "device_bytes_limit", lambda device: 128 * GIB)
    base = [t for t in TINY if not t.startswith("train.eval_")] + [
        "train.steps=1",
        "train.eval_every=0",
        "train.eval_prompts=2",
        "checkpoint.every=0",
    ]
    rows = loop.train(
        load_config(
            DEFAULT_CONFIG,
            base + ["train.microbatches=0", "train.logits_chunk=8", "train.remat=full"],
        ),
        tmp_path / "a",
    )
    assert rows[-1]["microbatches"] == 1  # recorded in the metrics row
    logged = [line for line in capsys.readouterr().err.splitlines() if "train.microbatches=0 (auto)" in line]
    assert len(logged) == 1 and "<= 64.00 GiB" in logged[0] and "bytes_limit 128.00 GiB" in logged[0]
