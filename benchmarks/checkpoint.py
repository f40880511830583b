"""How long an asynchronous checkpoint save blocks a training step (target: <= 2% of a step).

The loop calls `jaxrl.train.checkpoint.BackgroundSaver.save` after the step's update is dispatched: it
copies the state to host memory and runs orbax's save (which itself returns after its own host copy and
bookkeeping, then writes in a thread) on a background thread. What the step loses is the time `save`
takes to return. Two parts, both in this one run:

  1. the default run (`configs/grpo_arithmetic.py`, its warm-started embedded model), `--steps` steps
     with a checkpoint after EVERY step (10x the config's cadence): each `save` call is timed inside
     the real loop, after waiting for the update it saves (so the figure is the save alone, not the
     update it would otherwise wait for), beside the steps' own `step_seconds`.
  2. bench-small's train state (31M parameters + AdamW's two moments, ~370 MB): `save` timed alone
     (median of --repeats, each to a fresh step), and orbax's save called directly on the loop's thread
     (what the loop did before, `orbax_save_block_s`), beside one bench-small GRPO update on
     --update-batch x 192 tokens timed in the same run.

The last line printed is one JSON object: `block_fraction_default` and `block_fraction_bench_small`
(median save block / median step time), the save and step seconds, the state bytes, and the time
each save took to finish in the background (`manager.wait_until_finished`).

    PYTHONPATH=. python benchmarks/checkpoint.py            # full run
    PYTHONPATH=. python benchmarks/checkpoint.py --small    # smoke run (tiny model, seconds)
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common


def timed_saves(calls: list):
    """A wrapper of the loop's BackgroundSaver.save that records the seconds each call blocked, after
    waiting for the state it is given (the update that produced it) outside the timing."""
    import jax

    from jaxrl.train import checkpoint as ckpt

    original = ckpt.BackgroundSaver.save

    def save(self, step, state, host, **kw):
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        original(self, step, state, host, **kw)
        calls.append(time.perf_counter() - t0)

    return original, save


def default_run(steps: int, root: pathlib.Path, small: bool) -> dict:
    """Part 1: the default config's loop with a checkpoint after every step."""
    from jaxrl.config import load_config
    from jaxrl.train import checkpoint as ckpt
    from jaxrl.train.loop import train

    sets = [
        f"train.steps={steps}",
        "checkpoint.every=1",
        f"checkpoint.keep={steps + 1}",
        "train.progress=false",
        "train.eval_every=0",
    ]
    if small:
        sets += [
            "model.d_model=32",
            "model.n_layers=1",
            "model.mlp_dim=64",
            "model.n_heads=2",
            "model.n_kv_heads=1",
            "model.head_dim=16",
            "data.num_train=200",
            "data.num_test=20",
            "warmstart.steps=2",
            "warmstart.batch_size=8",
            "rollout.prompts_per_step=2",
            "rollout.group_size=4",
            "train.eval_prompts=8",
        ]
    cfg = load_config(pathlib.Path(__file__).resolve().parents[1] / "configs" / "grpo_arithmetic.py", sets)  # any cwd
    calls: list[float] = []
    original, wrapper = timed_saves(calls)
    ckpt.BackgroundSaver.save = wrapper
    try:
        rows = train(cfg, root / "default_run")
    finally:
        ckpt.BackgroundSaver.save = original
    step_s = [r["step_seconds"] for r in rows if r.get("step", 0) >= 2 and "step_seconds" in r]  # step 1 compiles
    block_s = calls[1:] or calls
    return {
        "save_block_s": statistics.median(block_s),
        "save_block_max_s": max(block_s),
        "step_s": statistics.median(step_s),
        "saves": len(calls),
        "steps": steps,
    }


