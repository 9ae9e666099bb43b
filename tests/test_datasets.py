"""Datasets: digits shape and labels, ImageFolder from real PNG files, and every error sentence."""

from __future__ import annotations

import os

import numpy as np
import pytest

from bt_hub.data.datasets import build_dataset, load_digits_split, synthetic_dataset, to_uint8_tensor


def test_digits_are_upsampled_rgb_images_with_ten_stratified_classes():
    train, test = load_digits_split(seed=0, test_fraction=0.2, image_size=32)
    assert len(train) + len(test) == 1797
    assert len(test) == 360
    image, label = train[0]
    assert image.size == (32, 32) and image.mode == "RGB"
    t = to_uint8_tensor(image)
    assert t.shape == (3, 32, 32) and t.dtype.is_floating_point is False
    assert sorted(set(train.targets)) == list(range(10)) and sorted(set(test.targets)) == list(range(10))
    assert int(t.max()) > 200 and int(t.min()) == 0  # strokes kept, background black
    again, _ = load_digits_split(seed=0, test_fraction=0.2, image_size=32)
    assert again.targets == train.targets
    other, _ = load_digits_split(seed=1, test_fraction=0.2, image_size=32)
    assert other.targets != train.targets


def test_build_dataset_digits_and_synthetic_splits():
    assert len(build_dataset("digits", "train", image_size=16)) == 1437
    assert len(build_dataset("digits", "test", image_size=16)) == 360
    syn = build_dataset("synthetic:50", "train", image_size=8)
    assert len(syn) == 40 and syn[0][0].size == (8, 8)
    assert len(build_dataset("synthetic:50", "val", image_size=8)) == 10


def test_synthetic_images_are_seeded_and_class_structured():
    a, b = synthetic_dataset(40, 16, seed=3), synthetic_dataset(40, 16, seed=3)
    np.testing.assert_array_equal(a.images, b.images)
    x = a.images.reshape(40, -1, 3).astype(float).mean(1)  # mean colour carries the class
    labels = np.array(a.targets)
    centroids = np.stack([x[labels == c].mean(0) for c in range(10)])
    nearest = ((x[:, None] - centroids[None]) ** 2).sum(-1).argmin(1)
    assert (nearest == labels).mean() > 0.9


def test_image_folder_reads_a_tree_of_png_files(image_folder, tmp_path):
    root = image_folder(tmp_path / "data", classes=("cat", "dog"), size=(10, 12), splits=())
    ds = build_dataset(root, "train", image_size=None)
    assert ds.classes == ["cat", "dog"] and len(ds) == 6 and ds.targets == [0, 0, 0, 1, 1, 1]
    image, label = ds[4]
    assert image.size == (12, 10) and image.mode == "RGB" and label == 1
    resized = build_dataset(root, "train", image_size=8)
    assert resized[0][0].size == (8, 8)


def test_imagenet_layout_picks_the_split_subdirectory(image_folder, tmp_path):
    image_folder(tmp_path, classes=("cat", "dog"), per_class=2, splits=("train",))
    image_folder(tmp_path, classes=("cat", "dog", "eel"), per_class=1, splits=("val",), seed=1)
    assert len(build_dataset(tmp_path, "train", image_size=None)) == 4
    assert len(build_dataset(tmp_path, "val", image_size=None)) == 3
    with pytest.raises(FileNotFoundError, match=r"has no test/ subdirectory \(it has train/, val/\)"):
        build_dataset(tmp_path, "test", image_size=None)  # a split is never another one under its name


def test_a_flat_imagefolder_is_a_training_split_only(image_folder, tmp_path):
    image_folder(tmp_path, classes=("cat", "dog"), per_class=2, splits=())
    assert len(build_dataset(tmp_path, "train", image_size=None)) == 4
    with pytest.raises(FileNotFoundError, match="has no val/ subdirectory"):
        build_dataset(tmp_path, "val", image_size=None)


def test_missing_directory_is_one_sentence_naming_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"data directory {tmp_path / 'nope'} does not exist"):
        build_dataset(tmp_path / "nope")


def test_empty_directory_is_one_sentence_naming_the_path(tmp_path):
    with pytest.raises(ValueError, match=f"data directory {tmp_path} has no class subdirectories"):
        build_dataset(tmp_path)


def test_directory_without_images_is_one_sentence_naming_the_path(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=f"data directory {tmp_path} contains no images"):
        build_dataset(tmp_path)


