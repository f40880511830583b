"""Scaling on fake devices: per-device FLOPs and XLA temporaries of the update, the rollout and the
engine chunk on 1, 2, 4 and 8 devices, relative to ideal (1/d of one device's), from `jaxrl plan`'s
machinery (jaxrl/train/plan.py: compiled on abstract shapes, nothing runs).

bench-small (benchmarks/common.py) with the update benchmark's shape: 8 prompts x 8 samples, prompt
64, 128 new tokens (64 rows of 192 tokens); the engine with 64 slots. Meshes `data` and `fsdp`,
train.microbatches 1 and 4 (the rollout and the engine chunk do not depend on it). For each case

    flops_ratio = flops_per_device(d) * d / flops_per_device(1)
    temp_ratio  = temp_per_device(d)  * d / temp_per_device(1)

(1.0: the work and the temporaries split perfectly; d: every device does all of it). The last line is
one JSON object: dp_flops_ratio_max and dp_temp_ratio_max over every preset, microbatch count, program
and d > 1, and every case's ratios. Each device count compiles in its own child process (the fake
device count is fixed when JAX starts).

    PYTHONPATH=. python benchmarks/scaling.py            # bench-small, 1/2/4/8 devices (minutes)
    PYTHONPATH=. python benchmarks/scaling.py --small    # a tiny model and shape, 1/2 devices
    PYTHONPATH=. python benchmarks/scaling.py --small --presets data --microbatches 1   # the test's run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "grpo_arithmetic.py")
PRESETS = ("data", "fsdp", "fsdp+rollout=data")  # "P+rollout=R": mesh.preset=P, rollout.mesh.preset=R
MICROBATCHES = (1, 4)
PROGRAMS = ("update", "rollout", "engine_chunk")


def bench_config(preset: str, microbatches: int, small: bool):
    """The default run's config with bench-small (or the tiny model) and the benchmark's shape."""
    from benchmarks import common
    from jaxrl.config import load_config

    if small:
        model, shape = common.tiny(), ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=8"]
        shape += ["data.max_prompt_len=8", "rollout.engine.slots=16"]
    else:
        model, shape = common.bench_small(), ["rollout.prompts_per_step=8", "rollout.group_size=8"]
        shape += ["rollout.max_new_tokens=128", "data.max_prompt_len=64", "rollout.engine.slots=64"]
    train_preset, _, rollout_preset = preset.partition("+rollout=")
    sets = [*shape, f"mesh.preset={train_preset}", f"train.microbatches={microbatches}", "train.eval_prompts=100"]
    sets += [f"rollout.mesh.preset={rollout_preset}"] if rollout_preset else []
    cfg = load_config(CONFIG, sets)
    return dataclasses.replace(cfg, model=model).validate()


def worker(small: bool, presets: list[str], microbatches: list[int]) -> None:
    """On this process's devices: one record per (preset, microbatches, program), printed as RESULT.
    The rollout and the engine chunk do not depend on the microbatches: compiled once, recorded for each."""
    from jaxrl.train.plan import plan

    out = []
    for preset in presets:
        for mb in microbatches:
            programs = PROGRAMS if mb == microbatches[0] else ("update",)
            for record in plan(bench_config(preset, mb, small), programs):
                mbs = [mb] if record["program"] == "update" else microbatches
                for m in mbs:
                    out.append(
                        {
                            "preset": preset,
                            "microbatches": m,
                            "program": record["program"],
                            "devices": record["devices"],
                            "flops": record["flops_per_device"],
                            "temp_mib": record["memory_mib"]["temp"],
                            "collectives": record["collectives"],
                            "rollout_copy_mib": record.get("rollout_copy_mib_per_device"),
                        }
                    )
    print("RESULT " + json.dumps(out), flush=True)


def run_devices(n: int, small: bool, flags: list[str]) -> list[dict]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    xla = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform")]
    env["XLA_FLAGS"] = " ".join([*xla, f"--xla_force_host_platform_device_count={n}"])
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", *(["--small"] if small else []), *flags]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        sys.exit(f"scaling.py: the {n}-device child failed:\n{proc.stderr[-3000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def ratios(records: list[dict]) -> list[dict]:
    """Each case with d > 1 against the same preset, microbatches and program on one device."""
    one = {(r["preset"], r["microbatches"], r["program"]): r for r in records if r["devices"] == 1}
    out = []
    for r in records:
        if r["devices"] == 1:
            continue
        base = one[(r["preset"], r["microbatches"], r["program"])]
        d = r["devices"]
        out.append(
            {
                **{k: r[k] for k in ("preset", "microbatches", "program", "devices")},
                "flops_ratio": round(r["flops"] * d / base["flops"], 3) if base["flops"] else None,
                "temp_ratio": round(r["temp_mib"] * d / base["temp_mib"], 3) if base["temp_mib"] else None,
                "flops_per_device": r["flops"],
                "temp_mib": r["temp_mib"],
                "collectives": {k: v for k, v in r["collectives"].items() if v},
                **({"rollout_copy_mib": r["rollout_copy_mib"]} if r.get("rollout_copy_mib") else {}),
            }
        )
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="a tiny model and shape on 1 and 2 devices (seconds)")
    p.add_argument("--devices", default=None, help="comma-separated device counts (default 1,2,4,8; --small 1,2)")
    p.add_argument("--presets", default=",".join(PRESETS), help=f"mesh presets (default {','.join(PRESETS)})")
    p.add_argument("--microbatches", default=",".join(map(str, MICROBATCHES)), help="train.microbatches (default 1,4)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    presets, microbatches = args.presets.split(","), [int(x) for x in args.microbatches.split(",")]
    if args.worker:
        worker(args.small, presets, microbatches)
        return
    counts = [int(x) for x in (args.devices or ("1,2" if args.small else "1,2,4,8")).split(",")]
    if 1 not in counts:
        sys.exit("scaling.py: --devices must include 1 (the ratios are against one device)")
    t0 = time.perf_counter()
    flags = ["--presets", args.presets, "--microbatches", args.microbatches]
    records = [r for n in counts for r in run_devices(n, args.small, flags)]
    cases = ratios(records)
    print(
        f"{'preset':17} {'mb':>2} {'program':12} {'d':>2} {'flops/dev':>12} {'ratio':>6} {'temp MiB':>9} {'ratio':>6}"
    )
    for c in cases:
        print(
            f"{c['preset']:17} {c['microbatches']:>2} {c['program']:12} {c['devices']:>2} "
            f"{c['flops_per_device']:>12.4g} {c['flops_ratio']:>6} {c['temp_mib']:>9.2f} {c['temp_ratio']:>6}"
        )
    flops = [c["flops_ratio"] for c in cases if c["flops_ratio"] is not None]
    temps = [c["temp_ratio"] for c in cases if c["temp_ratio"] is not None]
    summary = {
        "config": "tiny" if args.small else "bench-small",
        "devices": counts,
        "presets": presets,
        "microbatches": microbatches,
        "dp_flops_ratio_max": max(flops) if flops else None,
        "dp_temp_ratio_max": max(temps) if temps else None,
        "seconds": round(time.perf_counter() - t0, 1),
        "one_device": [r for r in records if r["devices"] == 1],
        "cases": cases,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
