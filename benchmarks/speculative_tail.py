"""Part "tail" of benchmarks/speculative.py: the slot engine's speculation toggle where decoding is
memory-bound, on a policy whose distribution is not uniform.

  policy    bench-small (31M params) after a short supervised warm start on long addition with an
            early-exit loss (`tail_policy.py`, made once under --root); also, for the acceptance
            only, the same recipe without the early-exit loss.
  costs     `calibrate.measure_step_costs` at 1..8 rows (cached under --root): a verify of k drafts
            and an early-exit drafted token, in plain steps at that row count; the measured
            acceptance; and from both `calibrate.tail_threshold`: the rows at or below which the
            engine speculates (`rollout.speculative.max_active_rows`).
  few rows  R = 1, 4, 8 rows (slots = R, one sample per prompt, 6-digit problems: ~60-token
            solutions, 64 new tokens with EOS ignored so both sides decode the same tokens,
            temperature 1): the plain engine vs the engine with speculation on (every chunk
            speculates), timed interleaved.
  rollout   a whole long-tailed rollout: 32 slots, 8 prompts x 4 samples of mixed lengths, the
            plain engine vs the toggle at the measured threshold.
  int8      whether int8 weights save memory traffic on XLA:CPU: a matmul over int8 weights
            converted inside the jitted loop vs the same over float32 weights, at 4 rows.

Timings are medians over `repeats` interleaved calls (plain, speculative, plain, ...) after a
compiling warm-up; tokens/s counts generated tokens; `tokens_per_cpu_s_x_cores` is tokens per
process CPU-second times the core count (steadier than wall time on a shared machine).

--small (a smoke run: random tiny weights, structure not figures) times one round and compiles one
engine shape: R = 1 and 2 rows in 4-slot engines that speculate at 2 or fewer decoding slots
(`few_rows[R]["slots"]`), and for the whole rollout the same engines with EOS ignored on 5 prompts of
one sample (4 decode plain, then the last alone speculates); and a 2 x 512 x 512 int8 probe.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import statistics
import time

ROWS = (1, 4, 8)
DRAFT_LAYERS, MAX_DRAFT = 2, 4


def _prompts(tok, n: int, digits: int, seed: int):
    """n long-addition prompts (token lists) whose longer operand has exactly `digits` digits when
    digits > 0, else of the task's own long-tailed sizes."""
    import random

    from jaxrl.data.long_addition import _random_problem, format_prompt

    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        if digits:
            a, b = rnd.randint(10 ** (digits - 1), 10**digits - 1), rnd.randint(10 ** (digits - 1), 10**digits - 1)
        else:
            a, b = _random_problem(6, rnd)
        out.append([tok.bos_id] + tok.encode(format_prompt(a, b)))
    return out


def task_token_ids(tok, n_problems: int = 256, seed: int = 3) -> tuple:
    """The long-addition task's token set, ranked: EOS, then every id in the prompts and reference
    solutions of n_problems random problems by count (the reduced draft head's ids)."""
    import random

    from jaxrl.data.long_addition import _random_problem, format_prompt, solution
    from jaxrl.rollout.speculative.draft_vocab import frequent_ids

    rnd = random.Random(seed)
    seqs = [
        tok.encode(format_prompt(a, b) + solution(a, b))
        for a, b in (_random_problem(6, rnd) for _ in range(n_problems))
    ]
    n = len({t for seq in seqs for t in seq} | {tok.eos_id})
    return frequent_ids(seqs, n, tok.vocab_size, first=(tok.eos_id,))


