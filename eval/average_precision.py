"""Average precision, the one implementation behind the VOC07 SVMs and the VOC detection devkit."""

from __future__ import annotations

import numpy as np

__all__ = ["ap_from_curve", "average_precision", "precision_recall", "voc07_11point_ap"]


def ap_from_curve(recall: np.ndarray, precision: np.ndarray, *, eleven_point: bool) -> float:
    """Area under a precision/recall curve: VOC2007's 11-point mean, or the all-point area (VOC2010+).

    11-point: the mean over t = 0, 0.1, ..., 1 of the best precision at recall >= t. All-point: precision
    made monotone, then summed over the recall steps.
    """
    recall, precision = np.asarray(recall), np.asarray(precision)
    if eleven_point:
        return float(
            np.mean([precision[recall >= t].max() if np.any(recall >= t) else 0.0 for t in np.linspace(0, 1, 11)])
        )
    mrec = np.concatenate(([0.0], recall, [1.0]))
    mpre = np.concatenate(([0.0], precision, [0.0]))
    mpre = np.maximum.accumulate(mpre[::-1])[::-1]
    steps = np.flatnonzero(mrec[1:] != mrec[:-1])
    return float(np.sum((mrec[steps + 1] - mrec[steps]) * mpre[steps + 1]))


def precision_recall(scores: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(recall, precision)`` after each sample ranked by decreasing score; ValueError without a positive sample."""
    scores, positive = np.asarray(scores, dtype=np.float64), np.asarray(labels) > 0
    if positive.sum() == 0:
        raise ValueError("average precision needs at least one positive sample")
    order = np.argsort(-scores, kind="stable")
    tp = np.cumsum(positive[order])
    fp = np.cumsum(~positive[order])
    return tp / positive.sum(), tp / (tp + fp)


def average_precision(scores: np.ndarray, labels: np.ndarray) -> float:
    """All-point interpolated AP (VISSL's ``calculate_ap``); ``labels`` > 0 positive (leave difficult ones out)."""
    return ap_from_curve(*precision_recall(scores, labels), eleven_point=False)


def voc07_11point_ap(scores: np.ndarray, labels: np.ndarray) -> float:
    """The VOC2007 11-point AP: mean over recall thresholds 0, 0.1, ..., 1 of the max precision at recall >= t."""
    return ap_from_curve(*precision_recall(scores, labels), eleven_point=True)
