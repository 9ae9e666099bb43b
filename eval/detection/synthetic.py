"""A generated detection set of four coloured shapes, as a VOC devkit and COCO json (docs/detection.md)."""

from __future__ import annotations

import math
import os
import shutil
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from bt_hub.common.config import MAX_IMAGE_SIZE, REQUIRED, check_seed, option
from bt_hub.common.files import atomic_write, atomic_write_json, atomic_write_text, read_json
from bt_hub.common.optional import require

CLASSES = ("square", "disc", "triangle", "cross")
COLOURS = {"square": (225, 45, 45), "disc": (40, 205, 70), "triangle": (55, 95, 240), "cross": (240, 215, 35)}
CLASSES_FILE = "classes.txt"
MARKER = "bt_hub_detection_data.json"
# make-detection-data writes into ``.<out name>.bt_hub-partial/`` beside ``--out`` and renames it into place at
# the end; this file, written first, marks such a folder as bt_hub's own (so only bt_hub's is ever removed).
PARTIAL_SUFFIX = ".bt_hub-partial"
PARTIAL_MARKER = "bt_hub_detection_data.partial.json"

__all__ = [
    "CLASSES",
    "CLASSES_FILE",
    "DetectionDataConfig",
    "Shape",
    "draw_image",
    "make_detection_data",
    "write_coco",
    "write_voc",
]


@dataclass(frozen=True)
class Shape:
    """One object: its class, its box (x0, y0, x1, y1: continuous pixel coordinates) and its polygon."""

    kind: str
    box: tuple[int, int, int, int]
    polygon: tuple[float, ...]


