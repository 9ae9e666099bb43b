"""Weighted kNN on frozen features (``bt-hub eval knn``; DINO's protocol, docs/protocols.md §2)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F

from bt_hub.common.config import option
from bt_hub.common.distributed import is_main_process
from bt_hub.common.optional import require
from bt_hub.common.presets import shown
from bt_hub.eval.config import EvalConfig, EvalWarning
from bt_hub.eval.features import as_float32
from bt_hub.eval.report import Table
from bt_hub.eval.runner import Cell, EvalRun, Scored
from bt_hub.method.knn import hit_rates, knn_hits

# ----------------------------------------------------------------------------- search and vote


# top1 / top5 repeat the first k's columns
TABLE = Table(
    "Weighted kNN (community protocol, not in the paper)",
    ("top1_k20", "top5_k20", "top1_k200", "top5_k200"),
    ("top1", "top5"),
)
BACKENDS = ("auto", "faiss", "torch")
TORCH_CHUNK_ROWS = 65_536  # bounds the torch backend's similarity block: 4096 queries x 65,536 rows = 1 GiB


def _chunk_searcher(
    chunk: torch.Tensor, k: int, backend: str, device: torch.device
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """queries -> (similarities, indices) of their ``k`` nearest rows of one normalised training chunk, on the CPU."""
    if backend == "faiss":
        faiss = require("faiss", "the kNN evaluation")
        index = faiss.IndexFlatIP(chunk.shape[1])
        index.add(chunk.cpu().numpy())

        def search(queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            sim, idx = index.search(queries.cpu().numpy(), k)
            return torch.from_numpy(sim), torch.from_numpy(idx).long()

        return search
    bank = chunk.to(device)

    def search(queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sim, idx = (queries.to(device) @ bank.T).topk(k, dim=1)
        return sim.cpu(), idx.cpu()

    return search


def resolve_backend(backend: str, device: str | torch.device) -> str:
    """``auto`` is torch on CUDA (faiss-gpu is not on PyPI) and faiss elsewhere."""
    if backend not in BACKENDS:
        raise ValueError(f"kNN backend {backend!r} is unknown; expected one of {BACKENDS}")
    if backend == "auto":
        return "torch" if torch.device(device).type == "cuda" else "faiss"
    return backend


def knn_search(
    train_features: torch.Tensor | np.ndarray,
    test_features: torch.Tensor | np.ndarray,
    k: int,
    *,
    query_batch: int = 4096,
    train_chunk: int = 262_144,
    backend: str = "auto",
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine similarities and indices (CPU) of each query's ``k`` nearest training rows, most similar first.

    Exact in both backends; ``train_chunk`` bounds memory; ``auto`` is torch on CUDA, faiss otherwise.
    """
    backend = resolve_backend(backend, device)
    n, q = len(train_features), len(test_features)
    if not 0 < k <= n:
        raise ValueError(f"k must be in [1, {n}] (the number of training samples), got {k}")
    if query_batch <= 0 or train_chunk <= 0:
        raise ValueError(f"query_batch and train_chunk must be positive, got {query_batch} and {train_chunk}")
    best_sim = torch.full((q, k), -float("inf"))
    best_idx = torch.zeros((q, k), dtype=torch.int64)
    if backend == "torch":
        train_chunk = min(train_chunk, TORCH_CHUNK_ROWS)
    for start in range(0, n, train_chunk):
        chunk = F.normalize(as_float32(train_features, start, start + train_chunk).to(device), dim=1)
        search = _chunk_searcher(chunk, min(k, len(chunk)), backend, torch.device(device))
        for qs in range(0, q, query_batch):
            queries = F.normalize(as_float32(test_features, qs, qs + query_batch).to(device), dim=1)
            sim, idx = search(queries)
            sims = torch.cat([best_sim[qs : qs + query_batch], sim], dim=1)
            idxs = torch.cat([best_idx[qs : qs + query_batch], idx + start], dim=1)
            top, order = sims.topk(k, dim=1)
            best_sim[qs : qs + query_batch] = top
            best_idx[qs : qs + query_batch] = idxs.gather(1, order)
        del search, chunk
    return best_sim, best_idx