def state_bytes(tree) -> int:
    import jax

    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def bench_small_state(root: pathlib.Path, repeats: int, update_batch: int, small: bool) -> dict:
    """Part 2: save-block of bench-small's state vs one bench-small update step."""
    import jax

    from benchmarks.update import make_batch
    from jaxrl.config import CheckpointConfig, LossConfig, OptimConfig
    from jaxrl.losses import make_loss
    from jaxrl.models.transformer import init_params
    from jaxrl.train import checkpoint as ckpt
    from jaxrl.train.state import init_state, make_optimizer
    from jaxrl.train.steps import make_logp_fn, make_update_step

    cfg = common.tiny() if small else common.bench_small()
    prompt_len, completion_len = (8, 16) if small else (64, 128)
    optimizer = make_optimizer(OptimConfig(), total_steps=1000)
    state = init_state(init_params(cfg, jax.random.PRNGKey(0)), optimizer, jax.random.PRNGKey(1))
    step = jax.jit(
        make_update_step(
            make_logp_fn(cfg, temperature=1.0),
            make_loss(LossConfig(preset="grpo")),
            optimizer,
            ppo_epochs=1,
            microbatches=1,
            max_new_tokens=completion_len,
            group_size=8,
            use_ref=False,
        ),
        donate_argnums=0,
    )
    batch = jax.device_put(make_batch(cfg, update_batch, prompt_len, completion_len, group_size=8, seed=0))
    holder = {"state": state}

    def update():
        holder["state"], metrics = step(holder["state"], batch)
        return metrics

    step_s, _ = common.median_time(update, repeats=max(1, repeats // 2))
    state = jax.block_until_ready(holder["state"])
    saver = ckpt.BackgroundSaver(ckpt.make_manager(root / "bench_small", CheckpointConfig(every=1, keep=2)))
    blocks, finishes, orbax_blocks = [], [], []
    for i in range(repeats + 1):  # the first save also creates the directories: not counted
        t0 = time.perf_counter()
        saver.save(2 * i + 1, state, {"stream": {}}, force=True)
        t1 = time.perf_counter()
        saver.wait()
        t2 = time.perf_counter()
        ckpt.save(saver.manager, 2 * i + 2, state, {"stream": {}}, force=True)  # orbax's async save, on this thread
        t3 = time.perf_counter()
        saver.wait()
        if i:
            blocks.append(t1 - t0)
            finishes.append(t2 - t0)
            orbax_blocks.append(t3 - t2)
    saver.close()
    return {
        "save_block_s": statistics.median(blocks),
        "save_block_max_s": max(blocks),
        "orbax_save_block_s": statistics.median(orbax_blocks),
        "save_finish_s": statistics.median(finishes),
        "step_s": step_s,
        "state_mib": state_bytes(state) / 2**20,
        "update_tokens": update_batch * (prompt_len + completion_len),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="default-run steps, each followed by a save")
    ap.add_argument("--repeats", type=int, default=5, help="bench-small saves timed")
    ap.add_argument("--update-batch", type=int, default=16, help="bench-small update rows (x 192 tokens)")
    ap.add_argument("--root", default="", help="scratch directory (default: a temporary one)")
    ap.add_argument("--small", action="store_true", help="tiny models, few steps (smoke test)")
    args = ap.parse_args(argv)
    if args.small:
        args.steps, args.repeats, args.update_batch = 3, 1, 8
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(args.root or tmp)
        default = default_run(args.steps, root, args.small)
        big = bench_small_state(root, args.repeats, args.update_batch, args.small)
    result = {
        "benchmark": "checkpoint",
        "block_fraction_default": default["save_block_s"] / default["step_s"],
        "block_fraction_bench_small": big["save_block_s"] / big["step_s"],
        "default_run": default,
        "bench_small": big,
        "config": "tiny" if args.small else "bench-small",
        "load_average": common.load_average(),
    }
    print(
        f"default run: {default['saves']} saves, each blocked the step {default['save_block_s'] * 1e3:.1f} ms "
        f"(median; max {default['save_block_max_s'] * 1e3:.1f} ms) of a {default['step_s']:.3f} s step "
        f"-> {result['block_fraction_default']:.2%}"
    )
    print(
        f"{result['config']} state ({big['state_mib']:.0f} MiB): save blocked {big['save_block_s'] * 1e3:.1f} ms "
        f"(median of {args.repeats}; max {big['save_block_max_s'] * 1e3:.1f} ms; orbax's save called on the loop's "
        f"thread: {big['orbax_save_block_s'] * 1e3:.1f} ms), finished in the background "
        f"after {big['save_finish_s']:.2f} s; one update on {big['update_tokens']} tokens takes {big['step_s']:.2f} s "
        f"-> {result['block_fraction_bench_small']:.2%}"
    )
    print(f"load average {result['load_average']}")
    common.emit(result)
    return result


if __name__ == "__main__":
    main()
