"""Packed vs padded update: live tokens trained per second by the real GRPO update step, both ways.

The update step (`make_update_step`, `grpo`, one PPO epoch, AdamW, the state donated) is compiled
twice over the same model: padded (the one-pass forward over B x (P + T)) and packed
(`train.packing=on`: the live tokens in N packs of L = P + T slots, the smallest N of `--sizes`
counts up to `--budget` of the padded slots that fits, jaxrl/models/packing.py). Two workloads,
each a set of `--batches` different batches timed in interleaved rounds (a load change on the
shared machine hits both alike):

* longtail: the long-tail task's batches (configs/grpo_longtail.py: 8 prompts x 8 rows, prompt <= 19
  tokens with BOS, completion <= 82 with EOS): prompts drawn from that task's training split
  (jaxrl.data.long_addition.generate_splits, as the config builds it), each row's completion its
  worked solution (the fallible teacher's carry-dropping variant for 60% of rows, as the warm start
  writes);
* uniform: every row full, prompt 19 and completion 82 (nothing to pack: the packs do not fit and the
  packed step runs padded behind its `lax.cond`; this measures what packing costs when it cannot help).

tokens/s = live completion tokens (the tokens the loss trains) / median update time; packed_speedup =
median over rounds and batches of padded time / packed time. Also the share of packed forwards that
fell back (`packing/fallback`) and the packs' fill. The last line printed is one JSON object.

    PYTHONPATH=. python benchmarks/packed_update.py                 # the long-tail config's model
    PYTHONPATH=. python benchmarks/packed_update.py --shared        # + the shared-prefix forward
    PYTHONPATH=. python benchmarks/packed_update.py --model bench-small
    PYTHONPATH=. python benchmarks/packed_update.py --small         # seconds-long smoke run (tests)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common

P, T, G, PROMPTS = 19, 82, 8, 8  # configs/grpo_longtail.py


def longtail_lengths(n_groups: int, seed: int) -> tuple[list[int], list[int]]:
    """(prompt lengths with BOS, completion lengths with EOS) of n_groups x G rows of the long-tail task:
    n_groups prompts drawn from its training split (configs/grpo_longtail.py: 8000 distinct problems,
    data seed 0), each row's completion its worked solution (the carry-dropping variant for 60%)."""
    from jaxrl.data.long_addition import generate_splits, solution

    records = generate_splits(8, "+", 8000, 500, 0)["train"]
    rnd = random.Random(seed)
    plens, clens = [], []
    for r in rnd.sample(records, n_groups):
        info = json.loads(r["info"])
        for _ in range(G):
            carries = rnd.random() >= 0.6  # the warm start's teacher forgets carries 60% of the time
            plens.append(len(r["prompt"]) + 1)
            clens.append(len(solution(info["a"], info["b"], carries)) + 1)
    return plens, clens


