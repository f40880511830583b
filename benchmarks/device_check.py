"""A device check, ready to run on one accelerator: one JSON line per stage, a summary JSON line last.

Nothing is downloaded: models are random-init, the checkpoint, tokenizer and GSM8K-format data are written
by the script itself (into --scratch). Stages, each in its own child Python (a crash, an out-of-memory
kill or a timeout fails that stage only; peak device memory is then per stage):

  env      versions (python, jax, jaxlib), backend, device kind and count, device memory, XLA flags, and
           the datasheet peaks used below (bf16 dense FLOP/s, HBM bytes/s; null for an unknown kind)
  update   the GRPO update (forward + backward + AdamW, the training loop's jitted step) at Qwen2.5-1.5B
           shape, bfloat16 compute, random init: tokens/s, MFU against the datasheet peak, peak memory
  rollout  the static sampler at the same shape with <= 8 rows: tokens/s, MFU, and decode bandwidth =
           weight bytes / decode-step time against the HBM bandwidth, with the weights as the trainer
           keeps them (float32) and cast once to bfloat16
  decode   benchmarks/decode_attention.py: the slot engine's decode step and one layer's cache read by
           decode kernel (dense, blocked, and the Pallas kernel where a GPU or TPU compiles it) at a
           cache 1/8 and wholly filled: whether the fill-bounded kernels read only what is filled
  train    `jaxrl train` of configs/qwen2.5_0.5b_gsm8k_grpo.py for 3 steps on a random Qwen2.5-0.5B-shaped
           HF checkpoint (bfloat16 safetensors + byte-level BPE tokenizer) and generated GSM8K-format files
  plan     `jaxrl plan`'s compiled memory of the same run's update, to set against the train stage's peak
  pytest   the GPU-relevant tests (file names with sharding, data_parallel, moe_expert_parallel, attention,
           decode_kernels, int8)

    PYTHONPATH=. python benchmarks/device_check.py --out benchmarks/results/device_$(date +%F).json
    PYTHONPATH=. python benchmarks/device_check.py --cpu-smoke        # tiny shapes, no pytest stage (~35 s, 2 cores)
    PYTHONPATH=. python benchmarks/device_check.py --stage update     # one stage, in this process

The whole run keeps to --budget-s (default 530 s): each stage's timeout is the smaller of its own and
what is left. FLOP counting is benchmarks/common.py's (one multiply-add = 2 FLOPs, training = 3 x forward).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import pathlib
import platform
import re
import subprocess
import sys
import tempfile
import time
import types
from typing import TYPE_CHECKING, Any

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import common  # noqa: E402

if TYPE_CHECKING:  # jaxrl.config is imported inside the functions: the parent process never imports jax
    from jaxrl.config import ModelConfig

RECIPE = "configs/qwen2.5_0.5b_gsm8k_grpo.py"
STAGES = ("env", "update", "rollout", "decode", "train", "plan", "pytest")
SMOKE_STAGES = ("env", "update", "rollout", "decode", "train", "plan")
# Seconds each stage may take at most (the run's --budget-s bounds them all together).
TIMEOUTS = {"env": 60, "update": 150, "rollout": 180, "decode": 90, "train": 240, "plan": 90, "pytest": 300}
PYTEST_NAMES = ("sharding", "data_parallel", "moe_expert_parallel", "attention", "decode_kernels", "int8")

# Datasheet figures by device kind (substring of `device.device_kind`, lower case; first match wins):
# dense bfloat16 matmul FLOP/s (no sparsity) and HBM bytes/s.
PEAKS = (
    ("h100 pcie", 756e12, 2.0e12),
    ("h200", 989e12, 4.8e12),
    ("h100", 989e12, 3.35e12),
    ("a100", 312e12, 2.0e12),  # the 80 GB part; the 40 GB one has 1.56 TB/s
    ("v5 lite", 197e12, 0.82e12),  # TPU v5e
    ("v5e", 197e12, 0.82e12),
    ("v6 lite", 918e12, 1.64e12),  # TPU v6e (Trillium)
    ("v6e", 918e12, 1.64e12),
)


def datasheet_peaks(device_kind: str) -> tuple[float | None, float | None]:
    """(bf16 dense FLOP/s, HBM bytes/s) of a device kind, (None, None) when it is not in PEAKS."""
    kind = device_kind.lower()
    for name, flops, hbm in PEAKS:
        if name in kind:
            return flops, hbm
    return None, None


def qwen25_1p5b(max_seq_len: int) -> ModelConfig:
    """Qwen2.5-1.5B's dimensions (config.json of the release), bfloat16 compute, random weights."""
    from jaxrl.config import ModelConfig

    return ModelConfig(
        vocab_size=151936, d_model=1536, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128, mlp_dim=8960,
        rope_theta=1e6, norm_eps=1e-6, qkv_bias=True, tie_embeddings=True, max_seq_len=max_seq_len,
        dtype="bfloat16",
    )  # fmt: skip


