"""Linear probe on a frozen backbone, and linear transfer (docs/protocols.md §2).

Presets (``--preset``; bt_hub.common.presets):

- ``imagenet`` (the paper, Table 1): backbone frozen in eval mode (BN uses running
  statistics); fc init N(0, 0.01), bias 0; SGD momentum 0.9, lr 0.3, wd 1e-6, batch 256,
  100 epochs, cosine per epoch, no warm-up; train RandomResizedCrop (8-100% of the area) +
  flip, test Resize + CenterCrop; top-1 / top-5.
- ``places205`` / ``inat18`` (PIRL's settings, the paper's Table 3): SGD momentum 0.9, lr
  0.01, wd 5e-4, batch 256, 14 / 84 epochs, lr x0.1 at two equally spaced points. VISSL's
  configs drop three times instead ([4, 8, 12] and [24, 48, 72]): pass ``--milestones``.
- ``small``: the imagenet recipe with crops of 40-100% of the area and no flip, for small
  images of few classes (the digits demo's crops; on its 8-px digits the paper's crops and
  flips cost 20 points of top-1, docs/performance.md "Cached linear probe").

``--cached`` trains the same classifier, with the same optimiser and schedule, on the
cached test-transform features of bt_hub.eval.features (no augmentation, so no backbone pass
per epoch); results say ``mode: cached`` ("cached features, no augmentation"). Under
torchrun the loop shards the data with a DistributedSampler and averages classifier
gradients with DDP.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from bt_hub.common.distributed import is_distributed, is_main_process, process_group
from bt_hub.common.runs import RunDir
from bt_hub.eval.classifier import (
    evaluate_features,
    evaluate_loader,
    make_classifier,
    make_loader,
    train_classifier,
    train_on_features,
)
from bt_hub.eval.config import EvalConfig, warn_about_settings
from bt_hub.eval.features import TransformedDataset, features_for, load_eval_backbone, train_transform
from bt_hub.eval.report import write_results
from bt_hub.eval.splits import splits_for
from bt_hub.method.transforms import eval_transforms


def equally_spaced_milestones(epochs: int, drops: int = 2) -> list[int]:
    """``drops`` LR drops at equally spaced epochs (14 epochs -> [5, 9]; 84 -> [28, 56])."""
    return [round(epochs * (i + 1) / (drops + 1)) for i in range(drops)]


# the paper's rows (bt_hub.common.records.PAPER_RESULTS) that a run from these presets follows
PAPER_TASKS = {"imagenet": "imagenet_linear", "places205": "places205_linear", "inat18": "inat18_linear"}


class FrozenBackboneClassifier(nn.Module):
    """A frozen backbone (kept in eval mode, no gradients) followed by a trainable linear layer."""

    def __init__(self, backbone: nn.Module, fc: nn.Linear) -> None:
        super().__init__()
        self.backbone = backbone.requires_grad_(False)
        self.fc = fc

    def train(self, mode: bool = True) -> FrozenBackboneClassifier:
        """Only the classifier changes mode: the backbone's BN keeps its running statistics."""
        super().train(mode)
        self.backbone.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            feats = self.backbone(x)
        return self.fc(feats.float())


# ----------------------------------------------------------------------------- the protocol


