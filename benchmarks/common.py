"""Shared pieces of the benchmarks: the bench-small model, FLOP counting, the machine's matmul peak, timing.

FLOP convention (one multiply-add = 2 FLOPs), per token, forward only:

    model_flops_per_token(cfg, context) = 2 * N_matmul + 4 * L * context * H * Hd

    N_matmul = L * (D*H*Hd + 2*D*K*Hd + H*Hd*D + 3*D*F) + D*V
             (q, k, v, o projections, SwiGLU gate/up/down, and the LM head; the embedding lookup is a
              gather, not a matmul, so it is not counted)
    attention: the query of a token scores `context` keys (q.k, 2*H*Hd FLOPs each) and mixes
             `context` values (p.v, 2*H*Hd FLOPs each) in every layer: 4 * L * context * H * Hd.

Norms, RoPE, softmax and sampling are O(D) or O(V) elementwise work and are left out, as in the usual
6ND accounting. A backward pass costs twice the forward, so a training token costs 3x this.

`context` is the number of keys the token attends to. The benchmarks count causal attention exactly
(a token at slot s attends s+1 keys) via `attention_flops`, rather than using the padded cache
length: work the implementation spends on masked slots is overhead, not model FLOPs.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable

from jaxrl.config import ModelConfig


def bench_small() -> ModelConfig:
    """ "bench-small": a Qwen2-shaped decoder, ~31M parameters (26.7M in matmuls), random weights."""
    return ModelConfig(
        vocab_size=8192,
        d_model=512,
        n_layers=8,
        n_heads=8,
        n_kv_heads=2,
        head_dim=64,
        mlp_dim=1408,
        rope_theta=10000.0,
        norm_eps=1e-6,
        tie_embeddings=False,
        max_seq_len=512,
        dtype="float32",
    )


def tiny() -> ModelConfig:
    """A shape small enough for the `--small` smoke runs in the tests."""
    return ModelConfig(
        vocab_size=256,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        mlp_dim=128,
        tie_embeddings=False,
        max_seq_len=64,
        dtype="float32",
    )


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: all projections plus the LM head."""
    D, H, K, Hd, F, L, V = (
        cfg.d_model,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        cfg.mlp_dim,
        cfg.n_layers,
        cfg.vocab_size,
    )
    per_layer = D * H * Hd + 2 * D * K * Hd + H * Hd * D + 3 * D * F
    return L * per_layer + D * V


def total_params(cfg: ModelConfig) -> int:
    """All parameters: matmul params, the input embedding (unless tied) and the norm scales."""
    D, L, V = cfg.d_model, cfg.n_layers, cfg.vocab_size
    embed = 0 if cfg.tie_embeddings else V * D
    return matmul_params(cfg) + embed + L * 2 * D + D


def model_flops_per_token(cfg: ModelConfig, context_len: int) -> float:
    """Forward FLOPs of one token attending to `context_len` keys: 2*N_matmul + 4*L*context*H*Hd."""
    return 2.0 * matmul_params(cfg) + 4.0 * cfg.n_layers * context_len * cfg.n_heads * cfg.head_dim


def attention_flops(cfg: ModelConfig, first_slot: int, n_tokens: int) -> float:
    """Attention score+value FLOPs of `n_tokens` consecutive tokens at slots first_slot.. (causal:
    the token at slot s attends s+1 keys)."""
    keys = n_tokens * (first_slot + 1) + n_tokens * (n_tokens - 1) // 2  # sum_{s} (s+1)
    return 4.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * keys


def sequence_flops(cfg: ModelConfig, first_slot: int, n_tokens: int) -> float:
    """Forward FLOPs of `n_tokens` consecutive tokens starting at slot `first_slot`."""
    return 2.0 * matmul_params(cfg) * n_tokens + attention_flops(cfg, first_slot, n_tokens)


def median_time(fn: Callable[[], object], repeats: int = 3, cpu_times: list | None = None) -> tuple[float, list[float]]:
    """(median wall seconds, all wall timings) of `fn()` after one untimed warm-up call (compilation).

    If `cpu_times` is a list, the process CPU seconds (all threads) of each timed call are appended
    to it: on a shared machine, wall time measures the contention as much as the code.
    """
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
        if cpu_times is not None:
            cpu_times.append(time.process_time() - c0)
    return statistics.median(times), times


def measure_matmul_peak(n: int = 2048, repeats: int = 7) -> float:
    """FLOP/s of a jitted float32 n x n @ n x n matmul (median of `repeats` after a warm-up)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.PRNGKey(2), (n, n), jnp.float32)
    mm = jax.jit(lambda x, y: x @ y)
    seconds, _ = median_time(lambda: mm(a, b), repeats)
    return 2.0 * n**3 / seconds


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def peak_rss_mib() -> float:
    """Peak resident memory of this process (Linux ru_maxrss is KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def config_dict(cfg: ModelConfig) -> dict:
    import dataclasses

    return dataclasses.asdict(cfg)


def emit(result: dict) -> None:
    """Print the one JSON line that must be the last line of a benchmark's output."""
    print(json.dumps(result, sort_keys=True), flush=True)
