"""``bt-hub demo``: Barlow Twins end to end on scikit-learn's digits, in minutes on a laptop CPU.

1. Pretrain a small-stem ResNet-18 with the Barlow Twins loss on the 1,437 training digits
   (bt_hub.train.pretrain, batched BYOL views, LARS with warm-up + cosine).
2. Score three representations on the 360 held-out digits: the pretrained backbone, the
   same network at its random initialisation (the weights pretraining started from) and
   the raw pixels, with weighted kNN, a linear probe on cached features, and fine-tuning
   on 1% / 10% of the training labels (the paper's semi-supervised protocol; a linear
   classifier for pixels), plus supervised training from scratch on the same labels.
3. Write ``report.md`` (the table, settings, timings) with PNG plots: the loss and its
   two terms, the cross-correlation matrix at the start and end of pretraining, and the
   accuracies; ``results.json`` holds every number.

Everything is seeded by ``--seed``: two runs with the same flags give the same report.
"""

from __future__ import annotations

import copy
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Subset

from bt_hub.common.config import RunConfig, out_field
from bt_hub.common.files import atomic_write_json, atomic_write_text
from bt_hub.common.presets import baseline, from_preset, preset_values
from bt_hub.common.runs import claim_run_dir, package_version
from bt_hub.eval.classifier import evaluate_features, train_on_features
from bt_hub.eval.features import TransformedDataset, extract_features, train_transform
from bt_hub.eval.knn import knn_classify
from bt_hub.eval.label_subsets import balanced_subset_indices
from bt_hub.eval.linear import LinearConfig
from bt_hub.eval.semi_supervised import SemiSupervisedConfig, finetune
from bt_hub.eval.splits import load_splits
from bt_hub.method.model import ARCHITECTURES, build_backbone
from bt_hub.method.transforms import eval_transforms
from bt_hub.train.plots import plot_accuracy_bars, run_plots, save_png
from bt_hub.train.pretrain import PretrainConfig, pretrain
from bt_hub.weights import load_backbone

FRACTIONS = (1, 10)
# The pretraining recipe is the `digits` preset of bt-hub pretrain; the demo's flags default to it.
DIGITS = preset_values(PretrainConfig, "digits")
COLUMNS = ("kNN", "linear", "1% labels", "10% labels")
LINEAR = {
    k: v
    for k, v in baseline(LinearConfig, "imagenet").items()
    if k in ("lr", "weight_decay", "momentum", "schedule", "milestones", "gamma")
}
# The fine-tuning recipe is the `small` preset of bt-hub eval semi (which was measured here).
SMALL = baseline(SemiSupervisedConfig, "small")