def qwen25_0p5b() -> ModelConfig:
    """Qwen2.5-0.5B's dimensions, as the checkpoint the train stage writes (the recipe sets the dtype)."""
    from jaxrl.config import ModelConfig

    return ModelConfig(
        vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64, mlp_dim=4864,
        rope_theta=1e6, norm_eps=1e-6, qkv_bias=True, tie_embeddings=True, max_seq_len=32768,
    )  # fmt: skip


def tiny_model(max_seq_len: int = 64, vocab_size: int = 256) -> ModelConfig:
    from jaxrl.config import ModelConfig

    return ModelConfig(
        vocab_size=vocab_size, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=128,
        qkv_bias=True, tie_embeddings=True, max_seq_len=max_seq_len, dtype="bfloat16",
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Batch shapes of the update and rollout stages."""

    update_batch: int
    update_seq: int
    update_prompt_len: int
    group_size: int
    rollout_prompts: int
    rollout_samples: int
    rollout_prompt_len: int
    rollout_short: int  # new tokens of the short call; the long call's minus this is the decode-step count
    rollout_long: int
    repeats: int


FULL = Shapes(16, 512, 128, 8, 2, 4, 128, 32, 160, 3)
SMOKE = Shapes(4, 16, 8, 2, 1, 2, 8, 4, 12, 1)


# ----------------------------------------------------------------------------------------------- stages


def device_figures() -> dict:
    """The first device's kind, its datasheet peaks and its memory counters (what the backend reports)."""
    import jax

    dev = jax.devices()[0]
    flops, hbm = datasheet_peaks(dev.device_kind)
    stats = _memory_stats(dev)
    return {
        "device_kind": dev.device_kind,
        "peak_bf16_flops": flops,
        "hbm_bytes_per_s": hbm,
        "memory_limit_bytes": stats.get("bytes_limit"),
        "peak_memory_bytes": stats.get("peak_bytes_in_use"),
    }


def _memory_stats(dev) -> dict:
    try:
        return dev.memory_stats() or {}
    except Exception:  # noqa: BLE001  (some backends raise instead of returning None)
        return {}


def stage_env(args) -> dict:
    import importlib.metadata

    import jax

    devs = jax.devices()
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
        "backend": jax.default_backend(),
        "device_count": len(devs),
        "device_kinds": sorted({d.device_kind for d in devs}),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("XLA_PYTHON_CLIENT", "JAX_", "CUDA_VISIBLE"))},
        **device_figures(),
    }


def stage_update(args) -> dict:
    """The training loop's update step on one batch of GRPO groups, timed after a compiling warm-up."""
    import statistics

    import jax

    from benchmarks.update import Variant, make_batch

    s = _shapes(args)
    cfg = tiny_model(s.update_seq) if args.cpu_smoke else qwen25_1p5b(s.update_seq)
    knobs = types.SimpleNamespace(
        batch=s.update_batch, seq=s.update_seq, prompt_len=s.update_prompt_len, group_size=s.group_size,
        seed=0, logits_chunk=0, remat="none", microbatches=1, memory_budget_gib=2.0,
    )  # fmt: skip
    T = s.update_seq - s.update_prompt_len
    batch = jax.device_put(make_batch(cfg, s.update_batch, s.update_prompt_len, T, s.group_size, 0))
    v = Variant(cfg, knobs, True, batch)
    metrics = jax.device_get(v.run())  # compiling warm-up call
    for _ in range(s.repeats):
        v.timed()
    seconds = statistics.median(v.times)
    dev = device_figures()
    tokens = s.update_batch * s.update_seq
    return {
        "model": "tiny" if args.cpu_smoke else "qwen2.5-1.5b-shape",
        "params": common.total_params(cfg),
        "dtype": cfg.dtype,
        "attention": cfg.attention,  # model.attention: `auto` picks the kernel by backend
        "shape": {
            "batch": s.update_batch,
            "seq": s.update_seq,
            "prompt_len": s.update_prompt_len,
            "group": s.group_size,
        },
        "seconds": seconds,
        "times": v.times,
        "tokens_per_s": tokens / seconds,
        "update_tflop": v.flops / 1e12,
        "tflops_per_s": v.flops / seconds / 1e12,
        "mfu": _ratio(v.flops / seconds, dev["peak_bf16_flops"]),
        "loss": float(metrics["loss"]) if "loss" in metrics else None,
        "xla_temp_mib": v.xla_temp_mib,
        "xla_args_mib": v.xla_args_mib,
        **dev,
    }


