"""The explicit, disjoint train and test splits every protocol reads; ``load_splits`` is the one way in."""

from __future__ import annotations

import copy
import hashlib
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from torch.utils.data import Dataset, Subset

from bt_hub.common.files import file_sha256
from bt_hub.data.datasets import SPLITS, ArrayImageDataset, build_dataset, dataset_fingerprint, is_builtin
from bt_hub.eval.config import EvalWarning
from bt_hub.eval.label_subsets import balanced_subset_indices

OVERLAP_SAMPLE = 64  # test images whose bytes are compared with the training split's
OVERLAP_SHARE = 0.1  # refuse when this share of the sample (and at least 2) is found in train
GENERIC_HASH_LIMIT = 20_000  # datasets that are neither files nor arrays: hash train items up to this size
TEST_SPLITS = ("val", "test")


@dataclass
class Splits:
    """The (train, test) datasets of a run and the facts results record about them (``info``)."""

    train: Dataset
    test: Dataset
    info: dict[str, Any]

    @property
    def classes(self) -> list[str]:
        """The class names, in label order."""
        return list(getattr(self.train, "classes", []))

    def image_side(self) -> int | None:
        """The shorter side of the first training image in pixels (None for an empty split)."""
        if not len(self.train):
            return None
        image = self.train[0][0]
        # PIL (w, h); tensors C x H x W
        size = image.size if isinstance(image, Image.Image) else tuple(np.asarray(image).shape[-2:])
        return int(min(size))


def load_splits(
    data: str,
    *,
    test_split: str | None = "val",
    holdout: float | None = None,
    seed: int = 0,
    image_size: int | None = None,
    scored: bool = True,
) -> Splits:
    """The training and test splits of ``--data``, checked to be disjoint.

    ``test_split`` None: no held-out split is read (an empty one); ``scored`` False: features only, one class will do.

    Args:
        data: ``digits`` or ``synthetic[:N]`` (built in, with their own held-out part), or a folder with
            ``train/`` and ``val/`` or ``test/`` of class sub-folders (ImageFolder), whose test classes are
            mapped to the training order.
        test_split: the held-out folder, ``"val"`` or ``"test"``; None reads none (an empty test split).
        holdout: instead of a test folder, a seeded class-stratified fraction in (0, 1) of ``train/`` (the
            record keeps the fraction, seed and a sha256 of the held-out indices).
        seed: the seed of ``holdout``'s draw and of the built-in sets' split.
        image_size: the side the built-in sets are rendered at; folders ignore it (their transform resizes).
        scored: False when no label is scored (``bt-hub embed``, ``bt-hub eval rankme``): a training split of one
            class is then accepted, and a folder of images without class folders is one class.

    Returns:
        ``Splits(train, test, info)``: ``info`` names the data and gives each split's name, size and
        fingerprint, the overlap check and the holdout's facts, as the results record them.

    Raises:
        FileNotFoundError: a directory without the held-out split asked for.
        ValueError: a bad fraction, an empty split, a training split of one class, or overlapping splits.
    """
    if test_split not in (*TEST_SPLITS, None):
        raise ValueError(f"--test-split must be one of {TEST_SPLITS}, got {test_split!r}")
    if holdout is not None and not 0 < holdout < 1:
        raise ValueError(f"--holdout must be a fraction in (0, 1), e.g. 0.2, got {holdout}")
    spec = str(data)
    size = image_size if is_builtin(spec) else None
    if not is_builtin(spec) and test_split is not None:
        _check_layout(Path(spec).expanduser(), test_split, holdout, scored)
    train = build_dataset(spec, "train", image_size=size, seed=seed, unlabelled=not scored)
    info: dict[str, Any] = {"name": _name(spec), "path": spec, "holdout": None}
    if holdout is not None:
        source_fingerprint = dataset_fingerprint(train)
        train_idx, test_idx = stratified_holdout(_targets(train), holdout, seed)
        train, test = take(train, train_idx), take(train, test_idx)
        info["holdout"] = {
            "fraction": holdout,
            "seed": seed,
            "source_split": "train",
            "source_fingerprint": source_fingerprint,
            "test_indices_sha256": indices_sha256(test_idx),
            "train_size": len(train_idx),
            "test_size": len(test_idx),
        }
        test_name = "holdout"
    elif test_split is None:
        test, test_name = take(train, []), "none"
    else:
        test = align_classes(train, build_dataset(spec, test_split, image_size=size, seed=seed), test_split)
        test_name = test_split
    check_scorable(spec, train, test, test_name, scored=scored)
    info["overlap_check"] = check_disjoint(train, test, of_holdout=holdout is not None)
    train_fp, test_fp = dataset_fingerprint(train), dataset_fingerprint(test)
    info["train"] = {"split": "train", "size": len(train), "fingerprint": train_fp}
    info["test"] = {"split": test_name, "size": len(test), "fingerprint": test_fp}
    info["fingerprint"] = hashlib.sha256(f"{train_fp}:{test_fp}".encode()).hexdigest()
    return Splits(train, test, info)


