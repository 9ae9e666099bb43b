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

``--search grid`` (the default on data that is not the preset's own, e.g. anything but
ImageNet for ``imagenet``) trains one head per (``--lr-grid`` x ``--weight-decay-grid``) pair
at once on the frozen features (DINOv2's linear evaluation: one stacked weight tensor, every
head updated from the same batch, one pass over the features per epoch), scores every head
on a seeded, class-stratified ``--val-fraction`` of the training split (never the test
split), and reports the test accuracy of the best head (ties: lower validation loss, then
grid order) as trained on the rest; the record's ``notes`` hold the whole grid, the choice
and the validation split. ``--search fixed`` is the preset's single recipe.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bt_hub.common.distributed import is_distributed, is_main_process, process_group
from bt_hub.common.progress import progress as reported
from bt_hub.common.runs import RunDir, releases_claim
from bt_hub.eval.classifier import (
    epoch_permutation,
    evaluate_loader,
    lr_factor,
    make_classifier,
    make_loader,
    topk_correct,
    train_classifier,
)
from bt_hub.eval.config import EvalConfig, warn_about_settings
from bt_hub.eval.features import TransformedDataset, features_for, load_eval_backbone, train_transform
from bt_hub.eval.report import write_results
from bt_hub.eval.splits import indices_sha256, splits_for, stratified_holdout
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


# ----------------------------------------------------------------------------- K heads at once

# The default grid: 6 learning rates x 2 weight decays = 12 heads (lr per batch of --batch-size features).
GRID_LRS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
GRID_WEIGHT_DECAYS = (0.0, 1e-3)
MAX_LR = 100.0  # larger LRs only overflow a linear classifier
MAX_EPOCHS = 100_000
# train_heads' softmax probabilities below this count as 0: subnormal floats slow x86 arithmetic ~10x
TINY_PROBABILITY = 2.0**-100


class NonFiniteLoss(ValueError):
    """The training loss of a linear head became NaN or inf."""


@dataclass
class LinearHeads:
    """K linear classifiers over the same features: ``weight`` K x C x D, ``bias`` K x C.

    ``lrs`` / ``weight_decays`` are each head's hyper-parameters; ``diverged[k]`` is the epoch
    (0-based) in which head k's loss became non-finite, else None (it stopped training there and
    keeps the weights it had at the start of that epoch).
    """

    weight: torch.Tensor
    bias: torch.Tensor
    lrs: list[float]
    weight_decays: list[float]
    diverged: list[int | None]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """N x K x C logits of every head: one matrix product for all of them."""
        k, c, d = self.weight.shape
        return (x @ self.weight.reshape(k * c, d).T + self.bias.reshape(-1)).view(len(x), k, c)