def stage_rollout(args) -> dict:
    """sample() with the float32 master weights and with weights cast once to bfloat16: tokens/s, MFU, and
    the decode step's weight bandwidth, from two calls that differ only in their new-token count."""
    import jax
    import jax.numpy as jnp

    from jaxrl.models.transformer import init_params

    s = _shapes(args)
    max_len = s.rollout_prompt_len + s.rollout_long
    cfg = tiny_model(max_len) if args.cpu_smoke else qwen25_1p5b(max_len)
    params_f32 = init_params(cfg, jax.random.PRNGKey(0))
    out = {
        "model": "tiny" if args.cpu_smoke else "qwen2.5-1.5b-shape",
        "params": common.total_params(cfg),
        "rows": s.rollout_prompts * s.rollout_samples,
        "attention": cfg.attention,
        "shape": {"prompts": s.rollout_prompts, "samples": s.rollout_samples, "prompt_len": s.rollout_prompt_len,
                  "new_tokens": [s.rollout_short, s.rollout_long]},
    }  # fmt: skip
    for name, params in (("float32_weights", params_f32), ("bfloat16_weights", None)):
        if params is None:
            params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params_f32)
        try:
            out[name] = _rollout_variant(cfg, params, s)
        except Exception as e:  # noqa: BLE001  (one variant failing leaves the other's figures)
            out[name] = {"error": f"{type(e).__name__}: {e}"[-2000:]}
    out.update(device_figures())
    return out


def _rollout_variant(cfg, params, s: Shapes) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.rollout import rollout_flops
    from jaxrl.rollout.sampler import SamplingParams, sample

    B, G, P = s.rollout_prompts, s.rollout_samples, s.rollout_prompt_len
    rng = np.random.default_rng(0)
    prompt_BxP = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, P), dtype=np.int32))
    mask_BxP = jnp.ones((B, P), jnp.int32)

    def call(T: int, seed: int):
        sampling = SamplingParams(temperature=1.0, max_new_tokens=T, eos_id=-1, pad_id=0)
        return sample(params, cfg, prompt_BxP, mask_BxP, jax.random.PRNGKey(seed), sampling=sampling, group_size=G)

    short, _ = common.median_time(lambda: call(s.rollout_short, 1), s.repeats)
    long, times = common.median_time(lambda: call(s.rollout_long, 2), s.repeats)
    steps = s.rollout_long - s.rollout_short
    step_s = max(long - short, 1e-12) / steps
    weight_bytes = sum(a.nbytes for a in jax.tree.leaves(params))
    prefill, decode = rollout_flops(cfg, B, G, P, s.rollout_long)
    dev = device_figures()
    return {
        "weight_dtype": str(jax.tree.leaves(params)[0].dtype),
        "seconds": long,
        "times": times,
        "tokens_per_s": B * G * s.rollout_long / long,
        "mfu": _ratio((prefill + decode) / long, dev["peak_bf16_flops"]),
        "decode_step_s": step_s,
        "weight_bytes": weight_bytes,
        "decode_weight_bytes_per_s": weight_bytes / step_s,
        "decode_hbm_fraction": _ratio(weight_bytes / step_s, dev["hbm_bytes_per_s"]),
    }


def stage_decode(args) -> dict:
    """benchmarks/decode_attention.py: the engine's decode step and one layer's cache read by decode
    kernel (`model.decode_attention`: dense, blocked, and on a GPU or TPU the Pallas kernel compiled for
    it) at a cache 1/8 and wholly filled."""
    import jax

    from benchmarks import decode_attention

    on_device = jax.default_backend() in ("gpu", "tpu")
    argv = ["--small"] if args.cpu_smoke else ["--repeats", "5"]
    argv += ["--kernels", "dense,blocked,pallas" if on_device else "dense,blocked"]
    return {**decode_attention.main(argv), **device_figures()}


