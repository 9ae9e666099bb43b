"""Point detectron2's standard dataset names (``voc_2007_trainval``, ``coco_2017_val``, ...) at ``--data ROOT``,
located as the torchvision engine locates them (``bt_hub.eval.detection.data.locate``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from detectron2.data import DatasetCatalog, MetadataCatalog
from detectron2.data.datasets import register_coco_instances
from detectron2.data.datasets.pascal_voc import load_voc_instances

from bt_hub.eval.detection.data import DatasetLocation, locate, voc_class_names

__all__ = ["num_classes", "register_datasets"]


def _replace(name: str) -> None:
    if name in DatasetCatalog.list():
        DatasetCatalog.remove(name)
    MetadataCatalog.remove(name)


def _register_voc(loc: DatasetLocation) -> None:
    _replace(loc.name)
    class_names = list(voc_class_names(loc.dirname))
    dirname, split = str(loc.dirname), loc.split
    DatasetCatalog.register(loc.name, lambda: load_voc_instances(dirname, split, class_names))
    MetadataCatalog.get(loc.name).set(
        thing_classes=class_names, dirname=dirname, year=loc.year, split=split, evaluator_type="pascal_voc"
    )


def _register_coco(loc: DatasetLocation) -> None:
    _replace(loc.name)
    register_coco_instances(loc.name, {}, str(loc.json_file), str(loc.dirname))


def register_datasets(names: Iterable[str], root: str | Path) -> None:
    """Register the VOC/COCO ``names`` on ``root`` (FileNotFoundError if missing, ValueError for others)."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"--data {root} is not a directory")
    for name in dict.fromkeys(names):
        try:
            loc = locate(name, root)
        except ValueError:
            if name in DatasetCatalog.list():
                continue
            raise ValueError(
                f"dataset {name!r} in the config is neither voc_<year>_<split>, coco_<year>_<split> nor registered"
            ) from None
        (_register_voc if loc.kind == "voc" else _register_coco)(loc)


def num_classes(name: str) -> int:
    """The number of classes of a registered dataset (loads a COCO json if not loaded yet)."""
    meta = MetadataCatalog.get(name)
    if not hasattr(meta, "thing_classes"):
        DatasetCatalog.get(name)
    return len(MetadataCatalog.get(name).thing_classes)
