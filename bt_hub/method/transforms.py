"""Normalisation and the evaluation preprocessing, below everything that uses them (torchvision's ``_presets.py``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torchvision import transforms as T
from torchvision.transforms._presets import ImageClassification

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def normalize(x: torch.Tensor) -> torch.Tensor:
    """ImageNet normalisation of float RGB images in [0, 1] (C x H x W or B x C x H x W)."""
    mean = torch.tensor(IMAGENET_MEAN, device=x.device, dtype=x.dtype).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=x.device, dtype=x.dtype).view(3, 1, 1)
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


def transforms_for(config: Mapping[str, Any] | None) -> ImageClassification:
    """The evaluation transforms (PIL images and tensors) of weights whose run config says ``image_size`` (else 224)."""
    size = int((config or {}).get("image_size") or 224)
    return ImageClassification(
        crop_size=size, resize_size=round(size * 256 / 224), mean=IMAGENET_MEAN, std=IMAGENET_STD
    )