def train_files(scratch: pathlib.Path, smoke: bool) -> list[str]:
    """Write a random Qwen2.5-shaped HF checkpoint with a tokenizer and GSM8K-format train/test files under
    `scratch`; -> the `--set` overrides that point the recipe at them and keep the run to its stage."""
    import jax

    sys.path.insert(0, str(REPO / "scripts"))
    sys.path.insert(0, str(REPO / "tests"))
    stand_in = importlib.import_module("hf_stand_in")  # the tests' tokenizer and chat-template builders
    problems = importlib.import_module("make_stand_in").problems  # GSM8K-format word problems
    CHATML_SPECIALS = stand_in.CHATML_SPECIALS

    from jaxrl.models import hf
    from jaxrl.models.transformer import init_params

    train, test = problems(32 if smoke else 256, 0), problems(8 if smoke else 32, 1)
    for name, rows in (("gsm8k_train.jsonl", train), ("gsm8k_test.jsonl", test)):
        (scratch / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    ckpt = scratch / "qwen2.5-0.5b-shape"
    ckpt.mkdir(parents=True, exist_ok=True)
    prompt_text = ["<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"]
    corpus = [r["question"] + " " + r["answer"] for r in train] * 5 + prompt_text * 5
    stand_in.save_bpe_tokenizer(
        ckpt, corpus, 300, CHATML_SPECIALS, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    )
    (ckpt / "chat_template.jinja").write_text(stand_in.QWEN25)
    cfg = dataclasses.replace(tiny_model(32768, 320), dtype="float32") if smoke else qwen25_0p5b()
    params = init_params(cfg, jax.random.PRNGKey(0))
    eos, pad = CHATML_SPECIALS.index("<|im_end|>"), CHATML_SPECIALS.index("<|endoftext|>")
    hf.save(ckpt, params, cfg, dtype="bfloat16", eos_token_id=eos, pad_token_id=pad)
    sets = [f"model.hf_path={ckpt}", f"data.train_file={scratch / 'gsm8k_train.jsonl'}"]
    sets += [f"data.test_file={scratch / 'gsm8k_test.jsonl'}", "train.eval_every=0", "train.eval_prompts=8"]
    sets += ["checkpoint.every=0"]  # 0: one checkpoint, at the end
    if smoke:  # the recipe at CPU size (scripts/make_stand_in.py's sizes, one step)
        sets += ["model.dtype=float32", "mesh.preset=single", "rollout.prompts_per_step=2"]
        sets += ["rollout.group_size=2", "rollout.max_new_tokens=8", "train.steps=1", "train.microbatches=1"]
    else:  # 32 microbatches of 8 rows: at the recipe's 8 (32 rows), `jaxrl plan` (XLA:CPU) counts 145 GB of
        # temporaries for the update, more than one H200 holds; at 32, 43 GB
        sets += ["train.steps=3", "train.microbatches=32"]
    return sets


def stage_train(args) -> dict:
    """`jaxrl train RECIPE` on the written files, in this process; the steps it logged and peak memory."""
    from jaxrl import cli

    scratch = pathlib.Path(args.scratch)
    t0 = time.perf_counter()
    sets = train_files(scratch, args.cpu_smoke) + list(args.train_set)
    write_s = time.perf_counter() - t0
    (scratch / "train_sets.json").write_text(json.dumps(sets))  # what the plan stage reads back
    workdir = scratch / "run"
    argv = ["train", RECIPE, *(w for s in sets for w in ("--set", s)), "--workdir", str(workdir)]
    t0 = time.perf_counter()
    rc = cli.main(argv)
    train_s = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"`jaxrl {' '.join(argv)}` exited {rc}")
    steps = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [m for m in steps if "step" in m and "loss" in m]  # the training steps (not other records)
    want = 1 if args.cpu_smoke else 3
    last = steps[-1] if steps else {}
    return {
        "command": "jaxrl " + " ".join(argv),
        "write_checkpoint_s": write_s,
        "train_s": train_s,
        "steps_logged": len(steps),
        "completed": len(steps) >= want,
        "last_step": {k: v for k, v in last.items() if isinstance(v, (int, float)) and not k.startswith("time")},
        **device_figures(),
    }


