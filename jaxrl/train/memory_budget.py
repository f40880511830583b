"""The update's memory, chosen from a budget of XLA temporaries (`train.memory_budget_gib`):
`train.microbatches=0` picks the fewest microbatches that fit, `train.remat="auto"` picks remat and
logits chunking (`choose_fit`).

The measure is XLA's own, `compiled.memory_analysis().temp_size_in_bytes`, known after compiling and
before anything runs. Microbatch candidates are the divisors n of the batch's B rows. n = 1 is
compiled first: activations scale with a microbatch's rows and the rest does not, so temp(n) >=
temp(1) / n and the search starts at the smallest divisor >= temp(1) / budget, walking up until one
fits. The chosen update's compile is the one the run then uses (jit reuses it).

`train.remat="auto"` trades memory for compute in order of what it costs (`memory_rungs`): the
forward as configured, then the LM head on chunks of (row, position) pairs (the same FLOPs, a loop),
then "dots" remat (norms, attention and activations recomputed in the backward), then "full" remat
(each layer's forward again, about a third more FLOPs); each at the configured microbatches (one
under microbatches=0), the first that fits wins. When none does: with microbatches=0, the fewest
microbatches that fit under full remat; with a fixed count, full remat, logged as over the budget.
Where the budget is only the CPU stand-in (no explicit budget, a device that reports no memory),
"auto" keeps the forward as configured: nothing is measured, so CPU runs compile as before.

`train.memory_budget_gib=0` (the default) takes the budget from the device (`resolve_budget_gib`): on a
backend that reports its memory (GPU, TPU: `memory_stats()['bytes_limit']`, what XLA's allocator may
use), DEVICE_SHARE of it, the rest left to what the update also holds (params, optimizer state,
gradients, the batch); on CPU, which reports nothing, CPU_BUDGET_GIB, the budget every run had before.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NamedTuple

from jaxrl.config.errors import ConfigError

GIB = 2**30
CPU_BUDGET_GIB = 2.0  # train.memory_budget_gib=0 where the device reports no memory limit (CPU)
DEVICE_SHARE = 0.5  # ... and the share of its bytes_limit where it reports one
AUTO_LOGITS_CHUNK = 1024  # (row, position) pairs per LM-head chunk when remat="auto" chunks and none is set


class Fit(NamedTuple):
    """How the update runs: microbatches per optimizer step and its forward's memory options
    (`transformer.token_logprobs`: remat, logits_chunk)."""

    microbatches: int
    remat: str = "none"
    logits_chunk: int = 0


def device_bytes_limit(device: Any) -> int | None:
    """What XLA may allocate on `device` (`memory_stats()['bytes_limit']`); None where not reported (CPU)."""
    stats = device.memory_stats()
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None


def resolve_budget_gib(configured: float, device: Any) -> tuple[float, str]:
    """-> (the budget in GiB, where it came from): `configured` where positive, else DEVICE_SHARE of the
    device's bytes_limit, else CPU_BUDGET_GIB (`is_stand_in` then says so)."""
    if configured > 0:
        return configured, f"train.memory_budget_gib={configured:g}"
    limit = device_bytes_limit(device)
    if limit is None:
        return CPU_BUDGET_GIB, f"train.memory_budget_gib=0: {device.platform} reports no limit, {CPU_BUDGET_GIB:g} GiB"
    gib = DEVICE_SHARE * limit / GIB
    return gib, f"train.memory_budget_gib=0: {DEVICE_SHARE:g} x {device.platform} bytes_limit {limit / GIB:.2f} GiB"


def is_stand_in(configured: float, device: Any) -> bool:
    """True when `resolve_budget_gib` falls back to CPU_BUDGET_GIB: nothing set, nothing reported."""
    return configured <= 0 and device_bytes_limit(device) is None


