"""The benchmark scripts run end to end (tiny shapes) and print one JSON line last; FLOP counting."""

import json
import sys

import pytest
from harness import REPO, run_benchmark_here

sys.path.insert(0, str(REPO))  # `benchmarks` is a plain folder at the repository root

from benchmarks import common  # noqa: E402  (imports jaxrl.config only: no jax work happens)
from jaxrl.config import ModelConfig  # noqa: E402


def _run(script: str, *flags: str, capsys) -> dict:
    result = run_benchmark_here(script, "--small", *flags, capsys=capsys)  # readable lines, then the JSON
    assert result["tokens_per_s"] > 0 and 0 < result["mfu"], result
    assert result["matmul_peak_gflops"] > 0 and result["seconds"] > 0, result
    return result


@pytest.mark.slow
def test_rollout_small_prints_json_last(capsys):
    """rollout.py --small --compare (update.py --small is checked with --run-peer in test_benchmark_update_peer)."""
    result = _run("rollout.py", "--compare", "--segments", "2", capsys=capsys)
    assert result["config"] == "tiny"
    shape = result["shape"]
    assert result["generated_tokens"] == shape["prompts"] * shape["samples"] * shape["new_tokens"]
    # --compare: the per-row cache timed in the same rounds; the ratio is per round, then median.
    assert len(result["row_cache_times"]) == len(result["times"]) and result["speedup_vs_row_cache"] > 0
    assert result["decode_segments"] == 2


@pytest.mark.slow
def test_scaling_small_prints_ratios_against_one_device(capsys):
    """scaling.py --small on 1 and 2 fake devices (each its own child), data preset, one microbatch."""
    result = run_benchmark_here("scaling.py", "--small", "--presets", "data", "--microbatches", "1", capsys=capsys)
    assert result["config"] == "tiny" and result["devices"] == [1, 2]
    cases = {c["program"]: c for c in result["cases"]}
    assert sorted(cases) == ["engine_chunk", "rollout", "update"] and all(c["devices"] == 2 for c in cases.values())
    for c in cases.values():  # the ratio is the 2-device figure x 2 over the one-device figure
        one = [r for r in result["one_device"] if r["program"] == c["program"]][0]
        assert c["flops_ratio"] == round(c["flops_per_device"] * 2 / one["flops"], 3)
    assert result["dp_flops_ratio_max"] == max(c["flops_ratio"] for c in cases.values())
    assert result["dp_temp_ratio_max"] == max(c["temp_ratio"] for c in cases.values())
    assert cases["update"]["collectives"].get("all-reduce", 0) > 0  # the gradients are summed over the devices


def test_model_flops_per_token_matches_hand_count():
    cfg = ModelConfig(
        vocab_size=10, d_model=4, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=3, mlp_dim=5, tie_embeddings=False
    )
    # Per layer: q 4*2*3=24, k 4*1*3=12, v 12, o 2*3*4=24, gate/up/down 3*4*5=60 -> 132 params in
    # matmuls; 2 layers = 264, plus the LM head 4*10=40 -> 304. Forward: 2 FLOPs per matmul param.
    assert common.matmul_params(cfg) == 304
    # Attention at context 7: scores + values = 4 * L * context * H * Hd = 4*2*7*2*3 = 336.
    assert common.model_flops_per_token(cfg, 7) == 2 * 304 + 336
    assert common.model_flops_per_token(cfg, 0) == 608
    # Causal sequence: tokens at slots 2, 3, 4 attend 3 + 4 + 5 = 12 keys.
    assert common.attention_flops(cfg, 2, 3) == 4 * 2 * 2 * 3 * 12
    assert common.sequence_flops(cfg, 2, 3) == 3 * 608 + 4 * 2 * 2 * 3 * 12
    # Embedding (unless tied) and norm scales count as parameters but not as matmul FLOPs.
    assert common.total_params(cfg) == 304 + 40 + 2 * 2 * 4 + 4
    tied = ModelConfig(**{**cfg.__dict__, "tie_embeddings": True})
    assert common.total_params(tied) == 304 + 2 * 2 * 4 + 4


