"""Image files decoded in batches on the training device (``--decode device``); loader workers decode the rest.

The path of one file, from disk to a batch on the device:

1. a loader worker reads the file's bytes once (:func:`read_encoded`) and looks at its JPEG header: a
   baseline/extended/progressive JPEG of 1 or 3 components is left encoded when the device decodes (nvJPEG on
   CUDA); anything else (PNG, CMYK JPEG, BMP, ...), and every file when the device is the CPU, is decoded in
   the worker from those bytes with PIL's RGB rules (:func:`worker_item`), so the main process never decodes;
2. the worker packs its batch, bytes and images alike, end to end into one tensor (:class:`PackedItems`);
3. the main process (or its prefetch thread) moves the decoded images to the device in one copy and decodes
   the JPEG bytes there in one batched nvJPEG call (:func:`to_device_images`); images of one size come out as
   one B x C x H x W tensor, others as a list that the views or the eval transform resize per size group.
"""

from __future__ import annotations

import contextlib
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


def worker_item(path: str | os.PathLike, device_decoder: bool) -> EncodedImage | torch.Tensor:
    """What a loader worker hands on for one file: its bytes when ``device_decoder`` takes them (a JPEG nvJPEG
    decodes, :func:`device_decodable`), else the image decoded here in the worker (PIL, from the bytes already
    read: the file is opened once), so that the main process never decodes a file the device refuses.
    """
    item = read_encoded(path)
    return item if device_decoder and item.device_decodable else decode_on_cpu(item)


class PackedItems(NamedTuple):
    """A loader batch of differently sized tensors (file bytes or decoded images) as one tensor, so that a worker
    hands the main process one shared-memory block a batch instead of one an item (7x the files/s with 2 workers),
    and the main process moves it to the device in one copy.
    """

    data: torch.Tensor  # every item flattened, end to end
    shapes: list[torch.Size]
    paths: list[str | None] | None  # per item: the file whose bytes these are, None for a decoded image
    device_decodable: list[bool] | None  # per item: bytes that the device decoder takes

    def unpack(self) -> list[EncodedImage | torch.Tensor]:
        """The items again, as views of ``data``: an :class:`EncodedImage` for file bytes, else the image."""
        parts = torch.split(self.data, [shape.numel() for shape in self.shapes])
        if self.paths is None or self.device_decodable is None:
            return [part.view(shape) for part, shape in zip(parts, self.shapes)]
        return [
            part.view(shape) if path is None else EncodedImage(part, path, decodable)
            for part, shape, path, decodable in zip(parts, self.shapes, self.paths, self.device_decodable)
        ]

    def pin_memory(self) -> PackedItems:
        """The same batch with ``data`` in page-locked memory (what a loader's ``pin_memory=True`` calls)."""
        return self._replace(data=self.data.pin_memory())


def collate_packed(items: Sequence[EncodedImage | torch.Tensor]) -> PackedItems:
    """A batch of files' bytes and/or of images of their own sizes as :class:`PackedItems`."""
    tensors = [item.data if isinstance(item, EncodedImage) else item for item in items]
    files = any(isinstance(item, EncodedImage) for item in items)
    return PackedItems(
        torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0, dtype=torch.uint8),
        [t.shape for t in tensors],
        [item.path if isinstance(item, EncodedImage) else None for item in items] if files else None,
        [isinstance(item, EncodedImage) and item.device_decodable for item in items] if files else None,
    )


def decode_on_cpu(item: EncodedImage) -> torch.Tensor:
    """PIL's RGB decode of one file's bytes (the workers' decoder) as a 3 x H x W uint8 tensor."""
    return to_uint8_tensor(open_rgb(item.path, item.data.numpy()), item.path)


def _decode_jpegs(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    from torchvision.io import ImageReadMode, decode_jpeg

    with warnings.catch_warnings():  # torchvision 0.29 marks its decoders deprecated in favour of torchcodec
        warnings.simplefilter("ignore", DeprecationWarning)
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)


def decode_images(items: Sequence[EncodedImage], device: str | torch.device) -> list[torch.Tensor]:
    """Decode a batch of files into 3 x H x W uint8 RGB tensors on ``device``, in order; PIL takes what it refuses.

    The files that reach this function are the ones the device decoder was expected to take (loader workers
    decode the rest, :func:`worker_item`); PIL here is the fallback for a JPEG whose header looked fine but
    that nvJPEG still refused, one file in many thousands.
    """
    device = torch.device(device)
    batch = [i for i, item in enumerate(items) if item.device_decodable]
    decoded: dict[int, torch.Tensor] = {}
    if batch:
        try:
            decoded = dict(zip(batch, _decode_jpegs([items[i].data for i in batch], device)))
        except RuntimeError:  # one at a time: only the files nvJPEG refuses go to PIL
            for i in batch:
                with contextlib.suppress(RuntimeError):
                    decoded[i] = _decode_jpegs([items[i].data], device)[0]
    return [
        decoded[i] if i in decoded else decode_on_cpu(item).to(device, non_blocking=True)
        for i, item in enumerate(items)
    ]


def to_device_images(
    batch: PackedItems | Sequence[EncodedImage | torch.Tensor], device: str | torch.device
) -> torch.Tensor | list[torch.Tensor]:
    """A loader's batch on ``device``: the decoded images in one host-to-device copy, as one B x C x H x W tensor
    when they all share a size (small-image folders: no per-image work at all), else a list in order, with the
    files' bytes decoded there (:func:`decode_images`).
    """
    if not isinstance(batch, PackedItems):
        batch = collate_packed(batch)
    device = torch.device(device)
    files = [i for i, path in enumerate(batch.paths or []) if path is not None]
    if not files and batch.shapes and len(set(batch.shapes)) == 1:
        return batch.data.to(device, non_blocking=True).view(len(batch.shapes), *batch.shapes[0])
    moved = batch.data if len(files) == len(batch.shapes) else batch.data.to(device, non_blocking=True)
    out = PackedItems(moved, batch.shapes, None, None).unpack()  # the images as views, the files' bytes replaced
    if files:
        items = batch.unpack()
        for i, image in zip(files, decode_images([items[i] for i in files], device)):  # type: ignore[misc]
            out[i] = image
    return out


def resolve_decode(decode: str, device: torch.device | str, views: str) -> str:
    """``auto`` is ``device`` for batched views on CUDA and ``workers`` otherwise; checks the combination."""
    if decode not in DECODE_MODES:
        raise ValueError(f"--decode {decode!r} is unknown; expected one of {DECODE_MODES}")
    if decode == "device" and views != "batched":
        raise ValueError("--decode device needs --views batched (PIL views decode and augment in the loader workers)")
    if decode == "auto":
        return "device" if views == "batched" and torch.device(device).type == "cuda" else "workers"
    return decode
