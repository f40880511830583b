"""`train.microbatches=0`: the fewest microbatches whose compiled update fits `train.memory_budget_gib`.

The measure is XLA's own, `compiled.memory_analysis().temp_size_in_bytes`, known after compiling and
before anything runs. Candidates are the divisors n of the batch's B rows. n = 1 is compiled first:
activations scale with a microbatch's rows and the rest does not, so temp(n) >= temp(1) / n and the
search starts at the smallest divisor >= temp(1) / budget, walking up until one fits. The chosen
update's compile is the one the run then uses (jit reuses it).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from jaxrl.config.errors import ConfigError

GIB = 2**30


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


def report_choice(n: int, tried: dict[int, float], budget_gib: float) -> str:
    """The one line printed when the run picks its microbatches."""
    seen = ", ".join(f"{k}: {v:.2f} GiB" for k, v in sorted(tried.items()))
    return (
        f"jaxrl: train.microbatches=0 (auto) -> {n} microbatch(es), XLA temporaries {tried[n]:.2f} GiB <= "
        f"train.memory_budget_gib={budget_gib} (compiled: {seen})"
    )


def auto_jit(
    jit_for: Callable[[int], Any],
    args: tuple,
    batch_rows: int,
    budget_gib: float,
    log=lambda line: print(line, file=sys.stderr),
) -> tuple[Any, int]:
    """(the jitted update for the chosen count, the count): jit_for(n) -> a jax.jit'ed update,
    lowered and compiled on `args` (state, batch) for each candidate; the choice is logged once."""
    jitted: dict[int, Any] = {}

    def compile_for(n: int):
        jitted[n] = jit_for(n)
        return jitted[n].lower(*args).compile()

    n, tried = choose_microbatches(compile_for, batch_rows, budget_gib)
    log(report_choice(n, tried, budget_gib))
    return jitted[n], n
