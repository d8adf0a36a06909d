"""95% intervals for the rates the evaluation prints, over documents (pure functions).

- `wilson`: the Wilson score interval of a proportion, for accuracies. A task score in [0, 1] per document is
  counted as that many successes out of one (exact for 0/1 scores; for partial-credit scores, e.g. MRCR's
  similarity ratio, it treats the summed credit as the success count).
- `bootstrap_mean`: the percentile bootstrap of a mean over documents, for per-document rates that are not
  Bernoulli (native top-k mass covered, golden recall, agreement, resident fraction, miss mass). Resampling is
  over documents, the unit that varies (steps within a document are not independent). Seeded: the same values
  give the same interval.
- `bootstrap_pooled`: the same over documents for a mean pooled over their cycles (`eval.evaluate`).
- `interval`: either one as a JSON-ready cell {"n", "lo", "hi", "method"}; NaN values (a document without golden
  labels has no recall) are left out of n; an infinite value is refused where it enters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile
N_BOOT = 2000  # bootstrap resamples
METHODS = ("wilson", "bootstrap")


def wilson(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval (lo, hi) of `successes` out of `n` trials; (nan, nan) when n == 0.

    lo/hi = (p + z^2 / 2n -/+ z sqrt(p (1 - p) / n + z^2 / 4n^2)) / (1 + z^2 / n), p = successes / n,
    clamped to [0, 1]. Needs 0 <= successes <= n."""
    if n < 0 or not 0.0 <= successes <= n:
        raise ValueError(f"wilson: need 0 <= successes <= n, got {successes} of {n}")
    if n == 0:
        return math.nan, math.nan
    p = successes / n
    z2 = z * z
    den = 1.0 + z2 / n
    mid = (p + z2 / (2 * n)) / den
    half = z * math.sqrt(max(p * (1.0 - p) / n + z2 / (4 * n * n), 0.0)) / den
    lo = 0.0 if successes == 0 else max(0.0, mid - half)
    hi = 1.0 if successes == n else min(1.0, mid + half)
    return lo, hi


def bootstrap_mean(
    values: Sequence[float], level: float = 0.95, n_boot: int = N_BOOT, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval (lo, hi) of the mean of `values` (finite floats); (nan, nan) when empty.

    Draws `n_boot` resamples of len(values) with replacement (torch generator seeded with `seed`), takes each
    resample's mean, sorts the means m[0..B-1] and returns the nearest-rank quantiles
    m[floor(a B)] and m[ceil((1 - a) B) - 1], a = (1 - level) / 2. One value, or equal values, give (v, v)."""
    return bootstrap_pooled(values, [1.0] * len(values), level, n_boot, seed)


def bootstrap_pooled(
    sums: Sequence[float], counts: Sequence[float], level: float = 0.95, n_boot: int = N_BOOT, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap over documents of a pooled mean sum(sums) / sum(counts) (document i contributes
    sums[i] over counts[i] > 0 items, e.g. cycles): documents are resampled whole, as in `bootstrap_mean`
    (which is this with every count 1). (nan, nan) without documents."""
    if not 0.0 < level < 1.0 or n_boot < 1:
        raise ValueError(f"bootstrap: need 0 < level < 1 and n_boot >= 1, got {level}, {n_boot}")
    if len(sums) != len(counts):
        raise ValueError(f"bootstrap: {len(sums)} sums against {len(counts)} counts")
    x = torch.tensor([float(v) for v in sums], dtype=torch.float64)
    c = torch.tensor([float(v) for v in counts], dtype=torch.float64)
    if x.numel() == 0:
        return math.nan, math.nan
    if not bool(torch.isfinite(x).all() and torch.isfinite(c).all()) or bool((c <= 0).any()):
        raise ValueError("bootstrap: values must be finite and counts > 0")
    ratio = x / c
    if bool((ratio == ratio[0]).all()):
        return float(ratio[0]), float(ratio[0])
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, x.numel(), (n_boot, x.numel()), generator=g)
    means = (x[idx].sum(1) / c[idx].sum(1)).sort().values
    a = (1.0 - level) / 2.0
    lo = means[min(n_boot - 1, math.floor(a * n_boot))]
    hi = means[max(0, math.ceil((1.0 - a) * n_boot) - 1)]
    return float(lo), float(hi)


def interval(values: Sequence[float], method: str) -> dict:
    """A 95% interval cell over per-document values: {"n": documents with a finite value, "lo", "hi", "method"}.

    method "wilson": values are per-document scores in [0, 1] (their sum is the success count);
    "bootstrap": `bootstrap_mean` of the values. NaN values are skipped; +-inf raises ValueError."""
    if method not in METHODS:
        raise ValueError(f"unknown interval method {method!r}; choose from {', '.join(METHODS)}")
    vals = [float(v) for v in values if not (isinstance(v, float) and math.isnan(v))]
    if any(math.isinf(v) for v in vals):
        raise ValueError(f"interval: infinite value among {vals}")
    if method == "wilson":
        if any(not 0.0 <= v <= 1.0 for v in vals):
            raise ValueError(f"interval: a Wilson interval needs scores in [0, 1], got {vals}")
        lo, hi = wilson(sum(vals), len(vals))
    else:
        lo, hi = bootstrap_mean(vals)
    return {"n": len(vals), "lo": lo, "hi": hi, "method": method}
