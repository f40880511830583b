"""Training-update throughput: the real GRPO update step (forward + backward + AdamW) on bench-small.

Default shape: 64 sequences of 192 tokens (prompt 64 + completion 128), random tokens and
advantages, one PPO epoch, the `grpo` loss preset, `make_update_step` jitted with the state donated,
exactly as the training loop runs it.

    PYTHONPATH=. python benchmarks/update.py               # full benchmark
    PYTHONPATH=. python benchmarks/update.py --small       # seconds-long smoke run (tests)
    PYTHONPATH=. python benchmarks/update.py --run-peer    # + the PyTorch peer in the same run: speedup_vs_torch
    PYTHONPATH=. python benchmarks/update.py --remat full --logits-chunk 1024 --microbatches 0   # memory options

`--microbatches 0` chooses the count from `--memory-budget-gib` as `train.microbatches=0` does;
`--logits-chunk`, `--remat` and `--dtype` are `train.logits_chunk`, `train.remat` and `model.dtype`.

Reports trained tokens/s = batch*seq / median wall time of one update (compiled, after a warm-up
call), and MFU = model FLOP/s / this machine's measured float32 matmul FLOP/s, with training FLOPs =
3 x forward FLOPs (backward = 2 x forward). Forward FLOPs per sequence (see benchmarks/common.py):
every token runs the layers (2 x layer matmul params + causal attention), and the LM head runs on the
`completion` positions whose log-probs the loss needs (token_logprobs skips the head elsewhere).
Peak memory: XLA's buffer sizes of the compiled update, and the process's peak RSS.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402


def update_flops(cfg, batch: int, prompt_len: int, completion_len: int) -> float:
    """Training FLOPs of one update: 3 x forward, head only on the completion positions."""
    seq = prompt_len + completion_len
    head = 2.0 * cfg.d_model * cfg.vocab_size
    forward = common.sequence_flops(cfg, 0, seq) - head * (seq - completion_len)
    return 3.0 * batch * forward


def make_batch(cfg, batch: int, prompt_len: int, completion_len: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    return {
        "prompt_tokens_BxP": rng.integers(0, cfg.vocab_size, (batch, prompt_len), dtype=np.int32),
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
    out = {"torch": {k: peer[k] for k in ("tokens_per_s", "seconds", "cpu_seconds", "tokens_per_cpu_s_x_cores",
                                          "torch_threads", "cores_used", "load_average", "loss", "trained_tokens")},
           "speedup_vs_torch": ours["tokens_per_s"] / peer["tokens_per_s"],
           "speedup_vs_torch_cpu": ours["tokens_per_cpu_s_x_cores"] / peer["tokens_per_cpu_s_x_cores"]}
    print(f"  torch peer      {peer['tokens_per_s']:.0f} tokens/s ({peer['tokens_per_cpu_s_x_cores']:.0f} per CPU-s "
          f"x cores, {peer['torch_threads']} threads) -> speedup_vs_torch {out['speedup_vs_torch']:.2f} "
          f"(per CPU-s {out['speedup_vs_torch_cpu']:.2f})")
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64, help="sequences per update")
    ap.add_argument("--seq", type=int, default=192, help="tokens per sequence (prompt + completion)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=1,
                    help="gradient-accumulation chunks (exact); 0: the fewest that fit --memory-budget-gib")
    ap.add_argument("--memory-budget-gib", type=float, default=2.0, help="XLA temporaries, for --microbatches 0")
    ap.add_argument("--logits-chunk", type=int, default=0, help="train.logits_chunk (0: unchunked log-softmax)")
    ap.add_argument("--remat", default="none", help="train.remat: none | full | dots")
    ap.add_argument("--dtype", default="float32", help="model.dtype (compute; weights stay float32)")
    ap.add_argument("--group-size", type=int, default=8, help="rows per prompt group (for the loss)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="tiny model and shape (smoke test)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-peer", action="store_true",
                    help="also run benchmarks/peers/torch_update.py (same shape) in a subprocess, after this "
                         "run's timing, and report speedup_vs_torch")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from jaxrl.config import LossConfig, OptimConfig
    from jaxrl.losses import make_loss
    from jaxrl.models.transformer import init_params
    from jaxrl.train.state import init_state, make_optimizer
    from jaxrl.train.steps import make_logp_fn, make_update_step

    if args.small:
        cfg = common.tiny()
        args.batch, args.seq, args.prompt_len, args.group_size = 8, 24, 8, 4
        args.repeats = min(args.repeats, 2)
        peak = common.measure_matmul_peak(n=512, repeats=3)
    else:
        cfg = common.bench_small()
        peak = common.measure_matmul_peak()
    B, P = args.batch, args.prompt_len
    T = args.seq - P
    if T <= 0 or args.microbatches < 0 or (args.microbatches and B % args.microbatches):
        ap.error("need --seq > --prompt-len and --microbatches 0 or dividing --batch")
    cfg = dataclasses.replace(cfg, dtype=args.dtype)

    loss = make_loss(LossConfig(preset="grpo"))
    optimizer = make_optimizer(OptimConfig(), total_steps=1000)
    params = init_params(cfg, jax.random.PRNGKey(args.seed))
    state = init_state(params, optimizer, jax.random.PRNGKey(args.seed + 1))
    logp_fn = make_logp_fn(cfg, temperature=1.0, logits_chunk=args.logits_chunk, remat=args.remat)
    kwargs = dict(ppo_epochs=1, max_new_tokens=T, use_ref=False)
    if "group_size" in inspect.signature(make_update_step).parameters:
        kwargs["group_size"] = args.group_size
    jit_for = lambda n: jax.jit(make_update_step(logp_fn, loss, optimizer, microbatches=n, **kwargs),  # noqa: E731
                                donate_argnums=0)
    batch = jax.device_put(make_batch(cfg, B, P, T, args.seed))

    if args.microbatches == 0:  # what train.microbatches=0 does (jaxrl.train.memory_budget)
        from jaxrl.train.memory_budget import auto_jit

        step, args.microbatches = auto_jit(jit_for, (state, batch), B, args.memory_budget_gib, log=print)
    else:
        step = jit_for(args.microbatches)
    compiled = step.lower(state, batch).compile()
    mem = compiled.memory_analysis()
    xla_temp_mib = float(getattr(mem, "temp_size_in_bytes", 0)) / 2**20 if mem is not None else None
    xla_args_mib = float(getattr(mem, "argument_size_in_bytes", 0)) / 2**20 if mem is not None else None

    holder = {"state": state}

    def run():
        holder["state"], metrics = compiled(holder["state"], batch)
        return metrics

    cpu = []
    seconds, times = common.median_time(run, args.repeats, cpu_times=cpu)
    import statistics
    cpu_seconds = statistics.median(cpu)
    metrics = jax.device_get(run())
    assert all(bool(jnp.isfinite(v)) for v in metrics.values()), metrics

    tokens = B * args.seq
    flops = update_flops(cfg, B, P, T)
    achieved = flops / seconds
    result = {
        "benchmark": "update",
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
        "trained_tokens": tokens,
        "update_gflop": flops / 1e9,
        "xla_temp_mib": xla_temp_mib,
        "xla_args_mib": xla_args_mib,
        "peak_rss_mib": common.peak_rss_mib(),
        "shape": {"batch": B, "seq": args.seq, "prompt_len": P, "completion_len": T,
                  "microbatches": args.microbatches},
        "options": {"logits_chunk": args.logits_chunk, "remat": args.remat, "dtype": args.dtype},
        "config": "tiny" if args.small else "bench-small",
        "model": common.config_dict(cfg),
        "params": common.total_params(cfg),
        "load_average": common.load_average(),
        "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    print(f"update [{result['config']}] {B} sequences x {args.seq} tokens (prompt {P} + completion {T}), "
          f"{args.microbatches} microbatch(es), {common.total_params(cfg) / 1e6:.1f}M params; logits_chunk "
          f"{args.logits_chunk}, remat {args.remat}, {args.dtype} compute")
    print(f"  time            {seconds:.3f} s (median of {args.repeats}: {', '.join(f'{t:.3f}' for t in times)})")
    print(f"  cpu             {cpu_seconds:.3f} CPU-s per call ({result['cores_used']:.2f} cores busy); "
          f"{result['tokens_per_cpu_s_x_cores']:.0f} tokens per CPU-s x {os.cpu_count()} cores")
    print(f"  throughput      {result['tokens_per_s']:.0f} trained tokens/s")
    print(f"  model FLOPs     {flops / 1e9:.1f} GFLOP (3 x forward) -> {achieved / 1e9:.1f} GFLOP/s")
    print(f"  matmul peak     {peak / 1e9:.1f} GFLOP/s -> MFU {result['mfu']:.1%}, "
          f"roofline {result['roofline_tokens_per_s']:.0f} tokens/s")
    if xla_temp_mib is not None:
        print(f"  memory          XLA temp {xla_temp_mib:.0f} MiB + arguments {xla_args_mib:.0f} MiB; "
              f"process peak RSS {result['peak_rss_mib']:.0f} MiB")
    print(f"  load average    {result['load_average']}")
    if args.run_peer:
        result.update(torch_peer(args, result))
    common.emit(result)
    return result


if __name__ == "__main__":
    main()
