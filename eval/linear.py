"""Linear probe on a frozen backbone (docs/protocols.md §2), and linear transfer (PIRL settings).

Presets:

- ``imagenet`` (the paper): backbone frozen in eval mode (BN uses running statistics); fc
  init N(0, 0.01), bias 0; SGD momentum 0.9, lr 0.3, wd 1e-6, batch 256, 100 epochs,
  cosine per epoch, no warm-up; train RandomResizedCrop + flip, test Resize + CenterCrop;
  top-1 / top-5.
- ``places205`` / ``inat18`` (PIRL): SGD momentum 0.9, lr 0.01, wd 5e-4, batch 256,
  14 / 84 epochs, lr ×0.1 at two equally spaced points. VISSL's configs drop three
  times instead ([4, 8, 12] and [24, 48, 72]): pass ``--milestones`` to follow them.

``--cached`` trains the same classifier, with the same optimiser and schedule, on the
cached test-transform features of eval.features (no augmentation, so no backbone pass
per epoch); results say ``mode: cached``. Under torchrun the full loop shards the data
with a DistributedSampler and averages classifier gradients with DDP.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from tqdm import tqdm

from bt_hub.data import build_dataset
from bt_hub.distributed import all_reduce_sum, get_rank, get_world_size, is_distributed, is_main_process, process_group
from bt_hub.runs import RunDir
from eval.config import EvalConfig
from eval.features import TransformedDataset, dataset_fingerprint, eval_transform, features_for, load_eval_backbone, train_transform
from eval.report import write_results

# ----------------------------------------------------------------------------- schedule, classifier, metrics


def lr_factor(epoch: int, epochs: int, schedule: str, milestones: Sequence[int] = (), gamma: float = 0.1) -> float:
    """Multiplier of the base LR during ``epoch`` (0-based): cosine per epoch (no warm-up) or steps.

    ``cosine`` is ``0.5 (1 + cos(pi epoch / epochs))`` (torch's CosineAnnealingLR stepped per
    epoch, as the reference evaluate.py); ``step`` multiplies by ``gamma`` once for every
    milestone ``m <= epoch`` ("×0.2 after epochs 12 and 16": milestones [12, 16]).
    """
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * epoch / epochs))
    if schedule == "step":
        return gamma ** sum(epoch >= m for m in milestones)
    raise ValueError(f"schedule {schedule!r} is unknown; expected 'cosine' or 'step'")


def equally_spaced_milestones(epochs: int, drops: int = 2) -> list[int]:
    """``drops`` LR drops at equally spaced epochs (14 epochs -> [5, 9]; 84 -> [28, 56])."""
    return [round(epochs * (i + 1) / (drops + 1)) for i in range(drops)]


def make_classifier(in_dim: int, num_classes: int) -> nn.Linear:
    """The linear classifier of the paper: weight ~ N(0, 0.01), bias 0."""
    fc = nn.Linear(in_dim, num_classes)
    nn.init.normal_(fc.weight, mean=0.0, std=0.01)
    nn.init.zeros_(fc.bias)
    return fc


def topk_correct(logits: torch.Tensor, targets: torch.Tensor, ks: Sequence[int] = (1, 5)) -> list[int]:
    """Number of samples whose target is among the top-k logits, for each k (k capped at the classes)."""
    kmax = min(max(ks), logits.shape[1])
    top = logits.topk(kmax, dim=1).indices
    hits = top == targets.view(-1, 1)
    return [int(hits[:, : min(k, kmax)].any(dim=1).sum()) for k in ks]


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The training order of ``epoch``: ``randperm(n)`` seeded by ``seed + epoch``, as DistributedSampler."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))


def set_epoch_lr(optimizer: torch.optim.Optimizer, base_lrs: Sequence[float], factor: float) -> None:
    """Set every parameter group's LR to its base LR times ``factor``."""
    for group, base in zip(optimizer.param_groups, base_lrs):
        group["lr"] = base * factor


# ----------------------------------------------------------------------------- cached features


