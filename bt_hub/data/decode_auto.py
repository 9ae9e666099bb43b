"""``--decode``, one rule for pretraining and evaluation (:func:`decode_choice`): who decodes the image files, as a
:class:`~bt_hub.data.decode.Decoding` handed on to the loaders, and why.

``auto`` times the decoders at hand on the data's first JPEGs and checks what each decoded against PIL's pixels
(:func:`measure_decoders`), once per machine (:mod:`bt_hub.data.measured`), then takes the fastest decoder whose
pixels are within ``AGREEMENT`` of PIL's, and on CUDA the share of each batch the loader workers decode beside the
GPU; a split is checked on those JPEGs too (:func:`split_problem`). Who decodes, and how, is
:mod:`bt_hub.data.decode`'s.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import statistics
import time
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import PIL
import torch
import torchvision
from PIL import Image

from bt_hub.data import measured
from bt_hub.data.decode import (
    Decoding,
    EncodedImage,
    collate_packed,
    decode_images,
    decode_on_cpu,
    nvimgcodec,
    read_encoded,
    to_device_images,
)

DECODE_MODES = ("auto", "device", "nvimgcodec", "pil", "workers")
DECODE_CACHE = "decode_auto.json"
SAMPLE = 256  # JPEGs of the data that --decode auto times the device decoders on, in one batch
CPU_SAMPLE = 32  # of them, the ones it times the workers' decoders on, one file at a time
# The most a decoder's pixels may differ from PIL's on the sample, in levels of 0..255 (docs/performance.md):
# torchvision's own test holds its CUDA decoder's mean within 2 of libjpeg's; single pixels at a saturated colour
# edge may differ more where chroma is upsampled otherwise. A wrong channel order, a transposed image or a shifted
# row is far outside both.
AGREEMENT = {"max": 64, "mean": 2.0}


class DecodeChoice(NamedTuple):
    """``--decode`` resolved: the mode that runs it again (``decode``: ``device``, ``nvimgcodec``, ``pil`` or
    ``workers``), who decodes (``decoding``), why (``reason``) and, for ``auto`` on JPEGs, how far each timed decoder's
    pixels were from PIL's (``agreement``: decoder -> ``max`` and ``mean`` levels)."""

    decode: str
    decoding: Decoding
    reason: str
    agreement: dict[str, dict[str, float]] | None = None


def check_decode(decode: str, views: str = "batched") -> None:
    """Refuse an unknown ``--decode``, and one of the device path with PIL views (pretraining's ``--views pil``)."""
    if decode not in DECODE_MODES:
        raise ValueError(f"--decode {decode!r} is unknown; expected one of {DECODE_MODES}")
    if views != "batched" and decode in ("device", "nvimgcodec", "pil"):
        raise ValueError(
            f"--decode {decode} needs --views batched (PIL views decode and augment in the loader workers)"
        )


def _given(decode: str, device: torch.device) -> Decoding:
    """Who decodes for a ``--decode`` given: on CUDA the device decodes the JPEGs (torchvision's nvJPEG for
    ``device``, nvImageCodec for ``nvimgcodec``); on a CPU, and for ``pil`` and ``workers``, the workers decode every
    file (nvImageCodec's CPU backend for ``nvimgcodec``, PIL otherwise)."""
    if decode not in ("device", "nvimgcodec"):
        return Decoding()
    if device.type == "cuda":
        return Decoding("torchvision" if decode == "device" else "nvimgcodec")
    return Decoding(None, "nvimgcodec" if decode == "nvimgcodec" else "pil")


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


