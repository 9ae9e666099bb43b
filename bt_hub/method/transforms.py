"""Normalisation and the evaluation preprocessing: one home below everything that uses them.

torchvision's ``_presets.py`` plays this role there: the weights registry attaches these
transforms to each weights record, the protocols score with them, and the pretraining views
normalise with the same ImageNet statistics.
"""

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
    """The evaluation preprocessing: Resize(image_size·256/224) -> CenterCrop(image_size) -> tensor -> normalised.

    At 224 px that is the paper's Resize(256) + CenterCrop(224).
    """
    return T.Compose(
        [
            T.Resize(resize_size or round(image_size * 256 / 224), interpolation=T.InterpolationMode.BILINEAR),
            T.CenterCrop(image_size),
            T.ToTensor(),
            T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


class DeviceEvalTransform:
    """``eval_transforms`` on decoded uint8 images where they are (the GPU, or the CPU): one batch out.

    Each 3 x H x W uint8 image is resized (shorter side to ``resize_size``, bilinear with
    antialiasing, as PIL) and centre-cropped, then the batch is stacked, scaled to [0, 1] and
    normalised with the ImageNet statistics. The images may differ in size; the output is
    B x 3 x image_size x image_size float32 on the images' device. Pixels match the PIL path
    within one or two levels (rounding of the resize, and the decoder's own tolerance).
    """

    def __init__(self, image_size: int = 224, resize_size: int | None = None) -> None:
        self.image_size = image_size
        self.resize_size = resize_size or round(image_size * 256 / 224)

    def __call__(self, images: Sequence[torch.Tensor]) -> torch.Tensor:
        from torchvision.transforms.v2 import functional as F

        crops = [
            F.center_crop(
                F.resize(image, [self.resize_size], interpolation=T.InterpolationMode.BILINEAR, antialias=True),
                [self.image_size],
            )
            for image in images
        ]
        return normalize(torch.stack(crops).float().div_(255))

    def __repr__(self) -> str:
        return (
            f"DeviceEvalTransform(resize={self.resize_size} bilinear antialias, centre crop={self.image_size}, "
            f"ImageNet mean/std)"
        )


def transforms_for(config: Mapping[str, Any] | None) -> ImageClassification:
    """The evaluation transforms of weights whose run config says ``image_size`` (224 when it does not).

    ``eval_transforms`` as torchvision's preset, which every loaded model carries as ``transforms``: the
    same tensor for a PIL image, and tensors (C x H x W or batches, uint8 or float) accepted too.
    """
    size = int((config or {}).get("image_size") or 224)
    return ImageClassification(
        crop_size=size, resize_size=round(size * 256 / 224), mean=IMAGENET_MEAN, std=IMAGENET_STD
    )