def _rows(features: torch.Tensor | np.ndarray, idx: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Rows ``idx`` of a tensor, or of a (memory-mapped) array read in sorted order, as float32 on ``device``."""
    if isinstance(features, torch.Tensor):
        return features[idx.to(features.device)].float().to(device)
    return torch.from_numpy(np.asarray(features[np.sort(idx.numpy())], dtype=np.float32)).to(device)


def train_on_features(
    features: torch.Tensor | np.ndarray,
    labels: torch.Tensor,
    num_classes: int,
    *,
    epochs: int,
    batch_size: int = 256,
    lr: float = 0.3,
    weight_decay: float = 1e-6,
    momentum: float = 0.9,
    schedule: str = "cosine",
    milestones: Sequence[int] = (),
    gamma: float = 0.1,
    seed: int = 0,
    progress: bool = True,
    device: str | torch.device | None = None,
) -> nn.Linear:
    """Train the paper's linear classifier on fixed features (the ``--cached`` mode).

    Args:
        features: N x D training features: a tensor, or a (memory-mapped) array read batch by
            batch, so ImageNet-sized caches need not fit in memory (any float dtype).
        labels: N integer labels.
        num_classes: classifier outputs.
        epochs, batch_size, lr, weight_decay, momentum, schedule, milestones, gamma: as the
            full loop (SGD, LR set per epoch by :func:`lr_factor`).
        seed: seeds the classifier init and the per-epoch shuffling, which is the full loop's
            (:func:`make_loader`): on the same inputs both train the same classifier.
        progress: show a progress bar (on a TTY, main process only).
        device: where the classifier trains; default the features' device (CPU for arrays).

    Returns:
        The trained classifier.
    """
    if device is None:
        device = features.device if isinstance(features, torch.Tensor) else torch.device("cpu")
    device = torch.device(device)
    torch.manual_seed(seed)
    fc = make_classifier(features.shape[1], num_classes).to(device)
    optimizer = torch.optim.SGD(fc.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    y = labels.long().cpu()
    n = len(y)
    for epoch in tqdm(range(epochs), desc="linear (cached)", unit="epoch", disable=not (progress and is_main_process()) or None):
        set_epoch_lr(optimizer, [lr], lr_factor(epoch, epochs, schedule, milestones, gamma))
        order = epoch_permutation(n, seed, epoch)
        for start in range(0, n, batch_size):
            idx = order[start : start + batch_size]
            if not isinstance(features, torch.Tensor):
                idx = idx.sort().values
            loss = F.cross_entropy(fc(_rows(features, idx, device)), y[idx].to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return fc


@torch.no_grad()
def evaluate_features(fc: nn.Module, features: torch.Tensor | np.ndarray, labels: torch.Tensor, batch_size: int = 4096) -> dict[str, float]:
    """Top-1 / top-5 accuracy (percent) of a classifier on fixed features (tensor or memmap)."""
    device = next(fc.parameters()).device
    correct = torch.zeros(2)
    for start in range(0, len(features), batch_size):
        idx = torch.arange(start, min(start + batch_size, len(features)))
        logits = fc(_rows(features, idx, device))
        correct += torch.tensor(topk_correct(logits, labels[idx].to(device)), dtype=torch.float)
    return {"top1": 100.0 * float(correct[0]) / len(features), "top5": 100.0 * float(correct[1]) / len(features)}


# ----------------------------------------------------------------------------- full loop (images, frozen backbone)


class FrozenBackboneClassifier(nn.Module):
    """A frozen backbone (kept in eval mode, no gradients) followed by a trainable linear layer."""

    def __init__(self, backbone: nn.Module, fc: nn.Linear) -> None:
        super().__init__()
        self.backbone = backbone.requires_grad_(False)
        self.fc = fc

    def train(self, mode: bool = True) -> "FrozenBackboneClassifier":
        """Only the classifier changes mode: the backbone's BN keeps its running statistics."""
        super().train(mode)
        self.backbone.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            feats = self.backbone(x)
        return self.fc(feats.float())


def make_loader(dataset: Dataset, batch_size: int, *, shuffle: bool, seed: int, num_workers: int, device: torch.device) -> DataLoader:
    """A loader of ``batch_size`` images in all, split over the ranks under torchrun.

    The order of an epoch is :func:`epoch_permutation` (DistributedSampler's rule, also in a
    single process; :func:`train_classifier` sets the epoch), so a loop over images and
    :func:`train_on_features` over their cached features see the same batches.
    """
    world = get_world_size()
    sampler = DistributedSampler(dataset, num_replicas=world, rank=get_rank(), shuffle=shuffle, seed=seed, drop_last=False)
    return DataLoader(dataset, batch_size=max(1, batch_size // world), sampler=sampler, num_workers=num_workers, pin_memory=device.type == "cuda")


@torch.no_grad()
def evaluate_loader(model: nn.Module, loader: DataLoader, device: torch.device, desc: str = "eval") -> dict[str, float]:
    """Top-1 / top-5 accuracy (percent) of an image classifier, summed over ranks."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for images, labels in tqdm(loader, desc=desc, unit="batch", leave=False, disable=not is_main_process() or None):
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.autocast(device.type, enabled=device.type == "cuda"):
            logits = model(images)
        c1, c5 = topk_correct(logits.float(), labels)
        totals += torch.tensor([c1, c5, len(labels)], dtype=torch.float64, device=device)
    # DistributedSampler pads the last shard by repeating samples; with world 1 counts are exact.
    totals = all_reduce_sum(totals)
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
    on_epoch: Any = None,
) -> None:
    """SGD with per-epoch LR on images: the loop shared by the linear probe and fine-tuning.

    Args:
        model: images -> logits (DDP-wrapped by the caller when distributed).
        param_groups: ``[{"params": ..., "lr": base_lr}, ...]``.
        on_epoch: optional ``callable(epoch, mean_loss)`` after each epoch.
    """
    optimizer = torch.optim.SGD(param_groups, lr=0.0, momentum=momentum, weight_decay=weight_decay)
    base_lrs = [g["lr"] for g in param_groups]
    scaler = torch.amp.GradScaler("cuda", enabled=device.type == "cuda")
    for epoch in tqdm(range(epochs), desc=desc, unit="epoch", disable=not is_main_process() or None):
        set_epoch_lr(optimizer, base_lrs, lr_factor(epoch, epochs, schedule, milestones, gamma))
        sampler = getattr(train_loader, "sampler", None)
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(epoch)
        model.train()
        total, count = 0.0, 0
        for images, labels in train_loader:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with torch.autocast(device.type, enabled=device.type == "cuda"):
                loss = F.cross_entropy(model(images).float(), labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            total, count = total + float(loss.detach()) * len(labels), count + len(labels)
        if on_epoch is not None:
            on_epoch(epoch, total / max(count, 1))


# ----------------------------------------------------------------------------- datasets shared by the protocols


def load_splits(config: EvalConfig, test_split: str = "val") -> tuple[Dataset, Dataset]:
    """The (train, test) datasets of ``--data`` as every protocol reads them (so they share cached features).

    Images keep their stored size (32 px for the built-in sets); the protocol's transforms
    resize them to ``--image-size``.
    """
    train = build_dataset(config.data, "train", image_size=None, seed=config.seed)
    test = build_dataset(config.data, test_split, image_size=None, seed=config.seed)
    return train, test


def combined_fingerprint(*fingerprints: str) -> str:
    """One sha256 for several datasets (train and test splits)."""
    return hashlib.sha256(":".join(fingerprints).encode()).hexdigest()


# ----------------------------------------------------------------------------- the protocol

# docs/protocols.md §2. PIRL drops the LR ×0.1 at two equally spaced points; VISSL's configs
# drop three times ([4, 8, 12] for Places, [24, 48, 72] for iNat): pass --milestones.
PRESET_VALUES: dict[str, dict[str, Any]] = {
    "imagenet": {"epochs": 100, "lr": 0.3, "weight_decay": 1e-6, "schedule": "cosine", "milestones": []},
    "places205": {"epochs": 14, "lr": 0.01, "weight_decay": 5e-4, "schedule": "step", "milestones": equally_spaced_milestones(14)},
    "inat18": {"epochs": 84, "lr": 0.01, "weight_decay": 5e-4, "schedule": "step", "milestones": equally_spaced_milestones(84)},
}


@dataclass
class LinearConfig(EvalConfig):
    """Flags of ``bt-hub eval linear``; unset hyper-parameters come from ``--preset``."""

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {name: {} for name in PRESET_VALUES}

    preset: Literal["imagenet", "places205", "inat18"] = field(default="imagenet", metadata={"help": "imagenet (paper: lr 0.3 cosine, 100 epochs), places205 / inat18 (PIRL: lr 0.01, wd 5e-4, 14 / 84 epochs, ×0.1 twice)"})
    epochs: Optional[int] = field(default=None, metadata={"help": "training epochs (default: the preset's)"})
    lr: Optional[float] = field(default=None, metadata={"help": "base LR for a batch of 256 images in all (default: the preset's)"})
    weight_decay: Optional[float] = field(default=None, metadata={"help": "SGD weight decay (default: the preset's)"})
    momentum: float = field(default=0.9, metadata={"help": "SGD momentum"})
    schedule: Optional[Literal["cosine", "step"]] = field(default=None, metadata={"help": "per-epoch LR schedule (default: the preset's)"})
    milestones: Optional[list[int]] = field(default=None, metadata={"help": "epochs after which the step schedule multiplies the LR by --gamma (default: the preset's)"})
    gamma: float = field(default=0.1, metadata={"help": "LR factor at each milestone of the step schedule"})
    cached: bool = field(default=False, metadata={"help": "fast mode: train the same classifier on cached test-transform features (no augmentation, no backbone pass per epoch); stated in results.json"})
    test_split: Literal["val", "test"] = field(default="val", metadata={"help": "held-out split of --data (ImageNet layout: val/)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.preset not in PRESET_VALUES:
            raise ValueError(f"--preset {self.preset!r} is unknown; expected one of {sorted(PRESET_VALUES)}")
        for name, value in PRESET_VALUES[self.preset].items():
            if getattr(self, name) is None:
                setattr(self, name, list(value) if isinstance(value, list) else value)
        if self.epochs <= 0:
            raise ValueError(f"--epochs must be positive, got {self.epochs}")
        if self.lr <= 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        if self.weight_decay < 0 or self.momentum < 0:
            raise ValueError(f"--weight-decay and --momentum must be non-negative, got {self.weight_decay} and {self.momentum}")
        if sorted(self.milestones) != list(self.milestones) or any(m <= 0 for m in self.milestones):
            raise ValueError(f"--milestones must be increasing positive epochs, got {self.milestones}")


@dataclass
class TransferConfig(LinearConfig):
    """Flags of ``bt-hub eval transfer``: the linear probe with PIRL's settings on any ImageFolder dataset."""

    preset: Literal["places205", "inat18", "imagenet"] = field(default="places205", metadata={"help": "places205 (14 epochs, drops after 5 and 9) or inat18 (84 epochs, drops after 28 and 56); SGD lr 0.01, wd 5e-4"})


def run(config: LinearConfig, protocol: str = "linear") -> dict[str, Any]:
    """Train and score a linear classifier on the frozen backbone of ``--weights``; write results.json.

    Returns:
        The results record (metrics ``top1`` / ``top5`` in percent, see eval.report).
    """
    with process_group(config.device) as device:
        return _run(config, device, protocol)


def run_transfer(config: TransferConfig) -> dict[str, Any]:
    """``bt-hub eval transfer``: :func:`run` with the transfer presets (Places-205, iNat18)."""
    return run(config, protocol="transfer")


def _run(config: LinearConfig, device: torch.device, protocol: str) -> dict[str, Any]:
    tick = time.perf_counter()
    torch.manual_seed(config.seed)
    backbone, weights_id = load_eval_backbone(config)
    train_set, test_set = load_splits(config, config.test_split)
    train_id, test_id = dataset_fingerprint(train_set), dataset_fingerprint(test_set)
    num_classes = len(train_set.classes)
    run_dir = RunDir(config.out, config, write=is_main_process())
    schedule = {"epochs": config.epochs, "lr": config.lr, "weight_decay": config.weight_decay, "momentum": config.momentum,
                "schedule": config.schedule, "milestones": config.milestones, "gamma": config.gamma}
    if config.cached:
        train_x, train_y = features_for(config, backbone, train_set, weights_id=weights_id, dataset_id=train_id)
        test_x, test_y = features_for(config, backbone, test_set, weights_id=weights_id, dataset_id=test_id)
        fc = train_on_features(train_x, train_y, num_classes, batch_size=config.batch_size, seed=config.seed, device=device, **schedule)
        metrics = evaluate_features(fc, test_x, test_y)
        mode = "cached: classifier trained on cached test-transform features, no augmentation"
    else:
        fc = make_classifier(backbone.feature_dim, num_classes)
        model: nn.Module = FrozenBackboneClassifier(backbone, fc).to(device)
        if is_distributed():
            model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        train_loader = make_loader(TransformedDataset(train_set, train_transform(config.image_size)), config.batch_size, shuffle=True,
                                   seed=config.seed, num_workers=config.num_workers, device=device)
        test_loader = make_loader(TransformedDataset(test_set, eval_transform(config.image_size)), config.batch_size, shuffle=False,
                                  seed=config.seed, num_workers=config.num_workers, device=device)
        train_classifier(model, [{"params": list(fc.parameters()), "lr": config.lr}], train_loader, device=device, desc=f"linear ({config.preset})",
                         epochs=config.epochs, momentum=config.momentum, weight_decay=config.weight_decay, schedule=config.schedule,
                         milestones=config.milestones, gamma=config.gamma,
                         on_epoch=lambda epoch, loss: run_dir.log({"epoch": epoch, "train_loss": loss}))
        metrics = evaluate_loader(model, test_loader, device)
        mode = "full: frozen backbone in eval mode, RandomResizedCrop + flip every epoch"
    record = {"metrics": metrics}
    if is_main_process():
        record = write_results(
            config.out, protocol=protocol, preset=config.preset, config=config, metrics=metrics, weights=config.weights,
            weights_sha256=weights_id, dataset=config.data, dataset_fingerprint=combined_fingerprint(train_id, test_id),
            seed=config.seed, wall_time_s=time.perf_counter() - tick, notes={"mode": mode},
        )
    return record