def make_batch(vocab: int, plens: list[int], clens: list[int], P: int, T: int, seed: int) -> dict:
    """A left-padded GRPO batch with these lengths; rows of a group share their prompt."""
    import numpy as np

    rng = np.random.default_rng(seed)
    B = len(plens)
    pl, cl = np.asarray(plens)[:, None], np.asarray(clens)[:, None]
    pmask = (np.arange(P)[None] >= P - pl).astype(np.int32)
    prompts = np.repeat(rng.integers(3, vocab, (B // G, P)), G, axis=0) * pmask
    cmask = (np.arange(T)[None] < cl).astype(np.float32)
    return {
        "prompt_tokens_BxP": prompts.astype(np.int32),
        "prompt_mask_BxP": pmask,
        "tokens_BxT": (rng.integers(3, vocab, (B, T)) * cmask).astype(np.int32),
        "completion_mask_BxT": cmask,
        "rewards_BxK": rng.integers(0, 2, (B, 1)).astype(np.float32),
        "truncated_B": np.zeros((B,), np.float32),
    }


class Step:
    """One compiled update (packed or padded) with its own donated state."""

    def __init__(self, cfg, packing, batch, args, prompt_groups: int = 0):
        import jax

        from jaxrl.config import LossConfig, OptimConfig
        from jaxrl.losses import make_loss
        from jaxrl.models.transformer import init_params
        from jaxrl.train.state import init_state, make_optimizer
        from jaxrl.train.steps import make_logp_fn, make_update_step

        optimizer = make_optimizer(OptimConfig(), total_steps=1000)
        self.state = init_state(init_params(cfg, jax.random.key(args.seed)), optimizer, jax.random.key(1))
        # one-pass forward when not packing, or each group's prompt once (`prompt_groups`)
        logp_fn = make_logp_fn(cfg, 1.0, prompt_groups=prompt_groups, packing=packing)
        step = make_update_step(
            logp_fn,
            make_loss(LossConfig(preset="grpo")),
            optimizer,
            ppo_epochs=1,
            microbatches=1,
            max_new_tokens=T,
            group_size=G,
            use_ref=False,
        )
        self.compiled = jax.jit(step, donate_argnums=0).lower(self.state, batch).compile()
        self.times: list[float] = []

    def __call__(self, batch, timed: bool) -> dict:
        import jax

        t0 = time.perf_counter()
        self.state, metrics = self.compiled(self.state, batch)
        metrics = jax.device_get(metrics)
        if timed:
            self.times.append(time.perf_counter() - t0)
        return metrics


def workload(name: str, cfg, batches: list[dict], args) -> dict:
    import jax

    from jaxrl.models.packing import PackSpec

    batches = [jax.device_put(b) for b in batches]
    _say(f"{name}: compiling the padded and the packed update")
    spec = PackSpec("on", 0, args.budget, args.sizes)
    padded, packed = Step(cfg, None, batches[0], args), Step(cfg, spec, batches[0], args)
    shared = Step(cfg, None, batches[0], args, prompt_groups=G) if args.shared else None
    fallback, fill = [], []
    for b in batches:  # warm-up
        padded(b, False)
        packed(b, False)
        if shared is not None:
            shared(b, False)
    for r in range(args.repeats):
        _say(f"{name}: round {r + 1} of {args.repeats}")
        for b in batches:
            padded(b, True)
            if shared is not None:
                shared(b, True)
            m = packed(b, True)
            fallback.append(float(m["packing/fallback"]))
            fill.append(float(m["packing/fill"]))
    live = statistics.mean(float(b["completion_mask_BxT"].sum()) for b in batches)
    padded_s, packed_s = statistics.median(padded.times), statistics.median(packed.times)
    width = batches[0]["prompt_mask_BxP"].shape[1] + T
    live_all = statistics.mean(
        float(b["prompt_mask_BxP"].sum() + b["completion_mask_BxT"].sum()) / (b["prompt_mask_BxP"].shape[0] * width)
        for b in batches
    )
    extra = {}
    if shared is not None:  # the shared-prefix forward (train.share_prefix), padded completions
        extra = {
            "shared_speedup": statistics.median(a / b for a, b in zip(padded.times, shared.times)),
            "packed_vs_shared": statistics.median(a / b for a, b in zip(shared.times, packed.times)),
            "shared_seconds": statistics.median(shared.times),
            "shared_times": shared.times,
        }
    return {
        **extra,
        "packed_speedup": statistics.median(a / b for a, b in zip(padded.times, packed.times)),
        "padded_tokens_per_s": live / padded_s,
        "packed_tokens_per_s": live / packed_s,
        "padded_seconds": padded_s,
        "packed_seconds": packed_s,
        "live_completion_tokens": live,
        "live_share_of_padded_slots": live_all,
        "fallback": statistics.mean(fallback),
        "fill": statistics.mean(fill),
        "padded_times": padded.times,
        "packed_times": packed.times,
    }


def main(argv=None) -> dict:
    from jaxrl.config import TrainConfig

    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", choices=("longtail", "bench-small"), default="longtail")
    ap.add_argument("--budget", type=float, default=TrainConfig.pack_budget, help="train.pack_budget (its default)")
    ap.add_argument("--sizes", type=int, default=TrainConfig.pack_sizes, help="train.pack_sizes (its default)")
    ap.add_argument("--batches", type=int, default=4, help="different batches per workload")
    ap.add_argument("--repeats", type=int, default=3, help="timing rounds over the batches")
    ap.add_argument(
        "--shared", action="store_true", help="also time the shared-prefix forward (train.share_prefix), interleaved"
    )
    ap.add_argument("--small", action="store_true", help="tiny model, one batch, one round (smoke test)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from jaxrl.config import load_config

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    vocab = 3 + 20  # the char tokenizer: 3 specials + jaxrl.data.tokenizer.DEFAULT_ALPHABET
    if args.small:
        cfg, args.batches, args.repeats = dataclasses.replace(common.tiny(), vocab_size=vocab), 1, 1
    elif args.model == "bench-small":
        cfg = dataclasses.replace(common.bench_small(), vocab_size=vocab)
    else:
        cfg = dataclasses.replace(
            load_config(os.path.join(repo, "configs", "grpo_longtail.py")).model, vocab_size=vocab
        )
    cfg = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, P + T))
    plens, clens = longtail_lengths(PROMPTS * args.batches, args.seed)
    n = PROMPTS * G
    longtail = [
        make_batch(vocab, plens[i * n : (i + 1) * n], clens[i * n : (i + 1) * n], P, T, args.seed + i)
        for i in range(args.batches)
    ]
    uniform = [make_batch(vocab, [P] * n, [T] * n, P, T, args.seed + i) for i in range(args.batches)]
    result = {
        "benchmark": "packed_update",
        "longtail": workload("longtail", cfg, longtail, args),
        "uniform": workload("uniform", cfg, uniform, args),
        "shape": {"batch": n, "prompt_len": P, "completion_len": T, "group_size": G},
        "packing": {"budget": args.budget, "sizes": args.sizes},
        "config": "tiny" if args.small else args.model,
        "model": common.config_dict(cfg),
        "load_average": common.load_average(),
    }
    for name in ("longtail", "uniform"):
        r = result[name]
        print(
            f"{name:9s} packed_speedup {r['packed_speedup']:.2f}  padded {r['padded_tokens_per_s']:.0f} -> packed "
            f"{r['packed_tokens_per_s']:.0f} live tokens/s  (live {r['live_share_of_padded_slots']:.0%} of the "
            f"padded slots, fill {r['fill']:.0%}, fallback {r['fallback']:.0%})"
        )
        if "shared_speedup" in r:
            shared, vs = r["shared_speedup"], r["packed_vs_shared"]
            print(f"{'':9s} shared prefix: {shared:.2f}x padded; packed {vs:.2f}x shared")
    result["packed_speedup"] = {k: result[k]["packed_speedup"] for k in ("longtail", "uniform")}
    common.emit(result)
    return result


def _say(what: str) -> None:
    print(f"packed_update.py: {what} ...", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
