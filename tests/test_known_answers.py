"""Every protocol through the CLI on images whose right answer is known by construction.

kNN: each test image is a near-copy of one training image (its planted neighbour), so k=1
is 100% with the right labels and 0% when the test labels are moved to another class.
Linear, transfer and semi-supervised: each class is one colour, linearly separable in any
network's features, so ~100% with the right labels and ~0% with swapped test labels.
A leak, a shuffle or a label-order mistake breaks these numbers.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from bt_hub import cli

PALETTE = np.array([[220, 40, 40], [40, 200, 40], [40, 40, 220]])


@pytest.fixture
def weights(small_stem_weights):
    return small_stem_weights


def _planted(root, move_test_labels=False, per_class=6, size=8):
    """train/: noise images; val/: a near-copy (pixels +-2) of every other training image.

    Each copy is in its class (or the next one, with ``move_test_labels``).
    """
    rng = np.random.default_rng(0)
    for c in range(3):
        for i in range(per_class):
            image = rng.integers(0, 256, (size, size, 3), dtype=np.int16)
            (root / "train" / f"c{c}").mkdir(parents=True, exist_ok=True)
            Image.fromarray(image.astype(np.uint8)).save(root / "train" / f"c{c}" / f"{i}.png")
            if i % 2 == 0:
                twin = np.clip(image + rng.integers(-2, 3, image.shape), 0, 255).astype(np.uint8)
                folder = root / "val" / f"c{(c + 1) % 3 if move_test_labels else c}"
                folder.mkdir(parents=True, exist_ok=True)
                Image.fromarray(twin).save(folder / f"{c}_{i}.png")
    return root


def _colours(root, swap_test_labels=False, train=8, val=4, size=8):
    """One noisy colour per class; with ``swap_test_labels`` val/c0 holds class 1's colour, and so on."""
    rng = np.random.default_rng(0)
    for split, n in (("train", train), ("val", val)):
        for c in range(3):
            folder = root / split / f"c{(c + 1) % 3 if swap_test_labels and split == 'val' else c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.fromarray(np.clip(PALETTE[c] + rng.normal(0, 20, (size, size, 3)), 0, 255).astype(np.uint8)).save(
                    folder / f"{split}{i}.png"
                )
    return root


def _run(argv, out):
    assert cli.main([*argv, "--out", str(out)]) == 0
    return json.loads((out / "results.json").read_text())


def test_knn_finds_the_planted_neighbours_and_prints_its_table(weights, tmp_path, capsys):
    common = ["eval", "knn", "--weights", str(weights), "--image-size", "8", "--k", "1", "3"]
    right = _run([*common, "--data", str(_planted(tmp_path / "right"))], tmp_path / "a")
    assert right["metrics"]["top1_k1"] == 100.0
    assert right["dataset"]["overlap_check"]["identical"] == 0  # near-copies, not the same bytes
    out = capsys.readouterr()
    assert out.out.splitlines()[0].split() == ["protocol", "setting", "data", "metrics"]
    assert "k=1 Top-1 100.0" in out.out and f"wrote {tmp_path / 'a' / 'results.json'}" in out.out
    assert "features train: 1/1 batch (100%)" in out.err and "features test: 1/1 batch (100%)" in out.err
    moved = _run([*common, "--data", str(_planted(tmp_path / "moved", move_test_labels=True))], tmp_path / "b")
    assert moved["metrics"]["top1_k1"] == 0.0


def test_cached_linear_probe_separates_colours_and_fails_on_swapped_labels(weights, tmp_path):
    common = [
        "eval",
        "linear",
        "--cached",
        "--weights",
        str(weights),
        "--image-size",
        "8",
        "--epochs",
        "30",
        "--batch-size",
        "8",
    ]
    assert _run([*common, "--data", str(_colours(tmp_path / "right"))], tmp_path / "a")["metrics"]["top1"] == 100.0
    assert (
        _run([*common, "--data", str(_colours(tmp_path / "swapped", swap_test_labels=True))], tmp_path / "b")[
            "metrics"
        ]["top1"]
        == 0.0
    )


def test_linear_loop_and_transfer_separate_colours(weights, tmp_path):
    data = str(_colours(tmp_path / "data"))
    common = ["--weights", str(weights), "--data", data, "--image-size", "8", "--batch-size", "8"]
    linear = _run(
        ["eval", "linear", "--preset", "small", "--search", "fixed", "--epochs", "10", *common], tmp_path / "linear"
    )
    assert (linear["mode"], linear["metrics"]["top1"]) == ("loop", 100.0)
    transfer = _run(["eval", "transfer", "--epochs", "10", *common], tmp_path / "transfer")
    assert (transfer["protocol"], transfer["preset"], transfer["metrics"]["top1"]) == ("transfer", "places205", 100.0)


def test_semi_supervised_fine_tuning_separates_colours_with_half_the_labels(weights, tmp_path):
    record = _run(
        [
            "eval",
            "semi",
            "--preset",
            "small",
            "--fraction",
            "50",
            "--epochs",
            "3",
            "--weights",
            str(weights),
            "--data",
            str(_colours(tmp_path / "data")),
            "--image-size",
            "8",
        ],
        tmp_path / "semi",
    )
    assert record["labels"]["count"] == 12 and record["metrics"]["top1"] == 100.0
    assert (record["hyperparameters"]["crop_scale_min"], record["hyperparameters"]["flip"]) == (0.4, False)
    assert record["warnings"] == [
        "preset 'small' assumes at least 4 batches per epoch (12 training images in batches of 32 make 1); "
        "its hyper-parameters may not fit: see --help for the other presets (paper, reference) or set the flags"
    ]