def _polygon(kind: str, box: tuple[int, int, int, int]) -> tuple[float, ...]:
    """The outline of ``kind`` inscribed in ``box``; its bounding box is ``box`` exactly."""
    x0, y0, x1, y1 = box
    cx, cy, w, h = (x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0
    if kind == "square":
        pts = [(x0, y0), (x1, y0), (x1, y1), (x0, y1)]
    elif kind == "triangle":
        pts = [(cx, y0), (x1, y1), (x0, y1)]
    elif kind == "cross":
        a, b = w / 3, h / 3
        pts = [
            (x0 + a, y0),
            (x1 - a, y0),
            (x1 - a, y0 + b),
            (x1, y0 + b),
            (x1, y1 - b),
            (x1 - a, y1 - b),
            (x1 - a, y1),
            (x0 + a, y1),
            (x0 + a, y1 - b),
            (x0, y1 - b),
            (x0, y0 + b),
            (x0 + a, y0 + b),
        ]
    else:
        angles = [2 * math.pi * k / 24 for k in range(24)]
        pts = [(cx + w / 2 * math.cos(t), cy + h / 2 * math.sin(t)) for t in angles]
        pts = [(min(max(x, x0), x1), min(max(y, y0), y1)) for x, y in pts]
    return tuple(float(v) for p in pts for v in p)


def rasterize(polygon: Sequence[float], height: int, width: int) -> np.ndarray:
    """The ``height`` x ``width`` bool mask of a polygon, rasterised as COCO's tools do."""
    mask_util = require("pycocotools.mask", "the generated detection set")
    rle = mask_util.merge(mask_util.frPyObjects([list(polygon)], height, width))
    return mask_util.decode(rle).astype(bool)


def _texture(rng: np.random.Generator, size: int) -> np.ndarray:
    """A grey canvas: coarse blotches plus fine grain, kept darker than every object colour."""
    coarse = rng.uniform(50, 130, size=(max(2, size // 16),) * 2 + (1,)).astype(np.float32)
    blotches = np.asarray(
        Image.fromarray(coarse[..., 0].astype(np.uint8)).resize((size, size), Image.BILINEAR), dtype=np.float32
    )
    tint = rng.uniform(-12, 12, size=3).astype(np.float32)
    grain = rng.normal(0, 10, size=(size, size, 3)).astype(np.float32)
    return np.clip(blotches[..., None] + tint + grain, 0, 255)


def _overlaps(box: Sequence[int], others: Sequence[Shape], gap: int = 2) -> bool:
    return any(
        box[0] < o.box[2] + gap and o.box[0] < box[2] + gap and box[1] < o.box[3] + gap and o.box[1] < box[3] + gap
        for o in others
    )


def draw_image(rng: np.random.Generator, size: int, max_objects: int = 5) -> tuple[Image.Image, list[Shape]]:
    """A textured ``size`` x ``size`` image with 2..max_objects non-overlapping shapes."""
    pixels = _texture(rng, size)
    shapes: list[Shape] = []
    low, high = max(6, round(0.10 * size)), max(8, round(0.45 * size))
    for _ in range(int(rng.integers(2, max_objects + 1))):
        for _attempt in range(30):
            side = int(round(math.exp(rng.uniform(math.log(low), math.log(high)))))
            aspect = rng.uniform(0.8, 1.25)
            w, h = max(4, min(size, round(side * aspect))), max(4, min(size, round(side / aspect)))
            x0, y0 = int(rng.integers(0, size - w + 1)), int(rng.integers(0, size - h + 1))
            box = (x0, y0, x0 + w, y0 + h)
            if not _overlaps(box, shapes):
                break
        else:
            continue
        kind = CLASSES[int(rng.integers(len(CLASSES)))]
        polygon = _polygon(kind, box)
        colour = np.asarray(COLOURS[kind], dtype=np.float32) + rng.uniform(-15, 15, size=3)
        pixels[rasterize(polygon, size, size)] = np.clip(colour, 0, 255)
        shapes.append(Shape(kind, box, polygon))
    return Image.fromarray(pixels.astype(np.uint8), "RGB"), shapes


def _save_jpeg(image: Image.Image, path: Path) -> None:
    atomic_write(path, lambda f: image.save(f, format="JPEG", quality=95))


def _voc_xml(file_id: str, size: int, shapes: list[Shape]) -> str:
    objects = "".join(
        f"<object><name>{s.kind}</name><pose>Unspecified</pose><truncated>0</truncated>"
        f"<difficult>0</difficult><bndbox><xmin>{s.box[0] + 1}</xmin><ymin>{s.box[1] + 1}</ymin>"
        f"<xmax>{s.box[2]}</xmax><ymax>{s.box[3]}</ymax></bndbox></object>"
        for s in shapes
    )
    return (
        f"<annotation><folder>VOC</folder><filename>{file_id}.jpg</filename>"
        f"<size><width>{size}</width><height>{size}</height><depth>3</depth></size>"
        f"<segmented>0</segmented>{objects}</annotation>\n"
    )


def write_voc(
    root: str | Path,
    *,
    splits: dict[str, dict[str, int]] | None = None,
    size: int = 128,
    seed: int = 0,
) -> Path:
    """Write a VOC devkit of generated images under ``root/VOC{year}/`` (1-based inclusive corners); return ``root``."""
    root = Path(root)
    splits = splits or {"2007": {"trainval": 8, "test": 4}, "2012": {"trainval": 8}}
    rng = np.random.default_rng(seed)
    for year, counts in splits.items():
        base = root / f"VOC{year}"
        atomic_write_text(base / CLASSES_FILE, "".join(name + "\n" for name in CLASSES))
        for split, count in counts.items():
            ids = [f"{year}_{split}_{i:06d}" for i in range(count)]
            for file_id in ids:
                image, shapes = draw_image(rng, size)
                _save_jpeg(image, base / "JPEGImages" / f"{file_id}.jpg")
                atomic_write_text(base / "Annotations" / f"{file_id}.xml", _voc_xml(file_id, size, shapes))
            atomic_write_text(base / "ImageSets" / "Main" / f"{split}.txt", "".join(i + "\n" for i in ids))
    return root


def write_coco(
    root: str | Path,
    *,
    splits: dict[str, int] | None = None,
    size: int = 128,
    seed: int = 0,
) -> Path:
    """Write the images of :func:`write_voc` in COCO layout under ``root``; return ``root``."""
    root = Path(root)
    splits = splits or {"train2017": 8, "val2017": 4}
    rng = np.random.default_rng(seed)
    categories = [{"id": i + 1, "name": name, "supercategory": "shape"} for i, name in enumerate(CLASSES)]
    ann_id = 0
    for split, count in splits.items():
        images, annotations = [], []
        for i in range(count):
            image, shapes = draw_image(rng, size)
            file_name = f"{i:012d}.jpg"
            _save_jpeg(image, root / split / file_name)
            images.append({"id": i + 1, "file_name": file_name, "height": size, "width": size})
            for s in shapes:
                ann_id += 1
                x0, y0, x1, y1 = s.box
                annotations.append(
                    {
                        "id": ann_id,
                        "image_id": i + 1,
                        "category_id": CLASSES.index(s.kind) + 1,
                        "bbox": [x0, y0, x1 - x0, y1 - y0],
                        "area": float(rasterize(s.polygon, size, size).sum()),
                        "segmentation": [list(s.polygon)],
                        "iscrowd": 0,
                    }
                )
        atomic_write_json(
            root / "annotations" / f"instances_{split}.json",
            {
                "images": images,
                "annotations": annotations,
                "categories": categories,
                "info": {"description": "bt_hub generated shapes"},
                "licenses": [],
            },
        )
    return root


@dataclass
class DetectionDataConfig:
    """Flags of ``bt-hub make-detection-data``."""

    out: str = option(
        REQUIRED, "new or empty folder to write into (VOC2007/ devkit + COCO annotations/, train2017/, val2017/)"
    )
    train: int = option(600, "training images (VOC2007 trainval = COCO train2017)")
    test: int = option(100, "held-out images (VOC2007 test = COCO val2017)")
    size: int = option(128, "image side in pixels")
    seed: int = option(0, "seed of every image and shape")

    def __post_init__(self) -> None:
        check_seed(self.seed)
        for flag, value, low in (("--train", self.train, 1), ("--test", self.test, 1), ("--size", self.size, 32)):
            if value < low:
                raise ValueError(f"{flag} must be >= {low}, got {value}")
        if self.size > MAX_IMAGE_SIZE:
            raise ValueError(f"--size {self.size} is larger than {MAX_IMAGE_SIZE} px; choose a smaller --size")


def make_detection_data(config: DetectionDataConfig) -> Path:
    """Write the generated set in both layouts under ``config.out``, through a partial folder renamed when complete.

    A folder that already holds the same set is left as it is; FileExistsError when ``--out`` holds other files.
    """
    root = Path(config.out).expanduser().resolve()
    record: dict[str, Any] = {**asdict(config), "classes": list(CLASSES), "layouts": ["voc2007", "coco2017"]}
    record.pop("out")
    marker = root / MARKER
    if marker.is_file() and read_json(marker) == record:
        return root
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise FileExistsError(
            f"--out {root} is not an empty folder; make-detection-data writes only into a new or empty folder"
        )
    partial = _clear_partial(root)
    atomic_write_json(partial / PARTIAL_MARKER, record)
    write_voc(
        partial, splits={"2007": {"trainval": config.train, "test": config.test}}, size=config.size, seed=config.seed
    )
    write_coco(partial, splits={"train2017": config.train, "val2017": config.test}, size=config.size, seed=config.seed)
    atomic_write_json(partial / MARKER, record)
    (partial / PARTIAL_MARKER).unlink()
    os.replace(partial, root)  # replaces an empty --out folder, as the rename of a file would
    return root


def _clear_partial(root: Path) -> Path:
    """The partial folder of ``root``, emptied of an interrupted run's files (only if bt_hub made it)."""
    partial = root.parent / f".{root.name}{PARTIAL_SUFFIX}"
    if partial.is_symlink() or partial.exists():
        if partial.is_symlink() or not (partial / PARTIAL_MARKER).is_file():
            raise FileExistsError(
                f"{partial} exists but is not a partial output of make-detection-data (no {PARTIAL_MARKER}); "
                "move it away and run again"
            )
        shutil.rmtree(partial)
        warnings.warn(f"removed {partial}, the partial output of an interrupted make-detection-data", stacklevel=3)
    return partial
