"""Speculative rollouts vs plain sampling: rollout tokens/s, acceptance, and where speculation pays.

Parts (all timed in this one run; every timing is the median over `--repeats` calls with different
RNG keys, after a warm-up call that compiles):
  1. embedded task: the policy after GRPO on the arithmetic task (`configs/grpo_arithmetic.py`,
     `--policy-steps` steps, trained once into --root and reused), the training batch (16 prompts x
     8 samples, 8 new tokens, temperature 1.0): plain sampling, each self-drafter (early exit: 1 of 2
     layers; int8), each with the adaptive control and with the draft length forced to max_draft,
     and trajectory reuse on a second pass over the same prompts (drafts = the first pass's
     completions, which is what reuse sees when a prompt comes back), adaptive and forced on.
  2. batch sweep (same policy): rows decoding at once 8 / 32 / 128, plain vs the forced best
     self-drafter: whether speculation pays at fewer rows on this machine.
  3. bench-small (random weights, ~31M params): 1 prompt x 8 samples, 64 prompt tokens, 32 new
     tokens, no EOS: plain, early exit (2 of 8 layers), int8, and reuse of a first pass.
  4. training (`--train-steps`, 0 to skip): the default run with and without
     `rollout.speculative.enabled` (early exit, adaptive), same seeds: accuracy curves and rollout time.
  5. the engine's tail (`speculative_tail.py`; `--only-tail` runs just this part, `--skip-tail`
     skips it): a warm-started bench-small policy, few rows decoding long completions, plain engine
     vs speculative engine, the measured costs, acceptance and threshold, and a whole long-tailed
     rollout with the toggle.

Parts 1 and 3 also measure the step costs the adaptive control uses (`rollout/calibrate.py`: a
verify forward of k+1 tokens and a drafted token, in plain steps, for that batch) and from them the
ceiling: the most a speculative step can give over a plain one with every draft accepted.

Tokens/s counts generated (unmasked) tokens. The last line printed is one JSON object with
`speedup_best_self_draft` and `speedup_trajectory_reuse` (part 1, throughput over plain sampling),
`acceptance_rate` (of the best self-drafter there), `ceiling_self_draft` / `ceiling_trajectory_reuse`,
and `speedup_tail_self_draft` (part 5: the engine's speculative / plain tokens/s at 1, 4 and 8 rows,
geometric mean).

    PYTHONPATH=. python benchmarks/speculative.py            # full run (trains the policy once)
    PYTHONPATH=. python benchmarks/speculative.py --small    # smoke run on random tiny weights
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common


def trained_policy(root: pathlib.Path, steps: int, overrides=()):
    """(params, model cfg, config) of the default GRPO run after `steps` steps (trained once, reused)."""
    import orbax.checkpoint as ocp

    from jaxrl.config import load_config
    from jaxrl.train.loop import train

    repo = pathlib.Path(__file__).resolve().parents[1]
    cfg = load_config(
        repo / "configs" / "grpo_arithmetic.py", [f"train.steps={steps}", "train.progress=false", *overrides]
    )
    tag = "_".join(o.replace("=", "-").replace(".", "-") for o in overrides) or "plain"
    workdir = root / f"grpo_steps{steps}_{tag}"
    manager = ocp.CheckpointManager(workdir.absolute() / "checkpoints")
    if manager.latest_step() != steps:
        rows = train(cfg, workdir)
    else:
        rows = None
    manager = ocp.CheckpointManager(workdir.absolute() / "checkpoints")
    restored = manager.restore(steps, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    return restored["state"]["params"], cfg, workdir, rows


def read_rows(workdir: pathlib.Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def timed(fn, repeats: int):
    """-> (median seconds, outputs of the timed calls)."""
    import jax

    jax.block_until_ready(fn(0))
    times, outs = [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(i + 1))
        times.append(time.perf_counter() - t0)
        outs.append(out)
    return statistics.median(times), outs


def measure(name, params, cfg, prompt, pmask, kw, spec, repeats, drafts=None, costs=None):
    """One sampler configuration -> result dict (tokens/s, acceptance, steps). An adaptive one with
    measured costs first asks `worth_speculating` at the initial acceptance estimates, as the
    training loop does, and runs the plain sampler when speculation cannot gain."""
    import jax
    import numpy as np

    from jaxrl.rollout.sampler import sample
    from jaxrl.rollout.speculative.sample import sample_speculative, worth_speculating

    planned = None
    if spec is not None and costs is not None:
        a = spec.initial_acceptance
        lengths = None if drafts is None else np.asarray(drafts[1])
        planned = "speculative" if worth_speculating(costs, spec, a, a, lengths) else "plain"
        spec = spec if planned == "speculative" else None

    if spec is None:

        def fn(i):
            return (sample(params, cfg, prompt, pmask, jax.random.PRNGKey(i), **kw), None)
    else:
        extra = {} if drafts is None else dict(draft_NxT=drafts[0], draft_len_N=drafts[1])
        extra["costs"] = costs

        def fn(i):
            return sample_speculative(
                params,
                cfg,
                prompt,
                pmask,
                jax.random.PRNGKey(i),
                spec=spec,
                **kw,
                **extra,
            )

    seconds, outs = timed(fn, repeats)
    tokens = float(np.median([float(o[0].completion_mask_BxT.sum()) for o in outs]))
    res = {
        "name": name,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "tokens": tokens,
        "decode_steps": float(np.median([int(o[0].num_steps) for o in outs])),
        "planned": planned,
    }
    if planned == "plain":
        res.update(acceptance_rate=None, speculated_frac=0.0)
    if spec is not None:
        st = [o[1] for o in outs]
        drafted, accepted = sum(int(s.drafted) for s in st), sum(int(s.accepted) for s in st)
        spec_steps = sum(int(s.self_steps) + int(s.reuse_steps) for s in st)
        all_steps = spec_steps + sum(int(s.plain_steps) for s in st)
        res.update(
            acceptance_rate=accepted / drafted if drafted else None,
            accepted_per_verification=accepted / max(1, sum(int(s.row_verifications) for s in st)),
            draft_len=sum(int(s.draft_len_sum) for s in st) / max(1, sum(int(s.self_steps) for s in st)),
            speculated_frac=spec_steps / max(1, all_steps),
        )
    acc = res.get("acceptance_rate")
    print(
        f"  {name:34s} {res['tokens_per_s']:9.0f} tok/s  {seconds * 1e3:8.1f} ms  steps {res['decode_steps']:4.0f}"
        + (f"  accept {acc:.3f}" if acc is not None else "")
        + (f"  speculated {res['speculated_frac']:.2f}" if "speculated_frac" in res else "")
        + ("  (planned: plain sampler)" if planned == "plain" else ""),
        flush=True,
    )
    return res, outs[0][0]


def ceilings(costs) -> dict:
    """The most tokens per unit of cost a speculative step can give over a plain step, with every
    draft accepted: max over k of (k + 1) / (verify cost of k drafts + k x draft cost). An upper
    bound on the speedup (a rollout also pays for its tail of rows and its bookkeeping)."""
    import numpy as np

    verify_K = np.asarray(costs.verify_K)
    k_K = np.arange(1, len(verify_K) + 1)
    return {
        "self_draft": float(np.max((k_K + 1) / (verify_K + k_K * float(costs.draft)))),
        "free_drafts": float(np.max((k_K + 1) / verify_K)),
    }


def drafter_suite(params, cfg, prompt, pmask, kw, repeats, draft_layers, max_draft, label, full=True):
    """Plain, each self-drafter (adaptive with measured costs, and forced; `full=False`: early exit
    forced only), and reuse of a first pass -> ({name: result}, {drafter: measured costs and ceilings})."""
    import numpy as np

    from jaxrl.config import SpeculativeConfig
    from jaxrl.rollout.speculative.calibrate import measure_step_costs

    big = 1 << 20  # never switch off for batch size here: part 2 measures that
    rows, cache_len = prompt.shape[0] * kw["group_size"], prompt.shape[1] + 2 * kw["sampling"].max_new_tokens + 1
    results, cost_table = {}, {}
    results["plain"], first = measure("plain", params, cfg, prompt, pmask, kw, None, repeats)
    for drafter in ("early_exit", "int8") if full else ("early_exit",):
        spec = SpeculativeConfig(enabled=True, drafter=drafter, draft_layers=draft_layers, max_draft=max_draft)
        costs = measure_step_costs(params, cfg, spec, rows, cache_len)
        cost_table[drafter] = {
            "verify_K": np.asarray(costs.verify_K).round(3).tolist(),
            "draft": round(float(costs.draft), 3),
            "ceiling": ceilings(costs),
        }
        print(
            f"  measured costs ({drafter}, {rows} rows), in plain steps: verify k=1..{max_draft} "
            f"{cost_table[drafter]['verify_K']}, drafted token {cost_table[drafter]['draft']}; "
            f"ceiling {cost_table[drafter]['ceiling']['self_draft']:.2f}x",
            flush=True,
        )
        for adaptive in (True, False) if full else (False,):
            spec = dataclasses.replace(spec, adaptive=adaptive, max_active_rows=big)
            name = f"{drafter}{'' if adaptive else f'_k{max_draft}'}"
            results[name], _ = measure(name, params, cfg, prompt, pmask, kw, spec, repeats, costs=costs)
    spec = SpeculativeConfig(
        enabled=True, drafter="reuse", reuse_width=kw["sampling"].max_new_tokens, max_active_rows=big
    )
    reuse_costs = measure_step_costs(params, cfg, spec, rows, cache_len)
    cost_table["reuse"] = {
        "verify_K": np.asarray(reuse_costs.verify_K).round(3).tolist(),
        "ceiling": ceilings(reuse_costs)["free_drafts"],
    }
    print(
        f"  measured verify costs (k=1..{kw['sampling'].max_new_tokens}): {cost_table['reuse']['verify_K']}; "
        f"reuse ceiling {cost_table['reuse']['ceiling']:.2f}x",
        flush=True,
    )
    drafts = (first.tokens_BxT, first.length_B)
    results["reuse"], _ = measure(
        "reuse (second pass)", params, cfg, prompt, pmask, kw, spec, repeats, drafts, costs=reuse_costs
    )
    results["reuse_forced"], _ = measure(
        "reuse forced (second pass)",
        params,
        cfg,
        prompt,
        pmask,
        kw,
        dataclasses.replace(spec, adaptive=False),
        repeats,
        drafts,
    )
    for r in results.values():
        r["speedup"] = r["tokens_per_s"] / results["plain"]["tokens_per_s"]
    print(f"  [{label}] speedups: " + ", ".join(f"{k} {v['speedup']:.2f}x" for k, v in results.items()))
    return results, cost_table


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(pathlib.Path.home() / ".cache" / "jaxrl" / "bench_speculative"))
    ap.add_argument("--policy-steps", type=int, default=40)
    ap.add_argument("--train-steps", type=int, default=40, help="part 4 run length (0: skip part 4)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--small", action="store_true", help="random tiny weights, no training (smoke test)")
    ap.add_argument("--only-tail", action="store_true", help="run part 5 (the engine's tail) only")
    ap.add_argument("--skip-tail", action="store_true", help="run parts 1-4 only (no part 5)")
    ap.add_argument("--tail-policy-steps", type=int, default=60, help="part 5's warm start (benchmarks/tail_policy.py)")
    args = ap.parse_args(argv)
    if args.only_tail:
        return _tail_only(args)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl.config import ModelConfig
    from jaxrl.data.tokenizer import CharTokenizer, encode_prompts
    from jaxrl.models.transformer import init_params
    from jaxrl.rollout.sampler import SamplingParams

    tok = CharTokenizer()
    root = pathlib.Path(args.root)
    if args.small:
        cfg = ModelConfig(
            vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64
        )
        params = init_params(cfg, jax.random.PRNGKey(0))
        args.repeats, args.train_steps, n_prompts = 2, 0, 2
    else:
        params, run_cfg, _, _ = trained_policy(root, args.policy_steps)
        cfg = dataclasses.replace(run_cfg.model, vocab_size=tok.vocab_size)
        n_prompts = run_cfg.rollout.prompts_per_step
    rng = np.random.default_rng(0)
    texts = [f"{a}+{b}=" for a, b in rng.integers(0, 100, (16, 2))]
    prompt, pmask, _, _ = encode_prompts(tok, texts, 16, skip_long=False, record_ids=[str(i) for i in range(16)])
    prompt, pmask = jnp.asarray(prompt), jnp.asarray(pmask)
    kw = dict(group_size=8, sampling=SamplingParams(max_new_tokens=8, eos_id=tok.eos_id, pad_id=tok.pad_id))

    print(
        f"1. embedded task policy ({'random tiny' if args.small else f'GRPO {args.policy_steps} steps'}), "
        f"{n_prompts} prompts x 8 samples, temperature 1.0, up to 8 new tokens"
    )
    embedded, embedded_costs = drafter_suite(
        params, cfg, prompt[:n_prompts], pmask[:n_prompts], kw, args.repeats, 1, 4, "embedded", full=not args.small
    )

    print("2. batch sweep: rows decoding at once (plain vs early exit k=2, forced)")
    from jaxrl.config import SpeculativeConfig

    sweep = []
    for n in () if args.small else (1, 4, 16):
        spec = SpeculativeConfig(
            enabled=True, drafter="early_exit", max_draft=2, adaptive=False, max_active_rows=1 << 20
        )
        p_res, _ = measure(f"plain {n * 8} rows", params, cfg, prompt[:n], pmask[:n], kw, None, args.repeats)
        s_res, _ = measure(f"early_exit_k2 {n * 8} rows", params, cfg, prompt[:n], pmask[:n], kw, spec, args.repeats)
        sweep.append(
            {
                "rows": n * 8,
                "plain_tokens_per_s": p_res["tokens_per_s"],
                "spec_tokens_per_s": s_res["tokens_per_s"],
                "speedup": s_res["tokens_per_s"] / p_res["tokens_per_s"],
                "acceptance_rate": s_res["acceptance_rate"],
            }
        )

    bench_small, bench_small_costs = {}, {}
    if not args.small:
        print("3. bench-small, random weights: 1 prompt x 8 samples, 64 prompt tokens, 32 new tokens, no EOS")
        bcfg = common.bench_small()
        bparams = init_params(bcfg, jax.random.PRNGKey(0))
        bprompt = jnp.asarray(rng.integers(3, bcfg.vocab_size, (1, 64), dtype=np.int32))
        bkw = dict(group_size=8, sampling=SamplingParams(max_new_tokens=32, eos_id=-1, pad_id=0))
        bench_small, bench_small_costs = drafter_suite(
            bparams, bcfg, bprompt, jnp.ones_like(bprompt), bkw, max(3, args.repeats // 3), 2, 4, "bench-small"
        )

    training = {}
    if args.train_steps:
        print(f"4. training: default config, {args.train_steps} steps, with and without speculative rollouts")
        for tag, overrides in (("plain", ()), ("speculative", ("rollout.speculative.enabled=true",))):
            _, _, workdir, _ = trained_policy(root, args.train_steps, overrides)
            rows = read_rows(workdir)
            steps = [r for r in rows if "rollout/seconds" in r]
            # Each sampler's first rollout compiles it: step 1, and with speculation on, the first
            # rollout planned plain (no spec/acceptance_estimate logged).
            plain_planned = [
                r["step"] for r in steps if "spec/speculated_frac" in r and "spec/acceptance_estimate" not in r
            ]
            compiles = {steps[0]["step"], *plain_planned[:1]}
            training[tag] = {
                "eval_accuracy": {r["step"]: r["eval/accuracy"] for r in rows if r.get("eval/accuracy") is not None},
                "rollout_seconds_total": sum(r["rollout/seconds"] for r in steps if r["step"] not in compiles),
                "rollouts_timed": sum(r["step"] not in compiles for r in steps),
                "rollouts_planned_plain": len(plain_planned),
                "speculated_frac_mean": float(np.mean([r.get("spec/speculated_frac") or 0 for r in steps])),
            }
            print(
                f"  {tag:12s} accuracy {training[tag]['eval_accuracy']}  rollout s over "
                f"{training[tag]['rollouts_timed']} rollouts {training[tag]['rollout_seconds_total']:.2f}"
            )

    self_names = [k for k in embedded if k.startswith(("early_exit", "int8"))]
    best = max(self_names, key=lambda k: embedded[k]["tokens_per_s"])
    # The adaptive control may keep speculation off (no acceptance): report the fastest that drafted.
    drafted = [k for k in self_names if embedded[k]["acceptance_rate"] is not None]
    acc_of = best if best in drafted or not drafted else max(drafted, key=lambda k: embedded[k]["tokens_per_s"])
    result = {
        "benchmark": "speculative",
        "config": "tiny" if args.small else "default",
        "tokens_per_s": embedded[best]["tokens_per_s"],
        "seconds": embedded[best]["seconds"],
        "speedup_best_self_draft": embedded[best]["speedup"],
        "best_self_drafter": best,
        "speedup_trajectory_reuse": embedded["reuse"]["speedup"],
        "speedup_trajectory_reuse_forced": embedded["reuse_forced"]["speedup"],
        "acceptance_rate": embedded[acc_of]["acceptance_rate"],
        "acceptance_rate_of": acc_of,
        "ceiling_self_draft": max(c["ceiling"]["self_draft"] for k, c in embedded_costs.items() if k != "reuse"),
        "ceiling_trajectory_reuse": embedded_costs["reuse"]["ceiling"],
        "embedded": embedded,
        "embedded_costs": embedded_costs,
        "batch_sweep": sweep,
        "bench_small": bench_small,
        "bench_small_costs": bench_small_costs,
        "training": training,
        "load_average": common.load_average(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
    }
    if not args.skip_tail:
        print("5. the engine's tail (benchmarks/speculative_tail.py)")
        result["tail"] = _tail(args)
        result["speedup_tail_self_draft"] = result["tail"]["speedup_tail_self_draft"]
    common.emit(result)
    return result


def _tail(args) -> dict:
    from benchmarks.speculative_tail import tail_part

    return tail_part(pathlib.Path(args.root), args.small, max(5, args.repeats // 2), args.tail_policy_steps)


def _tail_only(args) -> dict:
    import jax

    tail = _tail(args)
    result = {
        "benchmark": "speculative",
        "config": "tiny" if args.small else "default",
        "part": "tail",
        "speedup_tail_self_draft": tail["speedup_tail_self_draft"],
        "tail": tail,
        "load_average": common.load_average(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
    }
    common.emit(result)
    return result


if __name__ == "__main__":
    main()
