"""Training-update throughput: the real GRPO update step (forward + backward + AdamW) on bench-small.

Default shape: 64 sequences of 192 tokens (prompt 64 + completion 128) in 8 groups of G=8 rows that
share one prompt (as the training loop's static-sampler batches do), random tokens and rewards, one PPO
epoch, the `grpo` loss preset, `make_update_step` jitted with the state donated, exactly as the
training loop runs it. With `--share-prefix` (the default, like the loop's `train.share_prefix`) the
update forwards each group's prompt once (jaxrl.models.shared_prefix); `--no-share-prefix` runs the
one-pass forward over every row; `--compare` times both in one process, interleaved.

    PYTHONPATH=. python benchmarks/update.py               # full benchmark
    PYTHONPATH=. python benchmarks/update.py --compare     # shared vs one-pass prompt, interleaved
    PYTHONPATH=. python benchmarks/update.py --small       # seconds-long smoke run (tests)
    PYTHONPATH=. python benchmarks/update.py --run-peer    # + the PyTorch peer in the same run: speedup_vs_torch
    PYTHONPATH=. python benchmarks/update.py --remat full --logits-chunk 1024 --microbatches 0   # memory options

`--microbatches 0` chooses the count from `--memory-budget-gib` as `train.microbatches=0` does;
`--logits-chunk`, `--remat` and `--dtype` are `train.logits_chunk`, `train.remat` and `model.dtype`.

Reports trained tokens/s = batch*seq / median wall time of one update (compiled, after a warm-up
call), and MFU = model FLOP/s / this machine's measured float32 matmul FLOP/s, with training FLOPs =
3 x forward FLOPs (backward = 2 x forward) of the work the chosen path does (`update_flops`).
Peak memory: XLA's buffer sizes of the compiled update, and the process's peak RSS.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common


def update_flops(cfg, batch: int, prompt_len: int, completion_len: int, shared_group: int = 0) -> float:
    """Training FLOPs of one update: 3 x forward. One-pass (shared_group 0): every row runs its
    prompt + completion through the layers, the LM head only on the completion positions. Shared
    prompts (shared_group = G): each of the batch/G prompts runs once with the head on its last
    slot (it predicts completion token 0), then every row's completion tokens 0..T-2 run at slots
    P.. attending the prompt's keys and their own (the last token predicts nothing: not run)."""
    P, T = prompt_len, completion_len
    head = 2.0 * cfg.d_model * cfg.vocab_size
    if not shared_group:
        return 3.0 * batch * (common.sequence_flops(cfg, 0, P + T) - head * P)
    prompts = batch // shared_group * (common.sequence_flops(cfg, 0, P) - head * (P - 1))
    return 3.0 * (prompts + batch * common.sequence_flops(cfg, P, T - 1))