def check_scorable(data: str, train: Dataset, test: Dataset, test_name: str, *, scored: bool = True) -> None:
    """Refuse splits whose accuracy means nothing: an empty split, or (``scored``) a training split of one class."""
    if not len(train) or not (len(test) or test_name == "none"):
        hint = (
            " (synthetic:N holds out about a fifth of its N images: give a larger N, e.g. synthetic:100)"
            if is_builtin(data) and data != "digits"
            else ""
        )
        raise ValueError(
            f"--data {data} gives {len(train)} training and {len(test)} {test_name} images; "
            f"a run needs at least one of each{hint}"
        )
    classes = np.unique(_targets(train))
    if len(classes) < 2 and scored:
        raise ValueError(
            f"--data {data}: every training image is of one class ({_class_name(train, classes)}), so any "
            "classifier scores 100% and accuracy means nothing; give at least 2 classes"
        )


def _class_name(dataset: Dataset, labels: np.ndarray) -> str:
    names = list(getattr(dataset, "classes", []))
    return ", ".join(str(names[int(i)]) if int(i) < len(names) else str(i) for i in labels) or "none"


def _name(spec: str) -> str:
    return spec if is_builtin(spec) else Path(os.path.expanduser(spec)).resolve().name


def _check_layout(root: Path, test_split: str, holdout: float | None, scored: bool = True) -> None:
    if not root.is_dir():
        return  # build_dataset names the problem
    present = [s for s in SPLITS if (root / s).is_dir()]
    if holdout is not None:
        return
    if test_split in present and "train" in present:
        return
    if "train" in present and present != ["train"]:
        other = next(s for s in present if s != "train")
        raise FileNotFoundError(
            f"--data {root} has no {test_split}/ split (it has {', '.join(p + '/' for p in present)}); "
            f"pass --test-split {other}"
        )
    if present and "train" not in present:
        raise FileNotFoundError(
            f"--data {root} has {', '.join(p + '/' for p in present)} but no train/; "
            f"the training split must be {root}/train/<class>/<image>"
        )
    raise FileNotFoundError(
        f"--data {root} has no held-out split: expected {root}/train/<class>/<image> beside {root}/val/<class>/<image> "
        f"(ImageNet layout, --test-split val) or {root}/test/<class>/<image> (--test-split test); "
        "move held-out images there, "
        + (
            "or pass --holdout 0.2 to score on a seeded, class-stratified 20% of the images (recorded in results.json)"
            if scored
            else "or pass --splits train to embed the training images alone (bt-hub eval rankme: --split train)"
        )
    )


def _targets(dataset: Dataset) -> np.ndarray:
    targets = getattr(dataset, "targets", None)
    if targets is None:
        targets = [dataset[i][1] for i in range(len(dataset))]
    return np.asarray(targets)


def stratified_holdout(
    targets: Sequence[int] | np.ndarray, fraction: float, seed: int = 0
) -> tuple[list[int], list[int]]:
    """Seeded, class-stratified ``(train indices, held-out indices)``, both sorted."""
    if not 0 < fraction < 1:
        raise ValueError(f"--holdout must be a fraction in (0, 1), got {fraction}")
    held = balanced_subset_indices(targets, 100 * fraction, seed, leave_one=True)
    held_set = set(held)
    return [i for i in range(len(targets)) if i not in held_set], held


def indices_sha256(indices: Sequence[int]) -> str:
    """sha256 of ``"i0,i1,..."``: names a split of a dataset without listing it."""
    return hashlib.sha256(",".join(str(int(i)) for i in indices).encode()).hexdigest()


def take(dataset: Dataset, indices: Sequence[int]) -> Dataset:
    """The samples ``indices`` of a dataset, keeping its kind (file list or array) so fingerprints stay cheap."""
    indices = [int(i) for i in indices]
    if isinstance(dataset, ArrayImageDataset):
        return ArrayImageDataset(dataset.images[indices], np.asarray(dataset.targets)[indices], dataset.classes)
    if hasattr(dataset, "samples"):
        view = copy.copy(dataset)
        view.samples = [dataset.samples[i] for i in indices]
        view.targets = [s[1] for s in view.samples]
        return view
    view = Subset(dataset, indices)
    view.classes = list(getattr(dataset, "classes", []))
    view.targets = _targets(dataset)[indices].tolist()
    return view


