"""Linear probe on a frozen backbone, and linear transfer (docs/protocols.md §2, docs/evaluation.md)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from bt_hub.common.config import option, overrides
from bt_hub.common.distributed import distributed_data_parallel, is_main_process
from bt_hub.common.presets import shown
from bt_hub.common.runs import RunDir
from bt_hub.eval.classifier import evaluate_loader, loop_precision, make_classifier, make_loader, train_classifier
from bt_hub.eval.config import EvalConfig, warn_about_settings
from bt_hub.eval.features import TransformedDataset, train_transform
from bt_hub.eval.heads import (
    GRID_LRS,
    GRID_WEIGHT_DECAYS,
    MAX_EPOCHS,
    MAX_LR,
    NonFiniteLoss,
    grid_probes,
    score_heads,
    train_heads,
)
from bt_hub.eval.report import IMAGENET_FOLDERS, PaperRow, Table
from bt_hub.eval.runner import Cell, EvalRun, Scored
from bt_hub.method.transforms import eval_transforms


def equally_spaced_milestones(epochs: int, drops: int = 2) -> list[int]:
    """``drops`` LR drops at equally spaced epochs (14 epochs -> [5, 9]; 84 -> [28, 56])."""
    return [round(epochs * (i + 1) / (drops + 1)) for i in range(drops)]


LINEAR_TABLE = Table("Linear evaluation (paper Table 1)", ("top1", "top5"))
TRANSFER_TABLE = Table("Transfer to other classification tasks (paper Table 3)", ("top1", "mAP", "mAP_11point"))
_LOOP = "paper loop with augmentation"
# the paper's rows that a run from these presets follows, unless it searches a grid
PAPER_ROWS = {
    "imagenet": PaperRow("imagenet_linear", "ImageNet", f"preset imagenet; {_LOOP}", IMAGENET_FOLDERS, 50000),
    "places205": PaperRow(
        "places205_linear", "Places-205", f"preset places205; {_LOOP}", ("places205", "places"), 20500
    ),
    "inat18": PaperRow(
        "inat18_linear",
        "iNat18",
        f"preset inat18; {_LOOP}",
        ("inat18", "inat2018", "inaturalist2018", "inaturalist"),
        24426,
    ),
}


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

    preset: str = option("imagenet", "named sets of flag values; flags given override them")
    epochs: int = option(100, "training epochs")
    lr: float = option(0.3, "base LR for a batch of 256 images in all")
    weight_decay: float = option(1e-6, "SGD weight decay")
    momentum: float = option(0.9, "SGD momentum")
    schedule: Literal["cosine", "step"] = option("cosine", "per-epoch LR schedule")
    milestones: list[int] = option([], "epochs after which the step schedule multiplies the LR by --gamma", nargs="*")
    gamma: float = option(0.1, "LR factor at each milestone of the step schedule")
    crop_scale_min: float = option(
        0.08, "smallest area fraction of the training crops (paper: 0.08; small images want more)"
    )
    flip: bool = option(
        True, "random horizontal flips of the training images (paper: on; --no-flip for digits or text)"
    )
    cached: bool = option(
        False,
        "fast mode of the fixed recipe: train its classifier on cached test-transform features (no augmentation, "
        "no backbone pass per epoch); results say 'cached features, no augmentation'. The grid search trains on "
        "cached features whatever this says",
    )

    search: Literal["auto", "grid", "fixed"] = option(
        "auto",
        "grid: one head per --lr-grid x --weight-decay-grid pair trained at once on frozen features, the best "
        "chosen on --val-fraction of the training split; fixed: the preset's single recipe; auto: fixed on "
        "the data a paper preset was set for (e.g. 1000 classes for imagenet), grid on any other",
    )
    lr_grid: list[float] = option(list(GRID_LRS), "learning rates of the grid's heads")
    weight_decay_grid: list[float] = option(list(GRID_WEIGHT_DECAYS), "weight decays of the grid's heads")
    val_fraction: float = option(
        0.2, "seeded, class-stratified share of the training split the grid's choice is made on"
    )

    def __post_init__(self) -> None:
        self._use_every_flag()  # the search is settled first: which flags the run reads depends on it
        super().__post_init__()
        flag = self.flag  # each probe setting in its working range, in one sentence naming the flag as typed
        if not 1 <= self.epochs <= MAX_EPOCHS:
            raise ValueError(f"{flag('epochs')} must be an integer in [1, {MAX_EPOCHS}], got {self.epochs}")
        for name, values in (("lr", [self.lr]), ("lr_grid", self.lr_grid)):
            if not values or any(not 0 < v <= MAX_LR for v in values):
                raise ValueError(f"{flag(name)} must be in (0, {MAX_LR:g}], got {shown(values)}")
        for name, values in (("weight_decay", [self.weight_decay]), ("weight_decay_grid", self.weight_decay_grid)):
            if not values or any(not 0 <= v < 1 for v in values):
                raise ValueError(f"{flag(name)} must be in [0, 1), got {shown(values)}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"{flag('momentum')} must be in [0, 1), got {self.momentum:g}")
        if not 0 < self.val_fraction <= 0.5:
            raise ValueError(f"{flag('val_fraction')} must be in (0, 0.5], got {self.val_fraction:g}")
        self.require_fraction("gamma")
        if sorted(self.milestones) != list(self.milestones) or any(m <= 0 for m in self.milestones):
            raise ValueError(f"{flag('milestones')} must be increasing positive epochs, got {shown(self.milestones)}")
        self.require_fraction("crop_scale_min")

    def unused_flags(self) -> dict[str, str]:
        """The feature cache and CPU autocast under the paper's loop (``--search fixed`` without ``--cached``)."""
        unused = super().unused_flags()
        if self.search == "fixed" and not self.cached:
            why = "does not apply to the paper's loop (--search fixed without --cached), which extracts no features"
            unused |= {"cache_dir": why, "cache_dtype": why}
            if self.precision == "bf16" and not self.device.startswith("cuda"):
                unused["precision"] = "applies to the paper's loop on CUDA only; on the CPU it runs in fp32"
        return unused

    def _use_every_flag(self) -> None:
        """Flags of one search switch ``--search auto`` to it; flags the chosen search would ignore are refused."""
        changed = set(overrides(self, ignore=self.RUN_FIELDS))
        fixed = [self.flag(n) for n in ("lr", "weight_decay", "crop_scale_min", "flip") if n in changed]
        grid = [self.flag(n) for n in ("lr_grid", "weight_decay_grid", "val_fraction") if n in changed]
        if self.search == "auto" and fixed and grid:
            raise ValueError(
                f"{', '.join(fixed)} set the fixed recipe and {', '.join(grid)} the grid search; "
                "pass --search fixed or --search grid, or drop one set"
            )
        if self.search == "auto" and (fixed or grid):
            self.search = "fixed" if fixed else "grid"
        if self.search == "grid" and fixed:
            raise ValueError(
                f"{', '.join(fixed)} apply to the fixed recipe, which --search grid does not run (it searches "
                "--lr-grid x --weight-decay-grid on cached features); drop them or pass --search fixed"
            )
        if self.search == "fixed" and grid:
            raise ValueError(f"{', '.join(grid)} apply to --search grid only; drop them or pass --search grid")
        augment = [self.flag(n) for n in ("crop_scale_min", "flip") if n in changed]
        if self.cached and augment:
            raise ValueError(
                f"{', '.join(augment)} shape the augmented views of the paper loop, which --cached skips "
                "(it trains on test-transform features); drop them or --cached"
            )

    def uses_grid(self, num_classes: int) -> bool:
        """Whether this run searches the grid: asked for, or ``auto`` on data its paper preset was not set for."""
        if self.search != "auto":
            return self.search == "grid"
        assumed = self.PRESET_ASSUMPTIONS.get(self.preset, {}).get("num_classes")
        return not (self.preset in PAPER_ROWS and num_classes == assumed)