@dataclass
class DemoConfig(RunConfig):
    """Flags of ``bt-hub demo``; the defaults finish in about five minutes on two CPU cores."""

    out: str = out_field("demo_out", "output directory: report.md, PNG plots, results.json, pretrain/")
    # the demo's timings are stated for two threads
    threads: int = field(
        default=2, kw_only=True, metadata={"help": "CPU threads of torch in this process (0: torch's default)"}
    )
    epochs: int = field(default=DIGITS["epochs"], metadata={"help": "pretraining epochs"})
    max_steps: int = field(
        default=0,
        metadata={"help": "stop pretraining after this many steps (0: all epochs); the schedule is unchanged"},
    )
    batch_size: int = field(
        default=DIGITS["batch_size"], metadata={"help": "pretraining batch size (small: more steps in a short run)"}
    )
    lr_weights: float = field(
        default=DIGITS["lr_weights"],
        metadata={"help": "LARS base LR of the weights, × batch/256 (paper: 0.2, far too slow for 88 steps)"},
    )
    crop_scale_min: float = field(
        default=DIGITS["crop_scale_min"],
        metadata={
            "help": "smallest area fraction of the random crops in pretraining and fine-tuning (paper: 0.08, which "
            "can erase an 8-px digit)"
        },
    )
    image_size: int = field(
        default=DIGITS["image_size"],
        metadata={"help": "side of the digit images and views in pixels (the originals are 8x8)"},
    )
    backbone: str = field(
        default=DIGITS["backbone"],
        metadata={
            "help": "torchvision ResNet",
            "flag": "arch",
            "aliases": ("backbone",),
            "choices": tuple(ARCHITECTURES),
        },
    )
    small_image_stem: bool = field(
        default=DIGITS["small_image_stem"],
        metadata={
            "help": "3x3 stem without max-pool (the standard 7x7/2 stem + max-pool keeps too little of a 16-px digit)"
        },
    )
    projector: str = field(
        default=DIGITS["projector"],
        metadata={
            "help": "projector widths joined by '-' (a 32-d output: a batch of 64 can estimate a 32 x 32 "
            "cross-correlation of full rank)"
        },
    )
    lambd: float = field(default=DIGITS["lambd"], metadata={"help": "weight of the redundancy-reduction term"})
    warmup_epochs: int = field(default=DIGITS["warmup_epochs"], metadata={"help": "LARS warm-up epochs"})
    knn_k: int = field(default=20, metadata={"help": "neighbours of the weighted kNN (T = 0.07)"})
    linear_epochs: int = field(
        default=100, metadata={"help": "epochs of the cached linear probe (paper: 100, lr 0.3, cosine)"}
    )
    semi_epochs: int = field(
        default=10,
        metadata={
            "help": "fine-tuning epochs on 10% of the labels; 1% gets 10x as many, so both see as many images "
            "(cosine LR)"
        },
    )
    semi_batch_size: int = field(
        default=SMALL["batch_size"],
        metadata={"help": "fine-tuning batch size (the paper's 256 would be one step per epoch here)"},
    )
    semi_lr_classifier: float = field(
        default=SMALL["lr_classifier"],
        metadata={
            "help": "classifier LR of the fine-tuning (paper: 0.5, set for batches of 256 over 1,000 classes; on ten "
            "digits it swamps the pretrained backbone)"
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.crop_scale_min <= 1:
            raise ValueError(f"--crop-scale-min must be in (0, 1], got {self.crop_scale_min}")
        for name in (
            "epochs",
            "batch_size",
            "lr_weights",
            "image_size",
            "knn_k",
            "linear_epochs",
            "semi_epochs",
            "semi_batch_size",
            "semi_lr_classifier",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for name in ("max_steps", "warmup_epochs"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be non-negative, got {getattr(self, name)}")


# ----------------------------------------------------------------------------- pretraining


def _pretrain(config: DemoConfig, directory: Path) -> Path:
    """Barlow Twins on the digits' training split into ``directory`` (a previous demo's run there is replaced)."""
    if directory.exists():
        if not (directory / "run.json").exists():
            raise ValueError(f"{directory} exists and is not a previous demo's pretraining run; choose another --out")
        shutil.rmtree(directory)
    return pretrain(
        from_preset(
            PretrainConfig,
            "digits",
            out=str(directory),
            backbone=config.backbone,
            projector=config.projector,
            lambd=config.lambd,
            small_image_stem=config.small_image_stem,
            image_size=config.image_size,
            crop_scale_min=config.crop_scale_min,
            lr_weights=config.lr_weights,
            lr_biases=config.lr_weights * DIGITS["lr_biases"] / DIGITS["lr_weights"],
            epochs=config.epochs,
            batch_size=config.batch_size,
            warmup_epochs=min(config.warmup_epochs, config.epochs),
            seed=config.seed,
            device=config.device,
            max_steps=config.max_steps,
            log_every=1,
            checkpoint_every=0,
        )
    )


# ----------------------------------------------------------------------------- scoring


def _score_features(
    train: tuple[torch.Tensor, torch.Tensor], test: tuple[torch.Tensor, torch.Tensor], config: DemoConfig
) -> dict[str, float]:
    """Weighted kNN and the cached linear probe (all training labels)."""
    (train_x, train_y), (test_x, test_y) = train, test
    scores = {
        "kNN": knn_classify(train_x, train_y, test_x, test_y, k=config.knn_k, num_classes=10, device=config.device)[
            "top1"
        ]
    }
    fc = train_on_features(train_x, train_y, 10, seed=config.seed, epochs=config.linear_epochs, **LINEAR)
    scores["linear"] = evaluate_features(fc, test_x, test_y)["top1"]
    return scores


def _linear_on_subsets(
    train: tuple[torch.Tensor, torch.Tensor],
    test: tuple[torch.Tensor, torch.Tensor],
    config: DemoConfig,
    subsets: dict[int, list[int]],
) -> dict[str, float]:
    """Linear classifiers trained on the labelled subsets only (the pixels' semi-supervised columns)."""
    (train_x, train_y), (test_x, test_y) = train, test
    scores = {}
    for pct, idx in subsets.items():
        fc = train_on_features(
            train_x[idx], train_y[idx], 10, seed=config.seed, progress=False, epochs=config.linear_epochs, **LINEAR
        )
        scores[f"{pct}% labels"] = evaluate_features(fc, test_x, test_y)["top1"]
    return scores


def _finetune_on_subsets(
    backbone: nn.Module,
    train_set: Any,
    test_set: Any,
    config: DemoConfig,
    subsets: dict[int, list[int]],
    recipe: dict[str, Any],
    name: str,
) -> dict[str, float]:
    """Fine-tune a copy of ``backbone`` with a new classifier on each labelled subset; test top-1."""
    scores = {}
    for pct, idx in subsets.items():
        torch.manual_seed(config.seed)
        epochs = config.semi_epochs * max(FRACTIONS) // pct
        result = finetune(
            copy.deepcopy(backbone),
            10,
            Subset(
                TransformedDataset(
                    train_set,
                    train_transform(config.image_size, crop_scale_min=config.crop_scale_min, flip=SMALL["flip"]),
                ),
                idx,
            ),
            TransformedDataset(test_set, eval_transforms(config.image_size)),
            epochs=epochs,
            batch_size=config.semi_batch_size,
            seed=config.seed,
            device=config.device,
            desc=f"{name}, {pct}% labels",
            milestones=[],
            **recipe,
        )
        scores[f"{pct}% labels"] = result["top1"]
    return scores


# ----------------------------------------------------------------------------- report


def _plots(out: Path, pretrain_dir: Path, table: dict[str, dict[str, float]], lambd: float) -> list[str]:
    """loss.png, cross_correlation.png (as ``bt-hub report`` draws them) and accuracy.png; the names written."""
    written = run_plots(pretrain_dir, out, lambd=lambd)
    written.append(save_png(plot_accuracy_bars(table, COLUMNS, "Held-out digits accuracy"), out / "accuracy.png"))
    return [path.name for path in written]


def _report(
    config: DemoConfig,
    table: dict[str, dict[str, float]],
    timings: dict[str, float],
    plots: list[str],
    subsets: dict[int, list[int]],
    pretrain_dir: Path,
) -> str:
    stem = " (3x3 stem)" if config.small_image_stem else ""
    stopped = f" (stopped at step {config.max_steps})" if config.max_steps else ""
    lines = [
        "# Barlow Twins demo on the digits",
        "",
        f"bt_hub {package_version()}, seed {config.seed}. A {config.backbone}{stem} pretrained with the Barlow Twins "
        f"loss for {config.epochs} epochs{stopped} on the 1,437 training digits at {config.image_size} px, "
        f"projector {config.projector}, λ = {config.lambd}, batch {config.batch_size}, LARS base LR "
        f"{config.lr_weights}, crops of ≥ {config.crop_scale_min:.0%} of the area, no flip, no blur; "
        "scored on the 360 held-out digits (top-1 %).",
        "",
        "| representation | " + " | ".join(COLUMNS) + " |",
        "|---|" + "---|" * len(COLUMNS),
    ]
    for method, scores in table.items():
        lines.append(f"| {method} | " + " | ".join(f"{scores[c]:.1f}" if c in scores else "—" for c in COLUMNS) + " |")
    lines += [
        "",
        f"- **kNN**: weighted vote of the {config.knn_k} nearest training digits, cosine similarity, T = 0.07.",
        "- **linear**: the paper's linear probe (SGD lr 0.3, cosine, wd 1e-6, fc ~ N(0, 0.01)) for "
        f"{config.linear_epochs} epochs on cached frozen features (no augmentation).",
        f"- **1% / 10% labels**: {len(subsets[1])} / {len(subsets[10])} labelled training digits (seeded, "
        "class-balanced). Networks are fine-tuned with the "
        "paper's semi-supervised recipe (lr backbone 0.002, no wd) with a classifier LR of "
        f"{config.semi_lr_classifier} (paper: 0.5), cosine, batch {config.semi_batch_size}, "
        f"for {config.semi_epochs} epochs on 10% and {config.semi_epochs * 10} on 1% (the same number of images), "
        f"crops of ≥ {config.crop_scale_min:.0%} of the area, no flip; "
        "pixels get a linear classifier; *supervised from scratch* trains the random-init network with lr 0.1 for "
        "all layers, cosine, wd 5e-4.",
        "",
        "## Timings (s)",
        "",
        "| stage | seconds |",
        "|---|---|",
    ]
    lines += [f"| {stage} | {seconds:.1f} |" for stage, seconds in timings.items()]
    lines += ["", "## Plots", ""] + [f"![{name}]({name})" for name in plots]
    lines += ["", f"Pretraining run (weights, metrics.jsonl, cross-correlation matrices): `{pretrain_dir}`.", ""]
    return "\n".join(lines)


def run_demo(config: DemoConfig) -> dict[str, Any]:
    """Pretrain on digits, score against random init and pixels, write the report; return the numbers."""
    out = claim_run_dir(config.out, overwrite=config.overwrite)
    timings: dict[str, float] = {}
    tick = start = time.perf_counter()
    pretrain_dir = _pretrain(config, out / "pretrain")
    timings["pretraining"] = time.perf_counter() - tick

    tick = time.perf_counter()
    splits = load_splits("digits", test_split="test", seed=config.seed, image_size=config.image_size)
    train_set, test_set = splits.train, splits.test
    subsets = {pct: balanced_subset_indices(train_set.targets, pct, seed=config.seed) for pct in FRACTIONS}
    pretrained = load_backbone(pretrain_dir, progress=False)
    torch.manual_seed(config.seed)  # pretraining built its network right after this same call
    random_init = build_backbone(config.backbone, small_image_stem=config.small_image_stem)
    transform = eval_transforms(config.image_size)
    networks = {
        "Barlow Twins (pretrained)": pretrained,
        "random init (same network)": random_init,
        "raw pixels": nn.Flatten(),
    }
    table: dict[str, dict[str, float]] = {}
    for name, net in networks.items():
        feats = [
            extract_features(net, ds, transform=transform, batch_size=256, device=config.device)
            for ds in (train_set, test_set)
        ]
        table[name] = _score_features(feats[0], feats[1], config)
        if name == "raw pixels":
            table[name].update(_linear_on_subsets(feats[0], feats[1], config, subsets))
    timings["kNN and linear probes"] = time.perf_counter() - tick

    tick = time.perf_counter()
    # cosine (the reference code's schedule): the paper's step drops starved the 10% run (below the 1% one)
    recipe = {k: SMALL[k] for k in ("lr_backbone", "weight_decay", "momentum", "gamma", "schedule")}
    recipe["lr_classifier"] = config.semi_lr_classifier
    for name in ("Barlow Twins (pretrained)", "random init (same network)"):
        table[name].update(_finetune_on_subsets(networks[name], train_set, test_set, config, subsets, recipe, name))
    scratch = {
        "lr_backbone": 0.1,
        "lr_classifier": 0.1,
        "weight_decay": 5e-4,
        "momentum": 0.9,
        "schedule": "cosine",
        "gamma": 1.0,
    }
    table["supervised from scratch"] = _finetune_on_subsets(
        random_init, train_set, test_set, config, subsets, scratch, "from scratch"
    )
    timings["fine-tuning on 1% / 10%"] = time.perf_counter() - tick
    timings["total"] = time.perf_counter() - start

    plots = _plots(out, pretrain_dir, table, config.lambd)
    atomic_write_text(out / "report.md", _report(config, table, timings, plots, subsets, pretrain_dir))
    results = {
        "table": table,
        "timings_s": timings,
        "config": vars(config).copy(),
        "labelled": {str(p): len(i) for p, i in subsets.items()},
    }
    atomic_write_json(out / "results.json", results)
    return results