def test_update_flops_with_and_without_shared_prompts_by_hand():
    from benchmarks.update import update_flops

    cfg = ModelConfig(
        vocab_size=10, d_model=4, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=3, mlp_dim=5, tie_embeddings=False
    )
    # 608 FLOPs per token with the head (2 x 304 matmul params), the head alone 2*4*10 = 80; attention
    # 4*L*H*Hd = 48 per key. Batch 4, prompt 2, completion 3.
    # One pass: 5 tokens attending 1+2+3+4+5 = 15 keys, head on 3 of them:
    #   5*608 + 48*15 - 2*80 = 3600 per row -> 3 x 4 x 3600.
    assert update_flops(cfg, 4, 2, 3) == 3 * 4 * 3600
    # Groups of 2 -> 2 prompts once: 2 tokens, keys 1+2 = 3, head on the last only: 2*608 + 144 - 80 = 1280;
    # each of the 4 rows: completion tokens 0..1 at slots 2, 3 (keys 3+4 = 7): 2*608 + 48*7 = 1552.
    assert update_flops(cfg, 4, 2, 3, shared_group=2) == 3 * (2 * 1280 + 4 * 1552)


def test_bench_small_shape():
    cfg = common.bench_small()
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim, cfg.vocab_size) == (
        512,
        8,
        8,
        2,
        64,
        1408,
        8192,
    )
    assert cfg.dtype == "float32" and not cfg.tie_embeddings
    cfg.validate()


# The model, data and warm start of checkpoint.py --small's default run: the variants run's child
# generates the data set and trains the warm start once, into the session's caches (in_process_cache),
# and the checkpoint benchmark's run reads both.
TINY_RUN = [
    "model.d_model=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.head_dim=16",
    "model.mlp_dim=64",
    "data.num_train=200",
    "data.num_test=20",
    "rollout.prompts_per_step=4",
    "warmstart.steps=2",
    "warmstart.batch_size=8",
]


def test_variants_summary_by_hand():
    from benchmarks import variants

    rows = [
        {"step": 0, "eval/accuracy": 0.4},
        {"step": 1, "reward/mean": 0.5, "response_len/mean": 3.0},
        {"step": 2, "reward/mean": 1.0, "response_len/mean": 5.0, "clip_frac": 0.2, "eval/accuracy": 0.72},
        {"step": 4, "eval/accuracy": 0.69},
        {"step": 6, "eval/accuracy": 0.8},
    ]
    s = variants.summarise_run(rows, target=0.7)
    assert s["final_accuracy"] == 0.8 and s["base_accuracy"] == 0.4
    assert s["steps_to_target"] == 2  # the first evaluated step at or above 0.7, even if it dips after
    assert s["response_len"] == 4.0 and s["final_reward"] == 0.75 and s["clip_frac"] == 0.1
    assert variants.summarise_run(rows, target=0.9)["steps_to_target"] is None
    assert variants.finished(rows, 6) and not variants.finished(rows, 5)


