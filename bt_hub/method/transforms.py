"""Normalisation and the evaluation preprocessing, below everything that uses them (torchvision's ``_presets.py``)."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from PIL import Image
from torchvision import transforms as T
from torchvision.transforms._presets import ImageClassification

from bt_hub.common.files import CheckpointError
from bt_hub.common.images import to_rgb

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@functools.cache
def constant(values: tuple[float, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``values`` as a tensor on ``device``, made once: made again for each batch, it is a copy from pageable memory
    that waits for the device (a CUDA sync a batch). Read it; never write to it. Made outside inference mode, so
    that autograd may save it whoever asked first."""
    with torch.inference_mode(False):
        return torch.tensor(values, device=device, dtype=dtype)


def normalize(x: torch.Tensor) -> torch.Tensor:
    """ImageNet normalisation of float RGB images in [0, 1] (C x H x W or B x C x H x W)."""
    mean, std = (constant(v, x.device, x.dtype).view(3, 1, 1) for v in (IMAGENET_MEAN, IMAGENET_STD))
    return (x - mean) / std


def eval_transforms(image_size: int = 224, resize_size: int | None = None) -> T.Compose:
    """The evaluation preprocessing: Resize(image_size·256/224) -> CenterCrop(image_size) -> tensor -> normalised."""
    return T.Compose(
        [
            T.Resize(resize_size or round(image_size * 256 / 224), interpolation=T.InterpolationMode.BILINEAR),
            T.CenterCrop(image_size),
            T.ToTensor(),
            T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


class DeviceEvalTransform:
    """``eval_transforms`` on decoded uint8 images of any sizes where they are (GPU or CPU): one float32 batch out."""

    def __init__(self, image_size: int = 224, resize_size: int | None = None) -> None:
        self.image_size = image_size
        self.resize_size = resize_size or round(image_size * 256 / 224)

    def __call__(self, images: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """A B x C x H x W uint8 batch, or a list of 3 x H x W uint8 images of any sizes, as normalised crops.

        Images of one size are resized together (one call a size group, not one an image: on a GPU the per-image
        calls cost more in launches than the arithmetic); each image's result equals its own resize.
        """
        if isinstance(images, torch.Tensor) and images.dim() == 4:
            return self.finish(self.crop(images))
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, image in enumerate(images):
            groups.setdefault(tuple(image.shape), []).append(i)
        crops: list[torch.Tensor | None] = [None] * len(images)
        for members in groups.values():
            batch = self.crop(torch.stack([images[i] for i in members]))
            for i, crop in zip(members, batch):
                crops[i] = crop
        return self.finish(torch.stack(crops))  # type: ignore[arg-type]

    def crop(self, images: torch.Tensor) -> torch.Tensor:
        """Resize (shorter side to ``resize_size``, bilinear, antialiased) and centre-crop a uint8 batch; uint8 out."""
        from torchvision.transforms.v2 import functional as F

        resized = F.resize(images, [self.resize_size], interpolation=T.InterpolationMode.BILINEAR, antialias=True)
        return F.center_crop(resized, [self.image_size])

    @staticmethod
    def finish(crops: torch.Tensor) -> torch.Tensor:
        """uint8 crops (C = 1 or 3) -> normalised float32 RGB."""
        x = crops.float().div_(255)
        return normalize(x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x)

    def __repr__(self) -> str:
        return (
            f"DeviceEvalTransform(resize={self.resize_size} bilinear antialias, centre crop={self.image_size}, "
            f"ImageNet mean/std)"
        )


class RGBImageClassification(ImageClassification):
    """torchvision's evaluation preset after turning a PIL image of any mode (greyscale ``L``, palette, RGBA, 16-bit)
    into 8-bit RGB and a one-channel tensor into three, as bt_hub's own readers do."""

    def forward(self, img: Any) -> torch.Tensor:
        if isinstance(img, Image.Image):
            img = to_rgb(img)
        elif isinstance(img, torch.Tensor) and img.ndim >= 3 and img.shape[-3] == 1:
            img = img.expand(*img.shape[:-3], 3, *img.shape[-2:])
        return super().forward(img)


def transforms_for(config: Mapping[str, Any] | None) -> ImageClassification:
    """The evaluation transforms (PIL images and tensors) of weights whose run config says ``image_size`` (else 224)."""
    size = int((config or {}).get("image_size") or 224)
    return RGBImageClassification(
        crop_size=size, resize_size=round(size * 256 / 224), mean=IMAGENET_MEAN, std=IMAGENET_STD
    )


# --------------------------------------------------------------------------- what a weights file says of its input


def input_metadata(
    *,
    architecture: str,
    small_image_stem: bool,
    image_size: int | None,
    mean: Sequence[float] | None = IMAGENET_MEAN,
    std: Sequence[float] | None = IMAGENET_STD,
    run_id: str | None = None,
) -> dict[str, str]:
    """The safetensors metadata every weights file bt_hub writes carries, so that evaluation rebuilds the input
    the weights were trained on (docs/weights.md): network, stem, image side, normalisation, and the run; a value
    that is None (not known, e.g. of weights trained elsewhere) is left out."""
    meta = {"architecture": architecture, "small_image_stem": str(bool(small_image_stem))}
    if image_size is not None:
        meta["image_size"] = str(int(image_size))
    if mean is not None and std is not None:
        meta["mean"], meta["std"] = json.dumps([float(v) for v in mean]), json.dumps([float(v) for v in std])
    if run_id:
        meta["run_id"] = run_id
    return meta


def read_input_metadata(meta: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The keys of :func:`input_metadata` that ``meta`` holds, typed; a malformed one is an error naming ``source``."""
    found: dict[str, Any] = {}
    for key in ("architecture", "run_id"):
        if isinstance(meta.get(key), str) and meta[key]:
            found[key] = meta[key]
    if "small_image_stem" in meta:
        if str(meta["small_image_stem"]) not in ("True", "False"):
            raise CheckpointError(
                f"weights file {source} has small_image_stem {meta['small_image_stem']!r} in its metadata; "
                "expected True or False"
            )
        found["small_image_stem"] = str(meta["small_image_stem"]) == "True"
    if "image_size" in meta:
        text = str(meta["image_size"])
        if not text.isdigit() or int(text) <= 0:
            raise CheckpointError(
                f"weights file {source} has image_size {text!r} in its metadata; expected a positive integer"
            )
        found["image_size"] = int(text)
    for key in ("mean", "std"):
        if key in meta:
            try:
                values = tuple(float(v) for v in json.loads(str(meta[key])))
            except (ValueError, TypeError):
                values = ()
            if len(values) != 3:
                raise CheckpointError(
                    f"weights file {source} has {key} {meta[key]!r} in its metadata; expected a JSON list of 3 numbers"
                )
            found[key] = values
    return found
