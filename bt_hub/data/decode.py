"""Image files decoded in batches on the training device (``--decode device``); loader workers decode the rest.

The path of one file, from disk to a batch on the device:

1. a loader worker reads the file's bytes once (:func:`read_encoded`) and looks at its JPEG header: a
   baseline/extended/progressive JPEG of 1 or 3 components is left encoded when the device decodes (nvJPEG on
   CUDA); anything else (PNG, CMYK JPEG, BMP, ...), and every file when the device is the CPU, is decoded in
   the worker from those bytes with PIL's RGB rules (:func:`worker_item`), so the main process never decodes;
2. the worker packs its batch, bytes and images alike, end to end into one tensor (:class:`PackedItems`);
3. the main process (or its prefetch thread) moves the decoded images to the device in one copy and decodes
   the JPEG bytes there in one batched call (:func:`to_device_images`); images of one size come out as
   one B x C x H x W tensor, others as a list that the views or the eval transform resize per size group.

Who decodes is a :class:`Decoding`: the device's library (torchvision's nvJPEG, which runs on the GPU's SMs, or
nvImageCodec, ``pip install bt_hub[nvimgcodec]``, which uses the hardware JPEG engines of A100/H100/H200 where
they are), the workers' (PIL, or nvImageCodec's CPU backend: libjpeg-turbo as PIL's, the same pixels), and the
share of the device's JPEGs that the workers decode while the device decodes the rest: the CPU cores decode
beside the GPU instead of idling. Which decoders and what share ``--decode auto`` takes, by measuring them, is
:mod:`bt_hub.data.decode_auto`'s.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
import torch

from bt_hub.common.images import open_rgb
from bt_hub.common.optional import require
from bt_hub.data.datasets import to_uint8_tensor

NVIMGCODEC = "nvidia.nvimgcodec"
# index x this, modulo 1, spreads any run of consecutive indices evenly over [0, 1): the workers' share of a batch
_GOLDEN = (math.sqrt(5) - 1) / 2
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


class Decoding(NamedTuple):
    """Who decodes a batch's image files. ``device``: the library that decodes JPEGs on the device (``torchvision``:
    nvJPEG on the GPU's SMs; ``nvimgcodec``: nvImageCodec, on the hardware JPEG engines where the GPU has them);
    None: the loader workers decode every file. ``workers``: the workers' decoder (``pil``, or ``nvimgcodec``: its
    CPU backend). ``worker_share``: the fraction of the device's JPEGs that the workers decode instead, while the
    device decodes the rest (``--decode auto`` sets it from the two measured rates)."""

    device: str | None = None
    workers: str = "pil"
    worker_share: float = 0.0

    def leaves_encoded(self, item: EncodedImage, index: int) -> bool:
        """Whether a worker hands ``item`` (dataset index ``index``) on as bytes: a JPEG the device decoder takes,
        outside the workers' share (a fixed set of indices: the same in every epoch, worker and run)."""
        return self.device is not None and item.device_decodable and (index * _GOLDEN) % 1 >= self.worker_share

    def hand_on(self, item: EncodedImage, index: int) -> EncodedImage | torch.Tensor:
        """What a loader worker hands on for a file it read (dataset index ``index``): its bytes when this decoding
        leaves them to the device, else the image decoded by ``workers`` from those bytes."""
        return item if self.leaves_encoded(item, index) else decode_images([item], "cpu", self.workers)[0]

    def described(self) -> dict[str, str]:
        """What a record says of it: the ``decoder`` that decodes the JPEGs (``pil``, ``torchvision``,
        ``nvimgcodec``) and where (``decoded_on``: ``loader workers``, ``device``, or ``split``: the workers decode
        ``worker_share`` of them with ``pil``)."""
        if self.device is None:
            return {"decoder": self.workers, "decoded_on": "loader workers"}
        return {"decoder": self.device, "decoded_on": "split" if self.worker_share else "device"}


def worker_item(path: str | os.PathLike, decoding: Decoding, index: int = 0) -> EncodedImage | torch.Tensor:
    """What a loader worker hands on for one file (dataset index ``index``): its bytes when ``decoding`` leaves them
    to the device (:meth:`Decoding.leaves_encoded`), else the image decoded here in the worker by
    ``decoding.workers`` from the bytes already read (the file is opened once): the main process never decodes a
    file the device refuses, and a file of the workers' share is decoded once, here.
    """
    return decoding.hand_on(read_encoded(path), index)


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


