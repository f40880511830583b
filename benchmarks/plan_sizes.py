"""Per-device memory of the GSM8K recipe at real Qwen shapes, from `jaxrl plan` (compiled on abstract
shapes on fake CPU devices: no weights, no data, nothing runs).

The recipe is configs/qwen2.5_0.5b_gsm8k_grpo.py (bfloat16 compute, float32 params and Adam state,
256 rows of 320 prompt + 512 new tokens per step, train.microbatches=8, mesh.preset=fsdp). Its model is
replaced by one of SHAPES below through `--set model.*=...` with `model.hf_path=` (the architecture as
config.json gives it; the vocabulary is the real one, so the embedding and logits are real-sized).
Each case runs `jaxrl plan` in a child process (the fake device count is fixed when JAX starts) and
records the update's and the rollout's arguments and temporaries per device, with the exact command.

    PYTHONPATH=. python benchmarks/plan_sizes.py                          # every shape on 1, 8, 64 devices
    PYTHONPATH=. python benchmarks/plan_sizes.py --models qwen2.5-0.5b --devices 1
    PYTHONPATH=. python benchmarks/plan_sizes.py --print-command qwen2.5-7b --devices 8   # the command only

One JSON line per case on stdout (a case that fails records its error's last line), then a markdown
table on stderr. Numbers are XLA:CPU's buffer assignment; a GPU or TPU compiler assigns buffers its
own way (fusion differs), so read them as the size of the problem, not a GPU's exact peak.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/qwen2.5_0.5b_gsm8k_grpo.py"

# config.json of each checkpoint, as ModelConfig fields (jaxrl.models.hf maps the same keys).
_QWEN2 = {"rope_theta": 1000000.0, "qkv_bias": True, "norm_eps": 1e-6}
SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": {
        **_QWEN2,
        "vocab_size": 151936,
        "d_model": 896,
        "n_layers": 24,
        "n_heads": 14,
        "n_kv_heads": 2,
        "head_dim": 64,
        "mlp_dim": 4864,
        "tie_embeddings": True,
    },
    "qwen2.5-1.5b": {
        **_QWEN2,
        "vocab_size": 151936,
        "d_model": 1536,
        "n_layers": 28,
        "n_heads": 12,
        "n_kv_heads": 2,
        "head_dim": 128,
        "mlp_dim": 8960,
        "tie_embeddings": True,
    },
    "qwen2.5-7b": {
        **_QWEN2,
        "vocab_size": 152064,
        "d_model": 3584,
        "n_layers": 28,
        "n_heads": 28,
        "n_kv_heads": 4,
        "head_dim": 128,
        "mlp_dim": 18944,
        "tie_embeddings": False,
    },
    "qwen3-30b-a3b": {
        "rope_theta": 1000000.0,
        "norm_eps": 1e-6,
        "qk_norm": True,
        "vocab_size": 151936,
        "d_model": 2048,
        "n_layers": 48,
        "n_heads": 32,
        "n_kv_heads": 4,
        "head_dim": 128,
        "mlp_dim": 6144,
        "n_experts": 128,
        "experts_per_token": 8,
        "expert_mlp_dim": 768,
        "tie_embeddings": False,
    },
}
DEVICES = (1, 8, 64)
RECIPE_ROWS, RECIPE_MICROBATCHES = 32 * 8, 8  # the recipe's prompts_per_step * group_size, train.microbatches
PROGRAMS = "update,rollout"


def _value(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def command(model: str, devices: int, extra: tuple[str, ...] = ()) -> list[str]:
    """The `jaxrl plan` command line of one case (argv, without the interpreter)."""
    sets = ["model.hf_path=", *(f"model.{k}={_value(v)}" for k, v in SHAPES[model].items())]
    # Every dimension that does not divide over the fsdp axis (kv heads, 14 or 28 heads on 64 devices)
    # is replicated rather than an error: the table is about memory, and plan's layout lists them.
    sets.append("mesh.allow_replicated=*")
    # The recipe's 8 microbatches of 32 rows leave fewer rows than devices past 32 devices: each
    # microbatch then keeps at least one row per device (64 devices: 4 microbatches of 64 rows).
    if not any(s.startswith("train.microbatches=") for s in extra) and RECIPE_ROWS // RECIPE_MICROBATCHES < devices:
        sets.append(f"train.microbatches={max(1, RECIPE_ROWS // devices)}")
    sets.extend(extra)
    argv = ["jaxrl", "plan", CONFIG, "--devices", str(devices), "--programs", PROGRAMS]
    for s in sets:
        argv += ["--set", s]
    return argv


def run_case(model: str, devices: int, extra: tuple[str, ...], timeout: float) -> dict:
    argv = command(model, devices, extra)
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("XLA_FLAGS", None)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "jaxrl.cli", *argv[1:]],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"model": model, "devices": devices, "error": f"timed out after {timeout:.0f} s"}
    seconds = round(time.perf_counter() - t0, 1)
    case = {"model": model, "devices": devices, "command": shlex.join(argv), "seconds": seconds}
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        return {**case, "error": tail}
    for line in proc.stdout.splitlines():
        rec = json.loads(line)
        mem = rec["memory_mib"]
        case[rec["program"]] = {
            "argument_mib": mem["argument"],
            "temp_mib": mem["temp"],
            "gflops_per_device": round(rec["flops_per_device"] / 1e9, 1),
            "microbatches": rec.get("microbatches"),
            "replicated": [p["name"] for p in rec["layout"]["replicated"]],
        }
    return case


def _gib(mib: float) -> str:
    return f"{mib / 1024:.2f}"


def table(cases: list[dict]) -> str:
    rows = [
        "| model | devices | update args GiB | update temp GiB | rollout args GiB | rollout temp GiB |",
        "|---|---|---|---|---|---|",
    ]
    for c in cases:
        if "error" in c:
            rows.append(f"| {c['model']} | {c['devices']} | error: {c['error']} | | | |")
            continue
        u, r = c.get("update", {}), c.get("rollout", {})
        cells = [_gib(x[k]) if x else "-" for x in (u, r) for k in ("argument_mib", "temp_mib")]
        rows.append(f"| {c['model']} | {c['devices']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(SHAPES), help="comma-separated, of: " + ", ".join(SHAPES))
    ap.add_argument("--devices", default=",".join(map(str, DEVICES)), help="comma-separated device counts")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="another override for every case")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per case")
    ap.add_argument("--print-command", metavar="MODEL", help="print the jaxrl plan command of MODEL and exit")
    args = ap.parse_args()
    devices = [int(d) for d in args.devices.split(",")]
    if args.print_command:
        if args.print_command not in SHAPES:
            ap.error(f"--print-command: unknown model {args.print_command!r} (known: {', '.join(SHAPES)})")
        for d in devices:
            print(shlex.join(command(args.print_command, d, tuple(args.extra))))
        return 0
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in SHAPES]
    if unknown:
        ap.error(f"--models: unknown {', '.join(unknown)} (known: {', '.join(SHAPES)})")
    cases = []
    for d in devices:  # the small device counts (the fast compiles) first
        for m in models:
            case = run_case(m, d, tuple(args.extra), args.timeout)
            print(json.dumps(case), flush=True)
            cases.append(case)
    print(table(cases), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
