"""`jaxrl eval`'s numbers: the unbiased pass@k estimator, maj@k's vote and tie rule, the final answers."""

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from jaxrl.data.math_jsonl import verify_math_answer
from jaxrl.data.registry import get_task
from jaxrl.data.rewards import verify_arithmetic, verify_countdown, verify_long_addition
from jaxrl.eval.metrics import ks_up_to, majority_index, pass_at_k, sample_metrics


@pytest.mark.parametrize(
    "n, c, k, want",
    [
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (8, 1, 1, 0.125),  # pass@1 = c/n
        (4, 3, 2, 1.0),  # n - c < k: every pair holds a correct sample
        (4, 0, 4, 0.0),
        (4, 4, 1, 1.0),
    ],
)
def test_pass_at_k_hand_worked(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)


def test_pass_at_k_equals_brute_force_over_subsets():
    """The fraction of the C(n, k) k-subsets of the n samples that hold a correct one."""
    for n in range(1, 7):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                hit = sum(any(samples[i] for i in s) for s in subsets)
                assert len(subsets) == math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(hit / len(subsets), abs=1e-12), (n, c, k)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError, match="n=2, c=3"):
        pass_at_k(2, 3, 1)
    with pytest.raises(ValueError, match="k=3"):
        pass_at_k(2, 1, 3)


def test_ks_are_powers_of_two_then_k():
    assert ks_up_to(1) == [1]
    assert ks_up_to(4) == [1, 2, 4]
    assert ks_up_to(6) == [1, 2, 4, 6]
    assert ks_up_to(9) == [1, 2, 4, 8, 9]


def test_majority_vote_and_its_tie_rule():
    assert majority_index(["3", "5", "3"]) == 0  # "3" twice
    assert majority_index(["5", "3", "3"]) == 1  # the first sample carrying the winner
    assert majority_index(["5", "3"]) == 0  # 1-1 tie: the answer seen first
    assert majority_index(["5", "3", "3", "5"]) == 0  # 2-2 tie: "5" was seen first
    assert majority_index(["3", "5", "5", "3"]) == 0
    assert majority_index([None, "7"]) == 1  # an unreadable answer casts no vote
    assert majority_index([None, None, None, "4", "6", "6"]) == 4  # None x3 does not outvote "6" x2
    assert majority_index([None, None]) is None
    assert majority_index([Fraction(72), Fraction(144, 2)]) == 0  # equal values vote together


def test_sample_metrics_on_hand_made_prompts():
    # prompt 0: "2" is right; votes 1,2,2,1 -> maj@1 "1", maj@2 tie -> "1", maj@4 tie 2-2 -> "1": all wrong
    # prompt 1: "9" is right; votes 9,9,-,8 -> "9" at every k
    # prompt 2: "2" is right; votes 1,2,2,2 -> maj@1 "1", maj@2 tie -> "1" (wrong), maj@4 "2" (right)
    answers = [["1", "2", "2", "1"], ["9", "9", None, "8"], ["1", "2", "2", "2"]]
    correct_BxK = np.array([[0, 1, 1, 0], [1, 1, 0, 0], [0, 1, 1, 1]], bool)
    got = sample_metrics(correct_BxK, answers, [1, 2, 4])
    assert got["maj@k"] == pytest.approx({1: 1 / 3, 2: 1 / 3, 4: 2 / 3})
    # pass@1 = mean c/n = (2/4 + 2/4 + 3/4) / 3 = 7/12; pass@2 = (5/6 + 5/6 + 1) / 3 = 8/9
    # (prompt 2: n - c = 1 < 2); pass@4 = 1 (each prompt has a correct sample)
    assert got["pass@k"] == pytest.approx({1: 7 / 12, 2: 8 / 9, 4: 1.0})


@pytest.mark.parametrize(
    "task, verifier, record, same_answer, other",
    [
        ("arithmetic", verify_arithmetic, {"answer": "12"}, ["12", " 12 "], "13"),
        ("long_addition", verify_long_addition, {"info": '{"answer": 12}'}, ["5+7+0=12:12", "junk:12"], "x:13"),
        ("countdown", verify_countdown, {"info": '{"numbers": [3, 4], "target": 12}'}, ["3*4", " 3 * 4"], "4*3"),
        ("math_jsonl", verify_math_answer, {"answer": "72"}, ["#### 72", "so the answer is 72.0"], "#### 27"),
    ],
)
def test_final_answers_group_completions_the_verifier_judges_alike(task, verifier, record, same_answer, other):
    """Completions with one final answer are equally correct, so the voted answer's correctness is the
    correctness of any sample that gave it."""
    answer = get_task(task).final_answer
    assert answer(same_answer[0]) is not None
    assert answer(same_answer[0]) == answer(same_answer[1]) != answer(other)
    assert verifier(same_answer[0], True, record)[0] == verifier(same_answer[1], True, record)[0] == 1.0


def test_unreadable_final_answers_cast_no_vote():
    assert get_task("arithmetic").final_answer("   ") is None
    assert get_task("long_addition").final_answer("no colon") is None
    assert get_task("countdown").final_answer("3 *") is None
    assert get_task("math_jsonl").final_answer("no number") is None
