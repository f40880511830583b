"""Static sampler vs the slot engine: generated tokens/s for the same number of completed samples.

Workloads (bench-small shape, random weights, vocab cut to --vocab; one prompt of --prompt-len tokens
per group of G=8), then the long-tail task's own:
  long tail  final-norm scale 0, so every logit is 0 and each step draws uniformly over the vocab:
             EOS comes with probability 1/V per step and lengths are geometric (mean ~V), cut at
             --max-new. The forward still does all of its work (only the values are degenerate).
  uniform    EOS can never be drawn: every sample runs exactly --uniform-len tokens.
  policy     `configs/grpo_longtail.py`'s policy after its warm start (cached; trained first if
             missing) on the task's train prompts, one per group: worked long additions of 9-81
             tokens (skipped by --small and --no-policy).
The static sampler (`sampler.sample`) runs the samples in batches of --slots rows, each batch until its
longest row is done; the engine keeps --slots slots busy, admitting a group whenever G slots are free
(chunks of --chunk decode steps). Each is timed after an untimed warm-up run of the same workload.

--speculative also times the engine with early-exit drafting (`rollout.speculative`, drafter
early_exit: --draft-layers blocks draft --max-draft tokens per step) and reports its tokens/s and
acceptance rate. With these workloads' zeroed final norm the drafter's distribution IS the policy's
(both uniform), so every draft is accepted: the figure is the ceiling of early exit at this shape,
not what a trained policy would get.

Last line: one JSON object with `speedup_long_tail` (engine / static tokens/s on the long tail),
`uniform_ratio` (the same on uniform lengths) and `speedup_long_tail_policy` (the task's policy), plus
the raw figures: per workload also the CPU
seconds of each side and `ratio_cpu` (the ratio in tokens per CPU-second), and the load average.

    PYTHONPATH=. python benchmarks/engine.py            # bench-small
    PYTHONPATH=. python benchmarks/engine.py --small    # tiny model, seconds (smoke run)
    PYTHONPATH=. python benchmarks/engine.py --small --speculative   # plus the engine with early exit
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common

G = 8


def _prompt_at(prompts, i: int):
    """Group i's prompt (1-D real tokens): `prompts` is one array (every group's) or a list, cycled."""
    return prompts if not isinstance(prompts, list) else prompts[i % len(prompts)]


def _prompt_width(prompts) -> int:
    """The width every run pads prompts to: the longest of the whole list, so that the warm-up run
    (fewer groups) compiles the same shapes as the timed one and no compile is timed."""
    return len(prompts) if not isinstance(prompts, list) else max(len(p) for p in prompts)


def _static(params, cfg, prompts, n_samples, slots, max_new, eos, rng):
    """(tokens generated, seconds) for n_samples through `sampler.sample` in batches of `slots` rows."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl.rollout.engine.groups import left_pad
    from jaxrl.rollout.sampler import SamplingParams, sample

    B = slots // G
    width = _prompt_width(prompts)
    tokens, t0 = 0.0, time.perf_counter()
    for i in range(n_samples // slots):
        padded = [left_pad(_prompt_at(prompts, i * B + b), width, 0) for b in range(B)]
        prompt, mask = (jnp.asarray(np.stack(x)) for x in zip(*padded))
        out = sample(
            params,
            cfg,
            prompt,
            mask,
            jax.random.fold_in(rng, i),
            sampling=SamplingParams(max_new_tokens=max_new, eos_id=eos, pad_id=0),
            group_size=G,
        )
        tokens += float(jax.device_get(out.completion_mask_BxT).sum())
    return tokens, time.perf_counter() - t0


def _engine(params, cfg, prompts, n_samples, slots, chunk, max_new, eos, rng, speculative=None, counts=None):
    """(tokens generated, seconds) for n_samples through a fresh `Engine` with `slots` slots
    (`speculative`: a SpeculativeConfig; the engine's counts are copied into `counts`)."""
    from jaxrl.config import EngineConfig
    from jaxrl.rollout.engine.driver import Engine
    from jaxrl.rollout.sampler import SamplingParams

    ecfg = EngineConfig(enabled=True, slots=slots, chunk=chunk, admit_groups=max(1, slots // G // 4))
    n_groups = n_samples // G
    width = _prompt_width(prompts)
    engine = Engine(
        cfg,
        ecfg,
        sampling=SamplingParams(max_new_tokens=max_new, eos_id=eos, pad_id=0),
        group_size=G,
        prompt_len=width,
        rng=rng,
        speculative=speculative,
    )
    t0 = time.perf_counter()
    groups = engine.collect(params, 0, ((i, _prompt_at(prompts, i)) for i in range(n_groups)), n_groups=n_groups)
    tokens = float(sum(g.completion_mask_GxT.sum() for g in groups))
    if counts is not None:
        counts.update(engine.counts)
    return tokens, time.perf_counter() - t0


def _speculative(params, cfg, prompt_P, args, max_new, eos, plain_tok_per_s):
    """The engine with early-exit drafting on the same workload: tokens/s, acceptance, ratio to the plain engine."""
    import jax

    from jaxrl.config import SpeculativeConfig

    spec = SpeculativeConfig(
        enabled=True, drafter="early_exit", draft_layers=args.draft_layers, max_draft=args.max_draft
    )

    def run(n, key, counts=None):
        return _engine(params, cfg, prompt_P, n, args.slots, args.chunk, max_new, eos, key, spec, counts)

    run(2 * args.slots, jax.random.PRNGKey(0))  # warm-up (compile)
    counts = {}
    tok, sec = run(args.samples, jax.random.PRNGKey(1), counts)
    row = {
        "tokens": tok,
        "s": round(sec, 3),
        "tok_per_s": tok / sec,
        "drafted": counts["drafted"],
        "accepted": counts["accepted"],
        "acceptance": counts["accepted"] / max(counts["drafted"], 1),
        "chunks": counts["chunks"],
        "ratio_to_plain_engine": (tok / sec) / plain_tok_per_s,
    }
    print(
        f"{'':10s} engine + early exit (k={args.max_draft}) {tok:8.0f} tok in {sec:7.2f}s = {tok / sec:9.1f} tok/s"
        f" | acceptance {row['acceptance']:.2f} | vs plain engine {row['ratio_to_plain_engine']:.2f}",
        flush=True,
    )
    return row


def _compare(name, params, cfg, prompt_P, args, max_new, eos):
    import jax

    rng = jax.random.PRNGKey(0)
    n = args.samples
    _static(params, cfg, prompt_P, args.slots, args.slots, max_new, eos, rng)  # warm-up (compile)
    _engine(params, cfg, prompt_P, 2 * args.slots, args.slots, args.chunk, max_new, eos, rng)
    cpu0 = time.process_time()
    s_tok, s_sec = _static(params, cfg, prompt_P, n, args.slots, max_new, eos, jax.random.PRNGKey(1))
    cpu1 = time.process_time()
    e_tok, e_sec = _engine(params, cfg, prompt_P, n, args.slots, args.chunk, max_new, eos, jax.random.PRNGKey(1))
    s_cpu, e_cpu = cpu1 - cpu0, time.process_time() - cpu1
    # CPU seconds (all threads) as well as wall: on a shared machine the CPU ratio is the steadier one.
    row = {
        "workload": name,
        "samples": n,
        "static_tokens": s_tok,
        "static_s": round(s_sec, 3),
        "static_tok_per_s": s_tok / s_sec,
        "engine_tokens": e_tok,
        "engine_s": round(e_sec, 3),
        "engine_tok_per_s": e_tok / e_sec,
        "ratio": (e_tok / e_sec) / (s_tok / s_sec),
        "static_cpu_s": round(s_cpu, 3),
        "engine_cpu_s": round(e_cpu, 3),
        "ratio_cpu": (e_tok / e_cpu) / (s_tok / s_cpu),
        "load_average": common.load_average(),
    }
    print(
        f"{name:10s} static {s_tok:8.0f} tok in {s_sec:7.2f}s = {s_tok / s_sec:9.1f} tok/s | "
        f"engine {e_tok:8.0f} tok in {e_sec:7.2f}s = {e_tok / e_sec:9.1f} tok/s | ratio {row['ratio']:.2f} "
        f"(CPU-time ratio {row['ratio_cpu']:.2f}, load {(row['load_average'] or [float('nan')])[0]:.2f})",
        flush=True,
    )
    if args.speculative:
        row["speculative"] = _speculative(params, cfg, prompt_P, args, max_new, eos, row["engine_tok_per_s"])
    return row


def _longtail_policy():
    """(params, model cfg, prompts, max_new, eos) of `configs/grpo_longtail.py`: its warm-started policy
    (trained first if not cached, ~6 min) and the train split's prompts, one per group."""
    import numpy as np

    from jaxrl.config import load_config
    from jaxrl.data.tasks import load_task
    from jaxrl.data.tokenizer import CharTokenizer
    from jaxrl.policy.warmstart import load_or_train_base

    cfg = load_config(
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "grpo_longtail.py"), []
    )
    tok = CharTokenizer()
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tok.vocab_size)
    task = load_task(cfg.data)
    params, _ = load_or_train_base(cfg, model_cfg, tok, task.train, tok.alphabet, progress=True)
    prompts = [np.asarray(tok.encode(task.train[i]["prompt"]), np.int32) for i in range(512)]
    assert tok.pad_id == 0, "the benchmark pads prompts with 0"
    return params, model_cfg, prompts, cfg.rollout.max_new_tokens, tok.eos_id


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", help="tiny model, few samples (smoke run)")
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--chunk", type=int, default=8)
    p.add_argument("--samples", type=int, default=256, help="completed samples per workload (a multiple of slots)")
    p.add_argument("--vocab", type=int, default=48, help="vocab size: EOS probability per step is 1/vocab")
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--uniform-len", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--speculative", action="store_true", help="also time the engine with early-exit drafting")
    p.add_argument("--max-draft", type=int, default=4, help="--speculative: tokens drafted per step")
    p.add_argument("--draft-layers", type=int, default=1, help="--speculative: blocks the drafter runs")
    p.add_argument("--no-policy", action="store_true", help="skip the long-tail task's warm-started policy")
    args = p.parse_args(argv)
    if args.small:  # a smoke run: its time is compiling; 4 batches of slots are enough to run every path
        args.slots, args.samples, args.max_new, args.uniform_len, args.vocab = 16, 64, 64, 16, 12
    import jax
    import numpy as np

    from jaxrl.models import transformer as tf

    base = common.tiny() if args.small else common.bench_small()
    cfg = dataclasses.replace(base, vocab_size=args.vocab, max_seq_len=args.prompt_len + args.max_new)
    params = tf.init_params(cfg, jax.random.PRNGKey(0))
    params = dict(params, final_norm=jax.tree.map(lambda x: x * 0.0, params["final_norm"]))  # uniform next token
    prompt_P = np.random.default_rng(0).integers(2, args.vocab, args.prompt_len, dtype=np.int32)
    print(
        f"{'tiny' if args.small else 'bench-small'} (vocab {args.vocab}), {args.slots} slots / rows, G={G}, "
        f"chunk {args.chunk}, {args.samples} samples, backend {jax.default_backend()}",
        flush=True,
    )
    long_tail = _compare("long_tail", params, cfg, prompt_P, args, args.max_new, eos=1)
    uniform = _compare("uniform", params, cfg, prompt_P, args, args.uniform_len, eos=args.vocab)  # never drawn
    policy = None
    if not (args.small or args.no_policy):
        lt_params, lt_cfg, prompts, max_new, eos = _longtail_policy()
        print(
            f"long-tail task policy (configs/grpo_longtail.py after its warm start, d_model {lt_cfg.d_model}, "
            f"{lt_cfg.n_layers} layers), real prompts, max_new {max_new}",
            flush=True,
        )
        policy = _compare("policy", lt_params, lt_cfg, prompts, args, max_new, eos)
    print(
        json.dumps(
            {
                "speedup_long_tail": long_tail["ratio"],
                "uniform_ratio": uniform["ratio"],
                "speedup_long_tail_policy": policy and policy["ratio"],
                "policy": policy,
                "config": "tiny" if args.small else "bench-small",
                "slots": args.slots,
                "chunk": args.chunk,
                "backend": jax.default_backend(),
                "long_tail": long_tail,
                "uniform": uniform,
            }
        )
    )


if __name__ == "__main__":
    main()
