"""Runs you can watch: an online kNN monitor of the backbone (solo-learn's: a small labelled bank, held-out
queries, the weighted vote of 20 neighbours) with RankMe of the bank's features, and optional TensorBoard scalars.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torchvision.transforms.v2.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from bt_hub.common.optional import require
from bt_hub.common.signals import ignore_group_signals
from bt_hub.data.datasets import ImageFolderDataset, build_dataset, is_builtin, to_uint8_tensor
from bt_hub.method.knn import hit_rates, knn_hits, nearest_neighbours
from bt_hub.method.model import default_init_backbone
from bt_hub.method.rankme import rankme
from bt_hub.method.transforms import normalize
from bt_hub.train.resume import seeded_generator

MONITOR_K = 20
MONITOR_TEMPERATURE = 0.07
MAX_QUERIES = 500
MONITOR_SEED_KEY = 7_919  # keeps the monitor's subset draws apart from the training order's


class _Squared(Dataset):
    """Images ``indices`` of ``dataset`` squared at ``size``, with their labels."""

    def __init__(self, dataset: Any, indices: list[int], size: int) -> None:
        self.dataset, self.indices, self.size = dataset, indices, size

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        """Shorter side resized to ``size`` (bicubic), centre crop, as a 3 x size x size uint8 tensor; its label."""
        image, label = self.dataset[self.indices[i]]
        if image.size != (self.size, self.size):
            size = [self.size, self.size]
            image = F.center_crop(F.resize(image, self.size, interpolation=F.InterpolationMode.BICUBIC), size)
        return to_uint8_tensor(image), label


def _stack(dataset: Any, indices: torch.Tensor, size: int, num_workers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The images and labels, decoded from an image folder by ``num_workers`` loader workers (the main process
    opens no file of it), read in place from an in-memory set."""
    workers = num_workers if isinstance(dataset, ImageFolderDataset) else 0
    squared = _Squared(dataset, indices.tolist(), size)
    loader = DataLoader(squared, batch_size=64, num_workers=workers, worker_init_fn=ignore_group_signals)
    images, labels = zip(*loader)
    return torch.cat(images), torch.cat(labels)


def monitor_sets(
    data: str, image_size: int, seed: int, bank_size: int, num_workers: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bank images, bank labels, query images, query labels) of ``data``, uint8, seeded; queries held out (``val/``
    or ``test/``, else training images outside the bank); an image folder's files decoded by ``num_workers`` loader
    workers."""
    in_memory = is_builtin(data)
    size = image_size if in_memory else None
    train = build_dataset(data, "train", image_size=size, seed=seed)
    split = next((s for s in ("val", "test") if in_memory or (Path(data).expanduser() / s).is_dir()), None)
    held_out = build_dataset(data, split, image_size=size, seed=seed) if split else train  # else: outside the bank
    same = held_out is train
    queries = max(1, min(MAX_QUERIES, bank_size // 4))
    order = torch.randperm(len(train), generator=seeded_generator(seed, MONITOR_SEED_KEY))
    if same:  # a fifth of a small set at most, so that the bank keeps the rest
        queries = max(1, min(queries, len(train) // 5))
        query_idx, bank_idx = order[:queries], order[queries : queries + bank_size]
    else:
        bank_idx = order[:bank_size]
        query_idx = torch.randperm(len(held_out), generator=seeded_generator(seed, MONITOR_SEED_KEY, 1))[:queries]
    if len(bank_idx) < MONITOR_K:
        raise ValueError(
            f"the kNN monitor's data {data} gives {len(bank_idx)} bank images and it needs at least {MONITOR_K}: "
            "pass --monitor-data with more labelled images, or leave --monitor-knn out"
        )
    bank, bank_labels = _stack(train, bank_idx, image_size, num_workers)
    query, query_labels = _stack(held_out if not same else train, query_idx, image_size, num_workers)
    return bank, bank_labels, query, query_labels


class KnnMonitor:
    """Weighted kNN top-1 (percent) of a backbone's features and RankMe of the bank's; bank and queries (uint8 images)
    fixed at construction."""

    def __init__(
        self,
        bank: torch.Tensor,
        bank_labels: torch.Tensor,
        queries: torch.Tensor,
        query_labels: torch.Tensor,
        batch_size: int = 256,
    ) -> None:
        self.bank, self.bank_labels, self.queries, self.query_labels = bank, bank_labels, queries, query_labels
        self.batch_size = batch_size
        self.num_classes = int(max(bank_labels.max(), query_labels.max())) + 1

    @torch.no_grad()
    def _features(
        self, backbone: nn.Module, images: torch.Tensor, device: torch.device, amp_dtype: torch.dtype | None
    ) -> torch.Tensor:
        feats = []
        for start in range(0, len(images), self.batch_size):
            x = normalize(images[start : start + self.batch_size].to(device, non_blocking=True).float().div_(255))
            with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                feats.append(backbone(x).float())
        return torch.cat(feats)

    def __call__(
        self, backbone: nn.Module, device: torch.device | str, amp_dtype: torch.dtype | None = None
    ) -> dict[str, float]:
        """``knn_top1``, the top-1 of the k = 20, T = 0.07 vote, and ``rankme``, RankMe of the bank's features
        (:func:`bt_hub.method.rankme.rankme`, as ``bt-hub eval rankme`` computes it: N is the bank's size, so its
        largest value is min(bank, D)), with ``backbone`` in eval mode (its mode is restored)."""
        device = torch.device(device)
        was_training = backbone.training
        backbone.eval()
        try:
            bank = self._features(backbone, self.bank, device, amp_dtype)
            queries = self._features(backbone, self.queries, device, amp_dtype)
        finally:
            backbone.train(was_training)
        k = min(MONITOR_K, len(bank))
        sims, idx = nearest_neighbours(bank, queries, k)
        vote = knn_hits(
            sims.cpu(), idx.cpu(), self.bank_labels, self.query_labels, k, MONITOR_TEMPERATURE, self.num_classes
        )
        return {"knn_top1": hit_rates(vote)["top1"], "rankme": rankme(bank)}

    def baselines(
        self, arch: str, small_image_stem: bool, seed: int, device: torch.device | str, amp_dtype: torch.dtype | None
    ) -> dict[str, float]:
        """The same vote on the raw pixels and on the network at torchvision's default initialisation (``seed``):
        what the curve must beat, logged beside its first point."""
        random_init = default_init_backbone(arch, small_image_stem, seed).to(device)
        return {
            "knn_pixels": self(nn.Flatten(), device, amp_dtype)["knn_top1"],
            "knn_random_init": self(random_init, device, amp_dtype)["knn_top1"],
        }


class TensorBoardScalars:
    """Every number of a metrics row as a TensorBoard scalar ``pretrain/<key>`` at its step (needs tensorboard)."""

    def __init__(self, log_dir: str | Path) -> None:
        require("tensorboard", "--tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, row: dict[str, Any]) -> None:
        """Write the row's numbers (not ``step`` itself) at ``row["step"]``."""
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)):
                self.writer.add_scalar(f"pretrain/{key}", value, row["step"])
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()