def _torchvision(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    try:
        return _decode_jpegs(data, device)
    except RuntimeError:  # one at a time: only the files nvJPEG refuses go to PIL
        decoded: list[torch.Tensor | None] = []
        for one in data:
            try:
                decoded.append(_decode_jpegs([one], device)[0])
            except RuntimeError:
                decoded.append(None)
        return decoded


def nvimgcodec() -> ModuleType:
    """nvImageCodec (``pip install bt_hub[nvimgcodec]``, else one sentence naming it), imported without the lines
    it writes to stderr for each GPU codec library it does not find (nvJPEG2000, nvTIFF: bt_hub decodes JPEGs
    only) and, at its verbosity 0 (read at import), for each file it refuses (PIL decodes those, or names them)."""
    module = sys.modules.get(NVIMGCODEC)
    if module is not None:
        return module
    quiet = "PYNVIMGCODEC_VERBOSITY" not in os.environ
    os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "0")
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)  # the file descriptor: the lines come from its C++ libraries
    try:
        return require(NVIMGCODEC, "--decode nvimgcodec")
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
        if quiet:
            del os.environ["PYNVIMGCODEC_VERBOSITY"]


_NVIMGCODEC_DECODERS: dict[tuple[int, str], Any] = {}  # per process (a forked worker makes its own) and device


def _nvimgcodec_decoder(device: torch.device) -> Any:
    key = (os.getpid(), str(device))
    if key not in _NVIMGCODEC_DECODERS:
        codec = nvimgcodec()
        if device.type == "cuda":  # hardware engines first, then CUDA, then the CPU: nvImageCodec's own order
            index = device.index if device.index is not None else torch.cuda.current_device()
            _NVIMGCODEC_DECODERS[key] = codec.Decoder(device_id=index)
        else:  # the CPU backend alone, on one thread (a loader worker's): the default decoder needs a GPU
            cpu_only = [codec.Backend(codec.BackendKind.CPU_ONLY)]
            _NVIMGCODEC_DECODERS[key] = codec.Decoder(
                device_id=codec.NVIMGCODEC_DEVICE_CPU_ONLY, max_num_cpu_threads=1, backends=cpu_only
            )
    return _NVIMGCODEC_DECODERS[key]


def _nvimgcodec(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    codec = nvimgcodec()
    # PIL's pixels: RGB planes (3 x H x W, as torchvision's), no EXIF rotation
    params = codec.DecodeParams(
        apply_exif_orientation=False, color_spec=codec.ColorSpec.SRGB, sample_format=codec.SampleFormat.P_RGB
    )
    streams = {}
    for i, one in enumerate(data):
        with contextlib.suppress(RuntimeError):  # a header it cannot parse: PIL decodes the file, or names it
            streams[i] = codec.CodeStream(one.numpy())
    # on CUDA the images are ready on the stream torch is on and handed over by DLPack; host images by numpy's
    # array interface (their DLPack export asks for a GPU)
    on_gpu = device.type == "cuda"
    stream = {"cuda_stream": torch.cuda.current_stream(device).cuda_stream} if on_gpu else {}
    images = _nvimgcodec_decoder(device).decode(list(streams.values()), params=params, **stream)
    decoded: dict[int, torch.Tensor | None] = dict.fromkeys(range(len(data)))
    for i, image in zip(streams, images):
        if image is not None:
            decoded[i] = torch.from_dlpack(image) if on_gpu else torch.from_numpy(np.array(image))
    return list(decoded.values())


_DEVICE_DECODERS: dict[str, Callable[[list[torch.Tensor], torch.device], list[torch.Tensor | None]]] = {
    "torchvision": _torchvision,
    "nvimgcodec": _nvimgcodec,
}


def decode_images(
    items: Sequence[EncodedImage], device: str | torch.device, decoder: str = "torchvision"
) -> list[torch.Tensor]:
    """Decode a batch of files into 3 x H x W uint8 RGB tensors on ``device``, in order: the JPEGs the device decoder
    takes in one call of ``decoder`` (``torchvision``, ``nvimgcodec``; ``pil``: none), the rest and any it refuses
    by PIL.

    The files that reach this function on the device are the ones its decoder was expected to take (loader workers
    decode the rest, :func:`worker_item`); PIL here is the fallback for a JPEG whose header looked fine but that
    the decoder still refused, one file in many thousands.
    """
    device = torch.device(device)
    batch = [i for i, item in enumerate(items) if item.device_decodable and decoder != "pil"]
    decoded = dict(zip(batch, _DEVICE_DECODERS[decoder]([items[i].data for i in batch], device))) if batch else {}
    return [
        image if (image := decoded.get(i)) is not None else decode_on_cpu(item).to(device, non_blocking=True)
        for i, item in enumerate(items)
    ]


def to_device_images(
    batch: PackedItems | Sequence[EncodedImage | torch.Tensor], device: str | torch.device, decoder: str = "torchvision"
) -> torch.Tensor | list[torch.Tensor]:
    """A loader's batch on ``device``: the decoded images in one host-to-device copy, as one B x C x H x W tensor
    when they all share a size (small-image folders: no per-image work at all), else a list in order, with the
    files' bytes decoded there by ``decoder`` (:func:`decode_images`).
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
        for i, image in zip(files, decode_images([items[i] for i in files], device, decoder)):  # type: ignore[misc]
            out[i] = image
    return out
