"""LoRA vs full fine-tuning on bench-small: train-state bytes and update throughput, in one run.

Full fine-tuning's state: float32 params, AdamW's two moments and a reference copy (what a run with a
KL term holds). LoRA's state: the frozen base in `--base-dtype`, the adapters (rank `--rank` on every
projection) and AdamW's moments of the adapters only; the reference is the base with the adapters
off, so there is no copy. Byte counts come from the states' shapes (`jax.eval_shape`), exact.

Update throughput: the real GRPO update step (`make_update_step`, the state donated, one PPO epoch,
the `grpo` preset, a KL term so both sides run a reference forward) on the same batch, interleaved
rounds so a load change on a shared machine hits both alike; LoRA's step merges base + A @ B inside
its gradient (jaxrl.models.lora.merge), as the training loop does.

    PYTHONPATH=. python benchmarks/lora.py                 # bench-small, rank 8, bfloat16 base
    PYTHONPATH=. python benchmarks/lora.py --base-dtype int8
    PYTHONPATH=. python benchmarks/lora.py --small         # seconds-long smoke run (tests)

Reports state_bytes_ratio = LoRA state bytes / full state bytes (the issue's target: <= 0.35) for
each base dtype, and update_speed_ratio = LoRA tokens/s / full tokens/s (median over rounds of the
per-round time ratio). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common
from benchmarks.update import make_batch


def tree_bytes(tree) -> int:
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _states(cfg, lcfg, optimizer, seed: int):
    """(full state, LoRA state, the LoRA merge) built from one set of base params."""
    import jax

    from jaxrl.models import lora
    from jaxrl.models.transformer import init_params, param_logical_axes
    from jaxrl.train.state import init_state

    params = init_params(cfg, jax.random.key(seed))
    logical = param_logical_axes(cfg)
    full = init_state(params, optimizer, jax.random.key(seed + 1), ref_params=jax.tree.map(lambda x: x.copy(), params))
    adapters = lora.init_adapters(params, logical, lcfg, jax.random.key(seed + 2))
    base = lora.store_base(params, logical, lcfg)
    lora_state = init_state(adapters, optimizer, jax.random.key(seed + 1), base=base)
    return full, lora_state, lambda b, a: lora.merge(b, a, lcfg, logical)


def state_bytes(cfg, rank: int, optimizer) -> dict:
    """Train-state bytes of full fine-tuning and of LoRA with each base dtype, from shapes only."""
    import jax

    from jaxrl.config.lora import BASE_DTYPES, LoraConfig

    out = {}
    for dtype in BASE_DTYPES:
        full, lo = jax.eval_shape(lambda d=dtype: _states(cfg, LoraConfig(rank=rank, base_dtype=d), optimizer, 0)[:2])
        out["full"] = tree_bytes(full)
        out[dtype] = {
            "state_bytes": tree_bytes(lo),
            "base_bytes": tree_bytes(lo.base),
            "adapter_bytes": tree_bytes(lo.params),
            "optimizer_bytes": tree_bytes(lo.opt_state),
        }
    return out


def _update(logp_fn, optimizer, args, merge=None):
    import jax

    from jaxrl.config import LossConfig
    from jaxrl.losses import make_loss
    from jaxrl.train.steps import make_update_step

    step = make_update_step(
        logp_fn,
        make_loss(LossConfig(preset="grpo", kl_beta=0.01)),
        optimizer,
        ppo_epochs=1,
        microbatches=args.microbatches,
        max_new_tokens=args.seq - args.prompt_len,
        group_size=args.group_size,
        merge=merge,
    )
    return jax.jit(step, donate_argnums=0)


def time_updates(cfg, args, optimizer) -> dict:
    """Seconds per update of full fine-tuning and LoRA, interleaved rounds after a warm-up."""
    import jax
    import jax.numpy as jnp

    from jaxrl.config.lora import LoraConfig
    from jaxrl.train.steps import make_logp_fn

    lcfg = LoraConfig(rank=args.rank, base_dtype=args.base_dtype)
    full, lo, merge = _states(cfg, lcfg, optimizer, args.seed)
    batch = jax.device_put(make_batch(cfg, args.batch, args.prompt_len, args.seq - args.prompt_len, args.group_size, 0))
    logp_fn = make_logp_fn(cfg, temperature=1.0, prompt_groups=args.group_size)
    steps = {"full": _update(logp_fn, optimizer, args), "lora": _update(logp_fn, optimizer, args, merge)}
    states = {"full": full, "lora": lo}
    times: dict[str, list[float]] = {"full": [], "lora": []}
    for name in steps:  # compile + warm-up
        states[name], metrics = steps[name](states[name], batch)
        assert all(bool(jnp.isfinite(v)) for v in jax.device_get(metrics).values()), (name, metrics)
    for _ in range(args.repeats):
        for name in steps:
            t0 = time.perf_counter()
            states[name], metrics = steps[name](states[name], batch)
            jax.block_until_ready(metrics)
            times[name].append(time.perf_counter() - t0)
    return times


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=8, help="model.lora.rank (every projection)")
    ap.add_argument("--base-dtype", default="bfloat16", help="model.lora.base_dtype of the timed LoRA update")
    ap.add_argument("--batch", type=int, default=32, help="sequences per update")
    ap.add_argument("--seq", type=int, default=192, help="tokens per sequence (prompt + completion)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="tiny model and shape (smoke test)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.small:
        args.batch, args.seq, args.prompt_len, args.group_size, args.repeats = 8, 24, 8, 4, 2
    if args.base_dtype not in ("float32", "bfloat16", "int8"):
        ap.error(f"--base-dtype: got {args.base_dtype!r}, expected float32, bfloat16 or int8")
    if args.rank < 1:
        ap.error(f"--rank: got {args.rank}, expected a positive integer")
    return args


def main(argv=None) -> dict:
    args = _parse(argv)
    import jax

    from jaxrl.config import OptimConfig
    from jaxrl.train.state import make_optimizer

    cfg = common.tiny() if args.small else common.bench_small()
    optimizer = make_optimizer(OptimConfig(), total_steps=1000)
    sizes = state_bytes(cfg, args.rank, optimizer)
    times = time_updates(cfg, args, optimizer)
    tokens = args.batch * args.seq
    full_s, lora_s = statistics.median(times["full"]), statistics.median(times["lora"])
    result = {
        "benchmark": "lora",
        "config": "tiny" if args.small else "bench-small",
        "rank": args.rank,
        "base_dtype": args.base_dtype,
        "state_bytes_full": sizes["full"],
        "state_bytes_lora": sizes[args.base_dtype]["state_bytes"],
        "state_bytes_ratio": sizes[args.base_dtype]["state_bytes"] / sizes["full"],
        "state_bytes_ratio_by_base_dtype": {d: sizes[d]["state_bytes"] / sizes["full"] for d in sizes if d != "full"},
        "lora_state_parts": sizes[args.base_dtype],
        "update_tokens_per_s_full": tokens / full_s,
        "update_tokens_per_s_lora": tokens / lora_s,
        # per round: the two updates ran back to back, so a load change hits both
        "update_speed_ratio": statistics.median(f / lo for f, lo in zip(times["full"], times["lora"])),
        "times": times,
        "shape": {"batch": args.batch, "seq": args.seq, "prompt_len": args.prompt_len, "group_size": args.group_size},
        "model": common.config_dict(cfg),
        "params": common.total_params(cfg),
        "load_average": common.load_average(),
        "jax": jax.__version__,
    }
    _print(result)
    common.emit(result)
    return result


def _print(r: dict) -> None:
    mib = 2**20
    print(f"lora [{r['config']}] rank {r['rank']} on every projection, {r['params'] / 1e6:.1f}M params")
    print(f"  train state   full {r['state_bytes_full'] / mib:.1f} MiB (params + AdamW moments + reference copy)")
    for dtype, ratio in r["state_bytes_ratio_by_base_dtype"].items():
        print(f"                LoRA, {dtype:8s} base: {ratio * r['state_bytes_full'] / mib:.1f} MiB = {ratio:.3f} x")
    print(
        f"  update        full {r['update_tokens_per_s_full']:.0f} tokens/s, LoRA ({r['base_dtype']} base) "
        f"{r['update_tokens_per_s_lora']:.0f} tokens/s -> update_speed_ratio {r['update_speed_ratio']:.2f}"
    )


if __name__ == "__main__":
    main()
