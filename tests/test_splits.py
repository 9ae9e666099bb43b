"""bt_hub.eval.splits: explicit held-out splits, --holdout, overlap refused, one split function for every protocol."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections import Counter

import numpy as np
import pytest

from bt_hub import cli
from bt_hub.data.datasets import ImageFolderDataset
from bt_hub.eval.config import EvalWarning
from bt_hub.eval.splits import check_disjoint, indices_sha256, load_splits, stratified_holdout

PROTOCOLS = ["knn", "linear", "semi", "transfer", "all"]


@pytest.fixture
def weights(small_stem_weights):
    return small_stem_weights


@pytest.fixture
def folder(image_folder):
    """One flat class-per-folder tree of 8-px images (this file's default: three classes of five)."""

    def make(root, classes=("a", "b", "c"), per_class=5, seed=0):
        return image_folder(root, classes, per_class, 8, splits=(), seed=seed)

    return make


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_flat_folder_is_refused_by_every_protocol_naming_the_layouts_and_holdout(
    folder, protocol, weights, tmp_path, capsys
):
    flat = folder(tmp_path / "flat")
    assert (
        cli.main(["eval", protocol, "--weights", str(weights), "--data", str(flat), "--out", str(tmp_path / "out")])
        == 2
    )
    err = capsys.readouterr().err
    assert f"--data {flat} has no held-out split" in err
    assert f"{flat}/val/<class>/<image>" in err and "--holdout 0.2" in err
    assert not (tmp_path / "out" / "results.json").exists()


def test_test_split_flag_is_the_same_on_every_protocol():
    from bt_hub.eval.knn import KnnConfig
    from bt_hub.eval.linear import LinearConfig, TransferConfig
    from bt_hub.eval.semi_supervised import SemiSupervisedConfig
    from bt_hub.eval.suite import SuiteConfig

    specs = set()
    for cls in (KnnConfig, LinearConfig, TransferConfig, SemiSupervisedConfig, SuiteConfig):
        f = next(f for f in dataclasses.fields(cls) if f.name == "test_split")
        specs.add((str(f.type), f.default))
    assert specs == {("Literal['val', 'test']", "val")}


def test_a_missing_test_split_names_the_one_that_exists(folder, tmp_path):
    folder(tmp_path / "d" / "train")
    folder(tmp_path / "d" / "test", seed=1)
    with pytest.raises(FileNotFoundError, match=r"has no val/ split \(it has train/, test/\); pass --test-split test"):
        load_splits(str(tmp_path / "d"))
    assert load_splits(str(tmp_path / "d"), test_split="test").info["test"]["split"] == "test"


def test_holdout_is_disjoint_stratified_and_seed_stable():
    targets = np.repeat(np.arange(4), [10, 20, 5, 1])
    train, held = stratified_holdout(targets, 0.2, seed=3)
    assert not set(train) & set(held) and sorted(train + held) == list(range(len(targets)))
    assert Counter(targets[held].tolist()) == {0: 2, 1: 4, 2: 1}  # a class of one stays in training
    assert (train, held) == stratified_holdout(targets, 0.2, seed=3)
    assert held != stratified_holdout(targets, 0.2, seed=4)[1]


def test_cli_holdout_on_a_flat_folder_is_recorded_and_seed_stable(folder, weights, tmp_path):
    flat = folder(tmp_path / "flat", per_class=10)
    records = []
    for seed, out in ((0, "a"), (0, "b"), (1, "c")):
        argv = [
            "eval",
            "knn",
            "--weights",
            str(weights),
            "--data",
            str(flat),
            "--holdout",
            "0.2",
            "--seed",
            str(seed),
            "--image-size",
            "8",
            "--k",
            "3",
            "--out",
            str(tmp_path / out),
        ]
        assert cli.main(argv) == 0
        records.append(json.loads((tmp_path / out / "results.json").read_text()))
    holdout = records[0]["dataset"]["holdout"]
    assert (holdout["fraction"], holdout["seed"], holdout["train_size"], holdout["test_size"]) == (0.2, 0, 24, 6)
    _, held = stratified_holdout(ImageFolderDataset(flat).targets, 0.2, seed=0)
    assert holdout["test_indices_sha256"] == indices_sha256(held)
    assert records[0]["dataset"]["test"] == {
        "split": "holdout",
        "size": 6,
        "fingerprint": records[0]["dataset"]["test"]["fingerprint"],
    }
    assert records[1]["dataset"]["holdout"] == holdout
    assert records[2]["dataset"]["holdout"]["test_indices_sha256"] != holdout["test_indices_sha256"]
    assert "test: held-out 20% of train (seed 0)" in (tmp_path / "a" / "results.md").read_text()


def test_a_test_split_with_the_training_images_is_refused(folder, weights, tmp_path, capsys):
    folder(tmp_path / "d" / "train")
    shutil.copytree(tmp_path / "d" / "train", tmp_path / "d" / "val")
    assert (
        cli.main(
            ["eval", "knn", "--weights", str(weights), "--data", str(tmp_path / "d"), "--out", str(tmp_path / "out")]
        )
        == 2
    )
    assert "15 of 15 sampled test images are byte-identical to training images" in capsys.readouterr().err


def test_a_holdout_of_a_folder_holding_copies_of_its_images_names_the_copies(folder, tmp_path):
    """Guards: the refusal told a user who had passed --holdout to "give a disjoint held-out split or --holdout"."""
    flat = folder(tmp_path / "flat", per_class=10)
    for path in list(flat.rglob("*.png")):
        shutil.copy(path, path.with_name(f"copy_{path.name}"))
    with pytest.raises(ValueError, match="the training folder holds byte-identical copies of its images, which "):
        load_splits(str(flat), holdout=0.2)


def test_shared_paths_are_refused():
    class Files:
        def __init__(self, paths):
            self.samples = [(p, 0) for p in paths]

        def __len__(self):
            return len(self.samples)

    with pytest.raises(ValueError, match="shares 1 of its 2 files with the training split"):
        check_disjoint(Files(["/d/a.png", "/d/b.png"]), Files(["/d/b.png", "/d/c.png"]))


def test_a_few_duplicates_are_tolerated_and_recorded(folder, tmp_path):
    folder(tmp_path / "d" / "train", per_class=10)
    folder(tmp_path / "d" / "val", per_class=10, seed=1)
    shutil.copy(tmp_path / "d" / "train" / "a" / "a_0.png", tmp_path / "d" / "val" / "a" / "dup.png")
    with pytest.warns(EvalWarning, match="1 of 31 sampled test images are byte-identical to training images"):
        check = load_splits(str(tmp_path / "d")).info["overlap_check"]  # Guards: the copy was tolerated unsaid
    assert check == {
        "shared_files": 0,
        "sampled": 31,
        "identical": 1,
    }  # ImageNet's val holds a few copies of train images too


def test_test_labels_follow_the_training_class_order(folder, tmp_path):
    folder(tmp_path / "d" / "train", classes=("a", "b", "c"))
    folder(tmp_path / "d" / "val", classes=("a", "c"), seed=1)
    splits = load_splits(str(tmp_path / "d"))
    assert splits.test.classes == ["a", "b", "c"]
    assert sorted(set(splits.test.targets)) == [0, 2]  # 'c' keeps label 2, not val/'s own index 1
    folder(tmp_path / "d" / "val", classes=("zebra",), seed=2)
    with pytest.raises(ValueError, match=r"classes the training split lacks \(or holds no image of\): zebra"):
        load_splits(str(tmp_path / "d"))
    (tmp_path / "d" / "train" / "zebra").mkdir()  # Guards: an empty class folder let zebra's images be scored
    with pytest.raises(ValueError, match=r"classes the training split lacks \(or holds no image of\): zebra"):
        load_splits(str(tmp_path / "d"))
