"""Named Barlow Twins weights and the builders torch.hub calls (``hubconf.py`` lists them).

Weights are records, as in torchvision: where the file lives (URL or ``hf://`` id), its
sha256 when one is published, the evaluation transforms and what the paper and the
release report. ``resnet50(weights=...)`` takes a record, its name (``"barlowtwins-in1k"``),
a URL, ``hf://org/name[@rev]`` or a local path, and returns ``fc = Identity``: 2048-d
features, never a randomly initialised classifier (the reference hub entry's pitfall).
"""

from __future__ import annotations

import enum
import hashlib
import os
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional, Union

from torch import nn
from torchvision import transforms as T

from bt_hub.checkpoint import cached_download, load_backbone, read_projector_state_dict
from bt_hub.formats import CheckpointError, projector_spec
from bt_hub.model import BarlowTwins, build_backbone
from bt_hub.results import PAPER_RESULTS

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_REFERENCE = "https://dl.fbaipublicfiles.com/barlowtwins"
_PAPER = PAPER_RESULTS  # the paper's numbers for the 1000-epoch ResNet-50 (one home: bt_hub.results)
_RECIPE = {
    "dataset": "ImageNet-1k (train, no labels)", "epochs": 1000, "batch_size": 2048, "optimizer": "LARS",
    "lr_weights": 0.2, "lr_biases": 0.0048, "lambd": 0.0051, "projector": "8192-8192-8192",
    "code": "https://github.com/facebookresearch/barlowtwins",
}


def eval_transforms(crop_size: int = 224, resize_size: int = 256) -> T.Compose:
    """The evaluation preprocessing: Resize(256) -> CenterCrop(224) -> tensor -> ImageNet normalisation."""
    return T.Compose([
        T.Resize(resize_size, interpolation=T.InterpolationMode.BILINEAR),
        T.CenterCrop(crop_size),
        T.ToTensor(),
        T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ])


@dataclass(frozen=True)
class Weights:
    """One set of published weights.

    Attributes:
        url: ``https://`` URL or ``hf://org/name[@revision]``.
        file_name: name in torch.hub's cache (two releases share the name ``resnet50.pth``).
        sha256: the published hash, checked after download; None when none is published.
        architecture: the backbone the weights belong to.
        has_projector: the file carries the projector too (``barlow_twins`` can load it).
        transforms: builds the evaluation transforms.
        meta: the paper's and the release's numbers, the recipe, one sentence of docs.
    """

    url: str
    file_name: Optional[str]
    sha256: Optional[str]
    architecture: str
    has_projector: bool
    transforms: Callable[..., Any]
    meta: dict[str, Any] = field(hash=False, compare=False)


class BarlowTwinsWeights(enum.Enum):
    """Published Barlow Twins weights; ``DEFAULT`` is the reference release torch.hub has always served."""

    IN1K_EP1000 = Weights(
        url=f"{_REFERENCE}/ep1000_bs2048_lrw0.2_lrb0.0048_lambd0.0051/resnet50.pth",
        file_name="barlowtwins_ep1000_bs2048_resnet50.pth",
        sha256=None,
        architecture="resnet50",
        has_projector=False,
        transforms=partial(eval_transforms, crop_size=224, resize_size=256),
        meta={"paper": _PAPER, "release": {"imagenet_linear": {"top1": 73.5, "top5": 91.0}}, "recipe": _RECIPE,
              "num_params": 23_508_032,
              "docs": "The reference release (facebookresearch/barlowtwins hubconf), backbone only, BN statistics included."},
    )
    IN1K_LJNG = Weights(
        url=f"{_REFERENCE}/ljng/resnet50.pth",
        file_name="barlowtwins_ljng_resnet50.pth",
        sha256=None,
        architecture="resnet50",
        has_projector=False,
        transforms=partial(eval_transforms, crop_size=224, resize_size=256),
        meta={"paper": _PAPER, "release": {"imagenet_linear": {"top1": 73.5, "top5": 91.0}}, "recipe": _RECIPE,
              "num_params": 23_508_032, "docs": "The newer reference release (README link), backbone only."},
    )
    IN1K_LJNG_FULL = Weights(
        url=f"{_REFERENCE}/ljng/checkpoint.pth",
        file_name="barlowtwins_ljng_checkpoint.pth",
        sha256=None,
        architecture="resnet50",
        has_projector=True,
        transforms=partial(eval_transforms, crop_size=224, resize_size=256),
        meta={"paper": _PAPER, "release": {"imagenet_linear": {"top1": 73.5, "top5": 91.0}}, "recipe": _RECIPE,
              "docs": "The reference full checkpoint: backbone, 8192-8192-8192 projector and optimiser state."},
    )
    DEFAULT = IN1K_EP1000


# Names accepted where a record is expected (torch.hub users type strings).
WEIGHT_NAMES = {
    "barlowtwins-in1k": BarlowTwinsWeights.DEFAULT,
    "barlowtwins-in1k-ljng": BarlowTwinsWeights.IN1K_LJNG,
    "barlowtwins-in1k-full": BarlowTwinsWeights.IN1K_LJNG_FULL,
}

