"""The SGD classifier shared by the linear probe, transfer and semi-supervised fine-tuning: the paper's
initialisation and per-epoch LR, and a seeded data order that the cached-feature heads share.

The linear probe's first epoch is held to the official evaluate.py in tests/test_against_reference.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from bt_hub.common.distributed import all_reduce_sum, get_rank, get_world_size
from bt_hub.common.progress import progress as reported
from bt_hub.common.signals import ignore_group_signals
from bt_hub.data.precision import autocast_dtype

# ----------------------------------------------------------------------------- schedule, classifier, metrics


def lr_factor(epoch: int, epochs: int, schedule: str, milestones: Sequence[int] = (), gamma: float = 0.1) -> float:
    """Multiplier of the base LR during ``epoch``: cosine per epoch (no warm-up), or ``gamma`` per milestone passed."""
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * epoch / epochs))
    if schedule == "step":
        return gamma ** sum(epoch >= m for m in milestones)
    raise ValueError(f"schedule {schedule!r} is unknown; expected 'cosine' or 'step'")


def make_classifier(in_dim: int, num_classes: int) -> nn.Linear:
    """The linear classifier of the paper: weight ~ N(0, 0.01), bias 0."""
    fc = nn.Linear(in_dim, num_classes)
    nn.init.normal_(fc.weight, mean=0.0, std=0.01)
    nn.init.zeros_(fc.bias)
    return fc


def topk_hits(logits: torch.Tensor, targets: torch.Tensor, ks: Sequence[int] = (1, 5)) -> torch.Tensor:
    """Per sample, whether its target is among the top-k logits, for each k: N x len(ks) booleans (k capped at the
    classes)."""
    kmax = min(max(ks), logits.shape[1])
    hits = logits.topk(kmax, dim=1).indices == targets.view(-1, 1)
    return torch.stack([hits[:, : min(k, kmax)].any(dim=1) for k in ks], 1)


def distributed_sampler_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The training order of ``epoch``: ``randperm(n)`` seeded by ``seed + epoch``, torch's DistributedSampler's rule
    (pretraining's order, ``bt_hub.train.resume.derived_seed_permutation``, mixes the two instead)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))


def set_epoch_lr(optimizer: torch.optim.Optimizer, base_lrs: Sequence[float], factor: float) -> None:
    """Set every parameter group's LR to its base LR times ``factor``."""
    for group, base in zip(optimizer.param_groups, base_lrs):
        group["lr"] = base * factor


# ----------------------------------------------------------------------------- the loop over images


def make_loader(
    dataset: Dataset, batch_size: int, *, shuffle: bool, seed: int, num_workers: int, device: torch.device
) -> DataLoader:
    """A loader of ``batch_size`` images in all, split over the ranks, in the order of
    :func:`distributed_sampler_permutation`."""
    world = get_world_size()
    sampler = DistributedSampler(
        dataset, num_replicas=world, rank=get_rank(), shuffle=shuffle, seed=seed, drop_last=False
    )
    return DataLoader(
        dataset,
        batch_size=max(1, batch_size // world),
        sampler=sampler,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
        worker_init_fn=ignore_group_signals,
    )


def loop_precision(device: torch.device, precision: str) -> str:
    """The precision the image loops run in (recorded beside the extraction's): :func:`loop_autocast`'s, by name."""
    return precision if loop_autocast(device, precision) is not None else "fp32"


def loop_autocast(device: torch.device, precision: str) -> torch.dtype | None:
    """The autocast dtype of the image loops: the run's resolved ``--precision`` on CUDA (bf16 where the GPU
    has it), fp32 on the CPU, where bf16 training of these loops is unmeasured."""
    return autocast_dtype(precision) if device.type == "cuda" else None


@torch.no_grad()
def evaluate_loader(
    model: nn.Module,
    loader: DataLoader,
    device: torch.device,
    desc: str = "eval",
    precision: str = "fp32",
    hits: torch.Tensor | None = None,
) -> dict[str, float]:
    """Top-1 / top-5 accuracy (percent) of an image classifier, summed over ranks (autocast: ``loop_autocast``);
    ``hits`` (one boolean per image of the loader's dataset, in its order): each image's top-1 hit is written there,
    gathered from every rank."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    dtype = loop_autocast(device, precision)
    rows = iter(list(loader.sampler) if hits is not None else [])  # the dataset's indices this rank scores, in order
    scored = torch.zeros(len(hits) if hits is not None else 0, device=device)
    for images, labels in reported(loader, desc, unit="batch", leave=False):
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            logits = model(images)
        found = topk_hits(logits.float(), labels)
        totals += torch.tensor([*found.sum(0).tolist(), len(labels)], dtype=torch.float64, device=device)
        if hits is not None:
            scored[[next(rows) for _ in labels]] = found[:, 0].float()
    # DistributedSampler pads the last shard by repeating samples; with world 1 counts are exact.
    totals = all_reduce_sum(totals)
    if hits is not None:
        hits.copy_(all_reduce_sum(scored).cpu() > 0)
    return {"top1": 100.0 * float(totals[0] / totals[2]), "top5": 100.0 * float(totals[1] / totals[2])}


def train_classifier(
    model: nn.Module,
    param_groups: list[dict[str, Any]],
    train_loader: DataLoader,
    *,
    epochs: int,
    momentum: float,
    weight_decay: float,
    schedule: str,
    milestones: Sequence[int],
    gamma: float,
    device: torch.device,
    desc: str,
    on_epoch: Callable[[int, float], None] | None = None,
    precision: str = "fp32",
) -> None:
    """SGD with per-epoch LR on images: the loop shared by the linear probe and fine-tuning.

    ``model`` is DDP-wrapped by the caller when distributed; ``on_epoch(epoch, mean_loss)`` runs after each
    epoch; ``precision`` sets the autocast (a gradient scaler only for fp16).
    """
    optimizer = torch.optim.SGD(param_groups, lr=0.0, momentum=momentum, weight_decay=weight_decay)
    base_lrs = [g["lr"] for g in param_groups]
    dtype = loop_autocast(device, precision)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    for epoch in reported(range(epochs), desc, unit="epoch"):
        set_epoch_lr(optimizer, base_lrs, lr_factor(epoch, epochs, schedule, milestones, gamma))
        sampler = getattr(train_loader, "sampler", None)
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(epoch)
        model.train()
        total, count = 0.0, 0
        for images, labels in train_loader:
            if len(labels) == 1 and count:  # a last batch of one: BatchNorm cannot train on one 1x1 map (small images)
                continue
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(model(images).float(), labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            total, count = total + float(loss.detach()) * len(labels), count + len(labels)
        if on_epoch is not None:
            on_epoch(epoch, total / max(count, 1))
