"""Semi-supervised evaluation: fine-tune the whole network on 1% or 10% of the labels.

docs/protocols.md §2; the paper's Table 2. Presets (``--preset``;
bt_hub.common.presets):

- ``paper``: 20 epochs; SGD momentum 0.9, no weight decay, batch 256; lr 0.002 for the
  backbone and 0.5 for the classifier, both x0.2 after epochs 12 and 16; train
  RandomResizedCrop (8-100% of the area) + flip, test Resize + CenterCrop.
- ``reference`` (the reference implementation's README): lr 0.005 / 0.5 with a cosine schedule.
- ``small``: for small images of few classes, the fine-tuning recipe the digits demo measured
  (eval/demo.py, docs/evaluation.md "The demo"): classifier lr 0.05 (the paper's 0.5 is set for 1,000
  classes and batches of 256, and swamps the pretrained backbone on ten classes), cosine,
  batch 32, crops of 40-100% of the area, no flip; checked on a held-out 20% of the digits'
  training split, never on their test split (docs/evaluation.md "Presets fit the data, or say they don't").

The labelled subset comes from a SimCLR-format list (``--subset-file``, e.g. the published
``1percent.txt``, matched by file name) or is a seeded class-balanced ``--fraction`` percent
of any dataset (bt_hub.eval.label_subsets). BN layers train (batch statistics), unlike the linear
probe.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from bt_hub.common.config import option
from bt_hub.common.distributed import convert_sync_batchnorm, distributed_data_parallel, is_distributed
from bt_hub.common.presets import shown
from bt_hub.eval.classifier import evaluate_loader, loop_precision, make_classifier, make_loader, train_classifier
from bt_hub.eval.config import EvalConfig, warn_about_settings
from bt_hub.eval.features import TransformedDataset, train_transform
from bt_hub.eval.label_subsets import read_subset_file, subset_indices
from bt_hub.eval.report import IMAGENET_FOLDERS, PaperRow, Table
from bt_hub.eval.runner import Cell, EvalRun, Scored
from bt_hub.eval.splits import indices_sha256
from bt_hub.method.transforms import eval_transforms

# Flags of the fine-tuning recipe that finetune() takes as they are, under the same names.
_RECIPE_FIELDS = ("lr_backbone", "lr_classifier", "schedule", "milestones", "gamma", "weight_decay", "momentum")


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
    precision: str = "fp32",
    hits: torch.Tensor | None = None,
) -> dict[str, float]:
    """Fine-tune backbone + a new linear classifier on ``train_set``; return test top-1 / top-5 (percent).

    Args:
        backbone: images -> features, with a ``feature_dim`` attribute (trained in place).
        num_classes: classifier outputs.
        train_set, test_set: datasets yielding transformed ``(image tensor, label)``.
        lr_backbone, lr_classifier: base LRs of the two parameter groups.
        schedule, milestones, gamma: per-epoch LR (bt_hub.eval.classifier.lr_factor).
        seed: seeds the classifier init and the data order.
        precision: the resolved ``--precision``: the autocast of the loop on CUDA (``loop_autocast``).
        hits: one boolean per test image: whether its top-1 was right, written there (``evaluate_loader``).
    """
    device = torch.device(device)
    torch.manual_seed(seed)
    fc = make_classifier(backbone.feature_dim, num_classes)
    model: nn.Module = nn.Sequential(backbone, fc).to(device)
    groups = [
        {"params": list(fc.parameters()), "lr": lr_classifier},
        {"params": list(backbone.parameters()), "lr": lr_backbone},
    ]
    if is_distributed():
        model = convert_sync_batchnorm(model)  # BN statistics of the global batch, on CPU too
    model = distributed_data_parallel(model, device)
    train_loader = make_loader(train_set, batch_size, shuffle=True, seed=seed, num_workers=num_workers, device=device)
    test_loader = make_loader(test_set, batch_size, shuffle=False, seed=seed, num_workers=num_workers, device=device)
    train_classifier(
        model,
        groups,
        train_loader,
        epochs=epochs,
        momentum=momentum,
        weight_decay=weight_decay,
        schedule=schedule,
        milestones=milestones,
        gamma=gamma,
        device=device,
        desc=desc,
        precision=precision,
    )
    return evaluate_loader(model, test_loader, device, desc="score test", precision=precision, hits=hits)


@dataclass
class SemiSupervisedConfig(EvalConfig):
    """Flags of ``bt-hub eval semi``; the defaults are the ``paper`` preset."""

    RUN_FIELDS: ClassVar[tuple[str, ...]] = EvalConfig.RUN_FIELDS + (
        "fraction",
        "subset_file",
    )  # recorded under "labels"
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "paper": {},
        "reference": {"lr_backbone": 0.005, "schedule": "cosine", "milestones": []},
        # The digits demo's fine-tuning (eval/demo.py); see the module docstring.
        "small": {
            "lr_classifier": 0.05,
            "schedule": "cosine",
            "milestones": [],
            "batch_size": 32,
            "crop_scale_min": 0.4,
            "flip": False,
        },
    }
    PRESET_ASSUMPTIONS: ClassVar[dict[str, dict[str, Any]]] = {
        "paper": {"num_classes": 1000, "image_size": 224},
        "reference": {"num_classes": 1000, "image_size": 224},
        "small": {"num_classes": 10, "image_size": 16},
    }

    preset: str = option("paper", "named sets of flag values; flags given override them")
    fraction: int | None = option(
        None,
        "percent of the labels, class-balanced and seeded (1 or 10 in the paper); default 1 unless "
        "--subset-file is given",
    )
    subset_file: str | None = option(
        None, "SimCLR-format list of labelled training files (e.g. 1percent.txt), matched by file name"
    )
    epochs: int = option(20, "fine-tuning epochs")
    min_steps: int = option(
        0,
        "the fewest SGD steps: where the labelled images are few, the epochs rise until they make this "
        "many at --batch-size (0: --epochs as given; eval compare's --finetune-steps)",
    )
    lr_backbone: float = option(0.002, "backbone LR")
    lr_classifier: float = option(0.5, "classifier LR")
    weight_decay: float = option(0.0, "SGD weight decay")
    momentum: float = option(0.9, "SGD momentum")
    schedule: Literal["cosine", "step"] = option("step", "per-epoch LR schedule")
    milestones: list[int] = option(
        [12, 16], "epochs after which the step schedule multiplies both LRs by --gamma", nargs="*"
    )
    gamma: float = option(0.2, "LR factor at each milestone")
    crop_scale_min: float = option(
        0.08, "smallest area fraction of the training crops (paper: 0.08; small images want more)"
    )
    flip: bool = option(
        True, "random horizontal flips of the training images (paper: on; --no-flip for digits or text)"
    )
    decode: Literal["workers"] = option(
        "workers", "the fine-tuning loop decodes and augments in PIL in the loader workers; the only choice"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        flag = self.flag
        if self.fraction is not None and self.subset_file is not None:
            raise ValueError(f"{flag('fraction')} and {flag('subset_file')} exclude each other; give one")
        if self.fraction is None and self.subset_file is None:
            self.fraction = 1
        if self.fraction is not None and not 0 < self.fraction <= 100:
            raise ValueError(f"{flag('fraction')} must be a percentage in (0, 100], got {self.fraction}")
        self.require_positive("epochs")
        self.require_positive("min_steps", or_zero=True)
        if self.lr_backbone < 0 or self.lr_classifier <= 0:
            raise ValueError(
                f"{flag('lr_backbone')} must be >= 0 and {flag('lr_classifier')} positive, "
                f"got {self.lr_backbone} and {self.lr_classifier}"
            )
        if sorted(self.milestones) != list(self.milestones) or any(m <= 0 for m in self.milestones):
            raise ValueError(f"{flag('milestones')} must be increasing positive epochs, got {shown(self.milestones)}")
        self.require_fraction("crop_scale_min")

    def unused_flags(self) -> dict[str, str]:
        """The shared flags fine-tuning does not read: the feature cache, device decoding, CPU autocast."""
        no_features = "does not apply to eval semi: fine-tuning trains on images and extracts no features"
        unused = super().unused_flags() | {"cache_dir": no_features, "cache_dtype": no_features}
        in_pil = "does not apply to eval semi: fine-tuning decodes and augments in PIL in the loader workers"
        unused.update(dict.fromkeys(("decode", "store"), in_pil))
        if self.precision == "bf16" and not self.device.startswith("cuda"):
            unused["precision"] = "applies to fine-tuning on CUDA only; on the CPU the loop runs in fp32"
        return unused


TABLE = Table("Semi-supervised fine-tuning (paper Table 2)", ("top1", "top5"))
# the paper's rows, by label percentage, that a run of the ``paper`` preset follows
PAPER_ROWS = {
    pct: PaperRow(
        f"semi_supervised_{pct}pct",
        "ImageNet",
        f"{pct}% labels (SimCLR list {pct}percent.txt); preset paper; paper loop with augmentation",
        IMAGENET_FOLDERS,
        50000,
        labels=f"{pct}percent.txt",
    )
    for pct in (1, 10)
}


def paper_row(config: SemiSupervisedConfig, labels: Mapping[str, Any]) -> PaperRow | None:
    """The paper's row this run follows: the ``paper`` preset on 1% or 10% of the labels, else None."""
    return PAPER_ROWS.get(labels.get("fraction")) if config.preset == "paper" else None


