"""benchmarks/speculative.py runs end to end on random tiny weights and prints its JSON line last."""

import pytest
from harness import run_benchmark_here


@pytest.mark.slow
def test_small_run_prints_speedups_json_last(tmp_path, capsys):
    result = run_benchmark_here("speculative.py", "--small", "--skip-tail", "--root", str(tmp_path), capsys=capsys)
    assert result["benchmark"] == "speculative" and result["config"] == "tiny"
    assert "tail" not in result  # part 5 has its own smoke test below
    emb = result["embedded"]
    assert set(emb) == {"plain", "early_exit_k4", "reuse", "reuse_forced"}
    assert emb["plain"]["speedup"] == 1.0 and result["speedup_best_self_draft"] == emb["early_exit_k4"]["speedup"] > 0
    assert result["speedup_trajectory_reuse"] == emb["reuse"]["speedup"] > 0
    assert 0 < result["acceptance_rate"] <= 1 and emb["early_exit_k4"]["speculated_frac"] == 1.0
    # Same prompts, same number of rows: the generated token counts are real, positive numbers.
    assert all(r["tokens"] > 0 and r["tokens_per_s"] > 0 for r in emb.values())


@pytest.mark.slow
def test_small_tail_part_prints_its_json_last(tmp_path, capsys):
    """--only-tail --small: part 5 on random tiny weights (plain vs speculative engine at 1 and 2
    rows, the costs and threshold, a whole rollout with the toggle forced to 2 rows) in seconds."""
    result = run_benchmark_here("speculative.py", "--small", "--only-tail", "--root", str(tmp_path), capsys=capsys)
    tail = result["tail"]
    assert result["part"] == "tail" and result["speedup_tail_self_draft"] == tail["speedup_tail_self_draft"] > 0
    by_rows, reduced_by_rows = tail["speedup_tail_by_rows"], tail["speedup_tail_reduced_head_by_rows"]
    # Each head's figure is the geometric mean of its per-row speedups: sqrt(s1 * s2) for rows (1, 2);
    # the headline is the better of the two, both kept.
    assert set(by_rows) == set(reduced_by_rows) == {"1", "2"}
    assert abs(tail["speedup_tail_full_head"] - (by_rows["1"] * by_rows["2"]) ** 0.5) < 1e-9
    assert abs(tail["speedup_tail_reduced_head"] - (reduced_by_rows["1"] * reduced_by_rows["2"]) ** 0.5) < 1e-9
    assert tail["speedup_tail_self_draft"] == max(tail["speedup_tail_full_head"], tail["speedup_tail_reduced_head"])
    # The long-addition token set: EOS, digits 0-9, '+', '=', ',', ':'.
    assert len(tail["draft_ids"]) == 15 and len(set(tail["draft_ids"])) == 15
    for r in ("1", "2"):
        for head in ("speculative", "reduced_head"):
            spec = tail["few_rows"][r][head]
            assert spec["speculative_chunks"] == spec["chunks"] > 0 and 0 <= spec["acceptance"] <= 1
            assert spec["tokens"] == tail["few_rows"][r]["plain"]["tokens"] == int(r) * tail["new_tokens"]  # no EOS
        # --small: every part in the same 4-slot engines, speculating at 2 or fewer decoding slots
        assert tail["few_rows"][r]["slots"] == 4 and tail["few_rows"][r]["max_active_rows"] == 2
    assert set(tail["costs"]) == {"2"} and len(tail["costs"]["2"]["verify_K"]) == tail["max_draft"] == 2
    whole = tail["whole_rollout"]
    assert whole["threshold_rows"] == max(tail["threshold_rows"], 2) and whole["speculative"]["speculative_chunks"] > 0
    assert whole["speculative"]["chunks"] > whole["speculative"]["speculative_chunks"]  # plain while 4 slots decode
    assert whole["reduced_head"]["speculative_chunks"] > 0
    assert tail["int8_probe"]["float32_ms"] > 0 and tail["int8_probe"]["int8_ms"] > 0
