"""Decode step time by decode-attention kernel (`model.decode_attention`) and cache fill, on this machine.

    python benchmarks/decode_attention.py [--small] [--repeats N]

Two programs, each jitted once per kernel and timed at two fills of the same cache (every row at
slot S/8 - 1, then at slot S - 1; the cache length S is fixed, so the dense kernel does the same
work at both):

  step       the slot engine's decode step (`decode.decode_rows`: all layers, the head) of bench-small
             (31M params, 8 layers) for 8 rows over a 2048-slot cache, 8 steps in one loop with the
             cache in its carry (as the engine's chunk loop: no cache copy per step); time per step;
  attention  one layer's cache read alone (`attend_kv_head_major` / `attend_blocked`), same shapes.

"pallas" is left out by default: on CPU it runs in the Pallas interpreter (a test vehicle, not a
kernel); `--kernels dense,blocked,pallas` on a GPU or TPU times it too (benchmarks/device_check.py).
Medians of `repeats` calls after a compiling warm-up, wall seconds. Prints one line per case, then
one JSON line. --small: the tiny model, a 64-slot cache, 2 repeats (a smoke run: structure only).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common

KERNELS = ("dense", "blocked")  # --kernels' default
ROWS = 8
STEPS = 8  # decode steps per timed call of the `step` program


def _step_fn(cfg, S: int):
    """jitted (params, cache, fill_B) -> logits of one `decode_rows` step, and its inputs at a fill."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from jaxrl.models import transformer as tf
    from jaxrl.models.cache_kinds import LayerKV
    from jaxrl.models.decode import LayerCache, decode_rows, layer_params

    lparams = layer_params(tf.init_params(cfg, jax.random.PRNGKey(0)), cfg)
    shape = (ROWS, cfg.n_kv_heads, S, cfg.head_dim)
    keys = jax.random.split(jax.random.PRNGKey(1), 2 * cfg.n_layers)
    kv = tuple(
        LayerKV(jax.random.normal(keys[2 * i], shape), jax.random.normal(keys[2 * i + 1], shape))
        for i in range(cfg.n_layers)
    )
    token_B, advance_B = jnp.ones((ROWS,), jnp.int32), jnp.ones((ROWS,), jnp.int32)

    @functools.partial(jax.jit, donate_argnums=1)
    def steps(lparams, kv, fill_B):
        """STEPS decode steps at the same slot, the cache in the loop carry (written in place, as
        the engine's chunk loop does; donated, so no call copies it) -> (the last logits, cache)."""
        valid_BxS = jnp.arange(S)[None, :] <= fill_B[:, None]

        def one(_, carry):
            kv, _ = carry
            logits_BxV, cache, _ = decode_rows(
                lparams, cfg, token_B, LayerCache(kv, valid_BxS, fill_B), fill_B, advance_B
            )
            return cache.kv, logits_BxV

        kv, logits_BxV = lax.fori_loop(0, STEPS, one, (kv, jnp.zeros((ROWS, cfg.vocab_size), jnp.float32)))
        return logits_BxV, kv

    held = {"kv": kv}  # the donated cache comes back from each call and goes into the next

    def call(fill):
        logits_BxV, held["kv"] = steps(lparams, held["kv"], jnp.full((ROWS,), fill, jnp.int32))
        return logits_BxV

    return call


def _attention_fn(cfg, S: int, kernel: str):
    import jax
    import jax.numpy as jnp

    from jaxrl.models.attention import attend_kv_head_major
    from jaxrl.models.decode_attention import attend_cache, resolve_decode_kernel

    keys = jax.random.split(jax.random.PRNGKey(2), 3)
    q = jax.random.normal(keys[0], (ROWS, 1, cfg.n_heads, cfg.head_dim))
    k, v = (jax.random.normal(x, (ROWS, cfg.n_kv_heads, S, cfg.head_dim)) for x in keys[1:])
    decode = resolve_decode_kernel(kernel, cfg.decode_block)
    f = attend_kv_head_major if kernel == "dense" else functools.partial(attend_cache, decode=decode)
    read = jax.jit(lambda q, k, v, index_B: f(q, k, v, jnp.arange(S)[None, :] <= index_B[:, None], index_B, q.dtype))
    return lambda fill: read(q, k, v, jnp.full((ROWS,), fill, jnp.int32))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny model, 64-slot cache: a smoke run")
    parser.add_argument("--repeats", type=int, default=0, help="timed calls per case (default 15, --small 2)")
    parser.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated: dense, blocked, pallas")
    args = parser.parse_args(argv)
    kernels = tuple(k.strip() for k in args.kernels.split(","))
    if "dense" not in kernels or not set(kernels) <= {"dense", "blocked", "pallas"}:
        parser.error(f"--kernels: got {args.kernels!r}; expected dense and any of blocked, pallas")
    base = common.tiny() if args.small else common.bench_small()
    S = 64 if args.small else 2048
    block = 16 if args.small else 128
    repeats = args.repeats or (2 if args.small else 15)
    fills = {"eighth": S // 8 - 1, "full": S - 1}  # the slot each row decodes at
    ms: dict[str, dict[str, dict[str, float]]] = {"step": {}, "attention": {}}
    for kernel in kernels:
        cfg = dataclasses.replace(base, decode_attention=kernel, decode_block=block)
        programs = {"step": _step_fn(cfg, S), "attention": _attention_fn(cfg, S, kernel)}
        for program, fn in programs.items():
            ms[program][kernel] = {}
            for name, fill in fills.items():
                seconds, _ = common.median_time(functools.partial(fn, fill), repeats)
                seconds /= STEPS if program == "step" else 1
                ms[program][kernel][name] = round(seconds * 1e3, 4)
                print(f"{program:9s} {kernel:7s} fill {name:6s} (slot {fill:4d}/{S}): {seconds * 1e3:8.3f} ms")
    ratios = {
        program: {
            **{
                f"{k}_over_dense_{fill}": round(t[k][fill] / t["dense"][fill], 3)
                for k in kernels
                if k != "dense"
                for fill in fills
            },
            **{f"{k}_full_over_eighth": round(t[k]["full"] / t[k]["eighth"], 3) for k in kernels},
        }
        for program, t in ms.items()
    }
    result = {
        "benchmark": "decode_attention",
        "config": "tiny" if args.small else "bench-small",
        "rows": ROWS,
        "steps_per_call": STEPS,
        "cache_slots": S,
        "block": block,
        "fills": fills,
        "repeats": repeats,
        "ms": ms,
        "ratios": ratios,
        "load_average": common.load_average(),
    }
    common.emit(result)
    return result


if __name__ == "__main__":
    main()
