"""Peer rollout benchmark: Tunix's `Sampler` on its own Qwen2 model, bench-small's shape.

Runs in its own virtual environment (Tunix pins its own JAX), never in jaxrl's:

    python -m venv /work/peers-venv && /work/peers-venv/bin/pip install google-tunix==0.1.7
    /work/peers-venv/bin/python benchmarks/peers/tunix_sampler.py            # bench-small, 8 x 8 rows
    /work/peers-venv/bin/python benchmarks/peers/tunix_sampler.py --small    # seconds-long smoke run

`benchmarks/rollout.py --peer-python /work/peers-venv/bin/python` runs it as a subprocess in the same
run and reports `speedup_vs_tunix`. Nothing from jaxrl is imported here (the two stacks do not share a
JAX version), so the model shape is restated below and must match `benchmarks/common.bench_small`.

What is timed: one `Sampler.__call__` (the public API: prompt in, completions out) on prompts x
samples rows, i.e. each prompt repeated `samples` times (Tunix has no notion of a group, so it
prefills every row), random weights, float32, temperature 1, top_p 1 (plain categorical draws), an
end token that never occurs (-1), so every row runs exactly `new_tokens` steps (asserted). The
median of `--repeats` calls after one compiling warm-up call. Tunix's Qwen2 has q/k/v biases (the
Qwen2 architecture); bench-small has none, a few hundred extra adds per token.
Prompts are passed as strings of token ids through a minimal tokenizer (`IdTokenizer`), so Tunix
tokenises by `str.split` and decodes by `str.join`: the only host work besides its own.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

# bench-small (benchmarks/common.bench_small) and the tiny --small shape (benchmarks/common.tiny).
BENCH_SMALL = dict(
    num_layers=8,
    vocab_size=8192,
    embed_dim=512,
    hidden_dim=1408,
    num_heads=8,
    head_dim=64,
    num_kv_heads=2,
    rope_theta=10000,
    norm_eps=1e-6,
    use_tied_embedding=False,
)
TINY = dict(
    num_layers=2,
    vocab_size=256,
    embed_dim=64,
    hidden_dim=128,
    num_heads=4,
    head_dim=16,
    num_kv_heads=2,
    rope_theta=10000,
    norm_eps=1e-6,
    use_tied_embedding=False,
)


class IdTokenizer:
    """Token ids written as decimal words: the tokenizer interface Tunix's `TokenizerAdapter` accepts
    (encode, decode, bos_id, eos_id, pad_id). bos_id 0 means "add no BOS"; pad 0 never occurs in a
    prompt (ids are drawn from 1..V-1) and no prompt needs padding (all have the same length)."""

    def encode(self, text: str, **_) -> list:
        return [int(w) for w in text.split()]

    def decode(self, ids, **_) -> str:
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self) -> int:
        return 0

    def eos_id(self) -> int:
        return -1

    def pad_id(self) -> int:
        return 0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="tiny model and shape (smoke test)")
    args = ap.parse_args(argv)

    import jax
    import numpy as np
    from flax import nnx
    from tunix.generate import sampler as sampler_lib
    from tunix.models.qwen2 import model as qwen2

    shape = TINY if args.small else BENCH_SMALL
    if args.small:
        args.prompts, args.samples, args.prompt_len, args.new_tokens = 2, 2, 8, 8
        args.repeats = min(args.repeats, 2)
    B, G, P, T = args.prompts, args.samples, args.prompt_len, args.new_tokens
    N = B * G
    config = qwen2.ModelConfig(**shape, shd_config=qwen2.ShardingConfig.get_default_sharding(is_sampling=True))
    model = qwen2.Qwen2(config, rngs=nnx.Rngs(args.seed))
    cache = sampler_lib.CacheConfig(
        cache_size=P + T, num_layers=shape["num_layers"], num_kv_heads=shape["num_kv_heads"], head_dim=shape["head_dim"]
    )
    sampler = sampler_lib.Sampler(model, IdTokenizer(), cache)
    rng = np.random.default_rng(args.seed)
    prompts = [" ".join(map(str, row)) for row in rng.integers(1, shape["vocab_size"], (B, P))]
    rows = [p for p in prompts for _ in range(G)]  # rows i*G .. i*G+G-1: prompt i, as jaxrl's sampler

    def call(seed):
        out = sampler(
            rows, max_generation_steps=T, max_prompt_length=P, eos_tokens=[-1], temperature=1.0, top_p=1.0, seed=seed
        )
        assert all(len(t) == T for t in out.tokens), "a row stopped early"
        return out

    call(0)  # compile (twice: the first timed call after one warm-up still recompiled in a smoke run)
    call(0)
    walls, cpus = [], []
    for r in range(args.repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        call(r + 1)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    seconds, cpu_seconds = statistics.median(walls), statistics.median(cpus)
    tokens = N * T
    cores = os.cpu_count() or 1
    result = {
        "benchmark": "tunix_sampler",
        "tokens_per_s": tokens / seconds,
        "seconds": seconds,
        "times": walls,
        "cpu_seconds": cpu_seconds,
        "cores_used": cpu_seconds / seconds,
        "tokens_per_cpu_s_x_cores": tokens / cpu_seconds * cores,
        "generated_tokens": tokens,
        "shape": {"prompts": B, "samples": G, "prompt_len": P, "new_tokens": T},
        "config": "tiny" if args.small else "bench-small",
        "model": shape,
        "tunix": _version("google-tunix"),
        "jax": jax.__version__,
        "load_average": list(os.getloadavg()),
    }
    print(f"tunix Sampler [{result['config']}] {N} rows (prompt {P}), {T} new tokens, temperature 1")
    print(f"  time            {seconds:.3f} s (median of {args.repeats}: {', '.join(f'{t:.3f}' for t in walls)})")
    print(
        f"  throughput      {result['tokens_per_s']:.0f} generated tokens/s; "
        f"{result['tokens_per_cpu_s_x_cores']:.0f} per CPU-s x {cores} cores"
    )
    print(json.dumps(result))
    return result


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    main()
