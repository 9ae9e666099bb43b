"""Weighted kNN: bt_hub's faiss and torch searches vs scikit-learn's brute-force KNeighborsClassifier, same features.

    python benchmarks/knn.py                                  # 60k x 2048 bank, 10k queries, k = 20
    python benchmarks/knn.py --train 10000 --queries 2000     # smaller

Features are seeded class-structured Gaussians (float32). Both sides use L2-normalised
features and DINO's vote weights exp(sim / T): scikit-learn runs on the normalised
features with its fastest brute path (``metric="euclidean"``, whose neighbours are the
cosine neighbours; ``--sklearn-metric cosine`` for the cosine metric itself) and a
``weights`` callable turning each distance back into exp(sim / T); top-1 / top-5 come
from ``predict_proba``. bt_hub runs with each search backend: faiss and torch on the CPU,
and torch on CUDA when there is a GPU. The table gives wall seconds (fit + classify),
accuracy and the speed-up.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from bt_hub.eval.knn import knn_classify


def make_features(
    n: int, q: int, dim: int, classes: int, seed: int, noise: float = 6.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Seeded Gaussian clusters, one per class, with enough noise that kNN is not trivial."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, dim)).astype(np.float32)
    train_y, test_y = rng.integers(0, classes, n), rng.integers(0, classes, q)
    train_x = centres[train_y] + noise * rng.standard_normal((n, dim), dtype=np.float32)
    test_x = centres[test_y] + noise * rng.standard_normal((q, dim), dtype=np.float32)
    return train_x, train_y, test_x, test_y


def sklearn_knn(train_x, train_y, test_x, test_y, k: int, temperature: float, metric: str) -> dict[str, float]:
    """scikit-learn KNeighborsClassifier(algorithm="brute") with DINO's weights; top-1 / top-5 in percent."""
    from sklearn.neighbors import KNeighborsClassifier

    if metric == "euclidean":  # unit vectors: sim = 1 - d^2 / 2
        weights = lambda d: np.exp((1 - d**2 / 2) / temperature)  # noqa: E731
    else:  # cosine distance: sim = 1 - d
        weights = lambda d: np.exp((1 - d) / temperature)  # noqa: E731
    clf = KNeighborsClassifier(n_neighbors=k, algorithm="brute", metric=metric, weights=weights, n_jobs=-1)
    clf.fit(train_x, train_y)
    proba = clf.predict_proba(test_x)
    order = clf.classes_[np.argsort(-proba, axis=1, kind="stable")]
    correct = order == test_y[:, None]
    return {"top1": 100.0 * correct[:, 0].mean(), "top5": 100.0 * correct[:, :5].any(axis=1).mean()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=60_000, help="training (bank) samples")
    parser.add_argument("--queries", type=int, default=10_000, help="test queries")
    parser.add_argument("--dim", type=int, default=2048, help="feature dimension")
    parser.add_argument("--classes", type=int, default=100, help="number of classes")
    parser.add_argument("--k", type=int, default=20, help="neighbours")
    parser.add_argument("--temperature", type=float, default=0.07, help="T of exp(sim / T)")
    parser.add_argument(
        "--sklearn-metric",
        choices=["euclidean", "cosine"],
        default="euclidean",
        help="metric scikit-learn uses on the normalised features",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch / faiss threads (default: all cores)")
    parser.add_argument(
        "--noise",
        type=float,
        default=6.0,
        help="std of the per-dimension noise around unit-std class centres (6: far from 100 %% at 2048-d)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        import faiss

        torch.set_num_threads(args.threads)
        faiss.omp_set_num_threads(args.threads)

    train_x, train_y, test_x, test_y = make_features(
        args.train, args.queries, args.dim, args.classes, args.seed, args.noise
    )
    print(
        f"bank {args.train} x {args.dim}, {args.queries} queries, {args.classes} classes, "
        f"k = {args.k}, T = {args.temperature}"
    )

    runs = {
        "bt_hub knn_classify (faiss IndexFlatIP, CPU)": ("faiss", "cpu"),
        "bt_hub knn_classify (torch matmul + top-k, CPU)": ("torch", "cpu"),
    }
    if torch.cuda.is_available():
        runs["bt_hub knn_classify (torch matmul + top-k, CUDA)"] = ("torch", "cuda")
    ours = {}
    for name, (backend, device) in runs.items():
        t = time.perf_counter()
        result = knn_classify(
            torch.from_numpy(train_x),
            torch.from_numpy(train_y),
            torch.from_numpy(test_x),
            torch.from_numpy(test_y),
            k=args.k,
            temperature=args.temperature,
            num_classes=args.classes,
            backend=backend,
            device=device,
        )
        ours[name] = (result, time.perf_counter() - t)

    t = time.perf_counter()
    unit_train = F.normalize(torch.from_numpy(train_x), dim=1).numpy()
    unit_test = F.normalize(torch.from_numpy(test_x), dim=1).numpy()
    ref = sklearn_knn(unit_train, train_y, unit_test, test_y, args.k, args.temperature, args.sklearn_metric)
    ref_s = time.perf_counter() - t

    print()
    print("| method | seconds | top-1 | top-5 | speed-up |")
    print("|---|---|---|---|---|")
    print(
        f"| scikit-learn KNeighborsClassifier(brute, {args.sklearn_metric}) | {ref_s:.2f} | "
        f"{ref['top1']:.2f} | {ref['top5']:.2f} | 1.0x |"
    )
    for name, (result, seconds) in ours.items():
        print(f"| {name} | {seconds:.2f} | {result['top1']:.2f} | {result['top5']:.2f} | {ref_s / seconds:.1f}x |")
    largest = max(abs(r["top1"] - ref["top1"]) for r, _ in ours.values())
    print(f"\nlargest top-1 difference from scikit-learn: {largest:.3f} pt")


if __name__ == "__main__":
    main()
