"""The `small` presets against the paper's, on a held-out part of the digits' training split (never the test split).

    python benchmarks/small_preset.py --weights demo_out/pretrain            # after `bt-hub demo`
    python benchmarks/small_preset.py --weights demo_out/pretrain --holdout 0.3 --seed 1

Every row runs `bt-hub eval semi` or `bt-hub eval linear` (the library's run_protocol(entry, config)) with
`--holdout` on the digits: the classifier trains on the rest of the training split and is
scored on the held-out share, so the digits' test split stays unseen. The semi-supervised
rows change one thing at a time from the paper's recipe at the small preset's batch of 32:
the classifier LR (0.5 -> 0.05), then the crops (8% -> 40% of the area, no flip, cosine).
The linear rows run the paper's loop with its crops and flips, then with the small preset's.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bt_hub.common.config import from_preset
from bt_hub.eval.protocols import get_protocol
from bt_hub.eval.runner import run_protocol


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", required=True, help="the pretrained backbone, e.g. demo_out/pretrain")
    parser.add_argument("--holdout", type=float, default=0.2, help="held-out share of the digits' training split")
    parser.add_argument("--image-size", type=int, default=8)
    parser.add_argument("--linear-epochs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    common = {
        "weights": args.weights,
        "data": "digits",
        "holdout": args.holdout,
        "image_size": args.image_size,
        "seed": args.seed,
    }
    paper_at_32 = {"batch_size": 32}
    rows: list[tuple[str, str, str, str, dict[str, Any]]] = []
    for pct in (1, 10):
        rows += [
            (f"semi {pct}%", "paper, batch 32", "semi", "paper", {"fraction": pct, **paper_at_32}),
            (
                f"semi {pct}%",
                "paper, batch 32, classifier lr 0.05",
                "semi",
                "paper",
                {"fraction": pct, **paper_at_32, "lr_classifier": 0.05},
            ),
            (f"semi {pct}%", "small", "semi", "small", {"fraction": pct}),
        ]
    rows += [
        ("linear (loop)", "imagenet", "linear", "imagenet", {"epochs": args.linear_epochs}),
        ("linear (loop)", "small", "linear", "small", {"epochs": args.linear_epochs}),
    ]
    print(
        f"digits: held-out {args.holdout:.0%} of the training split (seed {args.seed}), {args.image_size} px, "
        f"weights {args.weights}, "
        f"{args.threads} threads\n"
    )
    print("| protocol | recipe | held-out top-1 | s |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for n, (protocol, recipe, name, preset, values) in enumerate(rows):
            entry = get_protocol(name)
            config = from_preset(entry.config_class, preset, **common, **values, out=str(Path(tmp) / str(n)))
            tick = time.perf_counter()
            record = run_protocol(entry, config)
            print(
                f"| {protocol} | {recipe} | {record['metrics']['top1']:.1f} | {time.perf_counter() - tick:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