def stage_plan(args) -> dict:
    """`jaxrl plan --programs update` of the train stage's config (its checkpoint must exist)."""
    sets = _train_sets(args)  # before any jax import: a missing train stage fails at once

    from jaxrl.config import load_config
    from jaxrl.train.plan import plan

    [record] = plan(load_config(str(REPO / RECIPE), sets), ("update",))
    mem = record["memory_mib"]
    return {
        "update_memory_mib": mem,
        "update_predicted_mib": mem["argument"] + mem["temp"] + mem["output"] - mem["alias"],
        "flops_per_device": record["flops_per_device"],
        "devices": record["devices"],
    }


def _train_sets(args) -> list[str]:
    """The train stage's overrides, read back from its run's command line (the files already exist)."""
    scratch = pathlib.Path(args.scratch)
    saved = scratch / "train_sets.json"
    if not saved.exists():
        raise RuntimeError(f"{saved} is missing: the plan stage reads the train stage's overrides; run `train` first")
    return json.loads(saved.read_text())


def stage_pytest(args) -> dict:
    """The GPU-relevant test files (by name) with `pytest -q`: pass/fail counts and the summary line."""
    files = sorted({str(p.relative_to(REPO)) for n in PYTEST_NAMES for p in (REPO / "tests").glob(f"test_*{n}*.py")})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    try:  # stop short of the parent's timeout, to report what ran
        # No preallocation: tests start children of their own, and each would take 75% of the device.
        env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
        proc = subprocess.run(
            cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=max(args.stage_timeout - 15, 10)
        )
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout or ""
        text, rc = (out.decode(errors="replace") if isinstance(out, bytes) else out), "timeout"
    return {"ok": rc == 0, "files": files, "returncode": rc, **pytest_counts(text)}  # a failing test fails the stage


def pytest_counts(text: str) -> dict:
    """Counts from `pytest -q` output (its last line, e.g. "3 failed, 40 passed, 1 skipped in 9.1s"), the
    FAILED/ERROR lines of its short summary, and that last line."""
    last = text.strip().splitlines()[-1] if text.strip() else ""
    counts = {
        k.rstrip("s") if k == "errors" else k: int(n)
        for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)", last)
    }
    return {
        "passed": counts.get("passed", 0),
        "failed": counts.get("failed", 0),
        "errors": counts.get("error", 0),
        "skipped": counts.get("skipped", 0),
        "summary_line": last,
        "failures": [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))][:30],
    }


RUNNERS = {
    "env": stage_env,
    "update": stage_update,
    "rollout": stage_rollout,
    "decode": stage_decode,
    "train": stage_train,
    "plan": stage_plan,
    "pytest": stage_pytest,
}


def _shapes(args) -> Shapes:
    return SMOKE if args.cpu_smoke else FULL


def _ratio(x: float, peak: float | None) -> float | None:
    return x / peak if peak else None


# ------------------------------------------------------------------------------------------ orchestration


def run_stage_here(name: str, args) -> dict:
    """One stage in this process -> its record (`ok` false and `error` set when it raised)."""
    t0 = time.perf_counter()
    try:
        record = {"stage": name, "ok": True, **RUNNERS[name](args)}  # a runner may set ok false itself
    except Exception as e:  # noqa: BLE001  (the fence: the record says what went wrong)
        record = {"stage": name, "ok": False, "error": f"{type(e).__name__}: {e}"[-4000:]}
    record["stage_seconds"] = time.perf_counter() - t0
    return record


def run_stage_child(name: str, args, timeout: float) -> dict:
    """One stage in a child Python (--stage NAME) -> its last JSON line, or an error record when the child
    died, printed no JSON line or ran past `timeout`."""
    cmd = [sys.executable, __file__, "--stage", name, "--scratch", args.scratch, "--stage-timeout", str(int(timeout))]
    cmd += ["--cpu-smoke"] if args.cpu_smoke else []
    cmd += [w for s in args.train_set for w in ("--train-set", s)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"stage": name, "ok": False, "error": f"timed out after {timeout:.0f} s", "stage_seconds": timeout}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode == 0 and lines:
        record = json.loads(lines[-1])
    else:
        why = f"child exited {proc.returncode}" + ("" if lines else " without a JSON line")
        record = {"stage": name, "ok": False, "error": f"{why}: {proc.stderr.strip()[-3000:]}"}
    record["stage_seconds"] = time.perf_counter() - t0
    return record