def pixel_difference(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> dict[str, float]:
    """The largest and the mean absolute difference, in levels, of images ``got`` from images ``want`` (a pixel of an
    image of another shape counts as 255 levels off)."""
    largest, total, count = 0, 0.0, 0
    for a, b in zip(got, want, strict=True):
        b = b.to(a.device)
        if a.shape != b.shape:
            largest, total = 255, total + 255.0 * b.numel()
        else:
            diff = (a.int() - b.int()).abs()
            largest, total = max(largest, int(diff.max())), total + float(diff.sum())
        count += b.numel()
    return {"max": largest, "mean": round(total / max(count, 1), 4)}


def agrees(levels: Mapping[str, float]) -> bool:
    """Whether a decoder whose pixels are ``levels`` (:func:`pixel_difference`) from PIL's may be taken."""
    return levels["max"] <= AGREEMENT["max"] and levels["mean"] <= AGREEMENT["mean"]


def measure_decoders(sample: Sequence[torch.Tensor], device: torch.device, on_device: bool) -> dict[str, Any]:
    """:func:`time_decoders`' ``seconds`` and, for each decoder timed but PIL, how far its pixels are from PIL's on
    the JPEGs it was timed on (``agreement``, :func:`pixel_difference`)."""
    seconds = time_decoders(sample, device, on_device)
    items = [EncodedImage(data, f"sample{i}.jpg", True) for i, data in enumerate(sample)]
    items = items if on_device else items[:CPU_SAMPLE]
    reference = [decode_on_cpu(item) for item in items]
    agreement = {
        name: pixel_difference(decode_images(items, device, name), reference) for name in seconds if name != "pil"
    }
    return {"seconds": seconds, "agreement": agreement}


def split_problem(sample: Sequence[torch.Tensor], decoding: Decoding, device: torch.device) -> str | None:
    """None when the split decode of ``sample`` (JPEG bytes as a loader's batch: the workers' share by
    ``decoding.workers``, the rest on the device, merged in order) gives the images of the unsplit decode, within
    ``AGREEMENT``; else how far apart they are."""
    items = [EncodedImage(data, f"sample{i}.jpg", True) for i, data in enumerate(sample)]
    whole = decoding._replace(worker_share=0.0)
    split, unsplit = (
        list(to_device_images(collate_packed([d.hand_on(item, i) for i, item in enumerate(items)]), device, d.device))
        for d in (decoding, whole)
    )
    levels = pixel_difference(split, unsplit)
    if agrees(levels):
        return None
    return f"differs from the unsplit decode by up to {levels['max']:.0f} levels (mean {levels['mean']:.2f})"


def _machine(device: torch.device, sample: Sequence[torch.Tensor]) -> tuple[str, str, set[str]]:
    """The machine key of ``--decode auto``'s measurement (the device, the CPU, the libraries, the images' size
    class), the sample's median size (``WxH``) and the decoders at hand."""
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
    at_hand = {"pil", *(["torchvision"] if device.type == "cuda" else []), *(["nvimgcodec"] if codec != "none" else [])}
    return key, f"{width}x{height}", at_hand


def _problem(found: Any, at_hand: Collection[str]) -> str | None:
    """What is wrong with a cached ``--decode auto`` measurement (:func:`measure_decoders`), or None."""
    if not isinstance(found, Mapping):
        return "holds no measurement for this machine"
    seconds, agreement = found.get("seconds"), found.get("agreement")
    wrong = measured.timings_problem(seconds, ("pil",), at_hand)
    if wrong is not None:
        return wrong
    if not isinstance(agreement, Mapping) or set(agreement) != set(seconds) - {"pil"}:
        return "holds no pixel check of every decoder it timed"
    for name, levels in agreement.items():
        numbers = [levels.get(k) for k in ("max", "mean")] if isinstance(levels, Mapping) else [None]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 255 for v in numbers):
            return f"holds {levels!r} as {name}'s difference from PIL, not a max and a mean of 0 to 255 levels"
    return None


def _refused(agreement: Mapping[str, Mapping[str, float]]) -> str:
    """``; not taken: <decoder> (its pixels up to N levels from PIL's, mean M)`` for the decoders over ``AGREEMENT``."""
    over = [
        f"{n} (its pixels up to {a['max']:.0f} levels from PIL's, mean {a['mean']:.2f})"
        for n, a in sorted(agreement.items())
        if not agrees(a)
    ]
    limit = f"over the {AGREEMENT['max']} / {AGREEMENT['mean']} allowed"
    return f"; not taken, {limit}: {', '.join(over)}" if over else ""


