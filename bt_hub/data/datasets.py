"""Datasets of ``(RGB PIL image, label)``: the embedded ``digits``, ImageFolder / ImageNet trees, synthetic; and the
fingerprint that says when one changed (what evaluation's records and caches and a resumed pretraining compare)."""

from __future__ import annotations

import hashlib
import os
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from bt_hub.common.artifacts import stat_row
from bt_hub.common.files import file_sha256
from bt_hub.common.images import open_rgb, to_rgb

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
SPLITS = ("train", "val", "test")


class VocObject(NamedTuple):
    """One ``<object>`` of a VOC annotation: its class, whether it is marked difficult, and its box as the file
    writes it (xmin, ymin, xmax, ymax: 1-based, inclusive), None where it has none."""

    name: str
    difficult: bool
    box: tuple[float, float, float, float] | None


def read_voc_annotation(path: Path) -> tuple[list[VocObject], tuple[int, int] | None]:
    """The objects of a VOC annotation file and its image's (height, width) where the file gives them; the one VOC
    XML reader of the classification (VOC07 SVMs) and detection protocols. Raises OSError / ValueError naming the
    file."""
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError) as err:
        raise OSError(f"annotation {path} cannot be read as VOC XML ({err})") from err
    objects = []
    for obj in root.iter("object"):
        name = (obj.findtext("name") or "").strip()
        if not name:
            raise ValueError(f"annotation {path} has an <object> without a <name>")
        box = _numbers(path, obj.find("bndbox"), ("xmin", "ymin", "xmax", "ymax"))
        objects.append(VocObject(name, (obj.findtext("difficult") or "0").strip() == "1", box))  # type: ignore[arg-type]
    size = _numbers(path, root.find("size"), ("height", "width"))
    return objects, (int(size[0]), int(size[1])) if size else None


def _numbers(path: Path, node: ET.Element | None, tags: tuple[str, ...]) -> tuple[float, ...] | None:
    if node is None:
        return None
    try:
        return tuple(float(node.findtext(tag)) for tag in tags)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"annotation {path}: <{node.tag}> must hold the numbers {', '.join(tags)}") from None


def to_uint8_tensor(image: Image.Image, source: str = "<in memory>") -> torch.Tensor:
    """A PIL image of any mode as a 3 x H x W uint8 RGB tensor (:func:`bt_hub.common.images.to_rgb`)."""
    array = np.asarray(to_rgb(image, source), dtype=np.uint8)
    return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()


class ArrayImageDataset(Dataset):
    """Images held in memory as an N x H x W x 3 uint8 array with integer labels."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, classes: Sequence[str]) -> None:
        self.images = images
        self.targets = [int(t) for t in labels]
        self.classes = list(classes)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        return Image.fromarray(self.images[index]), self.targets[index]


def _upsample_gray(images: np.ndarray, image_size: int) -> np.ndarray:
    t = torch.from_numpy(images).float().unsqueeze(1)
    t = torch.nn.functional.interpolate(t, size=(image_size, image_size), mode="bilinear", align_corners=False)
    t = (t.clamp(0, 1) * 255).round().to(torch.uint8)
    return t.expand(-1, 3, -1, -1).permute(0, 2, 3, 1).contiguous().numpy()


def load_digits_split(
    seed: int = 0, test_fraction: float = 0.2, image_size: int = 32
) -> tuple[ArrayImageDataset, ArrayImageDataset]:
    """scikit-learn's handwritten digits, upsampled to ``image_size``, as a seeded stratified (train, test) split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    digits = load_digits()
    images = _upsample_gray(digits.images / 16.0, image_size)
    idx = np.arange(len(digits.target))
    train_idx, test_idx = train_test_split(idx, test_size=test_fraction, random_state=seed, stratify=digits.target)
    classes = [str(c) for c in range(10)]
    train_idx, test_idx = np.sort(train_idx), np.sort(test_idx)
    return (
        ArrayImageDataset(images[train_idx], digits.target[train_idx], classes),
        ArrayImageDataset(images[test_idx], digits.target[test_idx], classes),
    )


def synthetic_dataset(
    num_samples: int = 512, image_size: int = 32, num_classes: int = 10, seed: int = 0
) -> ArrayImageDataset:
    """Seeded class-structured images: each class is a coloured oriented stripe pattern plus noise."""
    if num_samples <= 0 or image_size <= 0 or num_classes <= 0:
        raise ValueError(
            "synthetic data needs positive num_samples, image_size and num_classes; "
            f"got {num_samples}, {image_size}, {num_classes}"
        )
    rng = np.random.default_rng(seed)
    labels = np.arange(num_samples) % num_classes
    rng.shuffle(labels)
    yy, xx = np.mgrid[0:image_size, 0:image_size] / image_size
    palette = rng.uniform(0.2, 1.0, size=(num_classes, 3))
    images = np.empty((num_samples, image_size, image_size, 3), dtype=np.uint8)
    for i, c in enumerate(labels):
        angle = np.pi * c / num_classes
        freq = 2 + c % 4
        phase = rng.uniform(0, 2 * np.pi)
        pattern = 0.5 + 0.5 * np.sin(2 * np.pi * freq * (np.cos(angle) * xx + np.sin(angle) * yy) + phase)
        img = pattern[..., None] * palette[c] + rng.normal(0, 0.08, size=(image_size, image_size, 3))
        images[i] = (np.clip(img, 0, 1) * 255).round().astype(np.uint8)
    return ArrayImageDataset(images, labels, [str(c) for c in range(num_classes)])