def align_classes(train: Dataset, test: Dataset, split: str) -> Dataset:
    """``test`` with labels in ``train``'s class order; a test class with no training image is an error (its
    images could never be classified right: torchvision's ImageFolder refuses an empty class folder too)."""
    train_classes, test_classes = list(getattr(train, "classes", [])), list(getattr(test, "classes", []))
    if not hasattr(test, "samples"):
        return test
    unknown = sorted({test_classes[t] for t in set(test.targets)} - {train_classes[t] for t in set(_targets(train))})
    if unknown:
        raise ValueError(
            f"the {split} split has classes the training split lacks (or holds no image of): "
            f"{', '.join(unknown[:5])}; both must use the same class folders, each with training images"
        )
    if train_classes == test_classes:
        return test
    index = {c: i for i, c in enumerate(train_classes)}
    view = copy.copy(test)
    view.samples = [(path, index[test_classes[label]]) for path, label in test.samples]
    view.targets = [label for _, label in view.samples]
    view.classes = train_classes
    return view


# ----------------------------------------------------------------------------- overlap


def _paths(dataset: Dataset) -> list[str] | None:
    samples = getattr(dataset, "samples", None)
    return None if samples is None else [os.path.abspath(str(s[0])) for s in samples]


def _item_digest(dataset: Dataset, index: int) -> str:
    images = getattr(dataset, "images", None)
    if isinstance(images, np.ndarray):
        return hashlib.sha256(np.ascontiguousarray(images[index]).tobytes()).hexdigest()
    return hashlib.sha256(np.asarray(dataset[index][0]).tobytes()).hexdigest()


def check_disjoint(
    train: Dataset, test: Dataset, sample: int = OVERLAP_SAMPLE, of_holdout: bool = False
) -> dict[str, Any]:
    """Refuse a test split that shares files or images with the training split; return what was checked.

    All paths are compared, and the bytes of a seeded ``sample`` of test images with the training images
    of the same file size; copies too few to refuse the run (ImageNet's val holds a handful) are warned of.
    ``of_holdout``: ``test`` was drawn from the training folder (``--holdout``), so copies are the folder's own.
    """
    train_paths, test_paths = _paths(train), _paths(test)
    if train_paths is not None and test_paths is not None:
        shared = set(train_paths) & set(test_paths)
        if shared:
            raise ValueError(
                f"the test split shares {len(shared)} of its {len(test_paths)} files with the training split "
                f"(e.g. {min(shared)}); "
                "scoring on training images inflates every metric: give a disjoint held-out split or --holdout"
            )
    picked = sorted(np.random.default_rng(0).permutation(len(test))[: min(sample, len(test))].tolist())
    if test_paths is not None and train_paths is not None:
        test_files = [test_paths[i] for i in picked]
        sizes = {os.path.getsize(p) for p in test_files}
        candidates = [p for p in train_paths if os.path.getsize(p) in sizes]
        train_digests = {file_sha256(p) for p in candidates}
        identical = sum(file_sha256(p) in train_digests for p in test_files)
    elif isinstance(getattr(train, "images", None), np.ndarray) or len(train) <= GENERIC_HASH_LIMIT:
        train_digests = {_item_digest(train, i) for i in range(len(train))}
        identical = sum(_item_digest(test, i) in train_digests for i in picked)
    else:
        return {"shared_files": 0, "sampled": 0, "identical": None}
    if len(picked) and identical >= max(2, math.ceil(OVERLAP_SHARE * len(picked))):
        raise ValueError(
            f"{identical} of {len(picked)} sampled test images are byte-identical to training images; "
            + (
                "the training folder holds byte-identical copies of its images, which --holdout split apart: "
                "remove the copies"
                if of_holdout
                else "the test split overlaps the training split: give a disjoint held-out split or --holdout"
            )
        )
    if identical:
        warnings.warn(
            f"{identical} of {len(picked)} sampled test images are byte-identical to training images (a run is "
            f"refused from {OVERLAP_SHARE:.0%} and 2); they are scored, and counted in results.json's overlap_check",
            EvalWarning,
            stacklevel=2,
        )
    return {"shared_files": 0, "sampled": len(picked), "identical": identical}