def _labels(config: SemiSupervisedConfig, indices: Sequence[int], train_size: int, seed: int) -> dict[str, Any]:
    """What the results say about the labelled subset: fraction, source, count, and the list's name and hash."""
    if config.subset_file is None:
        return {"fraction": config.fraction, "source": "seeded", "seed": seed, "count": len(indices)}
    listing = read_subset_file(config.subset_file)
    fraction = (
        int(listing.published.removesuffix("percent.txt"))
        if listing.published
        else round(100.0 * len(indices) / train_size, 2)
    )
    return {
        "fraction": fraction,
        "source": "list",
        "file": listing.path.name,
        "sha256": listing.sha256,
        "published": listing.published,
        "count": len(indices),
    }


def dataset_info(run: EvalRun) -> dict[str, Any]:
    """The record's ``dataset`` block: the run's splits, the training split's with the sha256 of the labelled subset's
    indices (a list changed in place under the same name draws another subset: ``eval all`` scores it again)."""
    info = dict(run.splits.info)
    labelled = indices_sha256(_subset(run, run.config, run.config.seed))
    return info | {"train": {**info["train"], "labelled_indices_sha256": labelled}}


def score(run: EvalRun) -> Scored:
    """``bt-hub eval semi``'s scoring step, with the warnings of a preset set for other data: :func:`score_cell`."""
    config, splits = run.config, run.splits
    indices = _subset(run, config, config.seed)
    warned = warn_about_settings(
        config, num_classes=len(splits.classes), train_images=len(indices), image_side=splits.image_side()
    )
    scored = score_cell(run, config, config.seed)
    scored.warnings, scored.dataset = warned, dataset_info(run)
    return scored


