"""Label subsets: the published SimCLR lists, file-name matching, class-balanced subsets."""

from __future__ import annotations

import shutil
import warnings
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from bt_hub.data.datasets import ImageFolderDataset
from bt_hub.eval.label_subsets import (
    PUBLISHED_SUBSETS,
    balanced_subset_indices,
    class_of,
    indices_from_list,
    read_subset_file,
    subset_indices,
)


@pytest.mark.parametrize("name, lines", [("1percent.txt", 12_811), ("10percent.txt", 128_116)])
def test_published_lists_are_recognised_with_their_sizes_and_1000_classes(shared_data, name, lines):
    subset = read_subset_file(shared_data / "imagenet_subsets" / name)
    assert subset.sha256 == PUBLISHED_SUBSETS[name]
    assert subset.published == name
    assert len(subset.names) == lines
    assert len(set(subset.names)) == lines
    assert len(subset.classes) == 1000
    assert all(c.startswith("n") and len(c) == 9 for c in subset.classes)


def test_a_modified_copy_of_a_published_list_warns(shared_data, tmp_path):
    copy = tmp_path / "1percent.txt"
    lines = (shared_data / "imagenet_subsets" / "1percent.txt").read_text().splitlines()
    copy.write_text("\n".join(lines[:-1]) + "\n")
    with pytest.warns(UserWarning, match="not the published 1percent.txt"):
        subset = read_subset_file(copy)
    assert subset.published is None
    assert len(subset.names) == 12_810


def test_class_is_the_text_before_the_first_underscore():
    assert class_of("n04235860_14959.JPEG") == "n04235860"
    assert class_of("train/n01/n01440764_10_26.JPEG") == "n01440764"
    with pytest.raises(ValueError, match="has no '_'"):
        class_of("cat.png")


def test_a_subset_file_that_is_not_text_is_named(tmp_path):
    """Guards: a binary --subset-file failed with "'utf-8' codec can't decode byte 0xff", naming no file."""
    path = tmp_path / "1percent.txt"
    path.write_bytes(b"\xff\xfe\x00n01440764_10026.JPEG\n")
    with pytest.raises(
        ValueError, match=f"subset file {path} is not UTF-8 text \\(byte 0\\); expected a file name a line"
    ):
        read_subset_file(path)


def _image_folder(root, names):
    for name in names:
        folder = root / class_of(name)
        folder.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (4, 4)).save(folder / name, format="PNG")
    return ImageFolderDataset(root)


def test_list_selects_the_named_files_of_an_imagefolder(tmp_path):
    names = [f"n0000000{c}_{i}.png" for c in range(3) for i in range(4)]
    dataset = _image_folder(tmp_path / "train", names)
    listing = tmp_path / "mine.txt"
    listing.write_text("n00000001_2.png\nn00000000_0.png\n\nn00000002_3.png\n")
    idx = indices_from_list(dataset, read_subset_file(listing))
    picked = sorted(dataset.samples[i][0].name for i in idx)
    assert picked == ["n00000000_0.png", "n00000001_2.png", "n00000002_3.png"]
    assert [dataset.targets[i] for i in idx] == [0, 1, 2]


def test_a_listed_name_that_two_class_folders_hold_is_refused_not_guessed(tmp_path):
    """Guards: cat/img_0.png and dog/img_0.png, and a list naming img_0.png took dog's (the last) in silence."""
    for folder in ("cat", "dog"):
        (tmp_path / "train" / folder).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (4, 4)).save(tmp_path / "train" / folder / f"img_{i}.png")
    listing = tmp_path / "mine.txt"
    listing.write_text("img_0.png\n")
    with pytest.raises(ValueError, match="names img_0.png, found in several class folders; rename them apart"):
        indices_from_list(ImageFolderDataset(tmp_path / "train"), read_subset_file(listing))


def test_list_naming_absent_files_is_rejected_with_count_and_examples(shared_data, tmp_path):
    real = (shared_data / "imagenet_subsets" / "1percent.txt").read_text().split()
    dataset = _image_folder(tmp_path / "train", real[:3])
    listing = tmp_path / "list.txt"
    listing.write_text("\n".join(real[:10]) + "\n")
    with pytest.raises(ValueError, match=r"names 7 of its 10 files that are not in the dataset: .*and 2 more") as err:
        indices_from_list(dataset, read_subset_file(listing))
    assert real[3] in str(err.value) and real[0] not in str(err.value)


def test_published_list_against_a_small_tree_reports_how_many_are_missing(shared_data, tmp_path):
    path = tmp_path / "1percent.txt"
    shutil.copy(shared_data / "imagenet_subsets" / "1percent.txt", path)
    dataset = _image_folder(tmp_path / "train", path.read_text().split()[:2])
    with pytest.raises(ValueError, match="names 12809 of its 12811 files"):
        subset_indices(dataset, subset_file=path)


def test_balanced_subset_takes_the_share_of_every_class_and_is_seeded():
    targets = np.repeat(np.arange(5), [100, 200, 50, 10, 1000])
    idx = balanced_subset_indices(targets, 10, seed=3)
    counts = Counter(targets[idx].tolist())
    assert counts == {0: 10, 1: 20, 2: 5, 3: 1, 4: 100}
    assert idx == sorted(set(idx))
    assert idx == balanced_subset_indices(targets, 10, seed=3)
    assert idx != balanced_subset_indices(targets, 10, seed=4)
    assert Counter(targets[balanced_subset_indices(targets, 1)].tolist()) == {0: 1, 1: 2, 2: 1, 3: 1, 4: 10}


def test_a_fraction_that_one_image_a_class_far_exceeds_is_a_warning():
    """Guards: 10% of 150 classes of one image each fine-tuned on all 150 images under a '10% labels' heading."""
    with pytest.warns(UserWarning, match=r"^10% labels 150 of 150 images \(one a class at least\)$"):
        assert len(balanced_subset_indices(list(range(150)), 10)) == 150
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(balanced_subset_indices([0] * 10 + [1] * 10, 10)) == 2  # the share asked for: no warning


def test_balanced_subset_rejects_a_fraction_outside_0_to_100():
    with pytest.raises(ValueError, match="--fraction"):
        balanced_subset_indices([0, 1], 0)
