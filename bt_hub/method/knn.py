"""The weighted kNN vote (DINO's eval_knn.py) shared by ``bt-hub eval knn`` and the pretraining monitor.

Held to DINO's ``knn_classifier`` (top-1, top-5 and every prediction) in tests/test_against_reference.py.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def nearest_neighbours(bank: torch.Tensor, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine similarities and indices of each query's ``k`` most similar bank rows, most similar first."""
    if not 0 < k <= len(bank):
        raise ValueError(f"k must be in [1, {len(bank)}] (the bank size), got {k}")
    sims = F.normalize(queries.float(), dim=1) @ F.normalize(bank.float(), dim=1).T
    return sims.topk(k, dim=1)


def knn_hits(
    similarities: torch.Tensor,
    indices: torch.Tensor,
    train_labels: torch.Tensor,
    test_labels: torch.Tensor,
    k: int,
    temperature: float,
    num_classes: int,
) -> torch.Tensor:
    """Per test image, whether its label is the first, second, ... choice of the exp(sim / T)-weighted vote of its
    first ``k`` neighbours, in float64 (DINO): N x min(5, k, C) booleans, at most one True a row
    (:func:`hit_rates` sums them into top-1 / top-5)."""
    if k > similarities.shape[1]:
        raise ValueError(f"k={k} exceeds the {similarities.shape[1]} neighbours searched")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")
    train_labels = torch.as_tensor(train_labels).long()
    test_labels = torch.as_tensor(test_labels).long()
    neighbours = train_labels[indices[:, :k]]
    sims = similarities[:, :k].double()
    weights = ((sims - sims.max(dim=1, keepdim=True).values) / temperature).exp()
    votes = torch.zeros(len(neighbours), num_classes, dtype=torch.float64).scatter_add_(1, neighbours, weights)
    predictions = votes.argsort(dim=1, descending=True, stable=True)
    return predictions[:, : min(5, k, num_classes)].eq(test_labels.view(-1, 1))


def hit_rates(hits: torch.Tensor) -> dict[str, float]:
    """Top-1 / top-5 (percent) of :func:`knn_hits`' per-image choices."""
    return {"top1": 100.0 * hits[:, :1].sum().item() / len(hits), "top5": 100.0 * hits.sum().item() / len(hits)}
