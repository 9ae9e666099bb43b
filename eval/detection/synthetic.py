"""Tiny detection datasets on disk: a VOC devkit (2007 + 2012) and a COCO json with masks.

Each image is uniform noise with a few filled shapes (square, disc, triangle) whose boxes,
and for COCO polygon masks, are the annotations. They exist so that the whole detection
path (registration, training, VOC and COCO evaluation) runs on a CPU in minutes; the
numbers they give mean nothing about a backbone. Everything is drawn from one seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image, ImageDraw

from bt_hub.runs import atomic_write, atomic_write_json, atomic_write_text

SHAPES = ("square", "disc", "triangle")
# The VOC devkit only knows its 20 classes: the shapes are written under the first three.
VOC_NAMES = {"square": "aeroplane", "disc": "bicycle", "triangle": "bird"}

__all__ = ["SHAPES", "VOC_NAMES", "Shape", "draw_image", "write_coco", "write_voc"]


@dataclass(frozen=True)
class Shape:
    """One object: its kind, its box (x0, y0, x1, y1, pixels, exclusive) and its polygon."""

    kind: str
    box: tuple[int, int, int, int]
    polygon: tuple[float, ...]


def _polygon(kind: str, box: tuple[int, int, int, int]) -> tuple[float, ...]:
    x0, y0, x1, y1 = box
    if kind == "square":
        pts = [(x0, y0), (x1, y0), (x1, y1), (x0, y1)]
    elif kind == "triangle":
        pts = [((x0 + x1) / 2, y0), (x1, y1), (x0, y1)]
    else:
        cx, cy, rx, ry = (x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) / 2, (y1 - y0) / 2
        pts = [(cx + rx * math.cos(a), cy + ry * math.sin(a)) for a in np.linspace(0, 2 * math.pi, 16, endpoint=False)]
    return tuple(float(v) for p in pts for v in p)


def draw_image(rng: np.random.Generator, size: int, max_objects: int = 3) -> tuple[Image.Image, list[Shape]]:
    """A noise image of ``size`` x ``size`` with 1..max_objects shapes that do not overlap much.

    Args:
        rng: the random generator every choice is drawn from.
        size: image side in pixels.
        max_objects: the most shapes per image.

    Returns:
        The RGB image and its shapes.
    """
    pixels = rng.integers(0, 96, size=(size, size, 3), dtype=np.uint8)
    image = Image.fromarray(pixels, "RGB")
    draw = ImageDraw.Draw(image)
    shapes: list[Shape] = []
    for _ in range(int(rng.integers(1, max_objects + 1))):
        side = int(rng.integers(size // 5, size // 2))
        x0, y0 = (int(v) for v in rng.integers(0, size - side, size=2))
        box = (x0, y0, x0 + side, y0 + side)
        if any(_iou(box, s.box) > 0.3 for s in shapes):
            continue
        kind = SHAPES[int(rng.integers(len(SHAPES)))]
        polygon = _polygon(kind, box)
        colour = tuple(int(c) for c in rng.integers(140, 256, size=3))
        draw.polygon(list(zip(polygon[0::2], polygon[1::2])), fill=colour)
        shapes.append(Shape(kind, box, polygon))
    return image, shapes


def _iou(a: Sequence[int], b: Sequence[int]) -> float:
    ix = max(0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union else 0.0


def _save_jpeg(image: Image.Image, path: Path) -> None:
    atomic_write(path, lambda f: image.save(f, format="JPEG", quality=95))


def _voc_xml(file_id: str, size: int, shapes: list[Shape]) -> str:
    objects = "".join(
        f"<object><name>{VOC_NAMES[s.kind]}</name><pose>Unspecified</pose><truncated>0</truncated>"
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
    """Write a VOC devkit: ``root/VOC{year}/{Annotations,ImageSets/Main,JPEGImages}``.

    Boxes follow the devkit's convention (1-based, inclusive integer corners); every
    object has ``difficult`` 0.

    Args:
        root: the devkit root (``bt-hub detect --data`` takes this directory).
        splits: images per split per year; default 2007 trainval 8 / test 4, 2012 trainval 8.
        size: image side in pixels.
        seed: seed of every image and shape.

    Returns:
        ``root``.
    """
    root = Path(root)
    splits = splits or {"2007": {"trainval": 8, "test": 4}, "2012": {"trainval": 8}}
    rng = np.random.default_rng(seed)
    for year, counts in splits.items():
        base = root / f"VOC{year}"
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
    """Write COCO-layout data: ``root/annotations/instances_{split}.json`` and ``root/{split}/*.jpg``.

    Categories are the shapes (ids 1..3); each annotation carries its box ``[x, y, w, h]``,
    its polygon and its polygon's area.

    Args:
        root: the dataset root (``bt-hub detect --data`` takes this directory).
        splits: images per split; default train2017 8, val2017 4.
        size: image side in pixels.
        seed: seed of every image and shape.

    Returns:
        ``root``.
    """
    root = Path(root)
    splits = splits or {"train2017": 8, "val2017": 4}
    rng = np.random.default_rng(seed)
    categories = [{"id": i + 1, "name": name, "supercategory": "shape"} for i, name in enumerate(SHAPES)]
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
                xs, ys = np.asarray(s.polygon[0::2]), np.asarray(s.polygon[1::2])
                area = 0.5 * abs(float(np.dot(xs, np.roll(ys, 1)) - np.dot(ys, np.roll(xs, 1))))
                x0, y0, x1, y1 = s.box
                annotations.append(
                    {
                        "id": ann_id,
                        "image_id": i + 1,
                        "category_id": SHAPES.index(s.kind) + 1,
                        "bbox": [x0, y0, x1 - x0, y1 - y0],
                        "area": area,
                        "segmentation": [list(s.polygon)],
                        "iscrowd": 0,
                    }
                )
        atomic_write_json(
            root / "annotations" / f"instances_{split}.json",
            {"images": images, "annotations": annotations, "categories": categories, "info": {"description": "bt_hub synthetic shapes"}, "licenses": []},
        )
    return root

