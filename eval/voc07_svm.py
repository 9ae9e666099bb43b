"""Per-class linear SVMs on frozen VOC2007 features (``bt-hub eval voc07-svm``; VISSL's protocol)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from PIL import Image

from bt_hub.common.config import option
from bt_hub.common.distributed import is_main_process
from bt_hub.common.images import open_rgb
from bt_hub.common.presets import shown
from bt_hub.data.datasets import dataset_fingerprint, read_voc_annotation
from bt_hub.eval.config import EvalConfig
from bt_hub.eval.features import as_float32
from bt_hub.eval.linear import TRANSFER_TABLE
from bt_hub.eval.report import PaperRow
from bt_hub.eval.runner import EvalRun, Scored
from bt_hub.eval.splits import check_disjoint
from bt_hub.eval.svm_grid import COSTS, evaluate_svms, l2_normalize, svm_grid

if TYPE_CHECKING:
    import torch
    from torchvision import transforms

# PASCAL VOC's 20 classes in the devkit's order (the detection transfer reads the same list).
VOC_CLASSES = (
    "aeroplane",
    "bicycle",
    "bird",
    "boat",
    "bottle",
    "bus",
    "car",
    "cat",
    "chair",
    "cow",
    "diningtable",
    "dog",
    "horse",
    "motorbike",
    "person",
    "pottedplant",
    "sheep",
    "sofa",
    "train",
    "tvmonitor",
)
PAPER_ROW = PaperRow("voc07_svm", "VOC2007", "frozen features, no training", ("voc2007", "voc07"), 4952)

# ----------------------------------------------------------------------------- the devkit


def voc_root(path: str | os.PathLike) -> Path:
    """The ``VOC2007`` directory of a devkit given as VOCdevkit/, VOCdevkit/VOC2007/ or their parent."""
    path = Path(path).expanduser()
    for candidate in (path, path / "VOC2007", path / "VOCdevkit" / "VOC2007"):
        if (candidate / "ImageSets" / "Main").is_dir() and (candidate / "Annotations").is_dir():
            return candidate
    raise FileNotFoundError(
        f"{path} is not a VOC devkit; expected VOC2007/ImageSets/Main/*.txt and VOC2007/Annotations/*.xml under it"
    )


class VocClassification:
    """VOC2007 images of one ``split`` with VISSL-coded multi-label targets (1 present, 0 absent, -1 difficult only).

    ``classes`` defaults to the VOC classes found in this split, then any others sorted.
    """

    def __init__(self, path: str | os.PathLike, split: str, classes: Sequence[str] | None = None) -> None:
        self.root = voc_root(path)
        list_file = self.root / "ImageSets" / "Main" / f"{split}.txt"
        if not list_file.is_file():
            raise FileNotFoundError(f"split list {list_file} does not exist; expected one image id per line")
        ids = [line.split()[0] for line in list_file.read_text().splitlines() if line.strip()]
        if not ids:
            raise ValueError(f"split list {list_file} is empty")
        objects = {i: read_voc_annotation(self.root / "Annotations" / f"{i}.xml")[0] for i in ids}
        if classes is None:
            found = {obj.name for objs in objects.values() for obj in objs}
            classes = [c for c in VOC_CLASSES if c in found] + sorted(found - set(VOC_CLASSES))
        self.classes = list(classes)
        index = {c: j for j, c in enumerate(self.classes)}
        self.samples: list[tuple[Path, tuple[int, ...]]] = []
        for i in ids:
            target = [0] * len(self.classes)
            for obj in objects[i]:
                if obj.name in index and target[index[obj.name]] != 1:
                    target[index[obj.name]] = -1 if obj.difficult else 1
            image = self.root / "JPEGImages" / f"{i}.jpg"
            if not image.is_file():
                raise FileNotFoundError(f"image {image} listed in {list_file} does not exist")
            self.samples.append((image, tuple(target)))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Image.Image, torch.Tensor]:
        import torch

        path, target = self.samples[index]
        return open_rgb(path), torch.tensor(target, dtype=torch.int8)


def voc07_transform(image_size: int = 224) -> transforms.Compose:
    """VISSL's VOC07 SVM transform: Resize(256) then Resize((224, 224)) (scaled with ``image_size``), normalised."""
    from torchvision import transforms

    from bt_hub.method.transforms import IMAGENET_MEAN, IMAGENET_STD

    return transforms.Compose(
        [
            transforms.Resize(round(image_size * 256 / 224)),
            transforms.Resize((image_size, image_size)),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


# ----------------------------------------------------------------------------- bt-hub eval voc07-svm


@dataclass
class Voc07SvmConfig(EvalConfig):
    """``bt-hub eval voc07-svm``: VISSL's VOC07 linear-SVM protocol on frozen features."""

    RUN_FIELDS: ClassVar[tuple[str, ...]] = EvalConfig.RUN_FIELDS + ("batch_size", "n_jobs", "train_split")

    data: str = option("", "the VOC devkit: VOCdevkit/, VOCdevkit/VOC2007/ or their parent")
    pool: Literal["voc_res5", "avg"] = option(
        "voc_res5", "'voc_res5' (2x2 pooled res5, 8192-d, VISSL) or 'avg' (2048-d)"
    )
    costs: list[float] = option(list(COSTS), "SVM costs C tried per class")
    cv_folds: int = option(3, "cross-validation folds that choose each class's cost (on AP)")
    max_iter: int = option(2000, "liblinear iterations per SVM fit")
    n_jobs: int = option(-1, "parallel (class, cost) fits: -1 = all cores, 1 = sequential (same result)")
    train_split: str = option("trainval", "ImageSets/Main list the SVMs are trained on")
    decode: Literal["workers"] = option(
        "workers", "VISSL's two resizes run in PIL in the loader workers; the only choice of this protocol"
    )
    test_split: str = option(
        "test",
        "ImageSets/Main list the SVMs are scored on (a devkit list name, unlike the val/test folders of "
        "the other protocols)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.data or self.data == "digits":
            raise ValueError(
                "--data must point to a VOC devkit (VOCdevkit/VOC2007 with ImageSets/Main, Annotations, JPEGImages), "
                f"got {self.data!r}"
            )
        if not self.costs or any(c <= 0 for c in self.costs):
            raise ValueError(f"--costs must list positive numbers, got {shown(self.costs)}")
        if self.cv_folds < 2:
            raise ValueError(f"--cv-folds must be at least 2, got {self.cv_folds}")
        self.require_positive("max_iter")
        if self.n_jobs == 0:
            raise ValueError("--n-jobs must be -1 (all cores) or a positive number of jobs, got 0")

    def unused_flags(self) -> dict[str, str]:
        """VOC07 decodes in PIL and takes its splits from the devkit's lists."""
        in_pil = "does not apply to voc07-svm: VISSL's two resizes run in PIL in the loader workers"
        lists = "does not apply to VOC07: the devkit's ImageSets/Main lists give trainval and test"
        return super().unused_flags() | dict.fromkeys(("decode", "store"), in_pil) | {"holdout": lists}


def _splits(config: Voc07SvmConfig) -> tuple[VocClassification, VocClassification, dict[str, Any]]:
    """The devkit's trainval and test lists as datasets, and what the record says of them (fingerprints included)."""
    train = VocClassification(config.data, config.train_split)
    test = VocClassification(config.data, config.test_split, classes=train.classes)
    info: dict[str, Any] = {
        "name": voc_root(config.data).name,
        "path": config.data,
        "fingerprint": dataset_fingerprint(voc_root(config.data)),
        "holdout": None,
        "overlap_check": check_disjoint(train, test),
    }
    for name, split, dataset in (("train", config.train_split, train), ("test", config.test_split, test)):
        info[name] = {"split": split, "size": len(dataset), "fingerprint": dataset_fingerprint(dataset)}
    return train, test, info


def dataset_info(run: EvalRun) -> dict[str, Any]:
    """The record's ``dataset`` block of a run on ``run.config``'s devkit, before any scoring (``eval all`` compares
    it with a finished record's, :meth:`bt_hub.eval.runner.EvalRun.finished`)."""
    return _splits(run.config)[2]


def score(run: EvalRun) -> Scored:
    """The devkit's splits, their features (VISSL's transform and pool), one SVM per class and cost, test AP."""
    config = run.config
    train, test, info = _splits(config)
    transform = voc07_transform(run.settings.image_size)
    data = {}
    for name, split, dataset in (("train", config.train_split, train), ("test", config.test_split, test)):
        fingerprint = info[name]["fingerprint"]
        features, targets = run.features(
            name, dataset=dataset, dataset_id=fingerprint, transform=transform, pool=config.pool, label=split
        )
        data[name] = (l2_normalize(as_float32(features).numpy()), targets.numpy().astype(np.int8))
    if not is_main_process():
        return Scored({}, dataset=info)
    _, weights, biases, best = svm_grid(
        *data["train"],
        config.costs,
        folds=config.cv_folds,
        max_iter=config.max_iter,
        n_jobs=config.n_jobs,
        seed=config.seed,
    )
    ap, ap11 = evaluate_svms(weights, biases, *data["test"])
    scored = ~np.isnan(ap)
    metrics = {"mAP": 100.0 * float(ap[scored].mean()), "mAP_11point": 100.0 * float(ap11[scored].mean())}
    notes = {
        "classes": train.classes,
        "per_class_ap": {c: 100.0 * float(a) for c, a in zip(train.classes, ap) if not np.isnan(a)},
        "per_class_ap_11point": {c: 100.0 * float(a) for c, a in zip(train.classes, ap11) if not np.isnan(a)},
        "best_cost": dict(zip(train.classes, best)),
        "classes_without_test_positives": [c for c, s in zip(train.classes, scored) if not s],
        "feature_dim": int(data["train"][0].shape[1]),
    }
    return Scored(metrics, mode="features", paper=PAPER_ROW, table=TRANSFER_TABLE, notes=notes, dataset=info)
