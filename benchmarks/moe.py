"""MoE layer forward+backward throughput of the three dispatch paths of `jaxrl.models.moe` on one device.

Paths: dropless (grouped matmul `auto`: blocked on CPU, `lax.ragged_dot` on GPU/TPU), dropless_ragged
(`lax.ragged_dot` forced), capacity, naive (every expert on every token).
Default shape: 8 experts, top-2 (softmax router), d_model 256, expert mlp 512, 4096 tokens, float32,
no shared experts; capacity dispatch at capacity_factor 1.25.

    PYTHONPATH=. python benchmarks/moe.py            # full benchmark
    PYTHONPATH=. python benchmarks/moe.py --small    # seconds-long smoke run (tests)

One timed call = `jax.value_and_grad` of sum(y * r) + aux + z-loss of one `MoE` layer with respect to
its parameters and its input (a training step's worth of layer work), compiled, after a warm-up.
Timing runs in rounds, each timing every path once (so a load change on a shared machine hits all
paths alike); tokens/s = tokens / median wall time, and each speedup is the median over rounds of
that round's naive time / the path's time. Expert FLOPs (routed work only, 2 FLOPs per multiply-add,
backward = 2x forward) are reported per path as useful work: 3 * 2 * N*K * 3*D*F; the naive path
computes every expert on every token (E/K times that), the capacity path E*C slots plus its
one-hot dispatch/combine einsums. The last line printed is one JSON object.

Expert parallelism (skip with --no-ep): the script re-runs itself in a subprocess (`--ep-worker`) with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (it must be set before jax is imported), where it
times `dispatch_expert_parallel` forward+backward (expert weights sharded over an 8-way `expert` mesh
axis, tokens split over it, all_to_all both ways) against the same-shape `dispatch_dropless` on one of
those devices, checks both give the same outputs and gradients, and checks every expert weight is held
as 8 shards of E/8 experts. The router is fixed (routing computed once, gradients w.r.t. the expert
weights and the input). The experts are rounded up to a multiple of 8. Its figures come back as one
JSON line and go into the parent's JSON under `ep8_*`. Eight fake devices share this machine's cores,
so this measures the dispatch's overhead (buffers, all_to_all, per-device work), not a speed-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common

# dropless uses the backend's grouped matmul (`auto`: blocked on CPU, lax.ragged_dot elsewhere);
# dropless_ragged forces lax.ragged_dot, to show what it costs where there is no grouped kernel.
PATHS = ("dropless", "dropless_ragged", "capacity", "naive")
EP_DEVICES = 8


def run_ep_subprocess(args) -> dict:
    """Re-run this script as an `--ep-worker` on 8 fake devices; -> its JSON figures."""
    import json
    import subprocess

    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env = dict(
        os.environ,
        XLA_FLAGS=" ".join(flags + [f"--xla_force_host_platform_device_count={EP_DEVICES}"]),
        JAX_PLATFORMS="cpu",
    )
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--ep-worker",
        "--experts",
        str(args.experts),
        "--top-k",
        str(args.top_k),
        "--d-model",
        str(args.d_model),
        "--mlp",
        str(args.mlp),
        "--tokens",
        str(args.tokens),
        "--repeats",
        str(args.repeats),
        "--seed",
        str(args.seed),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"expert-parallel worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    sys.stdout.write("".join(line + "\n" for line in proc.stdout.splitlines()[:-1]))
    return json.loads(proc.stdout.splitlines()[-1])


def ep_worker(args) -> dict:
    """On 8 (fake) devices: expert-parallel vs single-device dropless dispatch, forward+backward."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxrl.models import moe, moe_dispatch

    assert jax.device_count() == EP_DEVICES, f"need {EP_DEVICES} devices, got {jax.devices()}"
    P = EP_DEVICES
    E = -(-args.experts // P) * P
    K, D, F, N = args.top_k, args.d_model, args.mlp, args.tokens
    assert N % P == 0, f"--tokens {N} must divide over {P} devices"
    gmm = "blocked" if jax.default_backend() == "cpu" else "ragged"
    rng = np.random.default_rng(args.seed)
    x = rng.normal(size=(N, D)).astype(np.float32)
    r = rng.normal(size=(N, D)).astype(np.float32)
    ws = [(rng.normal(size=s) * s[1] ** -0.5).astype(np.float32) for s in [(E, D, F), (E, D, F), (E, F, D)]]
    logits = jnp.asarray(rng.normal(size=(N, E)), jnp.float32)
    gates, experts, _, _ = jax.jit(moe.route, static_argnums=(1, 2))(logits, K, "softmax")  # one compile, not per op

    mesh = Mesh(np.array(jax.devices()), ("expert",))
    rows, by_expert = NamedSharding(mesh, PartitionSpec("expert")), NamedSharding(mesh, PartitionSpec("expert"))
    ws_ep = [jax.device_put(w, by_expert) for w in ws]
    x_ep, r_ep = jax.device_put(x, rows), jax.device_put(r, rows)
    experts_ep, gates_ep = jax.device_put(experts, rows), jax.device_put(gates, rows)
    shard_shapes = sorted({tuple(s.data.shape) for w in ws_ep for s in w.addressable_shards})
    weights_sharded = all(
        len({s.device for s in w.addressable_shards}) == P
        and {tuple(s.data.shape) for s in w.addressable_shards} == {(E // P,) + w.shape[1:]}
        for w in ws_ep
    )

    def ep_loss(ws, x, experts, gates, r):
        return jnp.sum(moe_dispatch.dispatch_expert_parallel(x, *ws, experts, gates, mesh, "expert", gmm) * r)

    def one_loss(ws, x, experts, gates, r):
        return jnp.sum(moe_dispatch.dispatch_dropless(x, *ws, experts, gates, gmm) * r)

    dev0 = jax.devices()[0]
    one_args = jax.device_put((ws, x, experts, gates, r), dev0)
    ep_args = (ws_ep, x_ep, experts_ep, gates_ep, r_ep)
    # Compiled ahead once: the executable that is timed is also the one whose HLO is checked below.
    ep_step = jax.jit(jax.value_and_grad(ep_loss, argnums=(0, 1))).lower(*ep_args).compile()
    one_step = jax.jit(jax.value_and_grad(one_loss, argnums=(0, 1)))

    ep_s, ep_times = common.median_time(lambda: ep_step(*ep_args), args.repeats)
    one_s, one_times = common.median_time(lambda: one_step(*one_args), args.repeats)
    (v_ep, (gw_ep, gx_ep)), (v_one, (gw_one, gx_one)) = ep_step(*ep_args), one_step(*one_args)
    y_ep = jax.jit(lambda *a: moe_dispatch.dispatch_expert_parallel(*a, mesh, "expert", gmm))(
        x_ep, *ws_ep, experts_ep, gates_ep
    )
    y_one = jax.jit(lambda *a: moe_dispatch.dispatch_dropless(*a, gmm))(*jax.device_put((x, *ws, experts, gates), dev0))
    y_err = float(np.max(np.abs(np.asarray(y_ep) - np.asarray(y_one))))
    g_err = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves((gw_ep, gx_ep)), jax.tree.leaves((gw_one, gx_one)))
    )
    outputs_match = bool(
        np.allclose(y_ep, y_one, rtol=1e-4, atol=1e-4)
        and all(
            np.allclose(a, b, rtol=1e-3, atol=1e-3)
            for a, b in zip(jax.tree.leaves((gw_ep, gx_ep)), jax.tree.leaves((gw_one, gx_one)))
        )
        and abs(float(v_ep) - float(v_one)) <= 1e-3 * max(1.0, abs(float(v_one)))
    )
    grads_sharded = all({tuple(s.data.shape) for s in g.addressable_shards} == {(E // P,) + g.shape[1:]} for g in gw_ep)
    hlo = ep_step.as_text()
    print(
        f"ep{P} expert-parallel {N / ep_s:10.0f} tokens/s  {ep_s * 1e3:9.1f} ms/step   "
        f"dropless on 1 of the {P} devices {N / one_s:10.0f} tokens/s  {one_s * 1e3:9.1f} ms/step   "
        f"max |dy| {y_err:.1e}",
        flush=True,
    )
    return {
        "ep8_devices": P,
        "ep8_tokens_per_s": N / ep_s,
        "ep8_seconds": ep_s,
        "ep8_times": ep_times,
        "ep8_single_device_dropless_tokens_per_s": N / one_s,
        "ep8_single_device_dropless_seconds": one_s,
        "ep8_single_device_dropless_times": one_times,
        "ep8_speedup_vs_single_device": one_s / ep_s,
        "ep8_outputs_match": outputs_match,
        "ep8_max_abs_err_out": y_err,
        "ep8_max_abs_err_grad": g_err,
        "ep8_weights_sharded": bool(weights_sharded and grads_sharded),
        "ep8_weight_shard_shapes": shard_shapes,
        "ep8_all_to_all_in_hlo": "all-to-all" in hlo,
        "ep8_grouped_matmul": gmm,
        "ep8_shape": {"experts": E, "top_k": K, "d_model": D, "expert_mlp": F, "tokens": N},
        "ep8_load_average": common.load_average(),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--mlp", type=int, default=512, help="expert mlp width")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds (each times every path once)")
    ap.add_argument("--small", action="store_true", help="tiny shape (smoke test)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-ep", action="store_true", help="skip the expert-parallel run on 8 fake devices")
    ap.add_argument("--ep-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.ep_worker:  # launched by run_ep_subprocess with 8 devices; prints its figures as one JSON line
        ep = ep_worker(args)
        common.emit(ep)
        return ep

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl.models.moe import MoE, MoESpec
    from jaxrl.models.moe_dispatch import capacity

    if args.small:
        args.experts, args.top_k, args.d_model, args.mlp, args.tokens = 4, 2, 32, 64, 256
        args.repeats = min(args.repeats, 2)
    E, K, D, F, N = args.experts, args.top_k, args.d_model, args.mlp, args.tokens
    rng = np.random.default_rng(args.seed)
    x_1xNxD = jnp.asarray(rng.normal(size=(1, N, D)), jnp.float32)
    r_1xNxD = jnp.asarray(rng.normal(size=(1, N, D)), jnp.float32)
    mask_1xN = jnp.ones((1, N), bool)
    specs = {
        p: MoESpec(
            E,
            K,
            F,
            0,
            "softmax",
            p.split("_")[0],
            args.capacity_factor,
            grouped_matmul="ragged" if p == "dropless_ragged" else "auto",
        )
        for p in PATHS
    }
    # Jitted: un-jitted, flax's init runs op by op and compiles each op on its own (dozens of compiles).
    init = jax.jit(MoE(D, specs["naive"]).init)
    params = nn.meta.unbox(init(jax.random.PRNGKey(args.seed), x_1xNxD, mask_1xN)["params"])

    def make_step(spec):
        def loss(p, x):
            y, st = MoE(D, spec).apply({"params": p}, x, mask_1xN)
            return jnp.sum(y * r_1xNxD) + st.aux_loss + st.z_loss, st.dropped_frac

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

    expert_flops = 3 * 2.0 * N * K * 3 * D * F  # routed work, forward + backward
    C = capacity(N, K, E, args.capacity_factor)
    results, outputs, steps = {}, {}, {}
    for path in PATHS:  # compile and check every path before timing any
        steps[path] = make_step(specs[path])
        (value, dropped), grads = jax.block_until_ready(steps[path](params, x_1xNxD))
        outputs[path] = (float(value), grads, float(dropped))
    # Interleaved rounds (every path once per round): load on a shared machine drifts over minutes, so
    # each round's naive/dropless ratio compares like with like; the speedup is the median ratio.
    times = {path: [] for path in PATHS}
    cpu = {path: [] for path in PATHS}
    for _ in range(args.repeats):
        for path in PATHS:
            c0, t0 = time.process_time(), time.perf_counter()
            jax.block_until_ready(steps[path](params, x_1xNxD))
            times[path].append(time.perf_counter() - t0)
            cpu[path].append(time.process_time() - c0)
    for path in PATHS:
        seconds, dropped = statistics.median(times[path]), outputs[path][2]
        results[path] = {
            "tokens_per_s": N / seconds,
            "seconds": seconds,
            "times": times[path],
            "cpu_seconds": statistics.median(cpu[path]),
            "expert_gflops_per_s": expert_flops / seconds / 1e9,
            "dropped_frac": dropped,
        }
        print(
            f"{path:15s} {N / seconds:10.0f} tokens/s  {seconds * 1e3:9.1f} ms/step  dropped {dropped:.3f}", flush=True
        )

    def speedup_over_naive(path):
        return statistics.median(n / t for n, t in zip(times["naive"], times[path]))

    # Same numbers from every path when nothing is dropped: a benchmark of a wrong kernel is worthless.
    ref_value, ref_grads, _ = outputs["naive"]
    for path in ("dropless", "dropless_ragged") + (("capacity",) if results["capacity"]["dropped_frac"] == 0 else ()):
        value, grads, _ = outputs[path]
        assert abs(value - ref_value) <= 1e-3 * max(1.0, abs(ref_value)), (path, value, ref_value)
        err = max(  # in numpy: jnp here would compile a subtract, abs and max per leaf shape
            float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))
        )
        assert err < 1e-2, (path, err)
    speedup = speedup_over_naive("dropless")
    print(
        f"dropless vs naive: {speedup:.2f}x   capacity vs naive: "
        f"{speedup_over_naive('capacity'):.2f}x   (capacity C={C} per expert; median of per-round ratios)"
    )
    ep = {} if args.no_ep else run_ep_subprocess(args)
    if ep:
        assert ep["ep8_outputs_match"], (
            "expert-parallel dispatch disagrees with dropless",
            ep["ep8_max_abs_err_out"],
            ep["ep8_max_abs_err_grad"],
        )
        assert ep["ep8_weights_sharded"], ("expert weights are not split 1/8 per device", ep["ep8_weight_shard_shapes"])
    result = {
        "benchmark": "moe",
        "tokens_per_s": results["dropless"]["tokens_per_s"],
        "seconds": results["dropless"]["seconds"],
        "paths": results,
        "speedup_dropless_vs_naive": speedup,
        "speedup_capacity_vs_naive": speedup_over_naive("capacity"),
        "speedup_dropless_ragged_vs_naive": speedup_over_naive("dropless_ragged"),
        "grouped_matmul": "blocked" if jax.default_backend() == "cpu" else "ragged",
        "capacity_per_expert": C,
        "shape": {
            "experts": E,
            "top_k": K,
            "d_model": D,
            "expert_mlp": F,
            "tokens": N,
            "capacity_factor": args.capacity_factor,
        },
        "config": "tiny" if args.small else "default",
        "load_average": common.load_average(),
        "peak_rss_mib": common.peak_rss_mib(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        **ep,
    }
    common.emit(result)
    return result


if __name__ == "__main__":
    main()