def _feature_rows(features: torch.Tensor | np.ndarray, idx: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Rows ``idx`` of a tensor or a (memory-mapped) array as float32 on ``device`` (arrays: ``idx`` sorted)."""
    if isinstance(features, torch.Tensor):
        return features[idx.to(features.device)].float().to(device)
    return torch.from_numpy(np.asarray(features[idx.numpy()], dtype=np.float32)).to(device)


def train_heads(
    features: torch.Tensor | np.ndarray,
    labels: torch.Tensor,
    num_classes: int,
    *,
    lrs: Sequence[float],
    weight_decays: Sequence[float],
    epochs: int,
    batch_size: int = 256,
    momentum: float = 0.9,
    schedule: str = "cosine",
    milestones: Sequence[int] = (),
    gamma: float = 0.1,
    seed: int = 0,
    rows: Sequence[int] | None = None,
    device: str | torch.device | None = None,
    progress: bool = True,
    desc: str = "linear heads",
) -> LinearHeads:
    """Train one linear head per ``(lrs[k], weight_decays[k])`` at once on fixed features.

    Every head starts from the same paper initialisation (``make_classifier`` after
    ``torch.manual_seed(seed)``) and sees the same batches (``epoch_permutation``), and each
    follows SGD with momentum and weight decay on its own LR, so one head is
    bt_hub.eval.classifier.train_on_features (to float32 rounding); the cost of K heads is one
    pass over the features per epoch, one K-times wider matrix product each way per batch (the
    bias rides as an extra weight column) and three element-wise updates of one flat parameter
    buffer. Finiteness is checked once per
    epoch: a head whose weights became non-finite in an epoch is put back to where it started
    that epoch and trains no further (``diverged``).

    Args:
        features, labels: N x D features (tensor or memmap) and N labels.
        lrs, weight_decays: per-head base LR and weight decay (equal lengths).
        epochs, batch_size, momentum, schedule, milestones, gamma: as the paper's probe.
        seed: seeds the initialisation and the data order.
        rows: train on these rows only (default all), e.g. the training part of a validation split.
        device: where the heads train (default: the features' device, CPU for arrays).
    """
    if len(lrs) != len(weight_decays) or not lrs:
        raise ValueError(
            f"lrs and weight_decays must be equally long and not empty, got {len(lrs)} and {len(weight_decays)}"
        )
    if device is None:
        device = features.device if isinstance(features, torch.Tensor) else torch.device("cpu")
    device = torch.device(device)
    pool = torch.arange(len(labels)) if rows is None else torch.as_tensor(list(rows), dtype=torch.long)
    torch.manual_seed(seed)
    fc = make_classifier(features.shape[1], num_classes)
    k, c, d = len(lrs), num_classes, features.shape[1]
    # every head's weight with its bias as an extra column, K*C x (D+1), one flat buffer per state
    # (parameters, gradients, momentum), so that x with a column of ones gives both in one product each way
    params = torch.cat([fc.weight.detach(), fc.bias.detach()[:, None]], 1).repeat(k, 1).to(device)
    grads, velocity, epoch_start = torch.empty_like(params), torch.zeros_like(params), torch.empty_like(params)
    heads = LinearHeads(
        params[:, :d].view(k, c, d),
        params[:, d].view(k, c),
        [float(v) for v in lrs],
        [float(v) for v in weight_decays],
        [None] * k,
    )
    # the same buffers with one row per head, for the per-head LR and weight decay (K x 1)
    head_params, head_grads, head_velocity = params.view(k, -1), grads.view(k, -1), velocity.view(k, -1)
    decay, base_lr = (torch.tensor(v, device=device)[:, None] for v in (heads.weight_decays, heads.lrs))
    alive = torch.ones(k, 1, dtype=torch.bool, device=device)
    classes = torch.arange(c, device=device)[:, None]
    rows_with_one = torch.ones(batch_size, d + 1, device=device)  # a batch of features and a column of ones
    y = labels.long().cpu()
    for epoch in reported(range(epochs), desc, unit="epoch") if progress else range(epochs):
        step = base_lr * lr_factor(epoch, epochs, schedule, milestones, gamma) * alive
        epoch_start.copy_(params)
        order = pool[epoch_permutation(len(pool), seed, epoch)]
        for first in range(0, len(order), batch_size):
            idx = order[first : first + batch_size]
            if not isinstance(features, torch.Tensor):
                idx = idx.sort().values
            n = len(idx)
            x = rows_with_one[:n]
            _copy_feature_rows(features, idx, x[:, :d])
            # the mean cross-entropy's gradient in closed form, (softmax - one-hot) / n per head, laid out
            # K x C x N so that the softmax runs along contiguous rows (20x faster than over 10 classes last);
            # probabilities below TINY_PROBABILITY become 0 so that no subnormal float reaches the exponential
            # or the products (logits more than 70 below their row's best give e^-70 < TINY_PROBABILITY)
            logits = torch.mm(params, x.T).view(k, c, n)
            g = torch.maximum(logits, logits.amax(1, keepdim=True) - 70.0).softmax(1)
            F.threshold(g, TINY_PROBABILITY, 0.0, inplace=True)
            g.sub_((y[idx].to(device) == classes).float()).mul_(1 / n)  # the C x N one-hot, broadcast over heads
            torch.mm(g.view(k * c, n), x, out=grads)
            # SGD with momentum and weight decay as torch.optim.SGD: v = mu v + (grad + wd w); w -= lr v
            head_grads.addcmul_(head_params, decay)
            torch.add(grads, velocity, alpha=momentum, out=velocity)
            head_params.addcmul_(head_velocity, step, value=-1)
        # one host sync per epoch: a non-finite loss makes that head's weights non-finite in the same step
        finite = torch.isfinite(head_params).all(1, keepdim=True)
        if not bool(finite.all()):
            back = ~finite.flatten()
            for h in back.nonzero().flatten().tolist():
                if heads.diverged[h] is None:
                    heads.diverged[h] = epoch
            alive &= finite
            head_params[back] = epoch_start.view(k, -1)[back]
            head_velocity[back] = 0
    return heads


def _copy_feature_rows(features: torch.Tensor | np.ndarray, idx: torch.Tensor, out: torch.Tensor) -> None:
    """Write rows ``idx`` of the features into ``out`` (a float32 tensor that may be strided) in one copy."""
    if isinstance(features, torch.Tensor) and features.dtype == out.dtype and features.device == out.device:
        torch.index_select(features, 0, idx.to(features.device), out=out)
    else:
        out.copy_(_feature_rows(features, idx, out.device))


@torch.no_grad()
def score_heads(
    heads: LinearHeads, features: torch.Tensor | np.ndarray, labels: torch.Tensor, batch_size: int = 4096
) -> list[dict[str, float]]:
    """Per head: ``top1`` / ``top5`` accuracy (percent) and the mean cross-entropy ``loss`` on fixed features."""
    k = heads.weight.shape[0]
    device = heads.weight.device
    correct, loss = torch.zeros(k, 2), torch.zeros(k, dtype=torch.float64)
    n = len(labels)
    for start in range(0, n, batch_size):
        idx = torch.arange(start, min(start + batch_size, n))
        logits, targets = heads.logits(_feature_rows(features, idx, device)), labels[idx].long().to(device)
        for h in range(k):
            correct[h] += torch.tensor(topk_correct(logits[:, h], targets), dtype=torch.float)
        loss += F.cross_entropy(logits.permute(0, 2, 1), targets[:, None].expand(-1, k), reduction="none").sum(0).cpu()
    return [
        {"top1": 100.0 * float(correct[h, 0]) / n, "top5": 100.0 * float(correct[h, 1]) / n, "loss": float(loss[h]) / n}
        for h in range(k)
    ]


def grid_probe(
    train_x: torch.Tensor | np.ndarray,
    train_y: torch.Tensor,
    test_x: torch.Tensor | np.ndarray,
    test_y: torch.Tensor,
    num_classes: int,
    *,
    lrs: Sequence[float] = GRID_LRS,
    weight_decays: Sequence[float] = GRID_WEIGHT_DECAYS,
    val_fraction: float = 0.2,
    seed: int = 0,
    **hyper: Any,
) -> dict[str, Any]:
    """The linear probe with its LR and weight decay chosen on a validation split carved from the training data.

    Trains ``len(lrs) x len(weight_decays)`` heads at once (``train_heads``) on the training
    rows outside a seeded, class-stratified ``val_fraction`` of them, picks the head with the
    best validation top-1 (ties: lower validation loss, then grid order) and scores it on the
    test features. The test split takes no part in the choice.

    Args:
        hyper: ``epochs``, ``batch_size``, ``momentum``, ``schedule``, ``milestones``, ``gamma``,
            ``device``, ``progress``, ``desc`` of ``train_heads``.

    Returns:
        ``metrics`` (the chosen head's test top-1 / top-5), ``chosen`` (its lr, weight decay and
        validation top-1), ``grid`` (every head's lr, weight decay, validation top-1 and loss, or the
        epoch it diverged in) and ``validation`` (fraction, seed, size, sha256 of the indices).

    Raises:
        NonFiniteLoss: every head diverged.
    """
    pairs = [(lr, wd) for wd in weight_decays for lr in lrs]
    fit_rows, val_rows = stratified_holdout(np.asarray(train_y), val_fraction, seed)
    if not val_rows:
        raise ValueError(
            f"the {len(fit_rows)} training images hold at most one per class, so the grid has no validation split to "
            "choose on; pass --search fixed (the preset's recipe) or label more images"
        )
    heads = train_heads(
        train_x,
        train_y,
        num_classes,
        lrs=[p[0] for p in pairs],
        weight_decays=[p[1] for p in pairs],
        seed=seed,
        rows=fit_rows,
        **hyper,
    )
    val_idx = torch.as_tensor(val_rows, dtype=torch.long)
    val_x = train_x[val_idx] if isinstance(train_x, torch.Tensor) else np.asarray(train_x[val_rows], dtype=np.float32)
    scores = score_heads(heads, val_x, train_y[val_idx])
    grid = []
    for (lr, wd), score, diverged in zip(pairs, scores, heads.diverged):
        ok = diverged is None and math.isfinite(score["loss"])
        grid.append(
            {
                "lr": lr,
                "weight_decay": wd,
                "val_top1": score["top1"] if ok else None,
                "val_loss": score["loss"] if ok else None,
                "diverged_epoch": diverged,
            }
        )
    usable = [h for h, row in enumerate(grid) if row["val_top1"] is not None]
    if not usable:
        raise NonFiniteLoss(
            f"every head of the linear grid diverged (lr {', '.join(f'{lr:g}' for lr in lrs)}); "
            "give smaller --lr-grid values"
        )
    best = min(usable, key=lambda h: (-grid[h]["val_top1"], grid[h]["val_loss"], h))
    test = score_heads(
        LinearHeads(
            heads.weight[best : best + 1], heads.bias[best : best + 1], [pairs[best][0]], [pairs[best][1]], [None]
        ),
        test_x,
        test_y,
    )[0]
    return {
        "metrics": {"top1": test["top1"], "top5": test["top5"]},
        "chosen": {"lr": pairs[best][0], "weight_decay": pairs[best][1], "val_top1": grid[best]["val_top1"]},
        "grid": grid,
        "validation": {
            "fraction": val_fraction,
            "seed": seed,
            "source_split": "train",
            "train_size": len(fit_rows),
            "val_size": len(val_rows),
            "val_indices_sha256": indices_sha256(val_rows),
            "refit": "none: the chosen head as trained on the rest of the training split",
        },
    }


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

    search: Literal["auto", "grid", "fixed"] = field(
        default="auto",
        metadata={
            "help": (
                "grid: one head per --lr-grid x --weight-decay-grid pair trained at once on frozen features, the best "
                "chosen on --val-fraction of the training split; fixed: the preset's single recipe; auto: fixed on "
                "the data a paper preset was set for (e.g. 1000 classes for imagenet), grid on any other"
            )
        },
    )
    lr_grid: list[float] = field(
        default_factory=lambda: list(GRID_LRS), metadata={"help": "learning rates of the grid's heads"}
    )
    weight_decay_grid: list[float] = field(
        default_factory=lambda: list(GRID_WEIGHT_DECAYS), metadata={"help": "weight decays of the grid's heads"}
    )
    val_fraction: float = field(
        default=0.2,
        metadata={"help": "seeded, class-stratified share of the training split the grid's choice is made on"},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_probe_settings(
            epochs=self.epochs,
            lrs={"--lr": [self.lr], "--lr-grid": self.lr_grid},
            weight_decays={"--weight-decay": [self.weight_decay], "--weight-decay-grid": self.weight_decay_grid},
            momentum=self.momentum,
            val_fraction=self.val_fraction,
        )
        if not 0 < self.gamma <= 1:
            raise ValueError(f"--gamma must be in (0, 1], got {self.gamma}")
        if sorted(self.milestones) != list(self.milestones) or any(m <= 0 for m in self.milestones):
            raise ValueError(f"--milestones must be increasing positive epochs, got {self.milestones}")
        if not 0 < self.crop_scale_min <= 1:
            raise ValueError(f"--crop-scale-min must be in (0, 1], got {self.crop_scale_min}")

    def uses_grid(self, num_classes: int) -> bool:
        """Whether this run searches the grid: asked for, or ``auto`` on data its paper preset was not set for."""
        if self.search != "auto":
            return self.search == "grid"
        assumed = self.PRESET_ASSUMPTIONS.get(self.preset, {}).get("num_classes")
        return not (self.preset in PAPER_TASKS and num_classes == assumed)


def check_probe_settings(
    *,
    epochs: int,
    lrs: dict[str, Sequence[float]],
    weight_decays: dict[str, Sequence[float]],
    momentum: float = 0.9,
    val_fraction: float = 0.2,
    epochs_flag: str = "--epochs",
) -> None:
    """Refuse linear-probe settings outside their working ranges, in one sentence naming the flag.

    ``lrs`` / ``weight_decays`` map each flag to its values. LRs must lie in (0, ``MAX_LR``], weight
    decays in [0, 1), momentum in [0, 1), epochs in [1, ``MAX_EPOCHS``], the validation share in (0, 0.5].
    """
    if not 1 <= epochs <= MAX_EPOCHS:
        raise ValueError(f"{epochs_flag} must be an integer in [1, {MAX_EPOCHS}], got {epochs}")
    for flag, values in lrs.items():
        if not values or any(not 0 < v <= MAX_LR for v in values):
            raise ValueError(f"{flag} must be in (0, {MAX_LR:g}], got {' '.join(f'{v:g}' for v in values) or 'none'}")
    for flag, values in weight_decays.items():
        if not values or any(not 0 <= v < 1 for v in values):
            raise ValueError(f"{flag} must be in [0, 1), got {' '.join(f'{v:g}' for v in values) or 'none'}")
    if not 0 <= momentum < 1:
        raise ValueError(f"--momentum must be in [0, 1), got {momentum:g}")
    if not 0 < val_fraction <= 0.5:
        raise ValueError(f"--val-fraction must be in (0, 0.5], got {val_fraction:g}")


@dataclass
class TransferConfig(LinearConfig):
    """Flags of ``bt-hub eval transfer``: the linear probe with PIRL's settings on any ImageFolder dataset.

    Build it with ``bt_hub.common.presets.from_preset(TransferConfig, ...)`` (as the CLI does): the
    default preset is ``places205``.
    """

    preset: str = field(default="places205", metadata={"help": "named sets of flag values; flags given override them"})


@releases_claim
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
    grid = config.uses_grid(num_classes)
    notes: dict[str, Any] = {"search": "grid" if grid else "fixed"}
    if config.cached or grid:
        fingerprints = {name: splits.info[name]["fingerprint"] for name in ("train", "test")}
        train_x, train_y = features_for(
            config, backbone, splits.train, weights_id=weights_id, dataset_id=fingerprints["train"], split="train"
        )
        test_x, test_y = features_for(
            config, backbone, splits.test, weights_id=weights_id, dataset_id=fingerprints["test"], split="test"
        )
        hyper = {k: v for k, v in schedule.items() if k != "weight_decay"}
        hyper.update(batch_size=config.batch_size, device=device)
        if grid:
            found = grid_probe(
                train_x,
                train_y,
                test_x,
                test_y,
                num_classes,
                lrs=config.lr_grid,
                weight_decays=config.weight_decay_grid,
                val_fraction=config.val_fraction,
                seed=config.seed,
                desc=f"linear grid ({len(config.lr_grid) * len(config.weight_decay_grid)} heads)",
                **hyper,
            )
            metrics = found.pop("metrics")
            notes.update(found)
        else:
            heads = train_heads(
                train_x,
                train_y,
                num_classes,
                lrs=[config.lr],
                weight_decays=[config.weight_decay],
                seed=config.seed,
                desc="linear (cached)",
                **hyper,
            )
            if heads.diverged[0] is not None:
                raise _diverged(config, heads.diverged[0])
            metrics = {k: v for k, v in score_heads(heads, test_x, test_y)[0].items() if k != "loss"}
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
            on_epoch=lambda epoch, loss: _log_epoch(run_dir, config, epoch, loss),
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
            mode="cached" if config.cached or grid else "loop",
            metrics=metrics,
            weights=config.weights,
            weights_sha256=weights_id,
            dataset=splits.info,
            seed=config.seed,
            wall_time_s=time.perf_counter() - tick,
            warnings=warned,
            notes=notes,
            paper_task=None if grid else PAPER_TASKS.get(config.preset or ""),
        )
    return record


def _diverged(config: LinearConfig, epoch: int) -> NonFiniteLoss:
    return NonFiniteLoss(
        f"the linear probe's training loss became non-finite in epoch {epoch + 1} with --lr {config.lr:g} and "
        f"--weight-decay {config.weight_decay:g}; lower --lr (or use --search grid)"
    )


def _log_epoch(run_dir: RunDir, config: LinearConfig, epoch: int, loss: float) -> None:
    """Log an epoch's mean training loss; stop the run when it is not finite."""
    if not math.isfinite(loss):
        raise _diverged(config, epoch)
    run_dir.log({"epoch": epoch, "train_loss": loss})