@dataclass
class LinearConfig(EvalConfig):
    """Flags of ``bt-hub eval linear``; the defaults are the ``imagenet`` preset (the paper's probe)."""

    RUN_FIELDS: ClassVar[tuple[str, ...]] = EvalConfig.RUN_FIELDS + ("cached",)  # recorded as the run's mode
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "imagenet": {},
        # PIRL's transfer settings: x0.1 at two equally spaced epochs.
        "places205": {
            "epochs": 14,
            "lr": 0.01,
            "weight_decay": 5e-4,
            "schedule": "step",
            "milestones": equally_spaced_milestones(14),
        },
        "inat18": {
            "epochs": 84,
            "lr": 0.01,
            "weight_decay": 5e-4,
            "schedule": "step",
            "milestones": equally_spaced_milestones(84),
        },
        # The digits demo's crops (eval/demo.py): >= 40% of the area, no flip.
        "small": {"crop_scale_min": 0.4, "flip": False},
    }
    PRESET_ASSUMPTIONS: ClassVar[dict[str, dict[str, Any]]] = {
        "imagenet": {"num_classes": 1000, "image_size": 224},
        "places205": {"num_classes": 205, "image_size": 224},
        "inat18": {"num_classes": 8142, "image_size": 224},
        "small": {"num_classes": 10, "image_size": 16},
    }

    preset: str = field(default="imagenet", metadata={"help": "named sets of flag values; flags given override them"})
    epochs: int = field(default=100, metadata={"help": "training epochs"})
    lr: float = field(default=0.3, metadata={"help": "base LR for a batch of 256 images in all"})
    weight_decay: float = field(default=1e-6, metadata={"help": "SGD weight decay"})
    momentum: float = field(default=0.9, metadata={"help": "SGD momentum"})
    schedule: Literal["cosine", "step"] = field(default="cosine", metadata={"help": "per-epoch LR schedule"})
    milestones: list[int] = field(
        default_factory=list,
        metadata={"help": "epochs after which the step schedule multiplies the LR by --gamma", "nargs": "*"},
    )
    gamma: float = field(default=0.1, metadata={"help": "LR factor at each milestone of the step schedule"})
    crop_scale_min: float = field(
        default=0.08,
        metadata={"help": "smallest area fraction of the training crops (paper: 0.08; small images want more)"},
    )
    flip: bool = field(
        default=True,
        metadata={"help": "random horizontal flips of the training images (paper: on; --no-flip for digits or text)"},
    )
    cached: bool = field(
        default=False,
        metadata={
            "help": (
                "fast mode: train the same classifier on cached test-transform features (no augmentation, no "
                "backbone pass per epoch); results say 'cached features, no augmentation'"
            )
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.epochs <= 0:
            raise ValueError(f"--epochs must be positive, got {self.epochs}")
        if self.lr <= 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        if self.weight_decay < 0 or self.momentum < 0:
            raise ValueError(
                f"--weight-decay and --momentum must be non-negative, got {self.weight_decay} and {self.momentum}"
            )
        if sorted(self.milestones) != list(self.milestones) or any(m <= 0 for m in self.milestones):
            raise ValueError(f"--milestones must be increasing positive epochs, got {self.milestones}")
        if not 0 < self.crop_scale_min <= 1:
            raise ValueError(f"--crop-scale-min must be in (0, 1], got {self.crop_scale_min}")


@dataclass
class TransferConfig(LinearConfig):
    """Flags of ``bt-hub eval transfer``: the linear probe with PIRL's settings on any ImageFolder dataset.

    Build it with ``bt_hub.common.presets.from_preset(TransferConfig, ...)`` (as the CLI does): the
    default preset is ``places205``.
    """

    preset: str = field(default="places205", metadata={"help": "named sets of flag values; flags given override them"})


def run(config: LinearConfig) -> dict[str, Any]:
    """Train and score a linear classifier on the frozen backbone of ``--weights``; write the results.

    A ``TransferConfig`` is recorded as protocol ``transfer``, a ``LinearConfig`` as ``linear``.

    Returns:
        The results record (metrics ``top1`` / ``top5`` in percent; bt_hub.common.records).
    """
    with process_group(config.device) as device:
        return _run(config, device)


def _run(config: LinearConfig, device: torch.device) -> dict[str, Any]:
    tick = time.perf_counter()
    torch.manual_seed(config.seed)
    backbone, weights_id = load_eval_backbone(config)
    splits = splits_for(config)
    warned = warn_about_settings(
        config, num_classes=len(splits.classes), train_images=len(splits.train), image_side=splits.image_side()
    )
    num_classes = len(splits.classes)
    run_dir = RunDir(config.out, config, write=is_main_process())
    schedule = {
        "epochs": config.epochs,
        "weight_decay": config.weight_decay,
        "momentum": config.momentum,
        "schedule": config.schedule,
        "milestones": config.milestones,
        "gamma": config.gamma,
    }
    if config.cached:
        fingerprints = {name: splits.info[name]["fingerprint"] for name in ("train", "test")}
        train_x, train_y = features_for(
            config, backbone, splits.train, weights_id=weights_id, dataset_id=fingerprints["train"], split="train"
        )
        test_x, test_y = features_for(
            config, backbone, splits.test, weights_id=weights_id, dataset_id=fingerprints["test"], split="test"
        )
        fc = train_on_features(
            train_x,
            train_y,
            num_classes,
            lr=config.lr,
            batch_size=config.batch_size,
            seed=config.seed,
            device=device,
            **schedule,
        )
        metrics = evaluate_features(fc, test_x, test_y)
    else:
        fc = make_classifier(backbone.feature_dim, num_classes)
        model: nn.Module = FrozenBackboneClassifier(backbone, fc).to(device)
        if is_distributed():
            model = nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None
            )
        augment = train_transform(config.image_size, crop_scale_min=config.crop_scale_min, flip=config.flip)
        train_loader = make_loader(
            TransformedDataset(splits.train, augment),
            config.batch_size,
            shuffle=True,
            seed=config.seed,
            num_workers=config.num_workers,
            device=device,
        )
        test_loader = make_loader(
            TransformedDataset(splits.test, eval_transforms(config.image_size)),
            config.batch_size,
            shuffle=False,
            seed=config.seed,
            num_workers=config.num_workers,
            device=device,
        )
        train_classifier(
            model,
            [{"params": list(fc.parameters()), "lr": config.lr}],
            train_loader,
            device=device,
            desc=f"linear ({config.preset})",
            on_epoch=lambda epoch, loss: run_dir.log({"epoch": epoch, "train_loss": loss}),
            **schedule,
        )
        metrics = evaluate_loader(model, test_loader, device, desc="score test")
    record = {"metrics": metrics}
    if is_main_process():
        record = write_results(
            config.out,
            protocol="transfer" if isinstance(config, TransferConfig) else "linear",
            config=config,
            preset=config.preset,
            mode="cached" if config.cached else "loop",
            metrics=metrics,
            weights=config.weights,
            weights_sha256=weights_id,
            dataset=splits.info,
            seed=config.seed,
            wall_time_s=time.perf_counter() - tick,
            warnings=warned,
            paper_task=PAPER_TASKS.get(config.preset or ""),
        )
    return record
