"""Shared by the sampler-distribution tests: a chi-square goodness-of-fit p-value of sampled
completions against an enumerated distribution {completion tuple: probability}."""

import jax
import numpy as np


def chi_square_pvalue(completions, dist):
    """-> (p-value, degrees of freedom). Completions rarer than 5 expected draws are pooled into one
    cell; a sampled completion the target gives no mass fails at once."""
    counts = {}
    for key in completions:
        assert key in dist, f"sampled {key}, impossible under the target"
        counts[key] = counts.get(key, 0) + 1
    n = len(completions)
    big = [k for k, p in dist.items() if p * n >= 5]
    obs = np.array([counts.get(k, 0) for k in big] + [n - sum(counts.get(k, 0) for k in big)], np.float64)
    exp = np.array([dist[k] * n for k in big] + [n - sum(dist[k] * n for k in big)], np.float64)
    keep = exp > 0
    chi2 = float(np.sum((obs[keep] - exp[keep]) ** 2 / exp[keep]))
    df = int(keep.sum()) - 1
    return float(jax.scipy.special.gammaincc(df / 2.0, chi2 / 2.0)), df
