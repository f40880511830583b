"""What a verify forward and a drafted token cost on THIS machine, in plain decode steps.

Speculation pays only when verifying k drafts costs well under k + 1 plain steps (memory-bound
decoding). `measure_step_costs` times, for the rollout's own row count and cache length, the policy
forward over 1 and over K + 1 tokens (K = max_draft, or reuse_width if wider) and one drafter token,
and returns the costs relative to the 1-token forward (widths in between interpolated linearly).
Which steps speculate decides which random numbers draw which token, so a training run never
re-times: `cached_step_costs` measures once per (machine, model, drafter, rollout shape) and caches
the costs on disk, and checkpoints carry the costs a run used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import platform
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl.config import ModelConfig, SpeculativeConfig
from jaxrl.models.cache_kinds import LayerKV
from jaxrl.models.decode import LayerCache, empty_window, layer_params, window_layers
from jaxrl.rollout.speculative.drafters import draft_view


class StepCosts(NamedTuple):
    """Costs in plain decode steps (a 1-token policy forward = 1)."""

    verify_K: jax.Array  # float32[K]: a forward over k + 1 tokens (verifying k drafts), k = 1..K
    draft: jax.Array  # float32 scalar: one drafted token


def widest_draft(spec: SpeculativeConfig) -> int:
    """K: the most drafts a verify forward of this configuration checks."""
    return max(spec.max_draft, spec.reuse_width if spec.drafter == "reuse" else 0)


def constant_costs(spec: SpeculativeConfig) -> StepCosts:
    """The configured (unmeasured) costs: rollout.speculative.verify_cost for every k, draft_cost."""
    return StepCosts(jnp.full((widest_draft(spec),), spec.verify_cost, jnp.float32), jnp.float32(spec.draft_cost))


def _seconds_per_forward(fwd, args, calls: int, repeats: int) -> float:
    """(fastest time of `calls` forwards in one jitted loop - fastest time of 1) / (calls - 1): the
    dispatch and loop entry cancel, and the minimum over `repeats` drops what other work on the
    machine added (interference only ever adds time)."""

    def fastest(n):
        jax.block_until_ready(fwd(n, *args))  # compiles on first use
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fwd(n, *args))
            times.append(time.perf_counter() - t0)
        return min(times)

    return max((fastest(calls) - fastest(1)) / (calls - 1), 1e-9)


def measure_step_costs(
    params, cfg: ModelConfig, spec: SpeculativeConfig, n_rows: int, cache_len: int, calls: int = 8, repeats: int = 7
) -> StepCosts:
    """Time the forwards a speculative rollout of n_rows rows over a cache_len-slot cache runs ->
    StepCosts (the draft cost stays spec.draft_cost when spec has no self-drafter)."""
    drafter = spec.fallback if spec.drafter == "reuse" else spec.drafter
    lparams = layer_params(params, cfg)
    dtype = jnp.dtype(cfg.dtype)
    kv = tuple(
        LayerKV(*(jnp.zeros((n_rows, cfg.n_kv_heads, cache_len, cfg.head_dim), dtype),) * 2)
        for _ in range(cfg.n_layers)
    )
    cache = LayerCache(kv, jnp.ones((n_rows, cache_len), bool), jnp.zeros((n_rows,), jnp.int32))
    fill_N = jnp.full((n_rows,), cache_len // 2, jnp.int32)  # a half-full cache: the rollout's average
    K = widest_draft(spec)
    W = K + 1

    def forward(width: int, n_layers: int):
        @jax.jit
        def loop(n, p, cache):
            def body(_, acc):
                # `acc` feeds the tokens so XLA cannot hoist the forward out of the loop.
                tokens_NxW = jnp.zeros((n_rows, width), jnp.int32) + (acc > jnp.inf).astype(jnp.int32)
                window = empty_window(cache, W, n_layers)
                logits, window, _ = window_layers(p, cfg, tokens_NxW, cache, fill_N, window, 0, n_layers)
                return acc + logits[0, 0, 0] + window[-1][0][0, 0, 0, 0]

            return lax.fori_loop(0, n, body, jnp.zeros((), jnp.float32))

        return loop

    one = _seconds_per_forward(forward(1, cfg.n_layers), (lparams, cache), calls, repeats)
    wide = _seconds_per_forward(forward(W, cfg.n_layers), (lparams, cache), calls, repeats)
    draft = spec.draft_cost
    if drafter != "none":
        dparams, d_layers = draft_view(lparams, drafter, spec.draft_layers, cfg.n_layers)
        draft = _seconds_per_forward(forward(1, d_layers), (dparams, cache), calls, repeats) / one
    k_K = np.arange(1, K + 1)
    verify_K = 1.0 + (wide / one - 1.0) * k_K / K
    return StepCosts(jnp.asarray(verify_K, jnp.float32), jnp.float32(draft))


def costs_to_json(costs: StepCosts) -> dict:
    return {"verify_K": [float(x) for x in np.asarray(costs.verify_K)], "draft": float(costs.draft)}


def costs_from_json(d: dict) -> StepCosts:
    return StepCosts(jnp.asarray(d["verify_K"], jnp.float32), jnp.float32(d["draft"]))


def _machine_key(cfg: ModelConfig, spec: SpeculativeConfig, n_rows: int, cache_len: int) -> dict:
    """Everything the measured costs depend on: the model, the drafter, the rollout shape, the machine."""
    device = jax.devices()[0]
    return {
        "model": dataclasses.asdict(cfg),
        "spec": {k: getattr(spec, k) for k in ("drafter", "fallback", "draft_layers", "max_draft", "reuse_width")},
        "n_rows": n_rows,
        "cache_len": cache_len,
        "host": platform.node(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "devices": jax.device_count(),
    }


def cached_step_costs(
    params, cfg: ModelConfig, spec: SpeculativeConfig, n_rows: int, cache_len: int, cache_dir: pathlib.Path
) -> tuple[StepCosts, pathlib.Path, bool]:
    """`measure_step_costs` once per (machine, model, drafter, rollout shape): the first run measures
    and writes `cache_dir/<key>.json`; every later run on this machine reads the same numbers, so the
    costs (and with them which steps speculate) do not vary between reruns of a config.
    -> (costs, the cache file, whether it was measured now). Delete the file to measure again."""
    key = _machine_key(cfg, spec, n_rows, cache_len)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = pathlib.Path(cache_dir) / f"{digest}.json"
    if path.exists():
        try:
            return costs_from_json(json.loads(path.read_text())), path, False
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a torn or foreign file: measure again and replace it
    costs = measure_step_costs(params, cfg, spec, n_rows, cache_len)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({**costs_to_json(costs), "key": key}, default=str, indent=1))
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
    return costs, path, True


# --- the engine's tail threshold (speculative.engine.ToggleChunk) ------------------------------


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a speculative step keeps per row, drafts accepted independently with probability a:
    1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a) (k + 1 at a = 1)."""
    a = float(acceptance)
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def tail_gain(costs: StepCosts, acceptance: float, k: int) -> float:
    """Tokens per unit cost of a speculative step with k drafts over a plain step (1 token, cost 1),
    with costs measured at the rows it runs: expected_tokens / (verify of k drafts + k drafted tokens)."""
    return expected_tokens(acceptance, k) / (float(np.asarray(costs.verify_K)[k - 1]) + k * float(costs.draft))


def tail_threshold(costs_by_rows: dict, acceptance: float, k: int) -> int:
    """The most rows R (of those measured) at which a k-draft speculative step gains over a plain
    one (`tail_gain` > 1) with R's measured costs; 0 when none does. The engine's speculative chunk
    always runs exactly `max_active_rows` rows (padded), so the costs at that R are the ones that count."""
    paying = [r for r, c in costs_by_rows.items() if tail_gain(c, acceptance, k) > 1.0]
    return max(paying, default=0)


def calibrated_tail_rows(
    params,
    cfg: ModelConfig,
    spec: SpeculativeConfig,
    candidate_rows,
    cache_len: int,
    acceptance: float,
    cache_dir: pathlib.Path,
) -> tuple[int, dict]:
    """`tail_threshold` over step costs measured (or read from `cache_dir`: `cached_step_costs`) at
    each candidate row count -> (rollout.speculative.max_active_rows to use, {rows: StepCosts})."""
    costs = {r: cached_step_costs(params, cfg, spec, r, cache_len, cache_dir)[0] for r in candidate_rows}
    return tail_threshold(costs, acceptance, spec.max_draft), costs
