"""train.microbatches=0: the fewest microbatches whose compiled update fits train.memory_budget_gib."""

import jax
import jax.numpy as jnp
import pytest
from conftest import DEFAULT_CONFIG, TINY
from jax import lax

from jaxrl.config import REMAT, ConfigError, load_config
from jaxrl.models.remat import REMAT_POLICIES
from jaxrl.train import loop, memory_budget
from jaxrl.train.memory_budget import (
    AUTO_LOGITS_CHUNK,
    CPU_BUDGET_GIB,
    GIB,
    Fit,
    auto_jit,
    choose_fit,
    choose_microbatches,
    memory_rungs,
    resolve_budget_gib,
)


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

    def jit_for(fit):
        n = fit.microbatches

        def grads(x, w):
            one = jax.grad(lambda w, xs: jnp.sum(jnp.tanh(xs @ w) ** 2))
            return lax.scan(lambda g, xs: (g + one(w, xs), None), jnp.zeros_like(w), x.reshape(n, -1, 64))[0]

        return jax.jit(grads)

    def temp(n):
        return jit_for(Fit(n)).lower(x, w).compile().memory_analysis().temp_size_in_bytes / GIB

    budget = temp(1) / 3
    lines = []
    step, fit, tried = auto_jit(jit_for, (x, w), 1024, budget, log=lines.append)
    n = fit.microbatches
    assert fit == Fit(n, "none", 0) and tried[fit] <= budget and n > 1 and temp(n) <= budget
    assert all(temp(m) > budget for m in range(1, n) if 1024 % m == 0), n
    assert jnp.allclose(step(x, w), jit_for(Fit(1))(x, w), rtol=1e-5, atol=1e-6)  # the chosen, compiled update
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
    defaults = load_config(DEFAULT_CONFIG, []).train
    assert defaults.memory_budget_gib == 0 and defaults.remat == "auto"  # the defaults: from the device


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
        fit, tried = choose_fit(lambda fit: _FakeCompiled(7 / fit.microbatches), 8, budget, 0, (("none", 0),))
        lines.append(memory_budget.report_choice(fit, tried, budget, source))
        assert fit == Fit(expected), (limit_gib, fit)
    assert "<= 2.00 GiB (train.memory_budget_gib=0: 0.5 x tpu bytes_limit 4.00 GiB" in lines[1], lines[1]


def test_memory_rungs():
    chunk = AUTO_LOGITS_CHUNK
    assert memory_rungs("auto", 0) == (("none", 0), ("none", chunk), ("dots", chunk), ("full", chunk))
    assert memory_rungs("auto", 64) == (("none", 64), ("dots", 64), ("full", 64))  # the configured chunk kept
    assert memory_rungs("auto", 0, stand_in=True) == (("none", 0),)  # CPU without a budget: as before
    assert memory_rungs("dots", 8) == memory_rungs("dots", 8, stand_in=True) == (("dots", 8),)


def _rung_temps(fit: Fit) -> _FakeCompiled:
    """A model of the update's temporaries: 8 GiB of activations per microbatch row block, halved by
    chunking the logits, then by dots, then by full remat; 1 GiB that does not shrink."""
    shrink = {("none", 0): 1.0, ("none", 1024): 0.5, ("dots", 1024): 0.25, ("full", 1024): 0.125}
    return _FakeCompiled(1 + 8 * shrink[fit.remat, fit.logits_chunk] / fit.microbatches)


@pytest.mark.parametrize(
    "budget, microbatches, expected",
    [
        (10, 1, Fit(1, "none", 0)),  # fits as configured: nothing traded
        (6, 1, Fit(1, "none", 1024)),  # 9 > 6 >= 5: the logits chunked
        (3.5, 1, Fit(1, "dots", 1024)),
        (2, 1, Fit(1, "full", 1024)),
        (1.5, 0, Fit(2, "full", 1024)),  # no rung fits one microbatch: the fewest under full remat
        (1.5, 2, Fit(2, "full", 1024)),  # a fixed count that nothing fits: full remat, over budget
        (3.5, 2, Fit(2, "none", 1024)),  # at the configured 2 microbatches: 1 + 4 * 0.5 = 3
    ],
)
def test_choose_fit_trades_cheapest_first(budget, microbatches, expected):
    seen = []

    def compile_for(fit):
        seen.append(fit)
        return _rung_temps(fit)

    fit, tried = choose_fit(compile_for, 8, budget, microbatches, memory_rungs("auto", 0))
    assert fit == expected and set(tried) == set(seen)
    line = memory_budget.report_choice(fit, tried, budget)
    assert ("over the budget" in line) == (tried[fit] > budget), line
    assert f"-> {fit.microbatches} microbatch(es), remat {fit.remat}, logits_chunk {fit.logits_chunk}" in line


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
    logged = [line for line in capsys.readouterr().err.splitlines() if "jaxrl: update memory" in line]
    assert len(logged) == 1 and "<= 64.00 GiB" in logged[0] and "bytes_limit 128.00 GiB" in logged[0]
    assert "remat full, logits_chunk 8" in logged[0]


@pytest.mark.slow
def test_training_run_with_auto_remat(tmp_path, in_process_cache, monkeypatch, capsys):
    # train.remat=auto (the default) against a budget the plain update's temporaries exceed: the run
    # trades memory for compute (full remat, chunked logits: equal numbers, tests/test_shared_prefix.py)
    # and logs it once.
    base = [t for t in TINY if not t.startswith("train.eval_")] + [
        "train.steps=1",
        "train.eval_every=0",
        "train.eval_prompts=2",
        "checkpoint.every=0",
    ]
    rows = loop.train(load_config(DEFAULT_CONFIG, base + ["train.memory_budget_gib=1e-9"]), tmp_path / "auto")
    logged = [line for line in capsys.readouterr().err.splitlines() if "jaxrl: update memory" in line]
    assert len(logged) == 1 and "remat full, logits_chunk 1024" in logged[0] and "over the budget" in logged[0]
    assert rows[-1]["step"] == 1 and "microbatches" not in rows[-1]  # a fixed count is not reported
    # No budget set and CPU reporting none: "auto" compiles the update as configured and logs nothing.
    loop.train(load_config(DEFAULT_CONFIG, base), tmp_path / "cpu")
    assert "jaxrl: update memory" not in capsys.readouterr().err
