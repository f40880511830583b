"""VIGOR's allocation rule (jaxrl.sources.allocation), pure host functions, against hand-worked
allocations; the engine side is tests/test_engine_sample.py and tests/test_engine_vigor.py."""

import itertools

import pytest

from jaxrl.sources.allocation import allocate, allocation_metrics, plan_round, prior_variance, variance_score


def test_one_round_goes_to_the_high_variance_prompts():
    # Budget 12 (4 prompts x G=3), n0 = 2: 4 extra samples. v0 = (1-0)^2/4 = 0.25;
    # score = (sum sq dev + 0.25) / (2 + 1): [1,1] -> 0.083, [0,1] -> (0.5 + 0.25)/3 = 0.25.
    # Prompt 1 (tie with 3 at 2 samples: earlier index), prompt 3 (0.25 > 1's 0.25/2), then both
    # at 0.125 > 0.083: prompt 1, prompt 3.
    rewards = [[1, 1], [0, 1], [0, 0], [1, 0]]
    assert plan_round(rewards, budget_left=4, rounds_left=1, cap=6) == [0, 2, 0, 2]
    # Over two rounds the first spends ceil(4/2) = 2: one each to prompts 1 and 3.
    assert plan_round(rewards, budget_left=4, rounds_left=2, cap=6) == [0, 1, 0, 1]


def test_variance_score_and_prior_by_hand():
    # prior_weight 0: the population variance, p(1-p) for 0/1 rewards: p = 3/4 -> 3/16.
    assert variance_score([0, 1, 1, 1], v0=0.25, prior_weight=0.0) == pytest.approx(3 / 16)
    # sum sq dev of [0,1,1,1] = 3 * 1/16 + 9/16 = 0.75; (0.75 + 0.25) / (4 + 1) = 0.2
    assert variance_score([0, 1, 1, 1], v0=0.25) == pytest.approx(0.2)
    # All-equal groups score a * v0 / (n + a): fewer agreeing samples -> more room for doubt.
    assert variance_score([0, 0], v0=0.25) == pytest.approx(0.25 / 3)
    assert variance_score([1, 1, 1, 1], v0=0.25) == pytest.approx(0.25 / 5)
    assert prior_variance([[0.5, 1.5], [1.0]]) == pytest.approx(0.25)  # range 1 -> (1/2)^2
    assert prior_variance([[2.0, 2.0], [2.0]]) == 0.0


def test_all_equal_prompts_can_still_get_samples():
    # [1,1,1,1] (0.25/5 = 0.05) < [0,0] (0.25/3 = 0.083) < [0,1] (0.25): the all-0 pair gets one
    # after [0,1] has had two (0.25/3 = 0.083 ties [0,0]; fewer samples so far wins: [0,0] at 2
    # vs [0,1] at 4).
    assert plan_round([[1, 1, 1, 1], [0, 0], [0, 1]], budget_left=3, rounds_left=1, cap=8) == [0, 1, 2]


def test_no_signal_anywhere_spreads_evenly():
    # Every reward equal: v0 = 0, every score 0; ties go to fewer samples, then the earlier prompt.
    assert plan_round([[1, 1], [1, 1], [1, 1]], budget_left=4, rounds_left=1, cap=4) == [2, 1, 1]


def _fake_draw(sequences):
    """draw(counts) taking the next counts[i] rewards of prompt i's fixed sequence."""
    its = [iter(s) for s in sequences]
    return lambda counts: [list(itertools.islice(it, k)) for it, k in zip(its, counts)]


def test_rounds_rescore_and_the_cap_binds():
    # 2 prompts, G=4 -> budget 8, n0 = 2, 3 rounds. Prompt 0 always 1; prompt 1 alternates 0,1.
    # Phase 1: [1,1], [0,1]; 4 left. Round 1 spends ceil(4/3) = 2: prompt 1 (0.25), prompt 1 again
    # (0.25/2 > 0.083) -> [0,1,0,1]. Round 2 spends 1: prompt 1 ((1 + 0.25)/5 = 0.25) -> [0,1,0,1,0].
    # Round 3 spends 1: prompt 1 ((1.2 + 0.25)/6 = 0.24 > 0.083) -> 6 samples.
    seqs = [[1] * 8, [0, 1] * 4]
    rewards = allocate(_fake_draw(seqs), 2, initial=2, budget=8, rounds=3, cap=6)
    assert rewards == [[1, 1], [0, 1, 0, 1, 0, 1]]
    # cap 5: round 3 finds prompt 1 full and gives prompt 0 the last sample.
    rewards = allocate(_fake_draw(seqs), 2, initial=2, budget=8, rounds=3, cap=5)
    assert rewards == [[1, 1, 1], [0, 1, 0, 1, 0]]


def test_allocate_rejects_budgets_that_cannot_be_met():
    with pytest.raises(ValueError, match="budget=8"):
        allocate(_fake_draw([[1] * 9] * 2), 2, initial=5, budget=8, rounds=1, cap=6)  # 2 x 5 > 8
    with pytest.raises(ValueError, match="cap=3"):
        allocate(_fake_draw([[1] * 9] * 2), 2, initial=2, budget=8, rounds=1, cap=3)  # 2 x 3 < 8


def test_allocation_metrics_by_hand():
    m = allocation_metrics([[1, 1], [0, 1, 0, 1, 0, 1]])
    assert (m["engine/vigor_min_group"], m["engine/vigor_max_group"], m["engine/vigor_mean_group"]) == (2, 6, 4.0)
    assert m["engine/vigor_informative_frac"] == 0.5
    assert m["engine/vigor_mean_variance"] == pytest.approx((0 + 0.25) / 2)  # p(1-p) = 1/4 for 0,1,0,1,0,1