def _walk(top: Path) -> list[tuple[str, list[str]]]:
    """``(folder, file names)`` under ``top``, symlinks followed; a link back to a folder already listed is refused."""
    seen, found = set(), []

    def unlisted(err: OSError) -> None:  # os.walk would skip the folder, and a class would lose its images unsaid
        raise OSError(f"data directory {err.filename} cannot be listed ({err.strerror}); fix its permissions")

    for dirpath, _, filenames in os.walk(top, followlinks=True, onerror=unlisted):  # alone, it lists a loop again
        if (real := os.path.realpath(dirpath)) in seen:
            raise ValueError(f"data directory {dirpath} leads back to {real} (a symlink loop); remove the link")
        seen.add(real)
        found.append((dirpath, filenames))
    return found


class ImageFolderDataset(Dataset):
    """``root/<class>/<image>``, classes sorted by name, optionally resized to ``image_size`` squares (bicubic);
    ``unlabelled``: a folder of images without class folders is read too, as one class named after the folder (a
    run that scores no label: ``bt-hub eval rankme``, ``bt-hub embed``)."""

    def __init__(self, root: str | os.PathLike, image_size: int | None = None, *, unlabelled: bool = False) -> None:
        self.root = Path(root)
        if not self.root.exists():
            raise FileNotFoundError(f"data directory {self.root} does not exist")
        if not self.root.is_dir():
            raise NotADirectoryError(
                f"data path {self.root} is not a directory; expected an ImageFolder tree (class/image.png)"
            )
        entries = [e for e in self.root.iterdir() if not e.name.startswith(".")]
        self.classes = sorted(e.name for e in entries if e.is_dir())
        loose = sorted(e.name for e in entries if e.name.lower().endswith(IMAGE_EXTENSIONS) and e.is_file())
        if loose and self.classes:  # ImageNet's raw val/ is loose files: scored on its class folders alone, unsaid
            warnings.warn(
                f"data directory {self.root}: {len(loose)} image files lie beside its class folders (e.g. {loose[0]}) "
                "and are not read; an ImageFolder holds <class>/<image>",
                stacklevel=2,
            )
        if not self.classes and not (unlabelled and loose):
            raise ValueError(
                f"data directory {self.root} has no class subdirectories; "
                "expected an ImageFolder tree (class/image.png)"
            )
        self.samples: list[tuple[Path, int]] = []
        apple_double: list[Path] = []  # macOS's "._x.png" beside "x.png": Finder metadata, not an image
        listed = {name: sorted(_walk(self.root / name)) for name in self.classes}
        if not listed:  # unlabelled: the folder's own images, one class
            listed = {self.root.resolve().name: [(str(self.root), loose)]}
        self.classes = list(listed)
        for label, folders in enumerate(listed.values()):
            for dirpath, filenames in folders:
                for fname in sorted(f for f in filenames if f.lower().endswith(IMAGE_EXTENSIONS)):
                    (apple_double if fname.startswith("._") else self.samples).append((Path(dirpath) / fname, label))
        if apple_double:
            warnings.warn(
                f"data directory {self.root}: skipped {len(apple_double)} macOS metadata files named ._* "
                f"(AppleDouble, not images), e.g. {apple_double[0][0]}",
                stacklevel=2,
            )
        if not self.samples:
            raise ValueError(
                f"data directory {self.root} contains no images "
                f"(looked for {', '.join(IMAGE_EXTENSIONS)}) in its class subdirectories"
            )
        self.targets = [label for _, label in self.samples]
        self.image_size = image_size

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        path, label = self.samples[index]
        image = open_rgb(path)
        if self.image_size is not None and image.size != (self.image_size, self.image_size):
            image = image.resize((self.image_size, self.image_size), Image.Resampling.BICUBIC)
        return image, label


def _folder_for_split(root: Path, split: str) -> Path:
    """``root/<split>`` when present; a flat ImageFolder is a training split only (never its own test split)."""
    if (root / split).is_dir():
        return root / split
    if split == "train" and not any((root / s).is_dir() for s in SPLITS):
        return root
    present = ", ".join(f"{s}/" for s in SPLITS if (root / s).is_dir()) or "no split subdirectories"
    raise FileNotFoundError(
        f"data directory {root} has no {split}/ subdirectory (it has {present}); "
        f"a held-out split must be a folder of its own, {root}/{split}/<class>/<image>, disjoint from {root}/train/"
    )


