"""Image files decoded in batches on the training device (``--decode device``); PIL takes what it refuses."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from bt_hub.common.images import open_rgb
from bt_hub.data.datasets import to_uint8_tensor

DECODE_MODES = ("auto", "device", "workers")
# Start-of-frame markers (baseline, extended, progressive, lossless, arithmetic), not DHT/JPG/DAC.
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


class EncodedImage(NamedTuple):
    """One file's bytes (1-D uint8 tensor), its path, and whether the device decoder takes it."""

    data: torch.Tensor
    path: str
    device_decodable: bool


def jpeg_frame(data: bytes | memoryview) -> tuple[int, int]:
    """(start-of-frame marker, colour components) of a JPEG's header; (0, 0) if it is not a readable JPEG."""
    if len(data) < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return 0, 0
    pos = 2
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            return 0, 0
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        length = (data[pos + 2] << 8) | data[pos + 3]
        if marker in _SOF_MARKERS:
            return (marker, data[pos + 9]) if pos + 9 < len(data) else (0, 0)
        if marker == 0xDA or length < 2:  # scan data before any frame header
            return 0, 0
        pos += 2 + length
    return 0, 0


def device_decodable(data: bytes | memoryview) -> bool:
    """True for baseline, extended and progressive JPEGs of 1 or 3 components (what nvJPEG decodes to RGB)."""
    marker, components = jpeg_frame(data)
    return marker in (0xC0, 0xC1, 0xC2) and components in (1, 3)


def read_encoded(path: str | os.PathLike) -> EncodedImage:
    """The bytes of an image file, for a data-loader worker (no decoding)."""
    data = np.fromfile(path, dtype=np.uint8)
    return EncodedImage(torch.from_numpy(data), str(path), device_decodable(memoryview(data)))


class PackedItems(NamedTuple):
    """A loader batch of differently sized tensors (file bytes or images) as one tensor, so that a worker hands
    the main process one shared-memory block a batch instead of one an item (7x the files/s with 2 workers).
    """

    data: torch.Tensor  # every item flattened, end to end
    shapes: list[torch.Size]
    paths: list[str] | None  # for file bytes (EncodedImage items): their paths and decodability
    device_decodable: list[bool] | None

    def unpack(self) -> list[EncodedImage] | list[torch.Tensor]:
        """The items again, as views of ``data``."""
        parts = torch.split(self.data, [shape.numel() for shape in self.shapes])
        if self.paths is None or self.device_decodable is None:
            return [part.view(shape) for part, shape in zip(parts, self.shapes)]
        return [EncodedImage(*item) for item in zip(parts, self.paths, self.device_decodable)]

    def pin_memory(self) -> PackedItems:
        """The same batch with ``data`` in page-locked memory (what a loader's ``pin_memory=True`` calls)."""
        return self._replace(data=self.data.pin_memory())


def collate_packed(items: Sequence[EncodedImage | torch.Tensor]) -> PackedItems:
    """A batch of files' bytes or of images of their own sizes as :class:`PackedItems`."""
    files = bool(items) and isinstance(items[0], EncodedImage)
    tensors = [item.data if isinstance(item, EncodedImage) else item for item in items]
    return PackedItems(
        torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0, dtype=torch.uint8),
        [t.shape for t in tensors],
        [item.path for item in items] if files else None,  # type: ignore[union-attr]
        [item.device_decodable for item in items] if files else None,  # type: ignore[union-attr]
    )


def decode_on_cpu(item: EncodedImage) -> torch.Tensor:
    """PIL's RGB decode of one file (the workers' decoder) as a 3 x H x W uint8 tensor."""
    return to_uint8_tensor(open_rgb(item.path))


def _decode_jpegs(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    from torchvision.io import ImageReadMode, decode_jpeg

    with warnings.catch_warnings():  # torchvision 0.29 marks its decoders deprecated in favour of torchcodec
        warnings.simplefilter("ignore", DeprecationWarning)
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)


def decode_images(items: Sequence[EncodedImage], device: str | torch.device) -> list[torch.Tensor]:
    """Decode a batch of files into 3 x H x W uint8 RGB tensors on ``device``, in order; PIL takes what it refuses."""
    device = torch.device(device)
    out: list[torch.Tensor | None] = [None] * len(items)
    batch = [i for i, item in enumerate(items) if item.device_decodable]
    if batch:
        try:
            decoded = _decode_jpegs([items[i].data for i in batch], device)
        except RuntimeError:
            decoded = []
            for i in batch:
                try:
                    decoded.append(_decode_jpegs([items[i].data], device)[0])
                except RuntimeError:
                    decoded.append(None)
        for i, image in zip(batch, decoded):
            out[i] = image
    for i, image in enumerate(out):
        if image is None:
            out[i] = decode_on_cpu(items[i]).to(device, non_blocking=True)
    return out  # type: ignore[return-value]


def to_device_images(
    batch: PackedItems | Sequence[EncodedImage | torch.Tensor], device: str | torch.device
) -> list[torch.Tensor]:
    """A loader's batch of items on ``device``: files decoded there (:func:`decode_images`), tensors moved."""
    if isinstance(batch, PackedItems):
        batch = batch.unpack()
    if batch and isinstance(batch[0], EncodedImage):
        return decode_images(batch, device)
    return [image.to(device, non_blocking=True) for image in batch]


def resolve_decode(decode: str, device: torch.device | str, views: str) -> str:
    """``auto`` is ``device`` for batched views on CUDA and ``workers`` otherwise; checks the combination."""
    if decode not in DECODE_MODES:
        raise ValueError(f"--decode {decode!r} is unknown; expected one of {DECODE_MODES}")
    if decode == "device" and views != "batched":
        raise ValueError("--decode device needs --views batched (PIL views decode and augment in the loader workers)")
    if decode == "auto":
        return "device" if views == "batched" and torch.device(device).type == "cuda" else "workers"
    return decode
