"""`train.microbatches=0`: the fewest microbatches whose compiled update fits `train.memory_budget_gib`.

The measure is XLA's own, `compiled.memory_analysis().temp_size_in_bytes`, known after compiling and
before anything runs. Candidates are the divisors n of the batch's B rows. n = 1 is compiled first:
activations scale with a microbatch's rows and the rest does not, so temp(n) >= temp(1) / n and the
search starts at the smallest divisor >= temp(1) / budget, walking up until one fits. The chosen
update's compile is the one the run then uses (jit reuses it).

`train.memory_budget_gib=0` (the default) takes the budget from the device (`resolve_budget_gib`): on a
backend that reports its memory (GPU, TPU: `memory_stats()['bytes_limit']`, what XLA's allocator may
use), DEVICE_SHARE of it, the rest left to what the update also holds (params, optimizer state,
gradients, the batch); on CPU, which reports nothing, CPU_BUDGET_GIB, the budget every run had before.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from jaxrl.config.errors import ConfigError

GIB = 2**30
CPU_BUDGET_GIB = 2.0  # train.memory_budget_gib=0 where the device reports no memory limit (CPU)
DEVICE_SHARE = 0.5  # ... and the share of its bytes_limit where it reports one


def device_bytes_limit(device: Any) -> int | None:
    """What XLA may allocate on `device` (`memory_stats()['bytes_limit']`); None where not reported (CPU)."""
    stats = device.memory_stats()
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None


def resolve_budget_gib(configured: float, device: Any) -> tuple[float, str]:
    """-> (the budget in GiB, where it came from): `configured` where positive, else DEVICE_SHARE of the
    device's bytes_limit, else CPU_BUDGET_GIB."""
    if configured > 0:
        return configured, f"train.memory_budget_gib={configured:g}"
    limit = device_bytes_limit(device)
    if limit is None:
        return CPU_BUDGET_GIB, f"train.memory_budget_gib=0: {device.platform} reports no limit, {CPU_BUDGET_GIB:g} GiB"
    gib = DEVICE_SHARE * limit / GIB
    return gib, f"train.memory_budget_gib=0: {DEVICE_SHARE:g} x {device.platform} bytes_limit {limit / GIB:.2f} GiB"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def temp_bytes(compiled) -> int:
    """XLA temporaries of a compiled computation (0 where the backend does not report them)."""
    analysis = compiled.memory_analysis()
    return int(getattr(analysis, "temp_size_in_bytes", 0) or 0) if analysis is not None else 0


def choose_microbatches(
    compile_for: Callable[[int], Any], batch_rows: int, budget_gib: float, field: str = "train.memory_budget_gib"
) -> tuple[int, dict[int, float]]:
    """-> (the fewest microbatches n dividing batch_rows whose compile_for(n) fits budget_gib of XLA
    temporaries, {n: GiB} of every candidate compiled). A ConfigError naming `field` when even
    batch_rows microbatches of one row do not fit."""
    budget = budget_gib * GIB
    tried: dict[int, float] = {}

    def fits(n: int) -> bool:
        tried[n] = temp_bytes(compile_for(n)) / GIB
        return tried[n] * GIB <= budget

    if fits(1):
        return 1, tried
    lower_bound = tried[1] / budget_gib  # temp(n) >= temp(1) / n (module docstring)
    candidates = [n for n in divisors(batch_rows) if 1 < n and n >= lower_bound]
    for n in candidates or [batch_rows] * (batch_rows > 1):  # none left: measure the most for the error
        if fits(n):
            return n, tried
    worst = max(tried)
    raise ConfigError(
        f"{field}={budget_gib}: no microbatch count fits; even {worst} microbatches of "
        f"{batch_rows // worst} row(s) need {tried[worst]:.2f} GiB of XLA temporaries. Raise "
        f"{field}, shrink the batch or the model, or set train.microbatches explicitly"
    )


def report_choice(n: int, tried: dict[int, float], budget_gib: float, source: str = "") -> str:
    """The one line printed when the run picks its microbatches (`source`: resolve_budget_gib's)."""
    seen = ", ".join(f"{k}: {v:.2f} GiB" for k, v in sorted(tried.items()))
    source = source or f"train.memory_budget_gib={budget_gib:g}"
    return (
        f"jaxrl: train.microbatches=0 (auto) -> {n} microbatch(es), XLA temporaries {tried[n]:.2f} GiB <= "
        f"{budget_gib:.2f} GiB ({source}; compiled: {seen})"
    )


def auto_jit(
    jit_for: Callable[[int], Any],
    args: tuple,
    batch_rows: int,
    budget_gib: float,
    log=lambda line: print(line, file=sys.stderr),
    source: str = "",
) -> tuple[Any, int]:
    """(the jitted update for the chosen count, the count): jit_for(n) -> a jax.jit'ed update,
    lowered and compiled on `args` (state, batch) for each candidate; the choice is logged once, with
    `source` (resolve_budget_gib's) saying where the budget came from."""
    jitted: dict[int, Any] = {}

    def compile_for(n: int):
        jitted[n] = jit_for(n)
        return jitted[n].lower(*args).compile()

    n, tried = choose_microbatches(compile_for, batch_rows, budget_gib)
    log(report_choice(n, tried, budget_gib, source))
    return jitted[n], n