@dataclass
class TransferConfig(LinearConfig):
    """Flags of ``bt-hub eval transfer``: the linear probe with PIRL's settings on any ImageFolder dataset."""

    preset: str = option("places205", "named sets of flag values; flags given override them")


def score(run: EvalRun) -> Scored:
    """The grid probe or the fixed recipe on cached features (:func:`score_cell`), or the paper's loop; top-1 /
    top-5 on the test split, with the warnings of a preset set for other data."""
    config, splits = run.config, run.splits
    warned = warn_about_settings(
        config, num_classes=len(splits.classes), train_images=len(splits.train), image_side=splits.image_side()
    )
    if config.cached or config.uses_grid(len(splits.classes)):
        scored = score_cell(run, config, config.seed)
    else:
        notes = {"search": "fixed", "loop_precision": loop_precision(run.device, run.settings.precision)}
        scored = _scored(config, _paper_loop(run, len(splits.classes)), "loop", notes)
    scored.warnings = warned
    return scored


def score_cell(cell: Cell, config: LinearConfig, seed: int) -> Scored:
    """The probe on ``cell``'s frozen features: the grid (heads chosen on a validation split drawn with ``seed``)
    or the preset's one recipe (``--cached``)."""
    return score_cells([cell], config, seed)[0]


def score_cells(cells: Sequence[Cell], config: LinearConfig, seed: int) -> list[Scored]:
    """:func:`score_cell` of several cells on the same splits and labels (the rows of ``eval compare``), each what it
    scores alone; the grids of the cells whose features share a width are trained together (``grid_probes``)."""
    num_classes = len(cells[0].splits.classes)
    pairs = [(cell.features("train"), cell.features("test")) for cell in cells]
    if not config.uses_grid(num_classes):
        return [
            _scored(config, _fixed_on_features(config, train, test, num_classes, seed, cell.device), "cached")
            for cell, (train, test) in zip(cells, pairs)
        ]
    scored: dict[int, Scored] = {}
    for width in dict.fromkeys(train[0].shape[1] for train, _ in pairs):
        group = [i for i, (train, _) in enumerate(pairs) if train[0].shape[1] == width]
        heads = len(config.lr_grid) * len(config.weight_decay_grid) * len(group)
        found = grid_probes(
            [pairs[i][0][0] for i in group],
            pairs[group[0]][0][1],
            [pairs[i][1][0] for i in group],
            pairs[group[0]][1][1],
            num_classes,
            **_schedule(config),
            batch_size=config.batch_size,
            device=cells[0].device,
            lrs=config.lr_grid,
            weight_decays=config.weight_decay_grid,
            val_fraction=config.val_fraction,
            seed=seed,
            desc=f"linear grid ({heads} heads)",
            progress=cells[0].progress,
        )
        for i, one in zip(group, found):
            metrics, correct = one.pop("metrics"), one.pop("correct")
            scored[i] = _scored(config, metrics, "cached", {"search": "grid", **one}, grid=True, correct=correct)
    return [scored[i] for i in range(len(cells))]


