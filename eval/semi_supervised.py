"""Semi-supervised evaluation: fine-tune the whole network on 1% or 10% of the labels (docs/protocols.md §2).

Presets:

- ``paper``: 20 epochs; SGD momentum 0.9, no weight decay, batch 256; lr 0.002 for the
  backbone and 0.5 for the classifier, both ×0.2 after epochs 12 and 16.
- ``reference`` (the reference README): lr 0.005 / 0.5 with a cosine schedule.

The labelled subset comes from a SimCLR-format list (``--subset-file``, e.g. the published
``1percent.txt``, matched by file name) or is a seeded class-balanced ``--fraction`` percent
of any dataset (bt_hub.label_subsets). BN layers train (batch statistics), unlike the
linear probe. Transforms are the linear probe's: RandomResizedCrop + flip for training,
Resize + CenterCrop for testing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional, Sequence

import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from bt_hub.distributed import convert_sync_batchnorm, is_distributed, is_main_process, process_group
from bt_hub.label_subsets import read_subset_file, subset_indices
from eval.config import EvalConfig
from eval.features import TransformedDataset, dataset_fingerprint, eval_transform, load_eval_backbone, train_transform
from eval.linear import combined_fingerprint, evaluate_loader, load_splits, make_classifier, make_loader, train_classifier
from eval.report import write_results

# Numbers of docs/protocols.md §2; each preset is a named set of flag values.
PAPER = {
    "lr_backbone": 0.002, "lr_classifier": 0.5, "schedule": "step", "milestones": [12, 16], "gamma": 0.2,
    "epochs": 20, "weight_decay": 0.0, "momentum": 0.9, "batch_size": 256,
}
REFERENCE = {**PAPER, "lr_backbone": 0.005, "schedule": "cosine", "milestones": []}


def finetune(
    backbone: nn.Module,
    num_classes: int,
    train_set: Dataset,
    test_set: Dataset,
    *,
    lr_backbone: float,
    lr_classifier: float,
    epochs: int,
    batch_size: int,
    schedule: str = "step",
    milestones: Sequence[int] = (12, 16),
    gamma: float = 0.2,
    weight_decay: float = 0.0,
    momentum: float = 0.9,
    seed: int = 0,
    num_workers: int = 0,
    device: str | torch.device = "cpu",
    desc: str = "fine-tune",
) -> dict[str, float]:
    """Fine-tune backbone + a new linear classifier on ``train_set``; return test top-1 / top-5 (percent).

    Args:
        backbone: images -> features, with a ``feature_dim`` attribute (trained in place).
        num_classes: classifier outputs.
        train_set, test_set: datasets yielding transformed ``(image tensor, label)``.
        lr_backbone, lr_classifier: base LRs of the two parameter groups.
        schedule, milestones, gamma: per-epoch LR (eval.linear.lr_factor).
        seed: seeds the classifier init and the data order.
    """
    device = torch.device(device)
    torch.manual_seed(seed)
    fc = make_classifier(backbone.feature_dim, num_classes)
    model: nn.Module = nn.Sequential(backbone, fc).to(device)
    groups = [{"params": list(fc.parameters()), "lr": lr_classifier}, {"params": list(backbone.parameters()), "lr": lr_backbone}]
    if is_distributed():
        model = convert_sync_batchnorm(model)  # BN statistics of the global batch, on CPU too
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    train_loader = make_loader(train_set, batch_size, shuffle=True, seed=seed, num_workers=num_workers, device=device)
    test_loader = make_loader(test_set, batch_size, shuffle=False, seed=seed, num_workers=num_workers, device=device)
    train_classifier(
        model, groups, train_loader, epochs=epochs, momentum=momentum, weight_decay=weight_decay,
        schedule=schedule, milestones=milestones, gamma=gamma, device=device, desc=desc,
    )
    return evaluate_loader(model, test_loader, device)


@dataclass
class SemiSupervisedConfig(EvalConfig):
    """Flags of ``bt-hub eval semi``; unset hyper-parameters come from ``--preset``."""

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {"paper": {}, "reference": {}}
    PRESET_VALUES: ClassVar[dict[str, dict[str, Any]]] = {"paper": PAPER, "reference": REFERENCE}

    preset: Literal["paper", "reference"] = field(default="paper", metadata={"help": "paper (lr 0.002 / 0.5, ×0.2 after epochs 12 and 16) or reference (0.005 / 0.5, cosine); 20 epochs, no weight decay"})
    fraction: Optional[int] = field(default=None, metadata={"help": "percent of the labels, class-balanced and seeded (1 or 10 in the paper); default 1 unless --subset-file is given"})
    subset_file: Optional[str] = field(default=None, metadata={"help": "SimCLR-format list of labelled training files (e.g. 1percent.txt), matched by file name"})
    epochs: Optional[int] = field(default=None, metadata={"help": "fine-tuning epochs (default: the preset's)"})
    lr_backbone: Optional[float] = field(default=None, metadata={"help": "backbone LR (default: the preset's)"})
    lr_classifier: Optional[float] = field(default=None, metadata={"help": "classifier LR (default: the preset's)"})
    weight_decay: Optional[float] = field(default=None, metadata={"help": "SGD weight decay (default: the preset's, 0)"})
    momentum: float = field(default=0.9, metadata={"help": "SGD momentum"})
    schedule: Optional[Literal["cosine", "step"]] = field(default=None, metadata={"help": "per-epoch LR schedule (default: the preset's)"})
    milestones: Optional[list[int]] = field(default=None, metadata={"help": "epochs after which the step schedule multiplies both LRs by --gamma (default: the preset's)"})
    gamma: Optional[float] = field(default=None, metadata={"help": "LR factor at each milestone (default: the preset's, 0.2)"})
    test_split: Literal["val", "test"] = field(default="val", metadata={"help": "held-out split of --data (ImageNet layout: val/)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.preset not in self.PRESET_VALUES:
            raise ValueError(f"--preset {self.preset!r} is unknown; expected one of {sorted(self.PRESET_VALUES)}")
        for name, value in self.PRESET_VALUES[self.preset].items():
            if getattr(self, name, None) is None:
                setattr(self, name, list(value) if isinstance(value, list) else value)
        if self.fraction is not None and self.subset_file is not None:
            raise ValueError("--fraction and --subset-file exclude each other; give one")
        if self.fraction is None and self.subset_file is None:
            self.fraction = 1
        if self.fraction is not None and not 0 < self.fraction <= 100:
            raise ValueError(f"--fraction must be a percentage in (0, 100], got {self.fraction}")
        if self.epochs <= 0:
            raise ValueError(f"--epochs must be positive, got {self.epochs}")
        if self.lr_backbone < 0 or self.lr_classifier <= 0:
            raise ValueError(f"--lr-backbone must be >= 0 and --lr-classifier positive, got {self.lr_backbone} and {self.lr_classifier}")


def run(config: SemiSupervisedConfig) -> dict[str, Any]:
    """Fine-tune the backbone of ``--weights`` on the labelled subset and score it; write results.json."""
    with process_group(config.device) as device:
        return _run(config, device)


def _run(config: SemiSupervisedConfig, device: torch.device) -> dict[str, Any]:
    tick = time.perf_counter()
    torch.manual_seed(config.seed)
    backbone, weights_id = load_eval_backbone(config)
    train_set, test_set = load_splits(config, config.test_split)
    indices = subset_indices(train_set, percent=config.fraction, subset_file=config.subset_file, seed=config.seed)
    if config.subset_file is not None:
        listing = read_subset_file(config.subset_file)
        subset = {"subset_file": str(listing.path), "subset_sha256": listing.sha256, "published": listing.published}
    else:
        subset = {"subset": f"seeded class-balanced {config.fraction}% (seed {config.seed})"}
    metrics = finetune(
        backbone, len(train_set.classes),
        Subset(TransformedDataset(train_set, train_transform(config.image_size)), indices),
        TransformedDataset(test_set, eval_transform(config.image_size)),
        lr_backbone=config.lr_backbone, lr_classifier=config.lr_classifier, epochs=config.epochs, batch_size=config.batch_size,
        schedule=config.schedule, milestones=config.milestones, gamma=config.gamma, weight_decay=config.weight_decay,
        momentum=config.momentum, seed=config.seed, num_workers=config.num_workers, device=device,
        desc=f"fine-tune ({config.preset}, {len(indices)} labels)",
    )
    record: dict[str, Any] = {"metrics": metrics}
    if is_main_process():
        record = write_results(
            config.out, protocol="semi", preset=config.preset, config=config, metrics=metrics, weights=config.weights,
            weights_sha256=weights_id, dataset=config.data,
            dataset_fingerprint=combined_fingerprint(dataset_fingerprint(train_set), dataset_fingerprint(test_set)),
            seed=config.seed, wall_time_s=time.perf_counter() - tick, notes={"labelled_samples": len(indices), **subset},
        )
    return record