def summary(records: list[dict], seconds: float) -> dict:
    """The last line: which stages passed, the headline figures and the issue's device targets (None when
    the figure is missing or has no datasheet peak to be judged against)."""
    by = {r["stage"]: r for r in records}

    def get(stage: str, *path) -> Any:
        x = by.get(stage, {})
        for p in path:
            x = x.get(p) if isinstance(x, dict) else None
        return x

    mfu, bw = get("update", "mfu"), get("rollout", "bfloat16_weights", "decode_hbm_fraction")
    peak, predicted = get("train", "peak_memory_bytes"), get("plan", "update_predicted_mib")
    within = abs(peak / 2**20 / predicted - 1) <= 0.15 if peak and predicted else None
    return {
        "summary": True,
        "ok": all(r["ok"] for r in records),
        "stages": {r["stage"]: r["ok"] for r in records},
        "failed": [r["stage"] for r in records if not r["ok"]],
        "seconds": seconds,
        "update_tokens_per_s": get("update", "tokens_per_s"),
        "update_mfu": mfu,
        "rollout_tokens_per_s": get("rollout", "bfloat16_weights", "tokens_per_s"),
        "decode_hbm_fraction_f32": get("rollout", "float32_weights", "decode_hbm_fraction"),
        "decode_hbm_fraction_bf16": bw,
        "decode_step_ratios": get("decode", "ratios", "step"),
        "train_completed": get("train", "completed"),
        "pytest": {k: get("pytest", k) for k in ("passed", "failed", "errors")} if "pytest" in by else None,
        "targets": {
            "update_mfu_ge_0.40": mfu >= 0.40 if mfu is not None else None,
            "decode_hbm_fraction_ge_0.60": bw >= 0.60 if bw is not None else None,
            "train_peak_within_plan_15pct": within,
        },
    }


def _emit(record: dict, out) -> None:
    line = json.dumps(_finite(record), sort_keys=True)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


def _finite(x):
    """NaN/inf -> None, so every line is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _parse(argv):
    ap = argparse.ArgumentParser(description="A device check: one JSON line per stage, a summary last.")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, a 1-step train, no pytest stage")
    ap.add_argument("--stage", choices=STAGES, help="run this one stage in this process")
    ap.add_argument("--stages", default=None, help="comma-separated subset of the stages to run (default: all)")
    ap.add_argument("--budget-s", type=float, default=530.0, help="wall-clock budget of the whole run")
    ap.add_argument("--scratch", default=None, help="where the checkpoint, data and run go (default: a temp dir)")
    ap.add_argument("--out", default=None, help="also write the JSON lines to this file")
    ap.add_argument(
        "--train-set", action="append", default=[], help="extra `--set KEY=VALUE` for the train stage (repeatable)"
    )
    ap.add_argument("--stage-timeout", type=float, default=600.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    names = SMOKE_STAGES if args.cpu_smoke else STAGES
    if args.stages is not None:
        wanted = [s.strip() for s in args.stages.split(",") if s.strip()]
        bad = [s for s in wanted if s not in STAGES]
        if bad or not wanted:
            ap.error(f"--stages: {args.stages!r}: expected a comma-separated subset of {', '.join(STAGES)}")
        names = tuple(s for s in STAGES if s in wanted)
    args.names = names
    return args


def main(argv=None) -> list[dict]:
    args = _parse(argv)
    scratch_dir = None
    if args.scratch is None:
        scratch_dir = tempfile.TemporaryDirectory(prefix="jaxrl_device_check_")
        args.scratch = scratch_dir.name
    pathlib.Path(args.scratch).mkdir(parents=True, exist_ok=True)
    if args.stage is not None:  # a child (or a user running one stage): one record, no summary
        record = run_stage_here(args.stage, args)
        _emit(record, None)
        return [record]
    out = open(args.out, "w") if args.out else None  # noqa: SIM115  (closed below)
    t0, records = time.perf_counter(), []
    try:
        for name in args.names:
            left = args.budget_s - (time.perf_counter() - t0)
            if left < 5:
                record = {
                    "stage": name,
                    "ok": False,
                    "error": f"--budget-s {args.budget_s:.0f} spent before it started",
                }
            else:
                record = run_stage_child(name, args, min(TIMEOUTS[name], left))
            records.append(record)
            _emit(record, out)
        records.append(summary(records, time.perf_counter() - t0))
        _emit(records[-1], out)
    finally:
        if out is not None:
            out.close()
        if scratch_dir is not None:
            scratch_dir.cleanup()
    return records


if __name__ == "__main__":
    main()
