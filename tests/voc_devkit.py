"""A tiny VOC2007-format devkit written at test time (nothing is downloaded)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image


def write_synthetic_devkit(
    root: str | os.PathLike,
    classes: Sequence[str] = ("cat", "dog", "car"),
    *,
    trainval: int = 24,
    test: int = 24,
    image_size: int = 32,
    seed: int = 0,
) -> Path:
    """A tiny VOC2007-format devkit.

    Each image shows one colour block per class it contains; some objects are difficult.

    Returns the ``VOC2007`` directory.
    """
    rng = np.random.default_rng(seed)
    voc = Path(root) / "VOC2007"
    for sub in ("ImageSets/Main", "Annotations", "JPEGImages"):
        (voc / sub).mkdir(parents=True, exist_ok=True)
    colours = rng.uniform(0, 255, size=(len(classes), 3))
    for split, count, offset in (("trainval", trainval, 0), ("test", test, trainval)):
        ids = [f"{offset + i:06d}" for i in range(count)]
        for n, image_id in enumerate(ids):
            present = [j for j in range(len(classes)) if rng.random() < 0.4] or [n % len(classes)]
            image = rng.normal(128, 20, size=(image_size, image_size, 3))
            objects = []
            for j in present:
                y, x = rng.integers(0, image_size // 2, size=2)
                image[y : y + image_size // 2, x : x + image_size // 2] = colours[j]
                objects.append(
                    f"<object><name>{classes[j]}</name><difficult>{int(rng.random() < 0.15)}</difficult></object>"
                )
            Image.fromarray(np.clip(image, 0, 255).astype(np.uint8)).save(voc / "JPEGImages" / f"{image_id}.jpg")
            (voc / "Annotations" / f"{image_id}.xml").write_text(
                f"<annotation><filename>{image_id}.jpg</filename>{''.join(objects)}</annotation>"
            )
        (voc / "ImageSets" / "Main" / f"{split}.txt").write_text("\n".join(ids) + "\n")
    return voc