def test_variants_tables_and_mc_grpo_gap_from_synthetic_runs(tmp_path):
    import argparse

    from benchmarks import variants

    arms = [variants.Arm("grpo", "grpo"), variants.Arm("mc_grpo", "mc_grpo"), *variants.MC_STUDY]
    final = {"grpo": [0.8, 0.9], "mc_grpo": [0.7, 0.7], "grpo G=2": [0.5, 0.6], "mc_grpo G=2 (draws 3)": [0.7, 0.8]}
    runs = [
        {
            "label": label,
            "preset": label.split()[0],
            "seed": seed,
            "final_accuracy": acc,
            "base_accuracy": 0.4,
            "curve": [(0, 0.4), (5, acc)],
            "steps_to_target": 5 if acc >= 0.7 else None,
            "response_len": 3.0,
            "final_reward": acc,
            "clip_frac": 0.0,
        }
        for label, accs in final.items()
        for seed, acc in enumerate(accs)
    ]
    runs.append({"label": "grpo", "preset": "grpo", "seed": 2, "error": "boom"})
    budget = variants.Budget(steps=5, eval_every=5, eval_prompts=10, target=0.7)
    out = tmp_path / "variants"
    summary = variants.write_outputs(arms, runs, budget, argparse.Namespace(seeds=2), out, 1.0, partial=False)
    # grpo G=2 -> G=8: 55% -> 85%; MC-GRPO at G=2: 75%: (75 - 55) / (85 - 55) = 2/3 of the gap.
    assert abs(summary["gap_closed_mc_grpo_g2"] - 2 / 3) < 1e-9 and summary["failed"] == 1
    table = out.with_suffix(".md").read_text()
    assert "| grpo | 85.0 ± 7.1 | +45.0 | 5 (2/2) |" in table  # std of [80, 90] with ddof 1 = 7.07
    assert "| mc_grpo G=2 (draws 3) | 75.0 ± 7.1 | +35.0 | 5 (2/2) |" in table
    assert "| grpo G=2 | 55.0 ± 7.1 | +15.0 | never (0/2) |" in table
    assert "| grpo G=8 | 85.0" in table and "= 0.67" in table
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.slow
def test_variants_script_tiny_then_reuses_finished_runs(tmp_path, in_process_cache, monkeypatch, capsys):
    """variants.py's main here (its training run is still its own `jaxrl train` child), twice."""
    from benchmarks import variants

    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
        monkeypatch.setenv(name, in_process_cache[name])  # the training child shares this worker's cache
    # and compiles as every test child does (harness.child_env): the tests' XLA flags, none forced
    if "XLA_FLAGS" in in_process_cache:
        monkeypatch.setenv("XLA_FLAGS", in_process_cache["XLA_FLAGS"])
    else:
        monkeypatch.delenv("XLA_FLAGS", raising=False)
    args = [
        "--presets",
        "grpo",
        "--seeds",
        "1",
        "--no-mc-study",
        "--steps",
        "2",
        "--eval-every",
        "1",
        "--eval-prompts",
        "8",
        "--root",
        str(tmp_path / "runs"),
        "--out",
        str(tmp_path / "out" / "variants"),
    ]
    for s in TINY_RUN:
        args += ["--set", s]
    capsys.readouterr()
    variants.main(args)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["runs"] == 1 and summary["failed"] == 0 and 0.0 <= summary["accuracy_mean"]["grpo"] <= 1.0
    table = (tmp_path / "out" / "variants.md").read_text()
    assert "| grpo |" in table and "PARTIAL" not in table and "MC-GRPO" not in table
    runs = json.loads((tmp_path / "out" / "variants.json").read_text())["runs"]
    assert len(runs) == 1 and runs[0]["seed"] == 0 and len(runs[0]["curve"]) == 3  # steps 0, 1, 2
    variants.main(args)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["failed"] == 0
    runs = json.loads((tmp_path / "out" / "variants.json").read_text())["runs"]
    assert runs[0]["reused"]  # a finished run is read back, not retrained


@pytest.mark.slow
def test_checkpoint_benchmark_small_reports_block_fractions(in_process_cache, capsys):
    result = run_benchmark_here("checkpoint.py", "--small", capsys=capsys)
    run, state = result["default_run"], result["bench_small"]
    assert run["saves"] == run["steps"] == 3, run  # a save after every step of the real loop
    assert result["block_fraction_default"] == pytest.approx(run["save_block_s"] / run["step_s"])
    assert 0 < state["save_block_s"] <= state["save_finish_s"], state  # returns before the write is done
    assert result["block_fraction_bench_small"] == pytest.approx(state["save_block_s"] / state["step_s"])


