"""The VOC07 protocol's SVM grid (VISSL's ``SVMTrainer``), run in joblib worker processes: imports no torch.

Every (class, cost, fold) cross-validation fit and every per-class refit is a job for joblib's
process pool (loky): each worker is a fresh interpreter that imports this module to unpickle its
jobs, and with ``--n-jobs -1`` there is one per core. Keep this module's imports, and those of the
package ``__init__`` files above it, free of torch: a worker that imports torch starts several seconds
later and holds hundreds of MB more (tests/test_voc07_svm.py holds it). Processes, not threads:
liblinear's random generator is process-global, so threads would race; each fit is seeded with
``seed``, so any ``n_jobs`` gives the sequential result bit for bit. The grid is held to VISSL's
``SVMTrainer`` in tests/test_against_reference.py (same cost per class, test AP within 1e-9).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from bt_hub.eval.average_precision import average_precision, voc07_11point_ap

COSTS = (0.01, 0.1, 1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 50.0, 100.0, 1000.0)


def l2_normalize(features: np.ndarray) -> np.ndarray:
    """VISSL's per-sample normalisation x / (||x|| + 1e-5), in float32."""
    features = np.asarray(features, dtype=np.float32)
    return features / (np.linalg.norm(features, axis=1, keepdims=True) + 1e-5)


def _svm(cost: float, max_iter: int, seed: int) -> Any:
    from sklearn.svm import LinearSVC

    return LinearSVC(
        C=cost,
        class_weight={1: 2, -1: 1},
        loss="squared_hinge",
        penalty="l2",
        dual=True,
        tol=1e-4,
        max_iter=max_iter,
        random_state=seed,
    )


def _train_targets(targets: np.ndarray, cls: int) -> np.ndarray:
    return np.where(targets[:, cls] == 1, 1, -1)


def _fitted_svm(features: np.ndarray, y: np.ndarray, cost: float, max_iter: int, seed: int) -> Any:
    """The protocol's LinearSVC fitted on (features, y), liblinear's convergence warnings silenced."""
    import warnings

    from sklearn.exceptions import ConvergenceWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return _svm(cost, max_iter, seed).fit(features, y)


def _fold_ap(
    features: np.ndarray, targets: np.ndarray, cls: int, cost: float, fold: int, folds: int, max_iter: int, seed: int
) -> float:
    from sklearn.metrics import get_scorer
    from sklearn.model_selection import StratifiedKFold

    y = _train_targets(targets, cls)
    train, test = list(StratifiedKFold(folds).split(features, y))[fold]
    svm = _fitted_svm(features[train], y[train], cost, max_iter, seed)
    return float(get_scorer("average_precision")(svm, features[test], y[test]))


def _fit(
    features: np.ndarray, targets: np.ndarray, cls: int, cost: float, max_iter: int, seed: int
) -> tuple[np.ndarray, float]:
    svm = _fitted_svm(features, _train_targets(targets, cls), cost, max_iter, seed)
    return svm.coef_[0].copy(), float(svm.intercept_[0])


def svm_grid(
    features: np.ndarray,
    targets: np.ndarray,
    costs: Sequence[float] = COSTS,
    *,
    folds: int = 3,
    max_iter: int = 2000,
    n_jobs: int = -1,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[float]]:
    """Cross-validate every (class, cost), refit each class at its best cost on all samples.

    ``n_jobs`` (joblib) does not change the result. Returns ``(cv_ap [C, len(costs)], weights [C, F],
    biases [C], best cost per class)``.
    """
    from joblib import Parallel, delayed

    num_classes = targets.shape[1]
    for cls in range(num_classes):
        positives = int((targets[:, cls] == 1).sum())
        if positives < folds:
            raise ValueError(
                f"class {cls} has {positives} positive training images; "
                f"{folds}-fold cross-validation needs at least {folds}"
            )
    # one job per (class, cost, fold), the largest costs (the slowest fits) first, so that
    # no worker is left alone with a long fit at the end
    grid = sorted(
        ((cls, j, fold) for cls in range(num_classes) for j in range(len(costs)) for fold in range(folds)),
        key=lambda job: -costs[job[1]],
    )
    parallel = Parallel(n_jobs=n_jobs, batch_size=1)
    scores = parallel(
        delayed(_fold_ap)(features, targets, cls, costs[j], fold, folds, max_iter, seed) for cls, j, fold in grid
    )
    fold_ap = np.zeros((num_classes, len(costs), folds))
    for (cls, j, fold), score in zip(grid, scores):
        fold_ap[cls, j, fold] = score
    cv_ap = fold_ap.mean(axis=2)
    best = [float(costs[int(np.argmax(row))]) for row in cv_ap]  # argmax: the smallest cost on ties
    fits = parallel(delayed(_fit)(features, targets, cls, best[cls], max_iter, seed) for cls in range(num_classes))
    weights = np.stack([w for w, _ in fits])
    biases = np.array([b for _, b in fits])
    return cv_ap, weights, biases, best


def evaluate_svms(
    weights: np.ndarray, biases: np.ndarray, features: np.ndarray, targets: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per-class (all-point AP, 11-point AP) on test features; difficult-only images are left out per class."""
    scores = features @ weights.T + biases
    ap, ap11 = [], []
    for cls in range(targets.shape[1]):
        keep = targets[:, cls] != -1
        labels = targets[keep, cls]
        if not np.any(labels == 1):
            ap.append(np.nan)
            ap11.append(np.nan)
            continue
        ap.append(average_precision(scores[keep, cls], labels))
        ap11.append(voc07_11point_ap(scores[keep, cls], labels))
    return np.array(ap), np.array(ap11)
