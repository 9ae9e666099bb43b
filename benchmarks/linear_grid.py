"""The linear probe's grid: K heads trained at once vs one head, same features, same epochs.

    python benchmarks/linear_grid.py                              # digits, random-init resnet18 (3x3 stem), 8 px
    python benchmarks/linear_grid.py --weights demo_out/pretrain --repeats 5

bt_hub.eval.heads.train_heads trains every head of the grid from the same batch (one stacked
K x C x D weight, one matrix product each way per batch, one pass over the features per epoch). The
table gives the median wall and CPU seconds of training 1 head and the 12-head default grid
(``GRID_LRS`` x ``GRID_WEIGHT_DECAYS``) on the same cached features, their ratio (the issue asks
for at most 1.5), and the grid's choice on the validation split with its test top-1. A second
table times the two matrix products alone (logits and weight gradient, float32, the same shapes
and batch count): the K-times wider products are the part of the cost that grows with K by
necessity, so ``floor`` = (1 head - its products + 12 heads' products) / 1 head is the ratio no
implementation of the same float32 arithmetic can beat on this CPU. A third table adds the feature
extraction that every probe from images pays once (``bt-hub eval linear`` on a cold cache). The CPU model, its vector
flags and the load average are printed beside the numbers: timings on a shared machine move
with its load (CPU seconds move less than wall seconds).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import machine  # benchmarks/machine.py, beside this script
import torch
import torch.nn.functional as F

from bt_hub.eval.features import extract_features
from bt_hub.eval.heads import GRID_LRS, GRID_WEIGHT_DECAYS, grid_probe, train_heads
from bt_hub.eval.splits import load_splits
from bt_hub.method.model import build_backbone
from bt_hub.method.transforms import eval_transforms
from bt_hub.weights import load_backbone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default=None, help="weights to embed the digits with (default: random init)")
    parser.add_argument("--image-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each side (the median is shown)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    splits = load_splits("digits", test_split="test", seed=0, image_size=args.image_size)
    if args.weights:
        net = load_backbone(args.weights, progress=False)
    else:
        torch.manual_seed(0)
        net = build_backbone("resnet18", small_image_stem=True)
    transform = eval_transforms(args.image_size)
    tick, cpu_tick = time.perf_counter(), time.process_time()
    train_x, train_y = extract_features(net, splits.train, transform=transform)
    test_x, test_y = extract_features(net, splits.test, transform=transform)
    extraction, extraction_cpu = time.perf_counter() - tick, time.process_time() - cpu_tick
    pairs = [(lr, wd) for wd in GRID_WEIGHT_DECAYS for lr in GRID_LRS]
    hyper = {"epochs": args.epochs, "batch_size": args.batch_size, "progress": False}
    seconds, cpu = {}, {}
    for label, chosen in (("1 head", pairs[3:4]), (f"{len(pairs)} heads", pairs)):
        times, cpu_times = [], []
        for _ in range(args.repeats):
            tick, cpu_tick = time.perf_counter(), time.process_time()
            train_heads(train_x, train_y, 10, lrs=[p[0] for p in chosen], weight_decays=[p[1] for p in chosen], **hyper)
            times.append(time.perf_counter() - tick)
            cpu_times.append(time.process_time() - cpu_tick)
        seconds[label], cpu[label] = statistics.median(times), statistics.median(cpu_times)
    products = {label: _products(train_x, len(chosen), 10, args) for label, chosen in zip(cpu, (pairs[3:4], pairs))}
    found = grid_probe(train_x, train_y, test_x, test_y, 10, **hyper)
    one, many = seconds.values()
    cpu_one, cpu_many = cpu.values()
    print(f"cpu: {machine.cpu()}")
    print(f"load average: {' '.join(f'{v:.2f}' for v in os.getloadavg())}; torch threads: {args.threads}")
    print(
        f"digits: {len(train_y)} training features of {train_x.shape[1]} dims, {args.epochs} epochs, "
        f"batch {args.batch_size}, median of {args.repeats}\n"
    )
    print("| heads | wall s | vs 1 head | CPU s | vs 1 head |")
    print("|---|---|---|---|---|")
    for label, value in seconds.items():
        print(f"| {label} | {value:.2f} | {value / one:.2f}x | {cpu[label]:.2f} | {cpu[label] / cpu_one:.2f}x |")
    chosen = found["chosen"]
    print(
        f"\ngrid's choice on {found['validation']['val_size']} validation digits (carved from training): "
        f"lr {chosen['lr']:g}, weight decay {chosen['weight_decay']:g}, val top-1 {chosen['val_top1']:.1f}; "
        f"test top-1 {found['metrics']['top1']:.1f}; 12 heads / 1 head = {many / one:.2f} (wall), "
        f"{cpu_many / cpu_one:.2f} (CPU)"
    )
    print(
        "\na probe from images (features extracted once, as `bt-hub eval linear` does on a cold cache, then the "
        f"heads trained): extraction {extraction:.2f} s wall / {extraction_cpu:.2f} s CPU at {args.image_size} px\n"
    )
    print("| probe | wall s | vs 1 head | CPU s | vs 1 head |")
    print("|---|---|---|---|---|")
    for label, value in seconds.items():
        wall, used = extraction + value, extraction_cpu + cpu[label]
        print(
            f"| extraction + {label} | {wall:.2f} | {wall / (extraction + one):.2f}x | {used:.2f} | "
            f"{used / (extraction_cpu + cpu_one):.2f}x |"
        )
    print("\nthe two float32 matrix products alone (K*C x D logits and weight gradient per batch, all batches):\n")
    print("| heads | GFLOP | CPU s | GFLOP/s | share of training |")
    print("|---|---|---|---|---|")
    for label, (flops, value) in products.items():
        print(f"| {label} | {flops / 1e9:.1f} | {value:.3f} | {flops / value / 1e9:.0f} | {value / cpu[label]:.0%} |")
    (_, one_products), (_, many_products) = products.values()
    floor = (cpu_one - one_products + many_products) / cpu_one
    print(f"\nfloor for 12 heads / 1 head with these products and everything else as cheap as for 1 head: {floor:.2f}x")


def _products(features: torch.Tensor, heads: int, num_classes: int, args: argparse.Namespace) -> tuple[float, float]:
    """FLOPs and median CPU seconds of train_heads' two matrix products alone, over every batch of every epoch."""
    n, d = features.shape[0], features.shape[1] + 1  # train_heads' weights carry the bias as a column
    weight, grad = torch.randn(heads * num_classes, d) * 0.01, torch.empty(heads * num_classes, d)
    batches = [F.pad(features[i : i + args.batch_size], (0, 1), value=1.0) for i in range(0, n, args.batch_size)]
    flops = 4.0 * heads * num_classes * d * n * args.epochs
    times = []
    for _ in range(args.repeats):
        tick = time.process_time()
        for _ in range(args.epochs):
            for x in batches:
                torch.mm(torch.mm(weight, x.T), x, out=grad)
        times.append(time.process_time() - tick)
    return flops, statistics.median(times)


if __name__ == "__main__":
    main()
