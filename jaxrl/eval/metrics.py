"""pass@k and maj@k from K scored samples per prompt (the final answers they vote with are the task's:
`jaxrl.data.registry.Task.final_answer`).

pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
Code", arXiv:2107.03374): with n samples of which c are correct, the chance that k of them drawn
without replacement hold at least one correct one, 1 - C(n-c, k) / C(n, k), averaged over prompts.

maj@k votes over the final answers of the first k samples (a sample whose answer cannot be read casts
no vote); a tie goes to the answer that appeared first among those k. The prompt counts as solved when
the voted answer is correct: the correctness of the first sample that gave it (samples with the same
final answer are equally correct under every task's verifier, since each verifier judges that answer).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k): the chance that k of the n samples (c correct), drawn without
    replacement, include a correct one. Exact integer binomials (Python ints divide correctly rounded)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_up_to(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks = [2**i for i in range(n.bit_length()) if 2**i <= n]
    return ks if ks[-1] == n else [*ks, n]


def majority_index(answers: Sequence[Hashable | None]) -> int | None:
    """The index of the first sample carrying the most frequent non-None answer (ties: the answer seen
    first); None when no sample has an answer."""
    counts: dict[Hashable, int] = {}
    first: dict[Hashable, int] = {}
    for i, a in enumerate(answers):
        if a is not None:
            counts[a] = counts.get(a, 0) + 1
            first.setdefault(a, i)
    if not counts:
        return None
    best = max(counts, key=lambda a: (counts[a], -first[a]))
    return first[best]


def sample_metrics(correct_BxK: np.ndarray, answers_BxK: Sequence[Sequence[Hashable | None]], ks: list[int]) -> dict:
    """{'pass@k': {k: value}, 'maj@k': {k: value}} averaged over the B prompts, from each prompt's K
    samples (correct_BxK: bool) and their final answers."""
    B, K = correct_BxK.shape
    c_B = correct_BxK.sum(axis=1)
    passes = {k: float(np.mean([pass_at_k(K, int(c), k) for c in c_B])) for k in ks}
    majority = {}
    for k in ks:
        voted = [majority_index(answers_BxK[b][:k]) for b in range(B)]
        majority[k] = float(np.mean([i is not None and bool(correct_BxK[b, i]) for b, i in enumerate(voted)]))
    return {"pass@k": passes, "maj@k": majority}
