"""Detection data without detectron2: dataset names -> files, annotation records, a torch Dataset."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from bt_hub.common.images import open_rgb
from bt_hub.common.optional import require
from bt_hub.data.datasets import read_voc_annotation
from bt_hub.eval.voc07_svm import VOC_CLASSES  # the 20 PASCAL VOC classes, one list for both protocols

__all__ = ["VOC_CLASSES", "DatasetLocation", "DetectionDataset", "Record", "load_records", "locate", "voc_class_names"]

_VOC = re.compile(r"^voc_(\d{4})_(\w+)$")
_COCO = re.compile(r"^coco_(\d{4})_(train|val|test|minival|valminusminival)$")


@dataclass(frozen=True)
class DatasetLocation:
    """Where a named dataset lives under ``--data``: its kind (``voc``/``coco``) and files."""

    name: str
    kind: str
    year: int
    split: str
    dirname: Path
    json_file: Path | None = None


@dataclass
class Record:
    """One image and its objects (boxes XYXY continuous pixels, 0-based labels)."""

    image_id: Any
    file_name: str
    height: int
    width: int
    boxes: np.ndarray
    labels: np.ndarray
    difficult: np.ndarray
    iscrowd: np.ndarray
    segmentations: list[Any] = field(default_factory=list)


def locate(name: str, root: str | Path) -> DatasetLocation:
    """The files of dataset ``name`` under ``root`` (FileNotFoundError if missing, ValueError for another name)."""
    root = Path(root).expanduser()
    if match := _VOC.match(name):
        year, split = match.groups()
        dirname = root / f"VOC{year}"
        image_set = dirname / "ImageSets" / "Main" / f"{split}.txt"
        if not image_set.is_file():
            raise FileNotFoundError(f"dataset {name} needs {image_set} (VOC devkit layout under --data {root})")
        return DatasetLocation(name, "voc", int(year), split, dirname)
    if match := _COCO.match(name):
        year, split = match.groups()
        json_file = root / "annotations" / f"instances_{split}{year}.json"
        image_root = root / f"{split}{year}"
        for path, what in ((json_file, "file"), (image_root, "folder")):
            if not path.exists():
                raise FileNotFoundError(f"dataset {name} needs the {what} {path} (COCO layout under --data {root})")
        return DatasetLocation(name, "coco", int(year), split, image_root, json_file)
    raise ValueError(f"dataset {name!r} in the config is neither voc_<year>_<split> nor coco_<year>_<split>")


def voc_class_names(dirname: str | Path) -> tuple[str, ...]:
    """``dirname/classes.txt`` (one class a line) when present, else the 20 PASCAL VOC classes."""
    path = Path(dirname) / "classes.txt"
    if not path.is_file():
        return VOC_CLASSES
    names = tuple(line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    if not names or len(set(names)) != len(names):
        raise ValueError(f"{path} must list each class once, one a line; got {list(names)}")
    return names


def _voc_records(loc: DatasetLocation, class_names: tuple[str, ...]) -> list[Record]:
    ids = (loc.dirname / "ImageSets" / "Main" / f"{loc.split}.txt").read_text().split()
    index = {name: i for i, name in enumerate(class_names)}
    records = []
    for file_id in ids:
        xml_path = loc.dirname / "Annotations" / f"{file_id}.xml"
        objects, shape = read_voc_annotation(xml_path)
        boxes, labels = [], []
        for obj in objects:
            if obj.name not in index:
                raise ValueError(
                    f"{xml_path}: class {obj.name!r} is not one of the dataset's classes {list(class_names)}"
                )
            if obj.box is None or shape is None:
                raise ValueError(f"annotation {xml_path} gives no <bndbox> of {obj.name} or no <size>")
            xmin, ymin, xmax, ymax = obj.box
            boxes.append([xmin - 1.0, ymin - 1.0, xmax, ymax])  # 1-based inclusive -> continuous
            labels.append(index[obj.name])
        records.append(
            Record(
                image_id=file_id,
                file_name=str(loc.dirname / "JPEGImages" / f"{file_id}.jpg"),
                height=shape[0],
                width=shape[1],
                boxes=np.asarray(boxes, dtype=np.float32).reshape(-1, 4),
                labels=np.asarray(labels, dtype=np.int64),
                difficult=np.asarray([obj.difficult for obj in objects], dtype=bool),
                iscrowd=np.zeros(len(labels), dtype=bool),
            )
        )
    return records


def coco_api(json_file: str | Path) -> Any:
    """A ``pycocotools.coco.COCO`` of ``json_file``, loaded without printing."""
    import contextlib
    import io

    coco_module = require("pycocotools.coco", "COCO-layout detection data")
    with contextlib.redirect_stdout(io.StringIO()):
        return coco_module.COCO(str(json_file))


def _coco_records(loc: DatasetLocation) -> tuple[list[Record], tuple[str, ...], list[int]]:
    coco = coco_api(loc.json_file)
    cat_ids = sorted(coco.getCatIds())
    index = {cat: i for i, cat in enumerate(cat_ids)}
    records = []
    for image_id in sorted(coco.getImgIds()):
        info = coco.imgs[image_id]
        anns = coco.imgToAnns.get(image_id, [])
        boxes = [[a["bbox"][0], a["bbox"][1], a["bbox"][0] + a["bbox"][2], a["bbox"][1] + a["bbox"][3]] for a in anns]
        records.append(
            Record(
                image_id=image_id,
                file_name=str(loc.dirname / info["file_name"]),
                height=int(info["height"]),
                width=int(info["width"]),
                boxes=np.asarray(boxes, dtype=np.float32).reshape(-1, 4),
                labels=np.asarray([index[a["category_id"]] for a in anns], dtype=np.int64),
                difficult=np.zeros(len(anns), dtype=bool),
                iscrowd=np.asarray([bool(a.get("iscrowd", 0)) for a in anns], dtype=bool),
                segmentations=[a.get("segmentation") for a in anns],
            )
        )
    return records, tuple(coco.cats[c]["name"] for c in cat_ids), cat_ids


def load_records(loc: DatasetLocation) -> tuple[list[Record], tuple[str, ...], list[int] | None]:
    """The records of a located dataset, its class names and (COCO) the category id of each class."""
    if loc.kind == "voc":
        names = voc_class_names(loc.dirname)
        return _voc_records(loc, names), names, None
    return _coco_records(loc)


def masks_of(record: Record, keep: np.ndarray) -> np.ndarray:
    """The ``record``'s object masks (``keep`` selects objects) as an N x H x W uint8 array."""
    mask_util = require("pycocotools.mask", "instance masks")
    masks = []
    for i in np.flatnonzero(keep):
        seg = record.segmentations[i] if i < len(record.segmentations) else None
        if seg is None:
            raise ValueError(
                f"{record.file_name}: object {i} has no segmentation; mask training needs COCO-layout data with masks"
            )
        if isinstance(seg, list):
            rle = mask_util.merge(mask_util.frPyObjects(seg, record.height, record.width))
        elif isinstance(seg.get("counts"), list):
            rle = mask_util.frPyObjects(seg, record.height, record.width)
        else:
            rle = seg
        masks.append(mask_util.decode(rle))
    return np.stack(masks).astype(np.uint8) if masks else np.zeros((0, record.height, record.width), dtype=np.uint8)


class DetectionDataset(Dataset):
    """Images of ``records`` as [0, 1] RGB tensors with torchvision targets (1-based labels, no crowds)."""

    def __init__(self, records: list[Record], *, with_masks: bool = False, flip: bool = False) -> None:
        self.records = records
        self.with_masks = with_masks
        self.flip = flip

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        record = self.records[index]
        image = torch.from_numpy(np.asarray(open_rgb(record.file_name), dtype=np.uint8).copy()).permute(2, 0, 1)
        image = image.float().div_(255)
        keep = ~record.iscrowd
        target = {
            "boxes": torch.from_numpy(record.boxes[keep]).float(),
            "labels": torch.from_numpy(record.labels[keep] + 1),
        }
        if self.with_masks:
            target["masks"] = torch.from_numpy(masks_of(record, keep))
        if self.flip and torch.rand(()) < 0.5:
            width = image.shape[-1]
            image = image.flip(-1)
            # in place: the boxes are the record's copy (boolean indexing copies), and the right side is read first
            target["boxes"][:, [0, 2]] = width - target["boxes"][:, [2, 0]]
            if self.with_masks:
                target["masks"] = target["masks"].flip(-1)
        return image, target
