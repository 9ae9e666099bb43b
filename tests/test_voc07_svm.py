"""bt_hub.eval.voc07_svm: AP against hand computation, the devkit reader, parallel == sequential, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from voc_devkit import write_synthetic_devkit

from bt_hub import cli
from bt_hub.eval.average_precision import average_precision, voc07_11point_ap
from bt_hub.eval.svm_grid import evaluate_svms, l2_normalize, svm_grid
from bt_hub.eval.voc07_svm import VocClassification

# ranking: + - + - +  (scores 0.9 .. 0.5)
# precision at each positive: 1/1, 2/3, 3/5 at recall 1/3, 2/3, 1
# all-point AP  = 1/3 * (1 + 2/3 + 3/5) = 0.755555...
# 11-point AP   = (4 * 1 + 3 * 2/3 + 4 * 3/5) / 11 = 8.4 / 11 = 0.763636...
SCORES = np.array([0.9, 0.8, 0.7, 0.6, 0.5])
LABELS = np.array([1, -1, 1, -1, 1])


def test_all_point_ap_equals_hand_computation():
    assert average_precision(SCORES, LABELS) == pytest.approx((1 + 2 / 3 + 3 / 5) / 3)


def test_11_point_ap_equals_hand_computation():
    assert voc07_11point_ap(SCORES, LABELS) == pytest.approx(8.4 / 11)


def test_ap_ignores_input_order_and_interpolates_precision():
    perm = np.array([4, 2, 0, 3, 1])
    assert average_precision(SCORES[perm], LABELS[perm]) == pytest.approx(average_precision(SCORES, LABELS))
    # - + + : precisions 1/2, 2/3 -> interpolated 2/3 at both recall steps
    assert average_precision(np.array([3.0, 2.0, 1.0]), np.array([-1, 1, 1])) == pytest.approx(2 / 3)


def test_ap_needs_a_positive():
    with pytest.raises(ValueError, match="at least one positive"):
        average_precision(np.array([1.0, 2.0]), np.array([-1, 0]))


def _handmade_devkit(root):
    """Four test images for class 'cat': present, difficult-only, absent, present (in that order)."""
    voc = root / "VOC2007"
    write_synthetic_devkit(root, ("cat", "dog"), trainval=6, test=4, image_size=8, seed=0)
    objects = {
        "000006": [("cat", 0)],
        "000007": [("cat", 1), ("dog", 0)],
        "000008": [("dog", 0)],
        "000009": [("dog", 1), ("cat", 0), ("cat", 1)],
    }
    for image_id, objs in objects.items():
        body = "".join(f"<object><name>{n}</name><difficult>{d}</difficult></object>" for n, d in objs)
        (voc / "Annotations" / f"{image_id}.xml").write_text(f"<annotation>{body}</annotation>")
    return voc


def test_devkit_targets_code_difficult_only_images_and_test_ap_leaves_them_out(tmp_path):
    voc = _handmade_devkit(tmp_path)
    test = VocClassification(voc, "test", classes=["cat", "dog"])
    targets = np.array([t for _, t in test.samples])
    assert targets.tolist() == [[1, 0], [-1, 1], [0, 1], [1, -1]]
    # one 'SVM' whose score for cat is a fixed ranking: img7 (difficult) > img8 (absent) > img6 > img9
    features = np.eye(4)
    weights = np.array([[2.0, 4.0, 3.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    ap, ap11 = evaluate_svms(weights, np.zeros(2), features, targets)
    # without the difficult image the cat ranking is: img8 (-), img6 (+), img9 (+) -> precisions 1/2, 2/3
    assert ap[0] == pytest.approx(0.5 * 2 / 3 + 0.5 * 2 / 3)
    assert ap11[0] == pytest.approx(2 / 3)
    # dog: img9 is difficult-only, so the two positives img7, img8 score equally with img6 (negative)
    assert ap[1] == pytest.approx(average_precision(np.array([1.0, 1.0, 1.0]), np.array([-1, 1, 1])))


def test_reader_rejects_a_folder_that_is_not_a_devkit(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a VOC devkit"):
        VocClassification(tmp_path, "trainval")


def _grid_problem(n=90, dim=12, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    targets = rng.choice([1, 0, 0, -1], size=(n, classes)).astype(np.int8)
    features = rng.normal(size=(n, dim)) + 0.8 * (targets == 1) @ rng.normal(size=(classes, dim))
    return l2_normalize(features), targets


def test_parallel_grid_equals_sequential_grid():
    features, targets = _grid_problem()
    costs = [0.1, 1.0, 10.0]
    sequential = svm_grid(features, targets, costs, n_jobs=1)
    parallel = svm_grid(features, targets, costs, n_jobs=2)
    for a, b in zip(sequential, parallel):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert sequential[0].shape == (3, 3) and 0.3 < sequential[0].mean() < 1.0


WORKER = """
import sys
import numpy as np
from bt_hub.eval.svm_grid import l2_normalize, svm_grid
rng = np.random.default_rng(0)
targets = rng.choice([1, 0], size=(30, 2)).astype(np.int8)
svm_grid(l2_normalize(rng.normal(size=(30, 4))), targets, [1.0], n_jobs=1)
print("torch" in sys.modules)
"""


def test_the_svm_grid_runs_without_importing_torch():
    """Guards the workers' start: each of --n-jobs processes imports bt_hub.eval.svm_grid to unpickle its jobs.

    With torch among its imports (as when the grid lived in voc07_svm.py) every worker took seconds longer
    to start and held hundreds of MB more; this runs the grid's module and jobs in a fresh interpreter.
    """
    done = subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False"]


def test_grid_picks_each_class_best_cross_validated_cost_and_difficult_trains_as_negative():
    features, targets = _grid_problem()
    costs = [0.01, 1.0, 100.0]
    cv_ap, weights, biases, best = svm_grid(features, targets, costs, n_jobs=1)
    assert best == [costs[int(np.argmax(row))] for row in cv_ap]
    from sklearn.svm import LinearSVC

    labels = np.where(targets[:, 0] == 1, 1, -1)  # difficult (-1) and absent (0) are both negatives
    ref = LinearSVC(C=best[0], class_weight={1: 2, -1: 1}, dual=True, tol=1e-4, max_iter=2000, random_state=0).fit(
        features, labels
    )
    np.testing.assert_allclose(weights[0], ref.coef_[0])
    assert biases[0] == pytest.approx(ref.intercept_[0])


def test_cli_voc07_svm_end_to_end_writes_results_json(resnet18_weights, tmp_path):
    devkit = tmp_path / "VOCdevkit"
    write_synthetic_devkit(devkit, ("cat", "dog", "car"), trainval=21, test=15, image_size=32, seed=1)
    weights = resnet18_weights
    out = tmp_path / "out"
    argv = [
        "eval",
        "voc07-svm",
        "--weights",
        str(weights),
        "--data",
        str(devkit),
        "--out",
        str(out),
        "--image-size",
        "176",
        "--batch-size",
        "18",
        "--costs",
        "0.1",
        "1",
        "10",
        "--n-jobs",
        "1",
    ]
    assert cli.main(argv) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["protocol"] == "voc07-svm"
    assert set(result["metrics"]) == {"mAP", "mAP_11point"}
    assert result["notes"]["feature_dim"] == 512  # resnet18 res5 at 176 px: 6x6 map -> 1x1x512
    assert set(result["notes"]["per_class_ap"]) == {"cat", "dog", "car"}
    assert 40.0 < result["metrics"]["mAP"] <= 100.0  # colour blocks are easy: well above chance
    md = (out / "results.md").read_text()
    assert "| ours: voc07-svm | frozen features, no training; costs [0.1, 1, 10] (default " in md
    assert (result["hyperparameters"]["image_size"], result["hyperparameters"]["image_size_from"]) == (
        176,
        "--image-size",
    )
    assert result["hyperparameters"]["decode"] == "workers"  # VISSL's two PIL resizes
    # the paper's row is VOC2007's 4,952 test images, not these 15: it is not beside them, and results.md says why
    assert "| Barlow Twins paper" not in md and result["paper"]["task"] == "voc07_svm"
    assert "row (frozen features, no training) is left out: the test split has 15 images, not VOC2007's 4952." in md


def test_cli_voc07_svm_needs_a_devkit(tmp_path, capsys):
    assert cli.main(["eval", "voc07-svm", "--weights", "w.pth"]) == 2
    assert "--data must point to a VOC devkit" in capsys.readouterr().err


def test_eval_all_with_a_devkit_runs_the_voc07_svms_on_its_lists_as_the_command_does(resnet18_weights, tmp_path):
    # Guards eval all's VOC07 run, which the suite configures itself (suite._runs, on --voc07-devkit): on the
    # devkit's own lists (not --data's), without the image-folder flags, scoring what bt-hub eval voc07-svm scores.
    devkit = write_synthetic_devkit(tmp_path / "VOCdevkit", ("cat", "dog"), trainval=12, test=10, image_size=32)
    common = ["--weights", str(resnet18_weights), "--image-size", "176", "--batch-size", "16", "--precision", "fp32"]
    suite = ["eval", "all", *common, "--data", "synthetic:20", "--fractions", "--linear-epochs", "2"]
    assert cli.main([*suite, "--voc07-devkit", str(devkit.parent), "--out", str(tmp_path / "all")]) == 0
    records = json.loads((tmp_path / "all" / "results.json").read_text())["results"]
    assert [r["protocol"] for r in records] == ["knn", "linear", "voc07-svm", "rankme"]
    voc = records[2]
    assert voc["hyperparameters"]["data"] == "VOCdevkit" and voc["hyperparameters"]["decode"] == "workers"
    alone = ["eval", "voc07-svm", *common, "--data", str(devkit.parent), "--out", str(tmp_path / "alone")]
    assert cli.main(alone) == 0
    assert json.loads((tmp_path / "alone" / "results.json").read_text())["metrics"] == voc["metrics"]