def is_builtin(spec: str) -> bool:
    """Whether a ``--data`` value names a set made in memory (``digits``, ``synthetic[:N]``, each with its own
    held-out part) rather than a folder (``synthetic_shapes/`` is a folder)."""
    return spec in ("digits", "synthetic") or spec.startswith("synthetic:")


def build_dataset(
    name_or_path: str | os.PathLike,
    split: str = "train",
    *,
    image_size: int | None = 32,
    seed: int = 0,
    test_fraction: float = 0.2,
    unlabelled: bool = False,
) -> Dataset:
    """The dataset behind a ``--data`` value (``digits``, ``synthetic[:N]`` or a directory) of (RGB image, label);
    ``unlabelled``: a folder of images without class folders is one class (:class:`ImageFolderDataset`)."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is unknown; expected one of {SPLITS}")
    spec = str(name_or_path)
    if is_builtin(spec) and Path(spec).is_dir():
        raise ValueError(f"--data {spec} names a built-in set and a folder here; pass ./{spec} for the folder")
    if spec == "digits":
        train, test = load_digits_split(seed=seed, test_fraction=test_fraction, image_size=image_size or 32)
        return train if split == "train" else test
    if spec == "synthetic" or spec.startswith("synthetic:"):
        try:
            n = int(spec.split(":", 1)[1]) if ":" in spec else 512
        except ValueError:
            raise ValueError(
                f"data {spec!r} is malformed; expected 'synthetic' or 'synthetic:N' with N an integer"
            ) from None
        full = synthetic_dataset(n, image_size or 32, seed=seed)
        n_test = int(round(n * test_fraction))
        part = slice(n_test, None) if split == "train" else slice(None, n_test)
        return ArrayImageDataset(full.images[part], np.array(full.targets[part]), full.classes)
    root = Path(spec).expanduser()
    if not root.exists():
        raise FileNotFoundError(
            f"data directory {root} does not exist "
            "(expected 'digits', 'synthetic[:N]' or a path to an ImageFolder tree)"
        )
    return ImageFolderDataset(_folder_for_split(root, split), image_size=image_size, unlabelled=unlabelled)


CONTENT_SAMPLE = 32  # files of a directory whose bytes go into its fingerprint


def _sampled_content(paths: list[Path]) -> bytes:
    """sha256s of ``CONTENT_SAMPLE`` evenly spaced files: two folders with the same names and sizes still differ."""
    picks = sorted({int(i) for i in np.linspace(0, len(paths) - 1, min(len(paths), CONTENT_SAMPLE))}) if paths else []
    return "".join(file_sha256(paths[i]) for i in picks).encode()


def dataset_fingerprint(dataset_or_path: Dataset | str | os.PathLike, *, content: bool = True) -> str:
    """A sha256 that changes when the images, their order or their labels change.

    Files: their stat rows (relative path, size, mtime, ctime: any write to a file moves its ctime, see
    :mod:`bt_hub.common.artifacts`) and labels, plus the bytes of 32 evenly spaced files unless ``content`` is False
    (pretraining's checkpoint: a store reads each image once, and no fingerprint reads one again); in-memory sets:
    the array and labels; other datasets: every item's pixels and label.
    """
    h = hashlib.sha256()
    if isinstance(dataset_or_path, (str, os.PathLike)):
        spec = str(dataset_or_path)
        root = Path(spec).expanduser()
        if not root.is_dir():
            h.update(spec.encode())
            return h.hexdigest()
        files = []
        for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
            dirnames.sort()
            for name in sorted(filenames):
                p = Path(dirpath) / name
                files.append(p)
                h.update(f"{stat_row(p, root)};".encode())
        h.update(_sampled_content(files) if content else b"")
        return h.hexdigest()
    dataset = dataset_or_path
    samples = getattr(dataset, "samples", None)
    images = getattr(dataset, "images", None)
    if samples is not None:
        root = Path(getattr(dataset, "root", "/"))
        h.update(f"{root.name}/;".encode())
        for path, label in samples:
            p = Path(path)
            h.update(f"{stat_row(p, root if p.is_relative_to(root) else Path(p.anchor))}:{label!r};".encode())
        h.update(_sampled_content([Path(s[0]) for s in samples]) if content else b"")
    elif isinstance(images, np.ndarray):
        h.update(f"{images.shape}:{images.dtype};".encode())
        h.update(np.ascontiguousarray(images).tobytes())
        h.update(repr(list(getattr(dataset, "targets", []))).encode())
    else:
        for i in range(len(dataset)):
            image, label = dataset[i][:2]
            h.update(np.asarray(image).tobytes())
            h.update(f":{label!r};".encode())
    return h.hexdigest()
