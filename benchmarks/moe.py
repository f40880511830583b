"""MoE layer forward+backward throughput of the three dispatch paths of `jaxrl.models.moe` on one device.

Paths: dropless (grouped matmul `auto`: blocked on CPU, `lax.ragged_dot` on GPU/TPU), dropless_ragged
(`lax.ragged_dot` forced), capacity, naive (every expert on every token).
Default shape: 8 experts, top-2 (softmax router), d_model 256, expert mlp 512, 4096 tokens, float32,
no shared experts; capacity dispatch at capacity_factor 1.25.

    PYTHONPATH=. python benchmarks/moe.py            # full benchmark
    PYTHONPATH=. python benchmarks/moe.py --small    # seconds-long smoke run (tests)

One timed call = `jax.value_and_grad` of sum(y * r) + aux + z-loss of one `MoE` layer with respect to
its parameters and its input (a training step's worth of layer work), compiled, after a warm-up.
Tokens/s = tokens / median wall time. Expert FLOPs (routed work only, 2 FLOPs per multiply-add,
backward = 2x forward) are reported per path as useful work: 3 * 2 * N*K * 3*D*F; the naive path
computes every expert on every token (E/K times that), the capacity path E*C slots plus its
one-hot dispatch/combine einsums. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402

# dropless uses the backend's grouped matmul (`auto`: blocked on CPU, lax.ragged_dot elsewhere);
# dropless_ragged forces lax.ragged_dot, to show what it costs where there is no grouped kernel.
PATHS = ("dropless", "dropless_ragged", "capacity", "naive")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--mlp", type=int, default=512, help="expert mlp width")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="tiny shape (smoke test)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl.models.moe import MoE, MoESpec, capacity

    if args.small:
        args.experts, args.top_k, args.d_model, args.mlp, args.tokens = 4, 2, 32, 64, 256
        args.repeats = min(args.repeats, 2)
    E, K, D, F, N = args.experts, args.top_k, args.d_model, args.mlp, args.tokens
    rng = np.random.default_rng(args.seed)
    x_1xNxD = jnp.asarray(rng.normal(size=(1, N, D)), jnp.float32)
    r_1xNxD = jnp.asarray(rng.normal(size=(1, N, D)), jnp.float32)
    mask_1xN = jnp.ones((1, N), bool)
    specs = {p: MoESpec(E, K, F, 0, "softmax", p.split("_")[0], args.capacity_factor,
                        grouped_matmul="ragged" if p == "dropless_ragged" else "auto") for p in PATHS}
    params = nn.meta.unbox(MoE(D, specs["naive"]).init(jax.random.PRNGKey(args.seed), x_1xNxD, mask_1xN)["params"])

    def make_step(spec):
        def loss(p, x):
            y, st = MoE(D, spec).apply({"params": p}, x, mask_1xN)
            return jnp.sum(y * r_1xNxD) + st.aux_loss + st.z_loss, st.dropped_frac

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

    expert_flops = 3 * 2.0 * N * K * 3 * D * F  # routed work, forward + backward
    C = capacity(N, K, E, args.capacity_factor)
    results, outputs = {}, {}
    for path in PATHS:
        step = make_step(specs[path])
        cpu = []
        seconds, times = common.median_time(lambda: step(params, x_1xNxD), args.repeats, cpu_times=cpu)
        (value, dropped), grads = step(params, x_1xNxD)
        outputs[path] = (float(value), grads)
        results[path] = {"tokens_per_s": N / seconds, "seconds": seconds, "times": times,
                         "cpu_seconds": statistics.median(cpu), "expert_gflops_per_s": expert_flops / seconds / 1e9,
                         "dropped_frac": float(dropped)}
        print(f"{path:15s} {N / seconds:10.0f} tokens/s  {seconds * 1e3:9.1f} ms/step  "
              f"dropped {float(dropped):.3f}", flush=True)
    # Same numbers from every path when nothing is dropped: a benchmark of a wrong kernel is worthless.
    ref_value, ref_grads = outputs["naive"]
    for path in ("dropless", "dropless_ragged") + (("capacity",) if results["capacity"]["dropped_frac"] == 0 else ()):
        value, grads = outputs[path]
        assert abs(value - ref_value) <= 1e-3 * max(1.0, abs(ref_value)), (path, value, ref_value)
        err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)))
        assert err < 1e-2, (path, err)
    speedup = results["naive"]["seconds"] / results["dropless"]["seconds"]
    print(f"dropless vs naive: {speedup:.2f}x   capacity vs naive: "
          f"{results['naive']['seconds'] / results['capacity']['seconds']:.2f}x   (capacity C={C} per expert)")
    result = {
        "benchmark": "moe",
        "tokens_per_s": results["dropless"]["tokens_per_s"],
        "seconds": results["dropless"]["seconds"],
        "paths": results,
        "speedup_dropless_vs_naive": speedup,
        "speedup_capacity_vs_naive": results["naive"]["seconds"] / results["capacity"]["seconds"],
        "speedup_dropless_ragged_vs_naive": results["naive"]["seconds"] / results["dropless_ragged"]["seconds"],
        "grouped_matmul": "blocked" if jax.default_backend() == "cpu" else "ragged",
        "capacity_per_expert": C,
        "shape": {"experts": E, "top_k": K, "d_model": D, "expert_mlp": F, "tokens": N,
                  "capacity_factor": args.capacity_factor},
        "config": "tiny" if args.small else "default",
        "load_average": common.load_average(),
        "peak_rss_mib": common.peak_rss_mib(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
    }
    common.emit(result)
    return result


if __name__ == "__main__":
    main()
