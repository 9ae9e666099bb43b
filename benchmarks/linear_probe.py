"""Cached linear probe vs the paper's loop: seconds per epoch and accuracy after equal epochs, same data.

    python benchmarks/linear_probe.py                        # digits, random-init resnet18, 10 epochs
    python benchmarks/linear_probe.py --weights demo_out/pretrain --epochs 20

Both sides train the same classifier (fc ~ N(0, 0.01), SGD momentum 0.9, lr 0.3, wd 1e-6,
batch 256, cosine per epoch) on the 1,437 training digits and score the 360 held-out ones.
The paper loop runs the frozen backbone (eval mode) on RandomResizedCrop + flip views every
epoch; the cached probe extracts the test-transform features once (reported apart) and
trains on them without augmentation. A third row runs the loop on the test-transform
images, the cached probe's own inputs, so that it separates what caching changes (only the
time) from what dropping the augmentation changes. The table gives wall seconds per epoch,
the speed-up per epoch and top-1 after the same number of epochs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from bt_hub.data.datasets import build_dataset
from bt_hub.eval.classifier import evaluate_loader, make_classifier, make_loader, train_classifier
from bt_hub.eval.features import TransformedDataset, extract_features, train_transform
from bt_hub.eval.heads import score_heads, train_heads
from bt_hub.eval.linear import FrozenBackboneClassifier
from bt_hub.method.model import build_backbone
from bt_hub.method.transforms import eval_transforms
from bt_hub.weights import load_backbone

HYPER = {"lr": 0.3, "weight_decay": 1e-6, "momentum": 0.9, "schedule": "cosine", "milestones": []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--weights",
        default=None,
        help="backbone to probe (anything load_backbone reads); default a random-init resnet18",
    )
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    backbone = load_backbone(args.weights, progress=False) if args.weights else build_backbone("resnet18")
    train_set = build_dataset("digits", "train", image_size=None, seed=args.seed)
    test_set = build_dataset("digits", "test", image_size=None, seed=args.seed)
    test_tf = eval_transforms(args.image_size)

    test_loader = make_loader(
        TransformedDataset(test_set, test_tf),
        256,
        shuffle=False,
        seed=args.seed,
        num_workers=0,
        device=torch.device("cpu"),
    )

    def loop(train_tf: Callable[[Any], torch.Tensor], desc: str) -> tuple[float, float]:
        """The full loop with ``train_tf`` on the training images: (seconds per epoch, test top-1)."""
        torch.manual_seed(args.seed)
        fc = make_classifier(backbone.feature_dim, 10)
        model = FrozenBackboneClassifier(backbone, fc)
        loader = make_loader(
            TransformedDataset(train_set, train_tf),
            args.batch_size,
            shuffle=True,
            seed=args.seed,
            num_workers=0,
            device=torch.device("cpu"),
        )
        tick = time.perf_counter()
        train_classifier(
            model,
            [{"params": list(fc.parameters()), "lr": HYPER["lr"]}],
            loader,
            epochs=args.epochs,
            gamma=1.0,
            device=torch.device("cpu"),
            desc=desc,
            **{k: v for k, v in HYPER.items() if k != "lr"},
        )
        seconds = (time.perf_counter() - tick) / args.epochs
        return seconds, evaluate_loader(model, test_loader, torch.device("cpu"))["top1"]

    paper_epoch, paper_top1 = loop(train_transform(args.image_size), "paper loop")
    plain_epoch, plain_top1 = loop(test_tf, "loop without augmentation")

    tick = time.perf_counter()
    train_x, train_y = extract_features(backbone, train_set, transform=test_tf)
    test_x, test_y = extract_features(backbone, test_set, transform=test_tf)
    extraction = time.perf_counter() - tick
    tick = time.perf_counter()
    cached_fc = train_heads(
        train_x,
        train_y,
        10,
        lrs=[HYPER["lr"]],
        weight_decays=[HYPER["weight_decay"]],
        epochs=args.epochs,
        batch_size=args.batch_size,
        momentum=HYPER["momentum"],
        schedule=HYPER["schedule"],
        milestones=HYPER["milestones"],
        seed=args.seed,
    )
    cached_epoch = (time.perf_counter() - tick) / args.epochs
    cached_top1 = score_heads(cached_fc, test_x, test_y)[0]["top1"]

    print(
        f"digits {len(train_set)} train / {len(test_set)} test, {args.image_size} px, {args.epochs} epochs, "
        f"{'weights ' + args.weights if args.weights else 'random-init resnet18'}, {args.threads} threads\n"
    )
    print("| mode | one-time feature extraction (s) | s / epoch | speed-up per epoch | top-1 after equal epochs |")
    print("|---|---|---|---|---|")
    print(
        f"| paper loop (frozen backbone, RandomResizedCrop + flip) | — | {paper_epoch:.3f} | 1.0× | {paper_top1:.1f} |"
    )
    print(
        f"| loop on the test-transform images (no augmentation) | — | {plain_epoch:.3f} | "
        f"{paper_epoch / plain_epoch:.1f}× | {plain_top1:.1f} |"
    )
    print(
        f"| cached (test-transform features, no augmentation) | {extraction:.2f} | {cached_epoch:.4f} | "
        f"{paper_epoch / cached_epoch:.0f}× | {cached_top1:.1f} |"
    )
    print(
        f"\ncached vs the loop on the same images: {cached_top1 - plain_top1:+.1f} pt; "
        f"vs the paper loop: {cached_top1 - paper_top1:+.1f} pt"
    )


if __name__ == "__main__":
    main()