def knn_classify(
    train_features: torch.Tensor | np.ndarray,
    train_labels: torch.Tensor,
    test_features: torch.Tensor | np.ndarray,
    test_labels: torch.Tensor,
    k: int = 20,
    temperature: float = 0.07,
    num_classes: int | None = None,
    query_batch: int = 4096,
    train_chunk: int = 262_144,
    backend: str = "auto",
    device: str | torch.device = "cpu",
) -> dict[str, float]:
    """Weighted kNN accuracy: ``{"top1": .., "top5": ..}`` in percent."""
    if num_classes is None:
        num_classes = int(max(torch.as_tensor(train_labels).max(), torch.as_tensor(test_labels).max())) + 1
    sims, idx = knn_search(
        train_features,
        test_features,
        k,
        query_batch=query_batch,
        train_chunk=train_chunk,
        backend=backend,
        device=device,
    )
    return hit_rates(knn_hits(sims, idx, train_labels, test_labels, k, temperature, num_classes))


# ----------------------------------------------------------------------------- bt-hub eval knn


@dataclass
class KnnConfig(EvalConfig):
    """``bt-hub eval knn``: weighted kNN on the frozen backbone's pooled features."""

    RUN_FIELDS: ClassVar[tuple[str, ...]] = EvalConfig.RUN_FIELDS + (
        "batch_size",
        "query_batch",
        "train_chunk",
        "backend",
    )

    k: list[int] = option(
        [20, 200],
        "numbers of neighbours; 'top1'/'top5' in results are those of the first; a k above the number of "
        "training images is scored (and named top1_kN) with N, the number of training images",
    )
    temperature: float = option(
        0.07, "T of the vote weights exp(sim / T); small T tends to 1-NN, large T to a majority vote"
    )
    query_batch: int = option(4096, "queries per search call; lower it if memory is short")
    train_chunk: int = option(
        262_144, "training rows searched at a time (memory = train_chunk x feature dim x 4 bytes)"
    )
    backend: Literal["auto", "faiss", "torch"] = option(
        "auto",
        "faiss (exact IndexFlatIP, CPU) or torch (matrix product + top-k on --device); auto: torch on "
        "CUDA, faiss on the CPU",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.k or any(k <= 0 for k in self.k):
            raise ValueError(f"{self.flag('k')} must list positive integers, got {shown(self.k)}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(
                f"{self.flag('temperature')} must be a positive finite number (any small value is valid: the vote "
                f"tends to the nearest neighbour's label), got {self.temperature}"
            )
        self.require_positive("query_batch", "train_chunk")


def effective_k(requested: list[int], train_size: int, flag: str) -> tuple[list[int], list[str]]:
    """The numbers of neighbours a run can use (each at most ``train_size``), deduplicated, and a warning per cut
    naming the ``flag`` that asked for them."""
    used = list(dict.fromkeys(min(k, train_size) for k in requested))
    cut = [k for k in requested if k > train_size]
    messages = [
        f"{flag} {' '.join(map(str, cut))} exceeds the {train_size} training images: scored with k={train_size} "
        f"(reported as top1_k{train_size})"
    ]
    return used, messages if cut else []


def score(run: EvalRun) -> Scored:
    """``bt-hub eval knn``'s scoring step: :func:`score_cell` of the run's weights with its config and seed."""
    return score_cell(run, run.config, run.config.seed)


def score_cell(cell: Cell, config: KnnConfig, seed: int) -> Scored:
    """Weighted kNN of test against training features for every ``--k`` (capped at the training size, warned).

    ``cell`` gives the features (an EvalRun, or a row of ``eval compare``); the vote draws nothing at random, so
    ``seed`` changes nothing.
    """
    train_x, train_y = cell.features("train")
    test_x, test_y = cell.features("test")
    num_classes = max(len(cell.splits.classes), int(max(train_y.max(), test_y.max())) + 1)
    if not is_main_process():
        return Scored({})
    used, warned = effective_k(config.k, len(train_y), config.flag("k"))
    for message in warned:
        warnings.warn(message, EvalWarning, stacklevel=2)
    backend = resolve_backend(config.backend, cell.device)
    sims, idx = knn_search(
        train_x,
        test_x,
        max(used),
        query_batch=config.query_batch,
        train_chunk=config.train_chunk,
        backend=backend,
        device=cell.device,
    )
    metrics: dict[str, float] = {}
    hits = {k: knn_hits(sims, idx, train_y, test_y, k, config.temperature, num_classes) for k in used}
    for k in used:
        result = hit_rates(hits[k])
        metrics.update({f"top1_k{k}": result["top1"], f"top5_k{k}": result["top5"]})
    metrics = {"top1": metrics[f"top1_k{used[0]}"], "top5": metrics[f"top5_k{used[0]}"], **metrics}
    notes = {"neighbours_used": {str(k): min(k, len(train_y)) for k in config.k}, "backend": backend}
    correct = hits[used[0]][:, 0].numpy()
    return Scored(metrics, mode="features", warnings=warned, notes=notes, table=TABLE, correct=correct)
