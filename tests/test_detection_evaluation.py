"""Known-answer tests of the detection evaluators of every engine (VOC devkit AP and COCO AP).

The ground truth of the generated test split, fed back as predictions, must score 100; a
planted error must score what is worked out by hand below; boxes in the wrong convention must
score visibly wrong. Each test runs for the torchvision engine (our evaluators) and, where it
is importable, for detectron2 (its own PascalVOCDetectionEvaluator / COCOEvaluator).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bt_hub.eval.detection.data import load_records, locate, masks_of
from bt_hub.eval.detection.evaluation import box_iou, voc_ap
from bt_hub.eval.detection.synthetic import CLASSES, DetectionDataConfig, make_detection_data

ENGINES = ["torchvision", pytest.param("detectron2", marks=pytest.mark.detectron2)]
LAYOUTS = {"voc": "voc_2007_test", "coco": "coco_2017_val"}
SHIFTED, SWAPPED, SWAPPED_TO = 0, 1, 2  # class indices: square boxes shifted, discs labelled as triangles
PLANTED_IOU = 0.625  # between the thresholds 0.60 and 0.65


def _evaluator(engine: str) -> Callable[..., dict[str, dict[str, float]]]:
    if engine == "detectron2":
        pytest.importorskip("detectron2")
        from bt_hub.eval.detection.detectron2_engine.trainer import evaluate_dataset
    else:
        from bt_hub.eval.detection.torchvision_engine.trainer import evaluate_dataset
    return evaluate_dataset


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return make_detection_data(
        DetectionDataConfig(out=str(tmp_path_factory.mktemp("shapes")), train=1, test=30, size=96, seed=7)
    )


def _ground_truth(root: Path, layout: str) -> tuple[list[Any], dict[Any, dict[str, Any]]]:
    records, names, _ = load_records(locate(LAYOUTS[layout], root))
    assert names == CLASSES
    truth = {}
    for r in records:
        p = {"boxes": r.boxes.astype(np.float64), "scores": np.ones(len(r.labels)), "labels": r.labels.copy()}
        if layout == "coco":
            p["masks"] = masks_of(r, np.ones(len(r.labels), dtype=bool)).astype(bool)
        truth[r.image_id] = p
    return records, truth


def _planted(truth: dict[Any, dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    """Square boxes shifted right to IoU 0.625 with their ground truth; discs labelled as triangles at score 0.5."""
    out = {}
    for image_id, p in truth.items():
        q = {k: v.copy() for k, v in p.items()}
        shifted = q["labels"] == SHIFTED
        widths = q["boxes"][:, 2] - q["boxes"][:, 0]
        # a box moved by d along its width w keeps IoU (w - d) / (w + d)
        d = widths * (1 - PLANTED_IOU) / (1 + PLANTED_IOU)
        q["boxes"][shifted, 0] += d[shifted]
        q["boxes"][shifted, 2] += d[shifted]
        swapped = q["labels"] == SWAPPED
        q["labels"][swapped] = SWAPPED_TO
        q["scores"][swapped] = 0.5
        out[image_id] = q
    return out


def _check(result: dict[str, dict[str, float]], task: str, expected: dict[str, float]) -> None:
    got = {k: result[task][k] for k in expected}
    assert got == pytest.approx(expected, abs=1e-6), (task, got)


@pytest.mark.parametrize("layout", ["voc", "coco"])
@pytest.mark.parametrize("engine", ENGINES)
def test_ground_truth_as_predictions_scores_100(engine, layout, root):
    _, truth = _ground_truth(root, layout)
    result = _evaluator(engine)(root, LAYOUTS[layout], truth, with_masks=layout == "coco")
    _check(result, "bbox", {"AP": 100.0, "AP50": 100.0, "AP75": 100.0})
    if layout == "coco":
        _check(result, "segm", {"AP": 100.0, "AP50": 100.0, "AP75": 100.0})


@pytest.mark.parametrize("layout", ["voc", "coco"])
@pytest.mark.parametrize("engine", ENGINES)
def test_planted_errors_score_the_ap_worked_out_by_hand(engine, layout, root):
    """Per class: the shifted squares match at IoU 0.50, 0.55, 0.60 only (AP 3/10 = 30, AP50 100, AP75 0);
    the discs are never found (0); the triangles' own detections rank above the relabelled discs (100);
    crosses are untouched (100). Masks are not shifted, only relabelled: squares 100, discs 0."""
    records, truth = _ground_truth(root, layout)
    for cls in (SHIFTED, SWAPPED, SWAPPED_TO):
        assert any((r.labels == cls).any() for r in records), f"the test split has no {CLASSES[cls]}"
    planted = _planted(truth)
    ious = np.concatenate(
        [np.diag(box_iou(planted[r.image_id]["boxes"], r.boxes))[r.labels == SHIFTED] for r in records]
    )
    assert ious == pytest.approx(PLANTED_IOU)
    k = len(CLASSES)
    result = _evaluator(engine)(root, LAYOUTS[layout], planted, with_masks=layout == "coco")
    _check(result, "bbox", {"AP": (30 + 0 + 100 * (k - 2)) / k, "AP50": 100 * (k - 1) / k, "AP75": 100 * (k - 2) / k})
    if layout == "coco":
        _check(result, "segm", {"AP": 100 * (k - 1) / k, "AP50": 100 * (k - 1) / k, "AP75": 100 * (k - 1) / k})


def _as_xywh(p: dict[str, Any]) -> dict[str, Any]:
    boxes = p["boxes"].copy()
    boxes[:, 2:] -= boxes[:, :2]
    return {**p, "boxes": boxes}


def _halved(p: dict[str, Any]) -> dict[str, Any]:
    return {**p, "boxes": p["boxes"] / 2}


@pytest.mark.parametrize("mistake", [_as_xywh, _halved], ids=["xywh-read-as-xyxy", "boxes-at-half-scale"])
@pytest.mark.parametrize("layout", ["voc", "coco"])
@pytest.mark.parametrize("engine", ENGINES)
def test_boxes_in_the_wrong_convention_score_visibly_wrong(engine, layout, mistake, root):
    _, truth = _ground_truth(root, layout)
    wrong = {image_id: mistake(p) for image_id, p in truth.items()}
    result = _evaluator(engine)(root, LAYOUTS[layout], wrong, with_masks=False)
    assert result["bbox"]["AP50"] < 25 and result["bbox"]["AP"] < 15, result["bbox"]


def test_voc_ap_eleven_point_and_all_point_on_a_hand_worked_curve():
    # detections: TP, FP, TP over 2 positives -> recall 0.5, 0.5, 1.0; precision 1, 1/2, 2/3
    recall, precision = np.array([0.5, 0.5, 1.0]), np.array([1.0, 0.5, 2 / 3])
    # 11-point: recall 0..0.5 (6 points) -> best precision 1; 0.6..1.0 (5 points) -> 2/3
    assert voc_ap(recall, precision, use_07_metric=True) == pytest.approx((6 + 5 * 2 / 3) / 11)
    # all-point: 0.5 of recall at precision 1, then 0.5 at 2/3
    assert voc_ap(recall, precision, use_07_metric=False) == pytest.approx(0.5 + 0.5 * 2 / 3)


def test_voc_evaluator_ignores_difficult_objects_and_counts_duplicates_as_false_positives(root):
    from bt_hub.eval.detection.evaluation import voc_evaluate

    records, truth = _ground_truth(root, "voc")
    first = next(r for r in records if len(r.labels) >= 2)  # an image with two objects or more
    first.difficult[0] = True
    # a difficult object is neither needed (no recall lost without it) nor a false positive when found
    keep = np.arange(len(first.labels)) != 0
    without = {**truth, first.image_id: {k: v[keep] for k, v in truth[first.image_id].items()}}
    for preds in (truth, without):
        assert voc_evaluate(records, preds, len(CLASSES), use_07_metric=False)["bbox"]["AP"] == pytest.approx(100.0)
    # a second, lower-scored copy of every box is a false positive ranked after every true positive
    doubled = {
        k: {
            "boxes": np.concatenate([p["boxes"]] * 2),
            "scores": np.concatenate([p["scores"], p["scores"] / 2]),
            "labels": np.concatenate([p["labels"]] * 2),
        }
        for k, p in truth.items()
    }
    assert voc_evaluate(records, doubled, len(CLASSES), use_07_metric=True)["bbox"]["AP"] == pytest.approx(100.0)
    # a box far from everything, ranked above all n true positives of its class: precision k / (k + 1)
    # at recall k / n rises with k, so the interpolated precision (the best at any higher recall) is
    # n / (n + 1) everywhere and that is the class's all-point AP
    cls = int(first.labels[1])
    n = sum(int(((r.labels == cls) & ~r.difficult).sum()) for r in records)
    stray = {
        **truth,
        first.image_id: {
            "boxes": np.concatenate([truth[first.image_id]["boxes"], [[0.0, 0.0, 1.0, 1.0]]]),
            "scores": np.concatenate([truth[first.image_id]["scores"], [2.0]]),
            "labels": np.concatenate([truth[first.image_id]["labels"], [cls]]),
        },
    }
    per_class = [100.0] * len(CLASSES)
    per_class[cls] = 100 * n / (n + 1)
    assert voc_evaluate(records, stray, len(CLASSES), use_07_metric=False)["bbox"]["AP50"] == pytest.approx(
        np.mean(per_class)
    )


def test_pycocotools_deprecation_warnings_are_filtered_from_the_test_output_and_ours_are_not():
    # Guards: the test output carried ~1,690 pycocotools DeprecationWarnings (numpy 2's copy keyword), burying ours.
    mask = pytest.importorskip("pycocotools.mask")
    with warnings.catch_warnings(record=True) as seen:  # keeps pytest's filters (pyproject's filterwarnings)
        mask.decode(mask.encode(np.asfortranarray(np.ones((4, 4, 1), dtype=np.uint8))))
        warnings.warn("a deprecation of ours", DeprecationWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["a deprecation of ours"]