def make_batch(cfg, batch: int, prompt_len: int, completion_len: int, group_size: int, seed: int):
    """A GRPO batch: batch/group_size random prompts, each repeated for its group's group_size rows."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, cfg.vocab_size, (batch // group_size, prompt_len), dtype=np.int32)
    return {
        "prompt_tokens_BxP": np.repeat(prompts, group_size, axis=0),
        "prompt_mask_BxP": np.ones((batch, prompt_len), np.int32),
        "tokens_BxT": rng.integers(0, cfg.vocab_size, (batch, completion_len), dtype=np.int32),
        "completion_mask_BxT": np.ones((batch, completion_len), np.float32),
        "rewards_BxK": rng.integers(0, 2, (batch, 1)).astype(np.float32),  # the update computes the advantages
    }


def torch_peer(args, ours: dict) -> dict:
    """Run the PyTorch forward+backward peer on the same shape in a subprocess (same run, same load)
    -> its figures and our speed-ups over it (wall and per CPU-second)."""
    import json
    import subprocess

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "torch_update.py")
    cmd = [sys.executable, script, "--batch", str(args.batch), "--seq", str(args.seq), "--repeats", str(args.repeats)]
    proc = subprocess.run(cmd + (["--small"] if args.small else []), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"update.py: error: the torch peer failed: {proc.stderr.strip()[-2000:]}")
    peer = json.loads(proc.stdout.strip().splitlines()[-1])
    out = {
        "torch": {
            k: peer[k]
            for k in (
                "tokens_per_s",
                "seconds",
                "cpu_seconds",
                "tokens_per_cpu_s_x_cores",
                "torch_threads",
                "cores_used",
                "load_average",
                "loss",
                "trained_tokens",
            )
        },
        "speedup_vs_torch": ours["tokens_per_s"] / peer["tokens_per_s"],
        "speedup_vs_torch_cpu": ours["tokens_per_cpu_s_x_cores"] / peer["tokens_per_cpu_s_x_cores"],
    }
    print(
        f"  torch peer      {peer['tokens_per_s']:.0f} tokens/s ({peer['tokens_per_cpu_s_x_cores']:.0f} per CPU-s "
        f"x cores, {peer['torch_threads']} threads) -> speedup_vs_torch {out['speedup_vs_torch']:.2f} "
        f"(per CPU-s {out['speedup_vs_torch_cpu']:.2f})"
    )
    return out


class Variant:
    """One compiled update (shared prompts or not) with its own donated state; `call()` times one step."""

    def __init__(self, cfg, args, shared: bool, batch):
        import jax

        from jaxrl.config import LossConfig, OptimConfig
        from jaxrl.losses import make_loss
        from jaxrl.models.transformer import init_params
        from jaxrl.train.state import init_state, make_optimizer
        from jaxrl.train.steps import make_logp_fn, make_update_step

        G, T = args.group_size, args.seq - args.prompt_len
        optimizer = make_optimizer(OptimConfig(), total_steps=1000)
        params = init_params(cfg, jax.random.PRNGKey(args.seed))
        self.state = init_state(params, optimizer, jax.random.PRNGKey(args.seed + 1))
        logp_fn = make_logp_fn(
            cfg, temperature=1.0, prompt_groups=G if shared else 0, logits_chunk=args.logits_chunk, remat=args.remat
        )

        def jit_for(n):
            return jax.jit(
                make_update_step(
                    logp_fn,
                    make_loss(LossConfig(preset="grpo")),
                    optimizer,
                    ppo_epochs=1,
                    microbatches=n,
                    max_new_tokens=T,
                    group_size=G,
                    use_ref=False,
                ),
                donate_argnums=0,
            )

        self.microbatches = args.microbatches
        if not self.microbatches:  # what train.microbatches=0 does (jaxrl.train.memory_budget)
            from jaxrl.train.memory_budget import auto_jit

            jit_fit = lambda fit: jit_for(fit.microbatches)  # noqa: E731
            step, fit, _ = auto_jit(jit_fit, (self.state, batch), args.batch, args.memory_budget_gib, log=print)
            self.microbatches = fit.microbatches
        else:
            step = jit_for(self.microbatches)
        # What the logp function does: share only when every microbatch holds whole groups.
        self.shared = shared and G > 1 and (args.batch // self.microbatches) % G == 0
        self.batch = batch
        self.compiled = step.lower(self.state, batch).compile()
        mem = self.compiled.memory_analysis()
        self.xla_temp_mib = float(getattr(mem, "temp_size_in_bytes", 0)) / 2**20 if mem is not None else None
        self.xla_args_mib = float(getattr(mem, "argument_size_in_bytes", 0)) / 2**20 if mem is not None else None
        self.flops = update_flops(cfg, args.batch, args.prompt_len, T, G if self.shared else 0)
        self.times, self.cpu = [], []

    def run(self):
        self.state, metrics = self.compiled(self.state, self.batch)
        return metrics

    def timed(self):
        import jax

        c0, t0 = time.process_time(), time.perf_counter()
        jax.block_until_ready(self.run())
        self.times.append(time.perf_counter() - t0)
        self.cpu.append(time.process_time() - c0)

    def figures(self, tokens: int, peak: float) -> dict:
        seconds, cpu_seconds = statistics.median(self.times), statistics.median(self.cpu)
        return {
            "share_prefix": self.shared,
            "microbatches": self.microbatches,
            "tokens_per_s": tokens / seconds,
            "mfu": self.flops / seconds / peak,
            "model_gflops_per_s": self.flops / seconds / 1e9,
            "roofline_tokens_per_s": tokens * peak / self.flops,
            "seconds": seconds,
            "cpu_seconds": cpu_seconds,
            "cores_used": cpu_seconds / seconds,
            # Contention-robust view for a shared machine: tokens per CPU-second times the core count
            # (what the run would reach with every core to itself and perfect scaling; an estimate).
            "tokens_per_cpu_s_x_cores": tokens / cpu_seconds * (os.cpu_count() or 1),
            "times": self.times,
            "update_gflop": self.flops / 1e9,
            "xla_temp_mib": self.xla_temp_mib,
            "xla_args_mib": self.xla_args_mib,
        }


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64, help="sequences per update")
    ap.add_argument("--seq", type=int, default=192, help="tokens per sequence (prompt + completion)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument(
        "--microbatches",
        type=int,
        default=1,
        help="gradient-accumulation chunks (exact); 0: the fewest that fit --memory-budget-gib",
    )
    ap.add_argument("--memory-budget-gib", type=float, default=2.0, help="XLA temporaries, for --microbatches 0")
    ap.add_argument("--logits-chunk", type=int, default=0, help="train.logits_chunk (0: unchunked log-softmax)")
    ap.add_argument("--remat", default="none", help="train.remat: none | full | dots")
    ap.add_argument("--dtype", default="float32", help="model.dtype (compute; weights stay float32)")
    ap.add_argument(
        "--run-peer",
        action="store_true",
        help="also run benchmarks/peers/torch_update.py (same shape) in a subprocess, after this "
        "run's timing, and report speedup_vs_torch",
    )
    ap.add_argument("--group-size", type=int, default=8, help="rows per prompt group (one prompt each)")
    ap.add_argument(
        "--share-prefix",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="forward each group's prompt once (the loop's train.share_prefix)",
    )
    ap.add_argument(
        "--compare", action="store_true", help="also time the other --share-prefix setting, interleaved in rounds"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="tiny model and shape (smoke test)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.small:
        args.batch, args.seq, args.prompt_len, args.group_size = 8, 24, 8, 4
        args.repeats = min(args.repeats, 2)
    if (
        args.seq <= args.prompt_len
        or args.microbatches < 0
        or (args.microbatches and args.batch % args.microbatches)
        or args.batch % args.group_size
    ):
        ap.error("need --seq > --prompt-len, --microbatches 0 or dividing --batch, and --group-size dividing --batch")
    return args


def main(argv=None) -> dict:
    args = _parse(argv)
    import jax
    import jax.numpy as jnp

    cfg = dataclasses.replace(common.tiny() if args.small else common.bench_small(), dtype=args.dtype)
    _say("measuring this machine's matmul peak (for MFU)")
    peak = common.measure_matmul_peak(n=512, repeats=3) if args.small else common.measure_matmul_peak()
    B, P, T = args.batch, args.prompt_len, args.seq - args.prompt_len
    batch = jax.device_put(make_batch(cfg, B, P, T, args.group_size, args.seed))
    variants = [Variant(cfg, args, args.share_prefix, batch)]
    if args.compare:
        variants.append(Variant(cfg, args, not args.share_prefix, batch))
    for v in variants:  # warm-up
        _say(f"compiling and warming up the update ({B} x {args.seq} tokens, shared prompts {v.shared})")
        jax.block_until_ready(v.run())
    for r in range(args.repeats):  # rounds: a load change on the shared machine hits every variant alike
        _say(f"timing round {r + 1} of {args.repeats}")
        for v in variants:
            v.timed()
    metrics = jax.device_get(variants[0].run())
    assert all(bool(jnp.isfinite(v)) for v in metrics.values()), metrics

    tokens = B * args.seq
    result = {
        "benchmark": "update",
        **variants[0].figures(tokens, peak),
        "matmul_peak_gflops": peak / 1e9,
        "trained_tokens": tokens,
        "peak_rss_mib": common.peak_rss_mib(),
        "shape": {
            "batch": B,
            "seq": args.seq,
            "prompt_len": P,
            "completion_len": T,
            "microbatches": variants[0].microbatches,
            "group_size": args.group_size,
        },
        "options": {"logits_chunk": args.logits_chunk, "remat": args.remat, "dtype": args.dtype},
        "config": "tiny" if args.small else "bench-small",
        "model": common.config_dict(cfg),
        "params": common.total_params(cfg),
        "load_average": common.load_average(),
        "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    if args.compare:
        other = variants[1].figures(tokens, peak)
        shared, plain = (variants[0], variants[1]) if variants[0].shared else (variants[1], variants[0])
        result["other"] = other
        # median over rounds of (one-pass time / shared time): > 1 when sharing is faster
        result["speedup_share_prefix"] = statistics.median(p / s for p, s in zip(plain.times, shared.times))
        result["speedup_share_prefix_cpu"] = statistics.median(p / s for p, s in zip(plain.cpu, shared.cpu))
    _print(result, args, cfg)
    if args.run_peer:
        _say("running the PyTorch peer on the same shape (benchmarks/peers/torch_update.py)")
        result.update(torch_peer(args, result))
    common.emit(result)
    return result


def _say(what: str) -> None:
    """Progress on stderr: a bench-small run is minutes of silence otherwise; stdout stays the report."""
    print(f"update.py: {what} ...", file=sys.stderr, flush=True)


def _print(result: dict, args, cfg) -> None:
    B, P = args.batch, args.prompt_len
    print(
        f"update [{result['config']}] {B} sequences x {args.seq} tokens (prompt {P} + completion "
        f"{args.seq - P}), groups of {args.group_size}, {result['shape']['microbatches']} microbatch(es), "
        f"{common.total_params(cfg) / 1e6:.1f}M params; logits_chunk {args.logits_chunk}, remat {args.remat}, "
        f"{args.dtype} compute"
    )
    for r in [result] + ([result["other"]] if "other" in result else []):
        print(f"  prompt shared   {r['share_prefix']}")
        print(
            f"    time          {r['seconds']:.3f} s (median of {len(r['times'])}: "
            f"{', '.join(f'{t:.3f}' for t in r['times'])})"
        )
        print(
            f"    cpu           {r['cpu_seconds']:.3f} CPU-s per call ({r['cores_used']:.2f} cores busy); "
            f"{r['tokens_per_cpu_s_x_cores']:.0f} tokens per CPU-s x {os.cpu_count()} cores"
        )
        print(f"    throughput    {r['tokens_per_s']:.0f} trained tokens/s")
        print(
            f"    model FLOPs   {r['update_gflop']:.1f} GFLOP (3 x forward) -> {r['model_gflops_per_s']:.1f} "
            f"GFLOP/s, MFU {r['mfu']:.1%} of {result['matmul_peak_gflops']:.1f}, roofline "
            f"{r['roofline_tokens_per_s']:.0f} tokens/s"
        )
        if r["xla_temp_mib"] is not None:
            print(f"    memory        XLA temp {r['xla_temp_mib']:.0f} MiB + arguments {r['xla_args_mib']:.0f} MiB")
    if "speedup_share_prefix" in result:
        print(
            f"  speedup         {result['speedup_share_prefix']:.2f}x wall, "
            f"{result['speedup_share_prefix_cpu']:.2f}x CPU-time (shared prompt vs one pass, median over rounds)"
        )
    print(f"  process         peak RSS {result['peak_rss_mib']:.0f} MiB; load average {result['load_average']}")


if __name__ == "__main__":
    main()
