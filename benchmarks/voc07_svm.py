"""The VOC07 SVM grid: parallel (joblib processes) vs sequential, same features, same result.

    python benchmarks/voc07_svm.py                                # VOC07 size: 5011 / 4952 x 8192, 20 classes, 11 costs
    python benchmarks/voc07_svm.py --train 1000 --test 1000 --dim 1024 --classes 6 --costs 0.1 1 10

Features are seeded multi-label Gaussians shaped like VOC07 res5 features (about 1.5
labels per image, 5 % difficult-only), L2-normalised as the protocol does. The grid is
VISSL's: every (class, cost) 3-fold cross-validated on AP, then each class refitted at
its best cost. The worker processes are started (and scikit-learn imported in them)
before timing: a one-off cost of a few seconds per run, not per fit. The table gives
wall seconds, mAP (all-point and 11-point) and the speed-up; the script fails if the
parallel result differs from the sequential one.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bt_hub.eval.svm_grid import COSTS, evaluate_svms, l2_normalize, svm_grid


def make_features(n: int, dim: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Multi-label features and VISSL-coded targets (1 present, 0 absent, -1 difficult only)."""
    rng = np.random.default_rng(seed)
    directions = rng.normal(size=(classes, dim)).astype(np.float32)
    present = rng.random((n, classes)) < 1.5 / classes
    present[np.arange(n), rng.integers(0, classes, n)] = True
    features = np.abs(rng.standard_normal((n, dim), dtype=np.float32)) * 3 + present.astype(np.float32) @ directions
    targets = present.astype(np.int8)
    difficult = (~present) & (rng.random((n, classes)) < 0.05)
    targets[difficult] = -1
    return l2_normalize(features), targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=5011, help="trainval images (VOC07: 5011)")
    parser.add_argument("--test", type=int, default=4952, help="test images (VOC07: 4952)")
    parser.add_argument("--dim", type=int, default=8192, help="feature dimension (res5 2x2 pool: 8192)")
    parser.add_argument("--classes", type=int, default=20, help="classes (VOC: 20)")
    parser.add_argument("--costs", type=float, nargs="+", default=list(COSTS), help="SVM costs")
    parser.add_argument("--n-jobs", type=int, default=2, help="parallel jobs of the parallel run")
    parser.add_argument("--max-iter", type=int, default=2000)
    parser.add_argument(
        "--repeats", type=int, default=1, help="alternating timed runs of each; the table shows the fastest"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    train_x, train_y = make_features(args.train, args.dim, args.classes, args.seed)
    test_x, test_y = make_features(args.test, args.dim, args.classes, args.seed + 1)
    print(
        f"trainval {args.train}, test {args.test}, dim {args.dim}, {args.classes} classes, {len(args.costs)} costs "
        f"-> {args.classes * len(args.costs) * 3} (class, cost, fold) CV jobs"
    )

    from joblib import Parallel, delayed

    Parallel(n_jobs=args.n_jobs)(delayed(__import__)("sklearn.model_selection") for _ in range(args.n_jobs))
    runs = (("sequential", 1), (f"parallel ({args.n_jobs} jobs)", args.n_jobs))
    seconds: dict[str, list[float]] = {name: [] for name, _ in runs}
    grids = {}
    for _ in range(args.repeats):  # alternate, so that load from other processes hits both alike
        for name, n_jobs in runs:
            t = time.perf_counter()
            grids[name] = svm_grid(train_x, train_y, args.costs, n_jobs=n_jobs, max_iter=args.max_iter, seed=args.seed)
            seconds[name].append(time.perf_counter() - t)
    results = [grids[name] for name, _ in runs]
    rows = []
    for name, _ in runs:
        ap, ap11 = evaluate_svms(grids[name][1], grids[name][2], test_x, test_y)
        rows.append((name, min(seconds[name]), 100 * np.nanmean(ap), 100 * np.nanmean(ap11)))

    identical = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(*results))
    print()
    print("| run | seconds (best of repeats) | mAP | mAP (11-point) | speed-up |")
    print("|---|---|---|---|---|")
    for name, seconds, m, m11 in rows:
        print(f"| {name} | {seconds:.2f} | {m:.4f} | {m11:.4f} | {rows[0][1] / seconds:.2f}x |")
    print(f"\nparallel == sequential (CV APs, weights, biases, costs): {identical}")
    if not identical:
        raise SystemExit("the parallel grid differs from the sequential grid")


if __name__ == "__main__":
    main()
