"""``--decode auto``: which decoder, and what share of each batch the loader workers decode, chosen by timing the
decoders at hand on the data's first JPEGs (:func:`decode_choice`); the timings are kept per machine
(:mod:`bt_hub.data.measured`). Pretraining's rule is here too (:func:`resolve_decode`). Who decodes, and how, is
:mod:`bt_hub.data.decode`'s.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import PIL
import torch
import torchvision
from PIL import Image

from bt_hub.data import measured
from bt_hub.data.decode import EncodedImage, decode_images, decode_on_cpu, nvimgcodec, read_encoded

DECODE_MODES = ("auto", "device", "workers")  # pretraining's --decode; evaluation's adds nvimgcodec
DECODE_CACHE = "decode_auto.json"
SAMPLE = 256  # JPEGs of the data that --decode auto times the device decoders on, in one batch
CPU_SAMPLE = 32  # of them, the ones it times the workers' decoders on, one file at a time


def resolve_decode(decode: str, device: torch.device | str, views: str) -> str:
    """``auto`` is ``device`` for batched views on CUDA and ``workers`` otherwise; checks the combination."""
    if decode not in DECODE_MODES:
        raise ValueError(f"--decode {decode!r} is unknown; expected one of {DECODE_MODES}")
    if decode == "device" and views != "batched":
        raise ValueError("--decode device needs --views batched (PIL views decode and augment in the loader workers)")
    if decode == "auto":
        return "device" if views == "batched" and torch.device(device).type == "cuda" else "workers"
    return decode


def jpeg_sample(root: str | os.PathLike, limit: int = SAMPLE) -> list[torch.Tensor]:
    """The bytes of the first ``limit`` JPEGs under the folder ``root`` (walked in sorted order) that the device
    decoder takes; [] when ``root`` is no folder (``digits``, ``synthetic``: images in memory)."""
    found: list[torch.Tensor] = []
    if not Path(root).expanduser().is_dir():
        return found
    for folder, subfolders, names in os.walk(Path(root).expanduser(), followlinks=True):
        subfolders.sort()
        for name in sorted(names):
            item = read_encoded(Path(folder) / name) if name.lower().endswith((".jpg", ".jpeg")) else None
            if item is not None and item.device_decodable:
                found.append(item.data)
                if len(found) == limit:
                    return found
    return found


def _seconds_an_image(decode: Callable[[], object], images: int, sync: Callable[[], None]) -> float:
    seconds = []
    for _ in range(4):  # one untimed call, then the median of three
        start = time.perf_counter()
        decode()
        sync()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:]) / images


def time_decoders(sample: Sequence[torch.Tensor], device: str | torch.device, on_device: bool) -> dict[str, float]:
    """Seconds an image of each decoder at hand on ``sample`` (JPEG bytes): the workers' (``pil``; on a CPU also
    ``nvimgcodec``'s CPU backend, where it is installed), one file at a time on one thread as a loader worker decodes
    them; with ``on_device``, the device's instead (``torchvision``, ``nvimgcodec``), the whole sample in one batch
    as the device decodes a loader's batch. A decoder that cannot run here is left out."""
    device = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    items = [EncodedImage(data, f"sample{i}.jpg", True) for i, data in enumerate(sample)]
    few = items[:CPU_SAMPLE]
    seconds = {"pil": _seconds_an_image(lambda: [decode_on_cpu(item) for item in few], len(few), sync)}
    for name in ("torchvision", "nvimgcodec") if on_device else ("nvimgcodec",):
        batches = [items] if on_device else [[item] for item in few]
        with contextlib.suppress(ImportError, RuntimeError):  # not installed, or built for another CUDA
            seconds[name] = _seconds_an_image(
                lambda b=batches, n=name: [decode_images(x, device, n) for x in b], sum(map(len, batches)), sync
            )
    return seconds


def _machine(device: torch.device, sample: Sequence[torch.Tensor]) -> tuple[str, str]:
    """The cache key of ``--decode auto``'s timings (the device, the CPU, the libraries, the images' size class) and
    the sample's median size, ``WxH``."""
    try:
        codec = getattr(nvimgcodec(), "__version__", "?")
    except ImportError:
        codec = "none"
    sizes = sorted((Image.open(io.BytesIO(data.numpy())).size for data in sample), key=math.prod)  # headers only
    width, height = sizes[len(sizes) // 2]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    key = (
        f"decode | {name} | {measured.cpu_model()} | torch {torch.__version__} | torchvision {torchvision.__version__}"
        f" | pillow {PIL.__version__} | nvimgcodec {codec} | ~2^{round(math.log2(width * height))} px"
    )
    return key, f"{width}x{height}"


def decode_choice(
    decode: str,
    device: str | torch.device,
    data: str | os.PathLike,
    num_workers: int,
    measure: Callable[[Sequence[torch.Tensor], torch.device, bool], Mapping[str, float]] | None = None,
) -> dict[str, Any]:
    """Evaluation's ``--decode`` resolved (``decode``), why (``decode_reason``) and the share of the device's JPEGs the
    loader workers decode (``decode_share``, see :func:`bt_hub.data.decode.decoding_for`).

    ``auto`` times the decoders at hand on the first JPEGs of ``data`` (``measure``, default :func:`time_decoders`;
    cached per device, CPU model, library versions and image size class) and takes on CUDA the faster device decoder,
    with the workers decoding the share of each batch that makes both finish together (the workers' rate: one
    worker's times the workers, at most one a core); on a CPU the faster of PIL and nvImageCodec's CPU backend in
    the workers. Without JPEGs to time it is ``device``, the default path.
    """
    if decode != "auto":
        return {"decode": decode, "decode_reason": f"--decode {decode}", "decode_share": 0.0}
    device, sample = torch.device(device), jpeg_sample(data)
    if not sample:
        return {"decode": "device", "decode_reason": "auto: no JPEG files to time decoders on", "decode_share": 0.0}
    on_device = device.type == "cuda"
    key, size = _machine(device, sample)
    timed = lambda: (measure or time_decoders)(sample, device, on_device)  # noqa: E731
    seconds, where = measured.measured(key, timed, measured.cache_file(DECODE_CACHE), ["pil"])
    rate, cores = {name: 1 / s for name, s in seconds.items()}, min(num_workers, os.cpu_count() or 1)
    if not on_device:
        fast = "nvimgcodec" if rate.get("nvimgcodec", 0) > rate["pil"] else "device"
        speeds = ", ".join(f"{rate[n]:,.0f} images/s with {n}" for n in sorted(rate))
        reason = f"auto: a loader worker decoded ~{size} JPEGs at {speeds} on {measured.cpu_model()} ({where})"
        return {"decode": fast, "decode_reason": reason, "decode_share": 0.0}
    on_gpu = {name: rate[name] for name in ("torchvision", "nvimgcodec") if name in rate}
    fast = max(on_gpu, key=on_gpu.__getitem__, default="torchvision")
    workers = cores * rate["pil"]
    share = workers / (workers + on_gpu.get(fast, 0.0)) if workers else 0.0
    speeds = ", ".join(f"{r:,.0f} images/s with {n}" for n, r in sorted(on_gpu.items()))
    reason = (
        f"auto: the {torch.cuda.get_device_name(device)} decoded ~{size} JPEGs at {speeds}, {cores} loader "
        f"workers at {workers:,.0f} with pil: {fast} on the device, the workers decoding {share:.0%} of each batch's "
        f"JPEGs ({where})"
    )
    return {"decode": "device" if fast == "torchvision" else fast, "decode_reason": reason, "decode_share": share}