@pytest.mark.slow
def test_lora_benchmark_small_counts_state_bytes_by_hand(capsys):
    """benchmarks/lora.py --small: the state sizes are exact (hand count below), both updates ran."""
    result = run_benchmark_here("lora.py", "--small", capsys=capsys)
    params = result["params"]  # tiny: d_model 64, 2 layers, q 4x16, k/v 2x16, mlp 128, vocab 256 untied
    # full fine-tuning: float32 params + AdamW's mu and nu + a reference copy = 16 bytes per parameter,
    # plus the step, the RNG key and Adam's count (a few scalars)
    assert 16 * params <= result["state_bytes_full"] <= 16 * params + 64
    parts = result["lora_state_parts"]
    assert parts["base_bytes"] == 2 * params  # bfloat16 base
    # rank 8 per layer: q 64*8+8*64, k and v 64*8+8*32, o 64*8+8*64, gate/up 64*8+8*128, down 128*8+8*64
    per_layer = 1024 + 768 + 768 + 1024 + 1536 + 1536 + 1536
    assert parts["adapter_bytes"] == 4 * 2 * per_layer
    assert 2 * parts["adapter_bytes"] <= parts["optimizer_bytes"] <= 2 * parts["adapter_bytes"] + 64
    assert result["state_bytes_ratio"] == pytest.approx(parts["state_bytes"] / result["state_bytes_full"])
    ratios = result["state_bytes_ratio_by_base_dtype"]
    assert ratios["int8"] < ratios["bfloat16"] < ratios["float32"] < 1
    assert result["update_tokens_per_s_full"] > 0 and result["update_speed_ratio"] > 0


def test_device_check_datasheet_peaks_by_device_kind():
    from benchmarks.device_check import datasheet_peaks

    assert datasheet_peaks("NVIDIA H200") == (989e12, 4.8e12)
    assert datasheet_peaks("NVIDIA H100 80GB HBM3") == (989e12, 3.35e12)
    assert datasheet_peaks("NVIDIA H100 PCIe") == (756e12, 2.0e12)  # before the plain H100 row
    assert datasheet_peaks("NVIDIA A100-SXM4-80GB") == (312e12, 2.0e12)
    assert datasheet_peaks("TPU v5 lite") == (197e12, 0.82e12)
    assert datasheet_peaks("TPU v6 lite") == (918e12, 1.64e12)
    assert datasheet_peaks("cpu") == (None, None)


def test_device_check_summary_judges_the_targets_and_pytest_counts():
    from benchmarks.device_check import pytest_counts, summary

    records = [
        {"stage": "env", "ok": True},
        {"stage": "update", "ok": True, "mfu": 0.41, "tokens_per_s": 5e4},
        {"stage": "rollout", "ok": True, "bfloat16_weights": {"decode_hbm_fraction": 0.55, "tokens_per_s": 900.0}},
        {"stage": "train", "ok": True, "completed": True, "peak_memory_bytes": 116 * 2**20},
        {"stage": "plan", "ok": True, "update_predicted_mib": 100.0},
        {"stage": "pytest", "ok": False, "error": "timed out after 9 s"},
    ]
    s = summary(records, 12.0)
    assert s["targets"] == {
        "update_mfu_ge_0.40": True,
        "decode_hbm_fraction_ge_0.60": False,
        "train_peak_within_plan_15pct": False,  # 116 MiB against 100 predicted: 16% over
    }
    assert not s["ok"] and s["failed"] == ["pytest"] and s["pytest"] == {"passed": None, "failed": None, "errors": None}
    records[3]["peak_memory_bytes"] = 114 * 2**20
    records[1]["mfu"] = None  # no datasheet peak for this device kind: not judged
    assert summary(records, 1.0)["targets"]["train_peak_within_plan_15pct"] is True
    assert summary(records, 1.0)["targets"]["update_mfu_ge_0.40"] is None
    out = "..F.\nFAILED tests/test_sharding.py::test_x - boom\n1 failed, 40 passed, 2 skipped, 1 error in 9.10s"
    counts = pytest_counts(out)
    assert (counts["passed"], counts["failed"], counts["skipped"], counts["errors"]) == (40, 1, 2, 1)
    assert counts["failures"] == ["FAILED tests/test_sharding.py::test_x - boom"]