def _scored(
    config: LinearConfig,
    metrics: dict[str, float],
    mode: str,
    notes: dict[str, Any] | None = None,
    grid: bool = False,
    correct: Any = None,
) -> Scored:
    transfer = isinstance(config, TransferConfig)
    return Scored(
        metrics,
        mode=mode,
        preset=config.preset,
        paper=None if grid else PAPER_ROWS.get(config.preset or ""),
        table=TRANSFER_TABLE if transfer or config.preset in ("places205", "inat18") else LINEAR_TABLE,
        notes=notes or {"search": "fixed"},
        correct=correct,
    )


def _schedule(config: LinearConfig) -> dict[str, Any]:
    keys = ("epochs", "momentum", "schedule", "milestones", "gamma")
    return {k: getattr(config, k) for k in keys}


def _fixed_on_features(
    config: LinearConfig, train: tuple[Any, Any], test: tuple[Any, Any], num_classes: int, seed: int, device: Any
) -> dict[str, float]:
    """The preset's one recipe trained on cached test-transform features (``--cached``)."""
    heads = train_heads(
        *train,
        num_classes,
        lrs=[config.lr],
        weight_decays=[config.weight_decay],
        seed=seed,
        desc="linear (cached)",
        batch_size=config.batch_size,
        device=device,
        **_schedule(config),
    )
    if heads.diverged[0] is not None:
        raise _diverged(config, heads.diverged[0])
    return {k: v for k, v in score_heads(heads, *test)[0].items() if k != "loss"}


def _paper_loop(run: EvalRun, num_classes: int) -> dict[str, float]:
    """The paper's probe: the frozen backbone (eval mode) runs on augmented views every epoch."""
    config, splits, device, size = run.config, run.splits, run.device, run.settings.image_size
    backbone = run.weights.network
    fc = make_classifier(backbone.feature_dim, num_classes)
    model = distributed_data_parallel(FrozenBackboneClassifier(backbone, fc).to(device), device)
    augment = train_transform(size, crop_scale_min=config.crop_scale_min, flip=config.flip)
    loaders = [
        make_loader(
            TransformedDataset(dataset, transform),
            config.batch_size,
            shuffle=shuffle,
            seed=config.seed,
            num_workers=config.num_workers,
            device=device,
        )
        for dataset, transform, shuffle in ((splits.train, augment, True), (splits.test, eval_transforms(size), False))
    ]
    on_epoch = None
    if run.out is not None:  # the per-epoch loss goes to metrics.jsonl of the run's folder
        run_dir = RunDir(run.out, config, write=is_main_process(), kind="eval", claimed=True)
        on_epoch = lambda epoch, loss: _log_epoch(run_dir, config, epoch, loss)  # noqa: E731
    train_classifier(
        model,
        [{"params": list(fc.parameters()), "lr": config.lr}],
        loaders[0],
        device=device,
        desc=f"linear ({config.preset})",
        on_epoch=on_epoch,
        weight_decay=config.weight_decay,
        precision=run.settings.precision,
        **_schedule(config),
    )
    return evaluate_loader(model, loaders[1], device, desc="score test", precision=run.settings.precision)


def _diverged(config: LinearConfig, epoch: int) -> NonFiniteLoss:
    return NonFiniteLoss(
        f"the linear probe's training loss became non-finite in epoch {epoch + 1} with --lr {config.lr:g} and "
        f"--weight-decay {config.weight_decay:g}; lower --lr (or use --search grid)"
    )


def _log_epoch(run_dir: RunDir, config: LinearConfig, epoch: int, loss: float) -> None:
    if not math.isfinite(loss):
        raise _diverged(config, epoch)
    run_dir.log({"epoch": epoch, "train_loss": loss})