def _engine(cfg, tok, slots: int, group: int, new_tokens: int, spec, seed: int, eos_id=None, draft_ids=None):
    import jax

    from jaxrl.config import EngineConfig
    from jaxrl.rollout.engine.driver import Engine
    from jaxrl.rollout.sampler import SamplingParams

    ecfg = EngineConfig(enabled=True, slots=slots, chunk=8, admit_groups=slots // group)
    return Engine(
        cfg,
        ecfg,
        sampling=SamplingParams(
            max_new_tokens=new_tokens, eos_id=tok.eos_id if eos_id is None else eos_id, pad_id=tok.pad_id
        ),
        group_size=group,
        prompt_len=16,
        rng=jax.random.PRNGKey(seed),
        speculative=spec,
        draft_ids=draft_ids,
    )


def _run(engine, params, prompts):
    """One collect of every prompt -> (wall s, process CPU s, generated tokens)."""
    t0, c0 = time.perf_counter(), time.process_time()
    groups = engine.collect(params, 0, [(i, p) for i, p in enumerate(prompts)], n_groups=len(prompts))
    tokens = sum(float(g.completion_mask_GxT.sum()) for g in groups)
    return time.perf_counter() - t0, time.process_time() - c0, tokens


def compare(params, cfg, tok, prompts, slots, group, new_tokens, spec, repeats, eos_id=None, draft_ids=None):
    """Plain engine vs `spec`'s engine on the same prompts, interleaved -> result dict. eos_id=-1:
    no sample ends before new_tokens (both sides decode the same number of tokens). draft_ids: also
    `spec` with the reduced draft head over those ids ("reduced_head", "speedup_reduced_head")."""
    engines = {
        "plain": _engine(cfg, tok, slots, group, new_tokens, None, 0, eos_id),
        "speculative": _engine(cfg, tok, slots, group, new_tokens, spec, 0, eos_id),
    }
    if draft_ids:
        reduced = dataclasses.replace(spec, draft_vocab=len(draft_ids))
        engines["reduced_head"] = _engine(cfg, tok, slots, group, new_tokens, reduced, 0, eos_id, draft_ids)
    for e in engines.values():
        _run(e, params, prompts)  # compiles
    times = {k: [] for k in engines}
    for _ in range(repeats):
        for k, e in engines.items():
            times[k].append(_run(e, params, prompts))
    res = {}
    for k, ts in times.items():
        wall, cpu, tokens = (statistics.median(x[i] for x in ts) for i in range(3))
        res[k] = {
            "tokens_per_s": tokens / wall,
            "tokens_per_cpu_s_x_cores": tokens / cpu * os.cpu_count(),
            "seconds": wall,
            "tokens": tokens,
        }
    for k in list(engines)[1:]:
        counts = engines[k].counts
        res[k].update(
            acceptance=counts["accepted"] / max(1, counts["drafted"]),
            speculative_chunks=counts["speculative_chunks"],
            chunks=counts["chunks"],
        )
        suffix = "" if k == "speculative" else "_" + k
        res["speedup" + suffix] = res[k]["tokens_per_s"] / res["plain"]["tokens_per_s"]
        res["speedup_cpu" + suffix] = res[k]["tokens_per_cpu_s_x_cores"] / res["plain"]["tokens_per_cpu_s_x_cores"]
    return res


def int8_probe(rows: int = 4, repeats: int = 7, layers: int = 8, width: int = 4096) -> dict:
    """ms per pass over `layers` layers of [512 x width] weights at `rows` rows: float32 weights vs int8
    weights converted to float32 inside the jitted loop (what XLA:CPU makes of an int8 drafter)."""
    import jax
    import jax.numpy as jnp

    w = jax.random.normal(jax.random.PRNGKey(0), (layers, 512, width), jnp.float32)
    q, scale = jnp.round(w * 20).astype(jnp.int8), jnp.full((layers, 1, width), 0.05, jnp.float32)
    x = jnp.ones((rows, 512), jnp.float32)

    def loop(weight):
        @jax.jit
        def run(n, x, *ws):
            def body(_, acc):
                h = x + acc[:, :512] * 0
                for layer in range(layers):
                    acc = acc + h @ weight(layer, *ws)[:, :width]
                return acc

            return jax.lax.fori_loop(0, n, body, jnp.zeros((rows, width), jnp.float32))

        return run

    f32 = loop(lambda i, w: w[i])
    i8 = loop(lambda i, q, s: q[i].astype(jnp.float32) * s[i])

    def ms(fn, *args):
        jax.block_until_ready(fn(20, x, *args))
        best = min(_timed(lambda: fn(20, x, *args)) for _ in range(repeats))
        return best / 20 * 1e3

    return {
        "rows": rows,
        "layers": layers,
        "width": width,
        "float32_ms": ms(f32, w),
        "int8_ms": ms(i8, q, scale),
        "bytes_float32": layers * 512 * width * 4,
        "bytes_int8": layers * 512 * width,
    }


def _timed(fn) -> float:
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def _headline(few: dict, rows_list, log) -> dict:
    """Each drafter head's geometric mean speedup over the row counts measured (none picked); the
    headline is the better head's, both are reported."""
    import numpy as np

    def geomean(key):
        return float(np.exp(np.mean([np.log(few[r][key]) for r in rows_list])))

    full_head, reduced_head = geomean("speedup"), geomean("speedup_reduced_head")
    log(
        f"  speedup over {list(rows_list)} rows (geometric mean): full head {full_head:.2f}x, reduced head "
        f"{reduced_head:.2f}x"
    )
    return {
        "speedup_tail_self_draft": max(full_head, reduced_head),
        "speedup_tail_full_head": full_head,
        "speedup_tail_reduced_head": reduced_head,
        "draft_head": "reduced" if reduced_head > full_head else "full",
    }


def tail_part(root: pathlib.Path, small: bool, repeats: int, policy_steps: int, log=print) -> dict:
    import jax

    from benchmarks import common, tail_policy
    from jaxrl.config import SpeculativeConfig
    from jaxrl.data.tokenizer import CharTokenizer
    from jaxrl.models.transformer import init_params
    from jaxrl.rollout.speculative.calibrate import calibrated_tail_rows, costs_to_json, tail_gain

    tok = CharTokenizer()
    if small:
        cfg = dataclasses.replace(common.tiny(), vocab_size=tok.vocab_size)
        params, info = init_params(cfg, jax.random.PRNGKey(0)), {"recipe": "random tiny"}
        rows_list, new_tokens, repeats, candidates, draft_layers = (1, 2), 8, 1, (2,), 1
        policies = {}
        # One engine shape for every part (4 slots, groups of 1, EOS ignored, speculation at 2 or
        # fewer decoding slots): a smoke run compiles one set of programs, not one per row count and
        # another for the whole rollout.
        few_slots, few_toggle = 4, 2
    else:
        cfg = common.bench_small()
        params, info = tail_policy.tail_policy(root, cfg, tok, policy_steps, DRAFT_LAYERS, 1.0, log)
        rows_list, new_tokens, candidates, draft_layers = ROWS, 64, (1, 2, 4, 8, 16), DRAFT_LAYERS
        policies = {"no_exit_loss": tail_policy.tail_policy(root, cfg, tok, policy_steps, DRAFT_LAYERS, 0.0, log)[0]}
        few_slots = few_toggle = 0  # R rows in R slots, every one speculating
    spec = SpeculativeConfig(
        enabled=True, drafter="early_exit", draft_layers=draft_layers, max_draft=MAX_DRAFT if not small else 2
    )
    cache_len = 16 + new_tokens + spec.max_draft
    draft_ids = task_token_ids(tok)  # the reduced draft head (FR-Spec): the task's token set
    log(
        f"tail: {'random tiny' if small else 'bench-small, warm-started with an early-exit loss'} policy; "
        f"early exit {draft_layers} of {cfg.n_layers} layers, k = {spec.max_draft}; reduced draft head: "
        f"{len(draft_ids)} of {cfg.vocab_size} ids (the task's token set)"
    )

    # Acceptance on the few-rows workload first (it steers the threshold), then the threshold.
    few = {}
    probe = _prompts(tok, max(rows_list), 6, seed=1)
    for r in rows_list:
        slots, toggle = few_slots or r, few_toggle or r
        assert r <= toggle  # R decoding rows: every chunk speculates
        few[r] = compare(
            params,
            cfg,
            tok,
            probe[:r],
            slots,
            1,
            new_tokens,
            dataclasses.replace(spec, max_active_rows=toggle),
            repeats,
            eos_id=-1,
            draft_ids=draft_ids,
        )
        few[r].update(slots=slots, max_active_rows=toggle)
        s, h = few[r]["speculative"], few[r]["reduced_head"]
        log(
            f"  {r} rows ({slots} slots): plain {few[r]['plain']['tokens_per_s']:.0f} tok/s, speculative "
            f"{s['tokens_per_s']:.0f} tok/s ({few[r]['speedup']:.2f}x, CPU {few[r]['speedup_cpu']:.2f}x), "
            f"acceptance {s['acceptance']:.3f}; "
            f"reduced head {h['tokens_per_s']:.0f} tok/s ({few[r]['speedup_reduced_head']:.2f}x, CPU "
            f"{few[r]['speedup_cpu_reduced_head']:.2f}x), acceptance {h['acceptance']:.3f}"
        )
    acceptance = statistics.mean(few[r]["speculative"]["acceptance"] for r in rows_list)
    threshold, costs = calibrated_tail_rows(params, cfg, spec, candidates, cache_len, acceptance, root / "costs")
    cost_rows = {r: {**costs_to_json(c), "gain": tail_gain(c, acceptance, spec.max_draft)} for r, c in costs.items()}
    for r, c in cost_rows.items():
        log(
            f"  costs at {r} rows (plain steps): verify k=1..{spec.max_draft} "
            f"{[round(v, 2) for v in c['verify_K']]}, drafted token {c['draft']:.2f}; "
            f"gain at acceptance {acceptance:.2f}: {c['gain']:.2f}"
        )
    log(f"  measured threshold (rollout.speculative.max_active_rows): {threshold}")

    other_acceptance = {}
    for name, p in policies.items():
        res = compare(p, cfg, tok, probe[:4], 4, 1, new_tokens, dataclasses.replace(spec, max_active_rows=4), 1, -1)
        other_acceptance[name] = res["speculative"]["acceptance"]
        log(f"  acceptance of the policy warm-started {name.replace('_', ' ')}: {other_acceptance[name]:.3f}")

    whole = None
    # --small smoke-tests the path at 2 rows whatever random weights measure (labelled forced).
    toggle_rows = max(threshold, few_toggle) if small else threshold
    if toggle_rows:
        # --small: the few-rows engines' shape (EOS ignored) and one group more than the slots hold, so
        # the last one decodes alone (the tail) after the others decode plain.
        slots, group, eos_id = (few_slots, 1, -1) if small else (32, 4, None)
        mixed = _prompts(tok, slots // group + small, 0, seed=2)
        whole = compare(
            params,
            cfg,
            tok,
            mixed,
            slots,
            group,
            new_tokens,
            dataclasses.replace(spec, max_active_rows=toggle_rows),
            repeats,
            eos_id=eos_id,
            draft_ids=draft_ids,
        )
        whole.update(threshold_rows=toggle_rows, forced=toggle_rows != threshold)
        log(
            f"  whole rollout ({slots} slots, {len(mixed)} prompts x {group}): plain "
            f"{whole['plain']['tokens_per_s']:.0f} tok/s, toggle at {toggle_rows} rows "
            f"{whole['speculative']['tokens_per_s']:.0f} tok/s ({whole['speedup']:.2f}x, "
            f"CPU {whole['speedup_cpu']:.2f}x),"
            f" {whole['speculative']['speculative_chunks']} of {whole['speculative']['chunks']} chunks speculative;"
            f" reduced head {whole['reduced_head']['tokens_per_s']:.0f} tok/s ({whole['speedup_reduced_head']:.2f}x)"
        )
    int8 = int8_probe(repeats=1, layers=2, width=512) if small else int8_probe()
    log(
        f"  int8 probe ({int8['rows']} rows, {int8['layers']} x 512 x {int8['width']}): float32 weights "
        f"{int8['float32_ms']:.2f} ms, int8 converted in the loop {int8['int8_ms']:.2f} ms"
    )
    return {
        **_headline(few, rows_list, log),
        "draft_ids": list(draft_ids),
        "speedup_tail_by_rows": {str(r): few[r]["speedup"] for r in rows_list},
        "speedup_tail_reduced_head_by_rows": {str(r): few[r]["speedup_reduced_head"] for r in rows_list},
        "acceptance_tail": acceptance,
        "threshold_rows": threshold,
        "rows": list(rows_list),
        "few_rows": {str(r): v for r, v in few.items()},
        "costs": cost_rows,
        "acceptance_other_policies": other_acceptance,
        "whole_rollout": whole,
        "int8_probe": int8,
        "policy": info,
        "max_draft": spec.max_draft,
        "draft_layers": draft_layers,
        "new_tokens": new_tokens,
    }