def _subset(cell: Cell, config: SemiSupervisedConfig, seed: int) -> list[int]:
    return subset_indices(cell.splits.train, percent=config.fraction, subset_file=config.subset_file, seed=seed)


def score_cell(cell: Cell, config: SemiSupervisedConfig, seed: int) -> Scored:
    """Fine-tune a copy of ``cell.network`` and a new classifier on the labelled subset (drawn with ``seed``);
    top-1 / top-5 on the test split."""
    splits, size = cell.splits, cell.settings.image_size
    indices = _subset(cell, config, seed)
    epochs = max(config.epochs, math.ceil(config.min_steps / math.ceil(len(indices) / config.batch_size)))
    augment = train_transform(size, crop_scale_min=config.crop_scale_min, flip=config.flip)
    hits = torch.zeros(len(splits.test), dtype=torch.bool)
    metrics = finetune(
        copy.deepcopy(cell.network),  # the run's weights stay as loaded for the protocols after this one
        len(splits.classes),
        Subset(TransformedDataset(splits.train, augment), indices),
        TransformedDataset(splits.test, eval_transforms(size)),
        **{name: getattr(config, name) for name in _RECIPE_FIELDS},
        epochs=epochs,
        batch_size=config.batch_size,
        seed=seed,
        num_workers=config.num_workers,
        device=cell.device,
        desc=f"fine-tune ({config.preset}, {len(indices)} labels)",
        precision=cell.settings.precision,
        hits=hits,
    )
    labels = _labels(config, indices, len(splits.train), seed)
    notes = {"loop_precision": loop_precision(cell.device, cell.settings.precision), "epochs": epochs}
    return Scored(
        metrics,
        mode="loop",
        preset=config.preset,
        paper=paper_row(config, labels),
        table=TABLE,
        labels=labels,
        notes=notes,
        correct=hits.numpy(),
    )