WeightsArg = Union[BarlowTwinsWeights, str, os.PathLike, None]


def get_weights(name: str) -> BarlowTwinsWeights:
    """The record called ``name``: a key of ``WEIGHT_NAMES`` or a member name (``"IN1K_LJNG"``, ``"DEFAULT"``)."""
    if name in WEIGHT_NAMES:
        return WEIGHT_NAMES[name]
    member = name.split(".")[-1]
    if member in BarlowTwinsWeights.__members__:
        return BarlowTwinsWeights[member]
    raise ValueError(f"weights {name!r} are unknown; expected one of {sorted(WEIGHT_NAMES)}, a URL, hf://org/name or a path")


def _is_named(weights: Any) -> bool:
    if isinstance(weights, BarlowTwinsWeights):
        return True
    text = os.fspath(weights)
    return text in WEIGHT_NAMES or (text.split(".")[-1] in BarlowTwinsWeights.__members__ and not os.path.exists(text))


def _local_source(weights: BarlowTwinsWeights | str | os.PathLike, progress: bool) -> tuple[str | os.PathLike, Optional[Weights]]:
    """Where the weights are on disk (or a URL / hf:// id), and their record when named."""
    if not _is_named(weights):
        return weights, None  # type: ignore[return-value]
    record = (weights if isinstance(weights, BarlowTwinsWeights) else get_weights(os.fspath(weights))).value
    if record.url.startswith("hf://"):
        return record.url, record
    path = cached_download(record.url, file_name=record.file_name, progress=progress)
    if record.sha256 is not None:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != record.sha256:
            raise CheckpointError(f"weights file {path} has sha256 {digest}, but {record.url} was published with {record.sha256}")
    return path, record


def resnet50(*, weights: WeightsArg = "barlowtwins-in1k", progress: bool = True, small_image_stem: Optional[bool] = None) -> nn.Module:
    """ResNet-50 (torchvision layout) with Barlow Twins weights and ``fc = Identity``: 2048-d features.

    Barlow Twins: Self-Supervised Learning via Redundancy Reduction (Zbontar et al., ICML 2021,
    https://arxiv.org/abs/2103.03230).

    Args:
        weights: a ``BarlowTwinsWeights`` record or its name (default ``"barlowtwins-in1k"``,
            the reference release), a URL, ``hf://org/name[@revision]``, a local file or run
            directory, or None for the architecture alone (zero-initialised residual BNs).
        progress: show a progress bar while downloading.
        small_image_stem: must agree with the weights when given (3x3 stem without max-pool).
    """
    if weights is None:
        return build_backbone("resnet50", small_image_stem=bool(small_image_stem))
    source, _ = _local_source(weights, progress)
    return load_backbone(source, arch="resnet50", small_image_stem=_agreeing_stem(source, small_image_stem), progress=progress)


def _agreeing_stem(source: str | os.PathLike, small_image_stem: Optional[bool]) -> Optional[bool]:
    if small_image_stem is None:
        return None
    from bt_hub.checkpoint import read_backbone_state_dict

    state, _ = read_backbone_state_dict(source)
    stored = tuple(state["conv1.weight"].shape[-2:]) == (3, 3) if "conv1.weight" in state else small_image_stem
    if stored != small_image_stem:
        raise ValueError(f"small_image_stem={small_image_stem} contradicts the weights {os.fspath(source)}, which have small_image_stem={stored}")
    return small_image_stem


def barlow_twins(*, weights: WeightsArg = "barlowtwins-in1k-full", progress: bool = True, lambd: float = 0.0051) -> BarlowTwins:
    """The whole Barlow Twins model (backbone + projector) from weights that carry the projector.

    Args:
        weights: a record or name with ``has_projector`` (default ``"barlowtwins-in1k-full"``, the
            reference ``checkpoint.pth``), a URL, ``hf://`` id, file or run directory; None gives
            the untrained ResNet-50 with the 8192-8192-8192 projector.
        progress: show a progress bar while downloading.
        lambd: weight of the redundancy-reduction term, for further training.

    Raises:
        CheckpointError: the weights carry no projector (use ``resnet50`` for the backbone).
    """
    if weights is None:
        return BarlowTwins("resnet50", "8192-8192-8192", lambd)
    source, record = _local_source(weights, progress)
    if record is not None and not record.has_projector:
        raise CheckpointError(f"weights {record.url} carry no projector; use resnet50(weights=...) for the backbone alone")
    projector = read_projector_state_dict(source)
    if not projector:
        raise CheckpointError(f"weights {os.fspath(source)} carry no projector; use resnet50(weights=...) for the backbone alone")
    backbone = load_backbone(source, progress=progress)
    model = BarlowTwins(backbone.weights_info["architecture"], projector_spec(projector), lambd,
                        small_image_stem=backbone.weights_info["small_image_stem"])
    model.backbone = backbone
    try:
        model.projector.load_state_dict(projector, strict=True)
    except RuntimeError as err:
        raise CheckpointError(f"projector weights in {os.fspath(source)} do not fit {projector_spec(projector)}: {str(err).splitlines()[0]}") from err
    return model
