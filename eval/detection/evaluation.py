"""Detection metrics without detectron2: the VOC devkit's AP and COCO AP, under detectron2's names."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bt_hub.common.files import atomic_write_json
from bt_hub.common.optional import require
from bt_hub.eval.average_precision import ap_from_curve
from bt_hub.eval.detection.data import Record

__all__ = [
    "REPORTED",
    "TRIAL_METRICS",
    "box_iou",
    "coco_evaluate",
    "encode_masks",
    "flatten_metrics",
    "voc_ap",
    "voc_evaluate",
    "write_trial",
]

VOC_IOU_THRESHOLDS = tuple(t / 100 for t in range(50, 100, 5))
# The metrics a trial reports (per task: bbox_AP, segm_AP75, ...) and the file each trial writes them to.
REPORTED = ("AP", "AP50", "AP75")
TRIAL_METRICS = "trial_metrics.json"


def flatten_metrics(results: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """``{"bbox": {"AP": 1.0}}`` -> ``{"bbox_AP": 1.0}`` (nested dataset keys are joined too)."""
    flat: dict[str, float] = {}
    for key, value in results.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_metrics(value, name + "_"))
        elif isinstance(value, (int, float, np.floating)) and not isinstance(value, bool):
            flat[name] = float(value)
    return flat


def write_trial(out: Path, seed: int, results: Mapping[str, Any], config: Any) -> dict[str, Any]:
    """A trial's ``{"seed", "metrics", "config"}``, written to ``out/TRIAL_METRICS``: the ``REPORTED`` metrics of
    ``results`` flattened (``bbox_AP``, ..., prefixed by dataset when ``results`` holds several)."""
    metrics = {k: v for k, v in flatten_metrics(results).items() if k.rsplit("_", 1)[-1] in REPORTED}
    trial = {"seed": seed, "metrics": metrics, "config": config}
    atomic_write_json(out / TRIAL_METRICS, trial)
    return trial


def box_iou(boxes: np.ndarray, others: np.ndarray) -> np.ndarray:
    """IoU matrix of XYXY boxes in continuous coordinates (N x M)."""
    boxes, others = (np.asarray(b, dtype=np.float64).reshape(-1, 4) for b in (boxes, others))
    lt = np.maximum(boxes[:, None, :2], others[None, :, :2])
    rb = np.minimum(boxes[:, None, 2:], others[None, :, 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), axis=2)
    area = lambda b: (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])  # noqa: E731
    union = area(boxes)[:, None] + area(others)[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


def voc_ap(recall: np.ndarray, precision: np.ndarray, use_07_metric: bool) -> float:
    """The devkit's AP of a precision/recall curve: 11-point for VOC2007, else all-point (``ap_from_curve``)."""
    return ap_from_curve(recall, precision, eleven_point=use_07_metric)


def _class_ap(
    records: Sequence[Record],
    predictions: Mapping[Any, Mapping[str, np.ndarray]],
    cls: int,
    thresholds: Sequence[float],
    use_07_metric: bool,
) -> np.ndarray | None:
    """AP of one class at each IoU threshold, as the devkit computes it; None when it has no ground truth."""
    gt = {}
    for r in records:
        sel = r.labels == cls
        gt[r.image_id] = (r.boxes[sel], r.difficult[sel])
    npos = int(sum((~d).sum() for _, d in gt.values()))
    if npos == 0:
        return None
    dets = [
        (float(s), image_id, b)
        for image_id, p in predictions.items()
        if image_id in gt
        for b, s, c in zip(np.asarray(p["boxes"]).reshape(-1, 4), p["scores"], p["labels"])
        if int(c) == cls
    ]
    dets.sort(key=lambda d: -d[0])
    aps = []
    for thr in thresholds:
        taken = {image_id: np.zeros(len(b), dtype=bool) for image_id, (b, _) in gt.items()}
        tp, fp = np.zeros(len(dets)), np.zeros(len(dets))
        for k, (_, image_id, box) in enumerate(dets):
            boxes, difficult = gt[image_id]
            ious = box_iou(box[None], boxes)[0] if len(boxes) else np.zeros(0)
            j = int(np.argmax(ious)) if len(ious) else -1
            if j >= 0 and ious[j] > thr:  # the devkit's strict '>'
                if difficult[j]:
                    continue
                if not taken[image_id][j]:
                    tp[k], taken[image_id][j] = 1, True
                else:
                    fp[k] = 1
            else:
                fp[k] = 1
        ctp, cfp = np.cumsum(tp), np.cumsum(fp)
        recall = ctp / npos
        precision = ctp / np.maximum(ctp + cfp, np.finfo(np.float64).eps)
        aps.append(voc_ap(recall, precision, use_07_metric))
    return np.asarray(aps) * 100


