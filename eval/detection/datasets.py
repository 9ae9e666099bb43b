"""Point detectron2's standard dataset names at a data root given on the command line.

The configs name the datasets as detectron2 does (``voc_2007_trainval``, ``coco_2017_val``,
...). detectron2 registers those names at import time under ``$DETECTRON2_DATASETS``;
:func:`register_datasets` replaces each name used by a config with the same dataset under
``--data ROOT``:

- ``voc_{year}_{split}``: ``ROOT/VOC{year}/`` in devkit layout (``Annotations/``,
  ``ImageSets/Main/{split}.txt``, ``JPEGImages/``); evaluated with detectron2's VOC
  evaluator (11-point AP for 2007, as the VOC07 devkit).
- ``coco_{year}_{split}``: ``ROOT/annotations/instances_{split}{year}.json`` with images in
  ``ROOT/{split}{year}/``; evaluated with detectron2's COCO evaluator (box, and mask when
  the model predicts masks).

Other names are left as they are if already registered (a caller's own datasets).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

from detectron2.data import DatasetCatalog, MetadataCatalog
from detectron2.data.datasets import register_coco_instances
from detectron2.data.datasets.pascal_voc import CLASS_NAMES, load_voc_instances

__all__ = ["num_classes", "register_datasets"]

_VOC = re.compile(r"^voc_(\d{4})_(\w+)$")
_COCO = re.compile(r"^coco_(\d{4})_(train|val|test|minival|valminusminival)$")


def _replace(name: str) -> None:
    if name in DatasetCatalog.list():
        DatasetCatalog.remove(name)
    MetadataCatalog.remove(name)


def _register_voc(name: str, root: Path, year: str, split: str) -> None:
    dirname = root / f"VOC{year}"
    image_set = dirname / "ImageSets" / "Main" / f"{split}.txt"
    if not image_set.is_file():
        raise FileNotFoundError(f"dataset {name} needs {image_set} (VOC devkit layout under --data {root})")
    _replace(name)
    class_names = list(CLASS_NAMES)
    DatasetCatalog.register(name, lambda: load_voc_instances(str(dirname), split, class_names))
    MetadataCatalog.get(name).set(
        thing_classes=class_names, dirname=str(dirname), year=int(year), split=split, evaluator_type="pascal_voc"
    )


def _register_coco(name: str, root: Path, year: str, split: str) -> None:
    json_file = root / "annotations" / f"instances_{split}{year}.json"
    image_root = root / f"{split}{year}"
    for path, what in ((json_file, "file"), (image_root, "folder")):
        if not path.exists():
            raise FileNotFoundError(f"dataset {name} needs the {what} {path} (COCO layout under --data {root})")
    _replace(name)
    register_coco_instances(name, {}, str(json_file), str(image_root))


def register_datasets(names: Iterable[str], root: str | Path) -> None:
    """Register every VOC/COCO name in ``names`` on the data under ``root`` (see the module doc).

    Raises:
        FileNotFoundError: a file or folder a dataset needs is missing under ``root``.
        ValueError: a name is neither VOC, COCO nor already registered.
    """
    root = Path(root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"--data {root} is not a directory")
    for name in dict.fromkeys(names):
        if match := _VOC.match(name):
            _register_voc(name, root, *match.groups())
        elif match := _COCO.match(name):
            _register_coco(name, root, *match.groups())
        elif name not in DatasetCatalog.list():
            raise ValueError(f"dataset {name!r} in the config is neither voc_<year>_<split>, coco_<year>_<split> nor registered")


def num_classes(name: str) -> int:
    """The number of classes of a registered dataset (loads a COCO json if not loaded yet)."""
    meta = MetadataCatalog.get(name)
    if not hasattr(meta, "thing_classes"):
        DatasetCatalog.get(name)
    return len(MetadataCatalog.get(name).thing_classes)
