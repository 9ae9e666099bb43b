"""The paired test behind every verdict of ``eval compare``: two rows' per-image results on the same test images.

Where the paired results are the same at every seed (one seed, or two deterministic kNN votes), McNemar's exact test:
a two-sided binomial test, against one half, of the discordant images (right in one row and wrong in the other).
Where they vary by seed, a paired bootstrap: the test images and the seeds resampled with replacement, seeded, for the
distribution of the mean difference in top-1. The level and the rule: docs/evaluation.md ("The rule").
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

LEVEL = 0.05  # a verdict says yes or no where the test's two-sided p-value is below this
RESAMPLES = 10_000  # of the paired bootstrap
_CHUNK = 2**20  # bootstrap counts drawn at a time (resamples x kinds of image), to bound memory


def mcnemar_p(row_only: int, baseline_only: int) -> float:
    """McNemar's exact two-sided p-value of ``row_only`` images right in one row alone against ``baseline_only`` in
    the other: ``min(1, 2 P(X <= min(b, c)))`` for X ~ Binomial(b + c, 1/2), summed in log space (no overflow)."""
    n, m = row_only + baseline_only, min(row_only, baseline_only)
    i = np.arange(1, m + 1)
    log_pmf = np.concatenate([[0.0], np.cumsum(np.log(n - i + 1) - np.log(i))]) - n * math.log(2)
    return min(1.0, 2.0 * float(np.exp(np.logaddexp.reduce(log_pmf))))


def paired_bootstrap(differences: np.ndarray, seed: int, resamples: int = RESAMPLES) -> tuple[float, list[float]]:
    """The two-sided p-value that the mean difference is 0, and its ``1 - LEVEL`` percentile interval in points, from
    ``differences`` (seeds x test images of -1, 0, 1): each resample draws the test images with replacement (the same
    images for every seed) and then the seeds. Seeded by ``seed``; an image is drawn as its kind (its differences at
    every seed), so a resample costs the kinds, not the images."""
    seeds, images = differences.shape
    kinds, counts = np.unique(differences.T, axis=0, return_counts=True)  # kinds x seeds
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    step = max(1, _CHUNK // len(kinds))
    for start in range(0, resamples, step):
        n = min(step, resamples - start)
        per_seed = rng.multinomial(images, counts / images, size=n) @ kinds / images  # n x seeds
        picked = rng.integers(0, seeds, size=(n, seeds))
        means[start : start + n] = 100.0 * np.take_along_axis(per_seed, picked, 1).mean(1)
    tail = min(int((means <= 0).sum()), int((means >= 0).sum()))
    interval = np.quantile(means, [LEVEL / 2, 1 - LEVEL / 2])
    return min(1.0, 2.0 * (1 + tail) / (resamples + 1)), [float(v) for v in interval]


def paired_test(row: Any, baseline: Any, seed: int) -> dict[str, Any]:
    """The verdict of ``row`` against ``baseline`` (per seed, one boolean per test image: was its top-1 right):
    ``better`` True (yes), False (no: the baseline is better) or None (the test set cannot tell), with the test, its
    ``p_value``, ``test_images``, and the discordant images (McNemar) or the interval (bootstrap)."""
    differences = np.asarray(row, np.int8) - np.asarray(baseline, np.int8)
    found: dict[str, Any] = {"test_images": differences.shape[1], "level": LEVEL}
    if (differences == differences[0]).all():
        b, c = int((differences[0] > 0).sum()), int((differences[0] < 0).sum())
        found |= {"test": "McNemar", "discordant": [b, c], "p_value": mcnemar_p(b, c)}
    else:
        p, interval = paired_bootstrap(differences, seed)
        found |= {"test": "bootstrap", "resamples": RESAMPLES, "interval": interval, "p_value": p}
    ahead = float(differences.mean())
    return found | {"better": None if found["p_value"] >= LEVEL or ahead == 0 else ahead > 0}