def decode_choice(
    decode: str,
    device: str | torch.device,
    data: str | os.PathLike,
    num_workers: int,
    measure: Callable[[Sequence[torch.Tensor], torch.device, bool], Mapping[str, Any]] | None = None,
) -> DecodeChoice:
    """``--decode`` resolved, for pretraining (with ``--views batched``) and evaluation alike: a mode given is taken
    as it is (:func:`_given`). ``auto`` measures the decoders at hand on the first JPEGs of ``data`` (``measure``,
    default :func:`measure_decoders`; kept per device, CPU model, library versions and image size class) and never
    takes one whose pixels are over ``AGREEMENT`` from PIL's. On CUDA it takes the faster device decoder (``device``:
    torchvision; ``nvimgcodec``), with the workers decoding the share of each batch that makes both finish together
    (the workers' rate: one worker's times the workers, at most one a core), checked by :func:`split_problem`; with
    none, the workers decode (``pil``). On a CPU the faster of PIL and nvImageCodec's CPU backend in the workers
    (``pil``, ``nvimgcodec``). Without JPEGs to time it is ``device``, the default path.
    """
    device = torch.device(device)
    if decode != "auto":
        return DecodeChoice(decode, _given(decode, device), f"--decode {decode}")
    sample = jpeg_sample(data)
    if not sample:
        return DecodeChoice("device", _given("device", device), "auto: no JPEG files to time decoders on")
    on_device = device.type == "cuda"
    key, size, at_hand = _machine(device, sample)
    note = (
        f"timing the JPEG decoders at hand on {len(sample)} JPEGs of the data once, their pixels checked against "
        f"PIL's (a few seconds; kept in {DECODE_CACHE})"
    )
    found, where = measured.measured(
        key,
        lambda: (measure or measure_decoders)(sample, device, on_device),
        DECODE_CACHE,
        lambda found: _problem(found, at_hand),
        note,
    )
    rate = {name: 1 / s for name, s in found["seconds"].items()}
    agreement = {name: dict(levels) for name, levels in found["agreement"].items()}
    taken = {name: rate[name] for name in agreement if agrees(agreement[name])}
    refused = _refused(agreement)
    if not on_device:
        fast = "nvimgcodec" if taken.get("nvimgcodec", 0) > rate["pil"] else "pil"
        speeds = ", ".join(f"{rate[n]:,.0f} images/s with {n}" for n in sorted(rate))
        reason = f"auto: a loader worker decoded ~{size} JPEGs at {speeds} on {measured.cpu_model()}{refused} ({where})"
        return DecodeChoice(fast, Decoding(None, fast), reason, agreement)
    gpu = torch.cuda.get_device_name(device)
    if not taken:
        reason = f"auto: the {gpu} has no decoder whose pixels match PIL's{refused}: the workers decode ({where})"
        return DecodeChoice("pil", Decoding(), reason, agreement)
    fast, cores = max(taken, key=taken.__getitem__), min(num_workers, os.cpu_count() or 1)
    workers = cores * rate["pil"]
    decoding = Decoding(fast, "pil", workers / (workers + taken[fast]) if workers else 0.0)
    speeds = ", ".join(f"{r:,.0f} images/s with {n}" for n, r in sorted(taken.items()))
    reason = (
        f"auto: the {gpu} decoded ~{size} JPEGs at {speeds}, {cores} loader workers at {workers:,.0f} with pil: "
        f"{fast} on the device, the workers decoding {decoding.worker_share:.0%} of each batch's JPEGs{refused} "
        f"({where})"
    )
    problem = split_problem(sample, decoding, device) if decoding.worker_share else None
    if problem is not None:
        warnings.warn(
            f"--decode auto: the split decode of the data's first JPEGs {problem}; {fast} decodes every JPEG on "
            "the device instead",
            measured.MeasurementWarning,
            stacklevel=2,
        )
        decoding, reason = decoding._replace(worker_share=0.0), f"{reason}; the split {problem}, so it is off"
    return DecodeChoice("device" if fast == "torchvision" else fast, decoding, reason, agreement)