def memory_rungs(remat: str, logits_chunk: int, stand_in: bool = False) -> tuple[tuple[str, int], ...]:
    """The (remat, logits_chunk) pairs `choose_fit` tries, cheapest in compute first (module
    docstring). A `remat` other than "auto", or a `stand_in` budget: only the configured pair
    ("auto" then meaning no remat)."""
    if remat != "auto" or stand_in:
        return (("none" if remat == "auto" else remat, logits_chunk),)
    chunk = logits_chunk or AUTO_LOGITS_CHUNK
    return tuple(dict.fromkeys([("none", logits_chunk), ("none", chunk), ("dots", chunk), ("full", chunk)]))


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


def choose_fit(
    compile_for: Callable[[Fit], Any],
    batch_rows: int,
    budget_gib: float,
    microbatches: int,
    rungs: tuple[tuple[str, int], ...],
    field: str = "train.memory_budget_gib",
) -> tuple[Fit, dict[Fit, float]]:
    """-> (the Fit the update runs, {Fit: GiB of XLA temporaries} of every candidate compiled): each of
    `rungs` at `microbatches` (1 when 0 = auto), the first that fits budget_gib; else, with
    microbatches=0, `choose_microbatches` on the last rung, or with a fixed count the last rung (over
    the budget: `report_choice` says so)."""
    tried: dict[Fit, float] = {}
    for remat, chunk in rungs:
        fit = Fit(microbatches or 1, remat, chunk)
        tried[fit] = temp_bytes(compile_for(fit)) / GIB
        if tried[fit] <= budget_gib:
            return fit, tried
    remat, chunk = rungs[-1]
    if microbatches:
        return Fit(microbatches, remat, chunk), tried
    n, by_count = choose_microbatches(lambda n: compile_for(Fit(n, remat, chunk)), batch_rows, budget_gib, field)
    tried.update({Fit(k, remat, chunk): gib for k, gib in by_count.items()})
    return Fit(n, remat, chunk), tried


def report_choice(fit: Fit, tried: dict[Fit, float], budget_gib: float, source: str = "") -> str:
    """The one line printed when the run picks its update's memory (`source`: resolve_budget_gib's)."""
    seen = ", ".join(f"{k.microbatches}/{k.remat}/{k.logits_chunk}: {v:.2f} GiB" for k, v in tried.items())
    source = source or f"train.memory_budget_gib={budget_gib:g}"
    verdict = "<=" if tried[fit] <= budget_gib else "over the budget of"
    return (
        f"jaxrl: update memory -> {fit.microbatches} microbatch(es), remat {fit.remat}, logits_chunk "
        f"{fit.logits_chunk}: XLA temporaries {tried[fit]:.2f} GiB {verdict} {budget_gib:.2f} GiB ({source}; "
        f"compiled microbatches/remat/logits_chunk: {seen})"
    )


def auto_jit(
    jit_for: Callable[[Fit], Any],
    args: tuple,
    batch_rows: int,
    budget_gib: float,
    log=lambda line: print(line, file=sys.stderr),
    source: str = "",
    microbatches: int = 0,
    rungs: tuple[tuple[str, int], ...] = (("none", 0),),
) -> tuple[Any, Fit, dict[Fit, float]]:
    """(the jitted update for the chosen Fit, the Fit, {Fit: GiB} of every candidate): jit_for(fit) ->
    a jax.jit'ed update, lowered and compiled on `args` (state, batch) for each candidate of
    `choose_fit`; the choice is logged once, with `source` (resolve_budget_gib's) saying where the budget came from."""
    jitted: dict[Fit, Any] = {}
    compiled: dict[Fit, Any] = {}

    def compile_for(fit: Fit):
        if fit not in compiled:
            jitted[fit] = jit_for(fit)
            compiled[fit] = jitted[fit].lower(*args).compile()
        return compiled[fit]

    fit, tried = choose_fit(compile_for, batch_rows, budget_gib, microbatches, rungs)
    log(report_choice(fit, tried, budget_gib, source))
    return jitted[fit], fit, tried