def test_corrupt_image_names_the_file(image_folder, tmp_path):
    root = image_folder(tmp_path, classes=("cat", "dog"), per_class=1, splits=())
    bad = root / "cat" / "cat_0.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    ds = build_dataset(root, image_size=None)
    with pytest.raises(OSError, match=f"image {bad} is corrupt or unreadable"):
        ds[0]


def test_macos_appledouble_files_beside_images_are_skipped_with_one_warning(image_folder, tmp_path):
    """Guards: '._cat_0.png' files (Finder metadata a Mac leaves on copies) were read as images and failed to decode,
    so the whole dataset was refused."""
    root = image_folder(tmp_path, classes=("cat", "dog"), per_class=2, splits=())
    for name in ("cat", "dog"):
        for i in range(2):
            (root / name / f"._{name}_{i}.png").write_bytes(b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        ")
    with pytest.warns(UserWarning) as caught:
        ds = build_dataset(root, image_size=None)
    assert [str(w.message) for w in caught] == [
        f"data directory {root}: skipped 4 macOS metadata files named ._* (AppleDouble, not images), "
        f"e.g. {root / 'cat' / '._cat_0.png'}"
    ]
    assert [path.name for path, _ in ds.samples] == ["cat_0.png", "cat_1.png", "dog_0.png", "dog_1.png"]
    assert [ds[i][1] for i in range(len(ds))] == [0, 0, 1, 1]  # every sample decodes


def test_images_beside_the_class_folders_are_named_in_a_warning(image_folder, tmp_path):
    """Guards: ImageNet's raw val/ (loose JPEGs) beside one class folder was scored on that folder alone, unsaid."""
    root = image_folder(tmp_path, classes=("cat",), per_class=1, splits=())
    for name in ("x.JPEG", "y.png"):
        (root / name).write_bytes(b"")  # never opened: only counted
    with pytest.warns(UserWarning, match=r"2 image files lie beside its class folders \(e.g. x.JPEG\) and are not"):
        assert len(build_dataset(root, image_size=None)) == 1


def test_a_symlink_loop_is_refused_not_listed_again_and_again(image_folder, tmp_path):
    """Guards: a link back up the tree (cat/up -> the root) had each image listed ~40 times, dog's as cats too
    (and two such links take exponential time)."""
    root = image_folder(tmp_path / "data", classes=("cat", "dog"), per_class=2, splits=())
    for link, target in (("up", root), ("again", root / "cat")):
        (root / "cat" / link).symlink_to(target)
        with pytest.raises(ValueError, match=r"leads back to .* \(a symlink loop\); remove the link"):
            build_dataset(root, image_size=None)
        (root / "cat" / link).unlink()
    (root / "dog" / "more").symlink_to(image_folder(tmp_path / "elsewhere", classes=("x",), per_class=1, splits=()))
    assert build_dataset(root, image_size=None).targets == [0, 0, 1, 1, 1]  # a link elsewhere is followed


def test_a_class_folder_that_cannot_be_listed_is_named_not_skipped(image_folder, tmp_path, monkeypatch):
    """Guards: os.walk skipped an unreadable folder (chmod 000) in silence, so its class lost every image."""
    root = image_folder(tmp_path, classes=("cat", "dog", "eel"), per_class=1, splits=())
    scandir = os.scandir

    def denied(path):
        if os.fspath(path) == str(root / "dog"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", denied)
    with pytest.raises(OSError, match=f"data directory {root / 'dog'} cannot be listed \\(Permission denied\\)"):
        build_dataset(root, image_size=None)


def test_a_folder_named_like_a_built_in_set_is_refused_not_shadowed(image_folder, tmp_path, monkeypatch):
    """Guards: --data digits, with a ./digits ImageFolder in the working directory, scored the embedded digits."""
    monkeypatch.chdir(tmp_path)
    image_folder(tmp_path / "digits", classes=("0", "1"), per_class=2, splits=())
    with pytest.raises(ValueError, match="--data digits names a built-in set and a folder here; pass ./digits"):
        build_dataset("digits", image_size=None)
    assert len(build_dataset("./digits", image_size=None)) == 4


def test_bad_names_and_splits_are_rejected():
    with pytest.raises(ValueError, match="'synthetic:x' is malformed"):
        build_dataset("synthetic:x")
    with pytest.raises(ValueError, match="split 'dev' is unknown"):
        build_dataset("digits", "dev")
