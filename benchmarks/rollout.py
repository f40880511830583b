"""Rollout throughput of `jaxrl.rollout.sampler.sample` on bench-small.

Default shape: 8 prompts x 8 samples (group_size 8), 64 random prompt tokens, exactly 128 new tokens
(eos_id=-1 is never sampled, so no row stops early; the script asserts every step ran), temperature 1,
no top-k/top-p.

    PYTHONPATH=. python benchmarks/rollout.py            # full benchmark
    PYTHONPATH=. python benchmarks/rollout.py --small    # seconds-long smoke run (tests)
    PYTHONPATH=. python benchmarks/rollout.py --compare  # also the per-row cache, interleaved
    PYTHONPATH=. python benchmarks/rollout.py --peer-python /work/peers-venv/bin/python  # + Tunix

The sampler runs its default decode (prompt prefix stored once per group, `--segments` loop segments;
default `group_decode.default_segments`). `--compare` times the per-row cache (`share_prefix=False`,
the sampler before the shared-prefix cache) in the same process, each round timing both once (a
load change on this shared machine then hits both alike), and reports `speedup_vs_row_cache` (median
over rounds of the per-round time ratio). `--peer-python` runs benchmarks/peers/tunix_sampler.py with
that interpreter (Tunix's own venv) on the same shape first and reports `speedup_vs_tunix` =
tokens_per_s / Tunix's, and the same ratio of `tokens_per_cpu_s_x_cores`.

Reports generated tokens/s = prompts*samples*new_tokens / median wall time of one `sample` call
(prefill + decode, compiled, after a warm-up call), MFU = model FLOP/s / this machine's measured
float32 matmul FLOP/s, and the compute-roofline tokens/s (model FLOPs at that matmul rate).

Model FLOPs of one call (see benchmarks/common.py for the per-token formula):
  prefill, once per prompt (shared by its group): prompts x (P-1) tokens at slots 0..P-2, without the
    LM head (the prefill needs no logits);
  decode: prompts*samples rows x new_tokens steps, step t feeding slot P-1+t (attending P+t keys),
    each with the LM head.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common


def rollout_flops(cfg, prompts: int, samples: int, prompt_len: int, new_tokens: int) -> tuple[float, float]:
    """(prefill FLOPs, decode FLOPs) of one sample() call, as described in the module docstring."""
    head = 2.0 * cfg.d_model * cfg.vocab_size
    n_pre = prompt_len - 1
    prefill = prompts * (common.sequence_flops(cfg, 0, n_pre) - head * n_pre) if n_pre > 0 else 0.0
    decode = prompts * samples * common.sequence_flops(cfg, prompt_len - 1, new_tokens)
    return prefill, decode


def interleaved_times(variants: dict, repeats: int) -> dict:
    """{name: (median wall s, wall times, median CPU s)}: one compiling warm-up call each, then
    `repeats` rounds that time every variant once (round-robin, so load changes hit all alike)."""
    import jax

    for fn in variants.values():
        jax.block_until_ready(fn())
    walls = {name: [] for name in variants}
    cpus = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            c0, t0 = time.process_time(), time.perf_counter()
            jax.block_until_ready(fn())
            walls[name].append(time.perf_counter() - t0)
            cpus[name].append(time.process_time() - c0)
    return {name: (statistics.median(walls[name]), walls[name], statistics.median(cpus[name])) for name in variants}


def run_peer(args) -> dict:
    """Run benchmarks/peers/tunix_sampler.py with `--peer-python` on this shape; its last JSON line."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "tunix_sampler.py")
    cmd = [
        args.peer_python,
        script,
        "--prompts",
        str(args.prompts),
        "--samples",
        str(args.samples),
        "--prompt-len",
        str(args.prompt_len),
        "--new-tokens",
        str(args.new_tokens),
        "--repeats",
        str(args.repeats),
        "--seed",
        str(args.seed),
    ] + (["--small"] if args.small else [])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"rollout.py: error: the Tunix peer ({args.peer_python}) failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def print_summary(result: dict, cfg) -> None:
    """The readable lines, then the one JSON line last."""
    r, s = result, result["shape"]
    print(
        f"rollout [{r['config']}] {s['prompts']} prompts x {s['samples']} samples, prompt {s['prompt_len']}, "
        f"{s['new_tokens']} new tokens ({r['generated_tokens']} generated tokens, "
        f"{common.total_params(cfg) / 1e6:.1f}M params)"
    )
    print(
        f"  time            {r['seconds']:.3f} s (median of {len(r['times'])}: "
        f"{', '.join(f'{t:.3f}' for t in r['times'])})"
    )
    print(
        f"  cpu             {r['cpu_seconds']:.3f} CPU-s per call ({r['cores_used']:.2f} cores busy); "
        f"{r['tokens_per_cpu_s_x_cores']:.0f} tokens per CPU-s x {os.cpu_count()} cores"
    )
    print(f"  throughput      {r['tokens_per_s']:.0f} generated tokens/s")
    print(
        f"  model FLOPs     {r['prefill_gflop'] + r['decode_gflop']:.1f} GFLOP (prefill {r['prefill_gflop']:.2f}, "
        f"decode {r['decode_gflop']:.1f}) -> {r['model_gflops_per_s']:.1f} GFLOP/s"
    )
    print(
        f"  matmul peak     {r['matmul_peak_gflops']:.1f} GFLOP/s -> MFU {r['mfu']:.1%}, "
        f"roofline {r['roofline_tokens_per_s']:.0f} tokens/s"
    )
    if "speedup_vs_row_cache" in r:
        print(
            f"  per-row cache   {r['row_cache_tokens_per_s']:.0f} tokens/s "
            f"({r['row_cache_tokens_per_cpu_s_x_cores']:.0f} per CPU-s x cores); shared prefix is "
            f"{r['speedup_vs_row_cache']:.2f}x (median of per-round ratios)"
        )
    if "tunix" in r:
        print(
            f"  Tunix Sampler   {r['tunix']['tokens_per_s']:.0f} tokens/s "
            f"({r['tunix']['tokens_per_cpu_s_x_cores']:.0f} "
            f"per CPU-s x cores) -> speedup_vs_tunix {r['speedup_vs_tunix']:.2f} "
            f"(per CPU-s {r['speedup_vs_tunix_cpu']:.2f})"
        )
    print(f"  load average    {r['load_average']}")
    common.emit(result)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8, help="group_size: samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--small", action="store_true", help="tiny model and shape (smoke test)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--segments", type=int, default=None, help="decode loop segments (default: the sampler's)")
    ap.add_argument("--compare", action="store_true", help="also time the per-row cache, interleaved")
    ap.add_argument("--peer-python", default=None, help="python of a venv with google-tunix: run the Tunix peer")
    args = ap.parse_args(argv)
    peer = run_peer(args) if args.peer_python else None

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl.models.group_decode import default_segments
    from jaxrl.models.transformer import init_params
    from jaxrl.rollout.sampler import SamplingParams, sample

    if args.small:
        cfg = common.tiny()
        args.prompts, args.samples, args.prompt_len, args.new_tokens = 2, 2, 8, 8
        args.repeats = min(args.repeats, 2)
        peak = common.measure_matmul_peak(n=512, repeats=3)
    else:
        cfg = common.bench_small()
        peak = common.measure_matmul_peak()
    B, G, P, T = args.prompts, args.samples, args.prompt_len, args.new_tokens
    N = B * G

    params = init_params(cfg, jax.random.PRNGKey(args.seed))
    rng = np.random.default_rng(args.seed)
    prompt_BxP = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, P), dtype=np.int32))
    pmask_BxP = jnp.ones((B, P), jnp.int32)
    keys = iter(jax.random.split(jax.random.PRNGKey(args.seed + 1), 2 * (args.repeats + 1)))

    def run(**kw):
        return lambda: sample(
            params,
            cfg,
            prompt_BxP,
            pmask_BxP,
            next(keys),
            sampling=SamplingParams(temperature=args.temperature, max_new_tokens=T, eos_id=-1, pad_id=0),
            group_size=G,
            **kw,
        )

    variants = {"shared_prefix": run(decode_segments=args.segments)}
    if args.compare:
        variants["row_cache"] = run(share_prefix=False)
    timed = interleaved_times(variants, args.repeats)
    seconds, times, cpu_seconds = timed["shared_prefix"]
    check = sample(
        params,
        cfg,
        prompt_BxP,
        pmask_BxP,
        jax.random.PRNGKey(123),
        sampling=SamplingParams(temperature=args.temperature, max_new_tokens=T, eos_id=-1, pad_id=0),
        group_size=G,
        decode_segments=args.segments,
    )
    assert int(check.num_steps) == T, f"decode stopped after {int(check.num_steps)} of {T} steps"
    assert float(jnp.sum(check.completion_mask_BxT)) == N * T, "some row stopped early"
    assert check.tokens_BxT.shape == (N, T)

    tokens = N * T
    pre_f, dec_f = rollout_flops(cfg, B, G, P, T)
    flops = pre_f + dec_f
    achieved = flops / seconds
    result = {
        "benchmark": "rollout",
        "tokens_per_s": tokens / seconds,
        "mfu": achieved / peak,
        "model_gflops_per_s": achieved / 1e9,
        "matmul_peak_gflops": peak / 1e9,
        "roofline_tokens_per_s": tokens * peak / flops,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "cores_used": cpu_seconds / seconds,
        # Contention-robust view for a shared machine: tokens per CPU-second times the core count
        # (what the run would reach with every core to itself and perfect scaling; an estimate).
        "tokens_per_cpu_s_x_cores": tokens / cpu_seconds * (os.cpu_count() or 1),
        "times": times,
        "generated_tokens": tokens,
        "prefill_gflop": pre_f / 1e9,
        "decode_gflop": dec_f / 1e9,
        "gflop_per_generated_token": flops / tokens / 1e9,
        "shape": {"prompts": B, "samples": G, "prompt_len": P, "new_tokens": T},
        "config": "tiny" if args.small else "bench-small",
        "model": common.config_dict(cfg),
        "params": common.total_params(cfg),
        "load_average": common.load_average(),
        "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "decode_segments": args.segments or default_segments(T),
    }
    if args.compare:
        row_s, row_times, row_cpu = timed["row_cache"]
        result.update(
            row_cache_tokens_per_s=tokens / row_s,
            row_cache_times=row_times,
            row_cache_tokens_per_cpu_s_x_cores=tokens / row_cpu * (os.cpu_count() or 1),
            speedup_vs_row_cache=statistics.median(r / t for r, t in zip(row_times, times)),
        )
    if peer is not None:
        result.update(
            tunix=peer,
            speedup_vs_tunix=result["tokens_per_s"] / peer["tokens_per_s"],
            speedup_vs_tunix_cpu=result["tokens_per_cpu_s_x_cores"] / peer["tokens_per_cpu_s_x_cores"],
        )
    print_summary(result, cfg)
    return result


if __name__ == "__main__":
    main()