def voc_evaluate(
    records: Sequence[Record],
    predictions: Mapping[Any, Mapping[str, np.ndarray]],
    num_classes: int,
    *,
    use_07_metric: bool,
) -> dict[str, dict[str, float]]:
    """PASCAL VOC box AP, AP50 and AP75 (percent) as the devkit computes them; classes without ground truth left out."""
    per_class = [_class_ap(records, predictions, c, VOC_IOU_THRESHOLDS, use_07_metric) for c in range(num_classes)]
    present = [ap for ap in per_class if ap is not None]
    by_threshold = np.stack(present).mean(axis=0) if present else np.zeros(len(VOC_IOU_THRESHOLDS))
    return {"bbox": {"AP": float(by_threshold.mean()), "AP50": float(by_threshold[0]), "AP75": float(by_threshold[5])}}


def encode_masks(masks: Any) -> list[dict[str, Any]]:
    """COCO RLEs (``counts`` as str) of an N x H x W bool array; a list of RLEs is returned as it is."""
    if isinstance(masks, list):
        return masks
    mask_util = require("pycocotools.mask", "COCO mask evaluation")
    masks = np.asarray(masks, dtype=np.uint8)
    rles = [mask_util.encode(np.asfortranarray(m[:, :, None]))[0] for m in masks]
    for rle in rles:
        rle["counts"] = rle["counts"].decode("ascii") if isinstance(rle["counts"], bytes) else rle["counts"]
    return rles


def coco_evaluate(
    coco_gt: Any, predictions: Mapping[Any, Mapping[str, Any]], category_ids: Sequence[int], *, with_masks: bool
) -> dict[str, dict[str, float]]:
    """COCO box (and, ``with_masks``, mask) AP / AP50 / AP75 in percent by pycocotools' ``COCOeval``."""
    cocoeval = require("pycocotools.cocoeval", "COCO evaluation")
    results = []
    for image_id, p in predictions.items():
        boxes = np.asarray(p["boxes"], dtype=np.float64).reshape(-1, 4)
        xywh = np.concatenate([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], axis=1)
        rles = encode_masks(p["masks"]) if with_masks else [None] * len(boxes)
        for box, score, label, rle in zip(xywh, p["scores"], p["labels"], rles):
            row = {
                "image_id": image_id,
                "category_id": int(category_ids[int(label)]),
                "bbox": [float(v) for v in box],
                "score": float(score),
            }
            if rle is not None:
                row["segmentation"] = rle
            results.append(row)
    out: dict[str, dict[str, float]] = {}
    for iou_type in ("bbox", "segm") if with_masks else ("bbox",):
        if not results:
            out[iou_type] = {"AP": 0.0, "AP50": 0.0, "AP75": 0.0}
            continue
        with contextlib.redirect_stdout(io.StringIO()):
            coco_dt = coco_gt.loadRes([dict(r) for r in results])
            evaluator = cocoeval.COCOeval(coco_gt, coco_dt, iou_type)
            evaluator.evaluate()
            evaluator.accumulate()
            evaluator.summarize()
        stats = evaluator.stats
        out[iou_type] = {
            name: float(stats[i] * 100) if stats[i] >= 0 else float("nan")
            for i, name in enumerate(("AP", "AP50", "AP75"))
        }
    return out