@pytest.mark.slow
def test_device_check_cpu_smoke_every_stage(tmp_path):
    """device_check.py --cpu-smoke: each stage in its own child, one JSON line each, the summary last;
    every figure finite, the 1-step `jaxrl train` of the GSM8K recipe completed."""
    import math

    from harness import child_env, run_python

    out = tmp_path / "device.json"
    proc = run_python(
        ["benchmarks/device_check.py", "--cpu-smoke", "--scratch", str(tmp_path / "s"), "--out", str(out)],
        child_env(),
        timeout=600,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert [json.loads(line) for line in out.read_text().splitlines()] == lines
    *stages, last = lines
    by = {r["stage"]: r for r in stages}
    assert list(by) == ["env", "update", "rollout", "decode", "train", "plan"], [r.get("error") for r in stages]
    assert all(r["ok"] for r in stages), {r["stage"]: r.get("error") for r in stages}

    def finite(x):
        return isinstance(x, (int, float)) and math.isfinite(x)

    env = by["env"]
    assert env["backend"] == "cpu" and env["jax"] and env["jaxlib"] and env["device_count"] >= 1
    assert env["peak_bf16_flops"] is None  # no datasheet peak for a CPU: MFU and bandwidth fractions null
    up = by["update"]
    assert up["dtype"] == "bfloat16" and up["mfu"] is None and up["attention"] == by["rollout"]["attention"] == "auto"
    assert all(finite(up[k]) and up[k] > 0 for k in ("tokens_per_s", "seconds", "update_tflop", "params"))
    assert up["tokens_per_s"] == pytest.approx(4 * 16 / up["seconds"])
    ro = by["rollout"]
    f32, bf16 = ro["float32_weights"], ro["bfloat16_weights"]
    for v in (f32, bf16):
        assert all(finite(v[k]) and v[k] > 0 for k in ("tokens_per_s", "decode_step_s", "decode_weight_bytes_per_s"))
        assert v["decode_hbm_fraction"] is None and v["mfu"] is None
    assert (f32["weight_dtype"], bf16["weight_dtype"]) == ("float32", "bfloat16")
    assert f32["weight_bytes"] == 2 * bf16["weight_bytes"]  # every weight cast once to 2 bytes
    dec = by["decode"]  # the CPU has no Pallas compiler: dense and blocked only, both fills timed
    assert set(dec["ms"]["step"]) == {"dense", "blocked"} and dec["ms"]["step"]["dense"]["full"] > 0
    assert last["decode_step_ratios"] == dec["ratios"]["step"]
    tr = by["train"]
    assert tr["completed"] and tr["steps_logged"] == 1 and tr["last_step"]["step"] == 1
    assert "configs/qwen2.5_0.5b_gsm8k_grpo.py" in tr["command"] and finite(tr["last_step"]["loss"])
    assert by["plan"]["update_predicted_mib"] > 0 and by["plan"]["devices"] == 1
    assert all(finite(r["stage_seconds"]) for r in stages)
    assert last["summary"] and last["ok"] and last["failed"] == [] and last["train_completed"] is True
    assert last["stages"] == dict.fromkeys(by, True) and last["pytest"] is None
    assert last["update_tokens_per_s"] == up["tokens_per_s"] and finite(last["seconds"])


def test_device_check_fences_a_failing_stage(tmp_path, capsys):
    """A stage that raises gives an error record (what went wrong, named), not an exception: the plan stage
    without the train stage's overrides."""
    from benchmarks import device_check

    [record] = device_check.main(["--stage", "plan", "--scratch", str(tmp_path)])
    assert not record["ok"] and "train_sets.json is missing" in record["error"], record
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == record
