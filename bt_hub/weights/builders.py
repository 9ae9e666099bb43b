"""The builders torch.hub and pip users call (``hubconf.py`` lists them), torchvision's way: keyword-only
``weights`` (anything ``resolve`` accepts), ``fc = Identity``, ``transforms`` attached.

One builder per architecture bt_hub trains (resnet18, resnet34, resnet50, resnet101). Barlow Twins weights are
published for ResNet-50 only (the registry): the other builders load the weights they are given (a file, run
folder, URL or Hub id) and refuse a registered name, ``"DEFAULT"`` or ``pretrained=True`` saying there are none.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from torch import nn

from bt_hub.common.files import CheckpointError
from bt_hub.method.model import BarlowTwins, build_backbone
from bt_hub.method.transforms import transforms_for
from bt_hub.weights.formats import projector_spec
from bt_hub.weights.load import load_backbone, load_projector
from bt_hub.weights.registry import RECIPE, BarlowTwinsWeights, find_weights
from bt_hub.weights.sources import WeightsSource

__all__ = ["barlow_twins", "resnet18", "resnet34", "resnet50", "resnet101"]


def _legacy_pretrained(
    builder: str, weights: WeightsSource | None, kwargs: dict[str, Any], default: BarlowTwinsWeights | None
) -> WeightsSource | None:
    """``weights`` after turning a deprecated ``pretrained=True/False`` into its record (with a warning)."""
    if "pretrained" not in kwargs:
        return weights
    pretrained = kwargs.pop("pretrained")
    if weights is not None:
        raise ValueError(
            f"{builder}() got both weights={weights!r} and the deprecated pretrained={pretrained!r}; pass weights only"
        )
    if pretrained and default is None:
        raise ValueError(f"{builder}(pretrained=True): {_none_published(builder)}")
    new = f'weights="{default.short_name}"' if pretrained else "weights=None"
    warnings.warn(
        f"{builder}(pretrained={pretrained!r}) is deprecated; use {builder}({new}) (the same result)",
        FutureWarning,
        stacklevel=3,
    )
    return default if pretrained else None


def _no_more(builder: str, kwargs: dict[str, Any], accepted: str) -> None:
    if kwargs:
        raise TypeError(f"{builder}() got unexpected keyword arguments {sorted(kwargs)}; it accepts {accepted}")


def _registered(weights: WeightsSource | None) -> BarlowTwinsWeights | None:
    """The registry member ``weights`` names (a path that exists is a path, never a name), else None; a TypeError
    in one sentence for a ``weights`` of another type (``weights=5``)."""
    if weights is None or isinstance(weights, BarlowTwinsWeights):
        return weights
    if not isinstance(weights, (str, os.PathLike)):
        raise TypeError(
            "weights must be a BarlowTwinsWeights member or its name, a file or run folder, a URL, a Hugging Face "
            f"Hub id (hf://org/name or org/name) or None, got a value of type {type(weights).__name__}"
        )
    return None if os.path.exists(os.fspath(weights)) else find_weights(os.fspath(weights))


def _none_published(arch: str) -> str:
    published = ", ".join(f"{m.short_name} ({m.architecture})" for m in BarlowTwinsWeights)
    return (
        f"no Barlow Twins weights are published for {arch} (the registered ones: {published}); pass weights= a file, "
        f"run folder, URL or Hub id of {arch} weights (e.g. a bt-hub pretrain --arch {arch} run), or None"
    )


def _resnet(arch: str, weights: WeightsSource | None, progress: bool, kwargs: dict[str, Any]) -> nn.Module:
    """The ``arch`` backbone of a public builder: untrained for ``weights=None``, else loaded strictly."""
    published = [m for m in BarlowTwinsWeights if m.architecture == arch]
    weights = _legacy_pretrained(arch, weights, kwargs, published[0] if published else None)
    small = kwargs.pop("small_image_stem", None)
    allow_non_finite = kwargs.pop("allow_non_finite", False)
    _no_more(arch, kwargs, "weights, progress, small_image_stem, allow_non_finite")
    member = _registered(weights)
    if member is not None and member.architecture != arch:
        raise ValueError(f"{arch}(weights={weights!r}) names {member.architecture} weights: {_none_published(arch)}")
    if weights is None:
        model = build_backbone(arch, small_image_stem=bool(small))
        model.transforms = transforms_for(None)
        return model
    model = load_backbone(weights, arch=arch, progress=progress, allow_non_finite=allow_non_finite)
    stored = model.weights_info["small_image_stem"]
    if small is not None and bool(small) != stored:
        raise ValueError(
            f"small_image_stem={small} contradicts the weights {model.weights_info['file']}, "
            f"which have small_image_stem={stored}"
        )
    return model


def resnet50(*, weights: WeightsSource | None = None, progress: bool = True, **kwargs: Any) -> nn.Module:
    """ResNet-50 (torchvision layout) with Barlow Twins weights and ``fc = Identity``: 2048-d features.

    Barlow Twins: Self-Supervised Learning via Redundancy Reduction (Zbontar et al., ICML 2021,
    https://arxiv.org/abs/2103.03230).

    Args:
        weights: ``BarlowTwinsWeights.DEFAULT`` / ``"barlowtwins-in1k"`` (the reference release), another
            registered name, a URL, ``hf://org/name[@revision]``, ``org/name``, a file or run directory;
            None (default) for the architecture alone.
        **kwargs: ``small_image_stem`` (must agree with the weights), ``allow_non_finite`` (forensics),
            and the deprecated ``pretrained`` (a FutureWarning names the new spelling).
    """
    return _resnet("resnet50", weights, progress, kwargs)


def resnet18(*, weights: WeightsSource | None = None, progress: bool = True, **kwargs: Any) -> nn.Module:
    """ResNet-18 (torchvision layout) with the Barlow Twins weights given and ``fc = Identity``: 512-d features.

    No Barlow Twins weights are published for ResNet-18: ``weights`` is a file, run folder, URL or Hub id
    (a registered name, ``"DEFAULT"`` or ``pretrained=True`` is a ValueError saying so). See ``resnet50``.
    """
    return _resnet("resnet18", weights, progress, kwargs)


def resnet34(*, weights: WeightsSource | None = None, progress: bool = True, **kwargs: Any) -> nn.Module:
    """ResNet-34 (torchvision layout) with the Barlow Twins weights given and ``fc = Identity``: 512-d features.

    No Barlow Twins weights are published for ResNet-34: ``weights`` is a file, run folder, URL or Hub id
    (a registered name, ``"DEFAULT"`` or ``pretrained=True`` is a ValueError saying so). See ``resnet50``.
    """
    return _resnet("resnet34", weights, progress, kwargs)


def resnet101(*, weights: WeightsSource | None = None, progress: bool = True, **kwargs: Any) -> nn.Module:
    """ResNet-101 (torchvision layout) with the Barlow Twins weights given and ``fc = Identity``: 2048-d features.

    No Barlow Twins weights are published for ResNet-101: ``weights`` is a file, run folder, URL or Hub id
    (a registered name, ``"DEFAULT"`` or ``pretrained=True`` is a ValueError saying so). See ``resnet50``.
    """
    return _resnet("resnet101", weights, progress, kwargs)


def barlow_twins(
    *, weights: WeightsSource | None = None, progress: bool = True, lambd: float | None = None, **kwargs: Any
) -> BarlowTwins:
    """The whole Barlow Twins model (backbone + projector + λ) from weights that carry the projector.

    ``weights`` None gives the untrained ResNet-50 with the 8192-8192-8192 projector; ``lambd`` defaults
    to the weights' config.json, else 0.0051.

    Raises:
        CheckpointError: the weights carry no projector (use ``resnet50`` for the backbone).
    """
    weights = _legacy_pretrained("barlow_twins", weights, kwargs, BarlowTwinsWeights.IN1K_LJNG_FULL)
    allow_non_finite = kwargs.pop("allow_non_finite", False)
    _no_more("barlow_twins", kwargs, "weights, progress, lambd, allow_non_finite")
    if weights is None:
        return BarlowTwins("resnet50", RECIPE["projector"], RECIPE["lambd"] if lambd is None else lambd)
    member = _registered(weights)
    if member is not None and not member.has_projector:
        raise CheckpointError(
            f"weights {member.short_name} carry no projector; use resnet50(weights=...) for the backbone, "
            f'or barlow_twins(weights="{BarlowTwinsWeights.IN1K_LJNG_FULL.short_name}")'
        )
    backbone = load_backbone(weights, progress=progress, allow_non_finite=allow_non_finite)
    projector = load_projector(weights, backbone, progress=progress, allow_non_finite=allow_non_finite)
    if projector is None:
        raise CheckpointError(
            f"weights {backbone.weights_info['file']} carry no projector; "
            "use resnet50(weights=...) for the backbone alone"
        )
    config = backbone.weights_info.get("config") or {}
    lambd = float(config.get("lambd", RECIPE["lambd"])) if lambd is None else lambd
    model = BarlowTwins(
        backbone.weights_info["architecture"],
        projector_spec(projector.state_dict()),
        lambd,
        small_image_stem=backbone.weights_info["small_image_stem"],
    )
    model.backbone, model.projector = backbone, projector
    return model
