"""RankMe (bt_hub.method.rankme, ``bt-hub eval rankme``): known ranks, a folder without class folders, the value of
the features ``bt-hub embed`` writes, the drawn subset, the projector's output, and compare's columns unchanged."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

import bt_hub.eval
from bt_hub import cli
from bt_hub.eval.compare_config import CompareConfig
from bt_hub.eval.rankme import drawn_rows
from bt_hub.eval.splits import indices_sha256
from bt_hub.method.model import BarlowTwins
from bt_hub.method.rankme import EPSILON, rankme

FP32 = ["--image-size", "8", "--precision", "fp32"]


def _numpy_rankme(features: np.ndarray) -> float:
    """The paper's formula on NumPy's float64 SVD."""
    sigma = np.linalg.svd(features.astype(np.float64), compute_uv=False)
    p = sigma / sigma.sum() + EPSILON
    return float(np.exp(-(p * np.log(p)).sum()))


def _record(out) -> dict:
    return json.loads((out / "results.json").read_text())


@pytest.mark.parametrize(("n", "d", "r"), [(2000, 256, 7), (2000, 256, 256), (60, 512, 60), (300, 2048, 1)])
def test_a_matrix_of_rank_r_with_equal_singular_values_scores_r(n, d, r):
    # guards: RankMe off the effective rank (a Gram matrix of the wrong side, sigma^2 for sigma, a lost epsilon).
    # Tolerance: the eps terms raise the value by at most a factor exp(min(N, D) * eps * |log eps|), 0.33% at 2048,
    # and the float32 features' rounding and the Gram matrix's (bt_hub/method/rankme.py) by under 1e-4 more; it stays
    # above r - 1e-6
    generator = torch.Generator().manual_seed(r)
    left = torch.linalg.qr(torch.randn(n, r, dtype=torch.float64, generator=generator))[0]
    right = torch.linalg.qr(torch.randn(d, r, dtype=torch.float64, generator=generator))[0]
    value = rankme((3.0 * left @ right.T).float())
    bound = r * np.exp(min(n, d) * EPSILON * -np.log(EPSILON)) * (1 + 1e-4)
    assert r - 1e-6 <= value <= bound, (value, r, bound)


def test_unequal_singular_values_score_below_the_rank_and_zeros_score_zero():
    # guards: RankMe read as the rank: a spectrum 1, 1/2, ..., 1/64 uses fewer than its 64 dimensions
    sigma = 1.0 / torch.arange(1, 65, dtype=torch.float64)
    basis = torch.linalg.qr(torch.randn(500, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))[0]
    assert 10 < rankme(basis * sigma) < 64
    assert rankme(torch.zeros(10, 4)) == 0.0  # the formula divides by the sum of the singular values


def test_eval_rankme_scores_a_folder_without_class_folders_that_knn_still_refuses(small_stem_weights, tmp_path, capsys):
    # guards: the data layer read only class folders, so a user's folder of unlabelled images could not be scored
    folder = tmp_path / "photos"
    folder.mkdir()
    for i in range(6):
        array = np.random.default_rng(i).integers(0, 256, (8, 8, 3), dtype=np.uint8)
        Image.fromarray(array).save(folder / f"img_{i}.png")
    weights = ["--weights", str(small_stem_weights), "--data", str(folder), *FP32]
    assert cli.main(["eval", "rankme", *weights, "--out", str(tmp_path / "r")]) == 0
    record = _record(tmp_path / "r")
    assert record["protocol"] == "rankme" and 1 < record["metrics"]["rankme"] <= 6
    assert record["notes"]["outputs"]["rankme"] == {"output": "backbone", "n": 6, "d": 512, "max_value": 6}
    assert record["dataset"]["train"]["size"] == 6 and "rankme_projector" not in record["metrics"]
    capsys.readouterr()
    assert cli.main(["eval", "knn", *weights, "--holdout", "0.5", "--out", str(tmp_path / "k")]) == 2
    assert "has no class subdirectories" in capsys.readouterr().err  # a labelled protocol still needs classes


def test_eval_rankme_equals_numpy_on_the_features_embed_writes_and_the_api_gives_the_same(
    small_stem_weights, image_folder, tmp_path
):
    # guards: the protocol scoring other features than bt-hub embed extracts for the same split and weights
    root = image_folder(tmp_path / "data", classes=("cat", "dog", "owl"), per_class=4, size=8, splits=("train", "test"))
    weights = ["--weights", str(small_stem_weights), "--data", str(root), *FP32]
    assert cli.main(["embed", *weights, "--splits", "train", "--out", str(tmp_path / "emb")]) == 0
    assert cli.main(["eval", "rankme", *weights, "--out", str(tmp_path / "r")]) == 0
    record = _record(tmp_path / "r")
    expected = _numpy_rankme(np.load(tmp_path / "emb" / "train.npy"))
    assert abs(record["metrics"]["rankme"] - expected) / expected < 1e-3
    assert record["notes"]["subset"] == {"count": 12, "of": 12, "seed": 0, "indices_sha256": indices_sha256(range(12))}
    api = bt_hub.eval.evaluate(small_stem_weights, root, "rankme", image_size=8, precision="fp32")
    assert api.records[0]["metrics"] == record["metrics"]
    held_out = ["eval", "rankme", *weights, "--test-split", "test", "--out", str(tmp_path / "t")]
    assert cli.main(held_out) == 2  # --test-split names a folder that --split train does not read
    assert cli.main([*held_out, "--split", "test"]) == 0
    assert (
        _record(tmp_path / "t")["notes"]["outputs"]["rankme"]["n"] == 12
        and _record(tmp_path / "t")["notes"]["split"] == "test"
    )


def test_a_split_above_max_images_is_scored_on_the_seeded_draw_it_records(small_stem_weights, image_folder, tmp_path):
    # guards: the images extracted for a split above --max-images were not the rows whose sha256 the record keeps
    root = image_folder(tmp_path / "data", classes=("a", "b"), per_class=5, size=8, splits=())
    weights = ["--weights", str(small_stem_weights), "--data", str(root), *FP32]
    assert cli.main(["embed", *weights, "--splits", "train", "--out", str(tmp_path / "emb")]) == 0
    assert cli.main(["eval", "rankme", *weights, "--max-images", "6", "--seed", "3", "--out", str(tmp_path / "r")]) == 0
    record, rows = _record(tmp_path / "r"), drawn_rows(10, 6, 3)
    assert len(rows) == 6 and rows != drawn_rows(10, 6, 4)
    assert record["notes"]["subset"] == {"count": 6, "of": 10, "seed": 3, "indices_sha256": indices_sha256(rows)}
    expected = _numpy_rankme(np.load(tmp_path / "emb" / "train.npy")[rows])
    assert abs(record["metrics"]["rankme"] - expected) / expected < 1e-3


def test_the_projectors_output_is_scored_where_the_weights_carry_one(image_folder, tmp_path):
    # guards: weights that carry a projector (a pretraining checkpoint) scored on the backbone alone
    torch.manual_seed(0)
    model = BarlowTwins("resnet18", "64-32", small_image_stem=True).eval()
    torch.save(model.state_dict(), tmp_path / "checkpoint.pth")
    root = image_folder(tmp_path / "data", classes=("a", "b"), per_class=5, size=8, splits=())
    weights = ["--weights", str(tmp_path / "checkpoint.pth"), "--data", str(root), *FP32]
    assert cli.main(["embed", *weights, "--splits", "train", "--out", str(tmp_path / "emb")]) == 0
    assert cli.main(["eval", "rankme", *weights, "--out", str(tmp_path / "r")]) == 0
    record = _record(tmp_path / "r")
    with torch.no_grad():
        projected = model.projector(torch.from_numpy(np.load(tmp_path / "emb" / "train.npy"))).numpy()
    expected = _numpy_rankme(projected)
    assert abs(record["metrics"]["rankme_projector"] - expected) / expected < 1e-3
    assert record["notes"]["outputs"]["rankme_projector"] == {"output": "projector", "n": 10, "d": 32, "max_value": 10}
    assert set(record["hyperparameters"]["features"]) == {"train", "train projector"}


def test_compare_keeps_its_columns_and_refuses_rankme_for_now(small_stem_weights):
    # guards: a label-free protocol in the table became a default column of compare (and of the demo's compare),
    # with verdicts of accuracy against the baselines; as a column it failed with a KeyError
    assert CompareConfig(weights=[str(small_stem_weights)], out=None).protocols == ["knn", "linear"]
    with pytest.raises(ValueError, match="--protocols must list some of knn, linear, semi, got"):
        CompareConfig(weights=[str(small_stem_weights)], protocols=["rankme"], out=None)
