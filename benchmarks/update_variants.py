"""The update's memory options side by side: XLA temporaries and time per variant, in one process.

Each variant is benchmarks/update.py's step (bench-small, GRPO, 64 x 192 tokens) built with one
combination of microbatches, train.logits_chunk, train.remat and model.dtype. All are compiled first
(XLA temporaries from `memory_analysis`, no allocation), then timed in interleaved rounds (variant A,
B, C, A, B, C, ...) so load changes on a shared machine hit all alike; the figure per variant is the
median over rounds, wall and CPU.

    PYTHONPATH=. python benchmarks/update_variants.py                       # the default set below
    PYTHONPATH=. python benchmarks/update_variants.py --memory-only         # compile only: temporaries
    PYTHONPATH=. python benchmarks/update_variants.py --variants mb1,mb1-chunk1024 --rounds 5
    PYTHONPATH=. python benchmarks/update_variants.py --small               # tiny model (tests)

Variant names: `mb<N>` (N microbatches, 0 = auto from --memory-budget-gib), then any of
`-chunk<R>` (logits_chunk R), `-remat<full|dots>`, `-bf16`. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common
from benchmarks.update import make_batch, update_flops

DEFAULT = (
    "mb1,mb1-chunk1024,mb1-chunk1024-rematdots,mb1-chunk1024-rematfull,mb4,mb4-chunk1024,mb8-chunk1024,"
    "mb0-chunk1024,mb1-chunk1024-rematfull-bf16"
)


def parse_variant(name: str) -> dict:
    m = re.fullmatch(r"mb(\d+)((?:-chunk\d+|-remat(?:full|dots)|-bf16)*)", name)
    if not m:
        raise SystemExit(f"update_variants.py: error: --variants: cannot read {name!r} (e.g. mb1-chunk1024-rematfull)")
    opts = m.group(2)
    chunk = re.search(r"-chunk(\d+)", opts)
    remat = re.search(r"-remat(full|dots)", opts)
    return {
        "microbatches": int(m.group(1)),
        "logits_chunk": int(chunk.group(1)) if chunk else 0,
        "remat": remat.group(1) if remat else "none",
        "dtype": "bfloat16" if "-bf16" in opts else "float32",
    }


def build(name, spec, cfg, shape, budget_gib, seed=0):
    """-> (compiled step, state, batch, chosen microbatches, temp MiB)."""
    import dataclasses

    import jax

    from jaxrl.config import LossConfig, OptimConfig
    from jaxrl.losses import make_loss
    from jaxrl.models.transformer import init_params
    from jaxrl.train.memory_budget import auto_jit
    from jaxrl.train.state import init_state, make_optimizer
    from jaxrl.train.steps import make_logp_fn, make_update_step

    B, P, T, G = shape
    cfg = dataclasses.replace(cfg, dtype=spec["dtype"])
    loss = make_loss(LossConfig(preset="grpo"))
    optimizer = make_optimizer(OptimConfig(), total_steps=1000)
    state = init_state(init_params(cfg, jax.random.PRNGKey(seed)), optimizer, jax.random.PRNGKey(seed + 1))
    logp_fn = make_logp_fn(cfg, 1.0, logits_chunk=spec["logits_chunk"], remat=spec["remat"])

    def jit_for(n):
        return jax.jit(
            make_update_step(
                logp_fn,
                loss,
                optimizer,
                ppo_epochs=1,
                microbatches=n,
                max_new_tokens=T,
                group_size=G,
                use_ref=False,
            ),
            donate_argnums=0,
        )

    batch = jax.device_put(make_batch(cfg, B, P, T, G, seed))
    n = spec["microbatches"]
    if n == 0:  # what train.microbatches=0 does (jaxrl.train.memory_budget)
        step, fit, _ = auto_jit(lambda fit: jit_for(fit.microbatches), (state, batch), B, budget_gib, log=print)
        n = fit.microbatches
    else:
        step = jit_for(n)
    compiled = step.lower(state, batch).compile()
    return compiled, state, batch, n, compiled.memory_analysis().temp_size_in_bytes / 2**20


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=DEFAULT)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--memory-budget-gib", type=float, default=2.0)
    ap.add_argument("--memory-only", action="store_true", help="compile and report temporaries; time nothing")
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args(argv)

    import jax

    names = args.variants.split(",")
    specs = {name: parse_variant(name) for name in names}
    if args.small:
        cfg, shape = common.tiny(), (8, 8, 16, 4)
        args.rounds = min(args.rounds, 2)
        specs = {k: dict(v, logits_chunk=min(v["logits_chunk"], 32)) for k, v in specs.items()}
    else:
        cfg, shape = common.bench_small(), (64, 64, 128, 8)
    B, P, T, _ = shape
    tokens = B * (P + T)
    flops = update_flops(cfg, B, P, T)
    built = {}
    for name in names:
        t0 = time.perf_counter()
        compiled, state, batch, n, temp = build(name, specs[name], cfg, shape, args.memory_budget_gib)
        built[name] = {"compiled": compiled, "state": state, "batch": batch}
        specs[name].update(chosen_microbatches=n, xla_temp_mib=temp, compile_s=time.perf_counter() - t0)
        print(f"  {name:34s} temp {temp:8.0f} MiB  (compile {specs[name]['compile_s']:.0f} s)", flush=True)
        if args.memory_only:
            del built[name]
    if not args.memory_only:
        times = {n: [] for n in names}
        cpu = {n: [] for n in names}
        for name in names:  # warm-up
            b = built[name]
            b["state"], m = b["compiled"](b["state"], b["batch"])
            jax.block_until_ready(m)
        for _ in range(args.rounds):
            for name in names:
                b = built[name]
                c0, t0 = time.process_time(), time.perf_counter()
                b["state"], m = b["compiled"](b["state"], b["batch"])
                jax.block_until_ready(m)
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
        for name in names:
            s, c = statistics.median(times[name]), statistics.median(cpu[name])
            specs[name].update(
                seconds=s,
                cpu_seconds=c,
                tokens_per_s=tokens / s,
                tokens_per_cpu_s_x_cores=tokens / c * (os.cpu_count() or 1),
                model_gflops_per_s=flops / s / 1e9,
                times=times[name],
            )
            print(
                f"  {name:34s} {tokens / s:7.0f} tokens/s  {specs[name]['tokens_per_cpu_s_x_cores']:7.0f} "
                f"per CPU-s x cores  temp {specs[name]['xla_temp_mib']:6.0f} MiB",
                flush=True,
            )
    result = {
        "benchmark": "update_variants",
        "variants": specs,
        "trained_tokens": tokens,
        "config": "tiny" if args.small else "bench-small",
        "load_average": common.load_average(),
        "peak_rss_mib": common.peak_rss_mib(),
        "jax": jax.__version__,
        # required by the common smoke test
        "tokens_per_s": max((v.get("tokens_per_s", 0.0) for v in specs.values()), default=0.0),
    }
    common.emit(result)
    return result


if __name__ == "__main__":
    main()
