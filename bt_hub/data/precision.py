"""``--precision auto``: bfloat16 where it is measured faster. On CUDA: bf16 where the GPU supports it. On a CPU:
the faster of fp32 and bf16 autocast on a micro-benchmark (a ResNet-18 step), timed once per CPU model and torch
version and cached; the speed of bf16 differs by CPU (avx512_bf16 alone has run slower than fp32), so CPU flags
are no guide.

The timings are kept as every measured choice is (:mod:`bt_hub.data.measured`), in ``precision_auto.json``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from bt_hub.data import measured

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
CACHE_NAME = "precision_auto.json"
TIMED_REPEATS = 5  # timed steps per precision, after one untimed warm-up step each
STEP_IMAGES, STEP_SIDE = 16, 64  # the micro-benchmark's batch: 16 images of 64 px


def time_step(dtype: torch.dtype | None, repeats: int = TIMED_REPEATS) -> float:
    """Median seconds of a ResNet-18 forward and backward step (batch 16, 64 px) on the CPU under ``dtype``
    autocast (None: fp32), after one warm-up step."""
    from bt_hub.method.model import build_backbone

    generator = torch.Generator().manual_seed(0)
    network = build_backbone("resnet18")
    x = torch.randn(STEP_IMAGES, 3, STEP_SIDE, STEP_SIDE, generator=generator)
    seconds = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = network(x).float().square().mean()
        loss.backward()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])


def measure_cpu() -> dict[str, float]:
    """Seconds of the micro-benchmark's step in fp32 and in bf16 autocast on this CPU."""
    return {"fp32": time_step(None), "bf16": time_step(torch.bfloat16)}


def cpu_choice(measure: Callable[[], Mapping[str, float]] | None = None) -> dict[str, Any]:
    """``--precision auto`` on this CPU: the faster of fp32 and bf16 by ``measure``'s seconds (default
    :func:`measure_cpu`), kept in ``precision_auto.json`` (:mod:`bt_hub.data.measured`) per CPU model and torch
    version; the choice, why, and both times."""
    steps = 2 * (TIMED_REPEATS + 1)
    note = (
        f"timing bf16 against fp32 on this CPU once ({steps} steps of a ResNet-18, under a minute on most CPUs; "
        f"kept in {CACHE_NAME})"
    )
    timings, where = measured.measured(
        f"{measured.cpu_model()} | torch {torch.__version__}",
        measure or measure_cpu,
        CACHE_NAME,
        lambda found: measured.timings_problem(found, ("fp32", "bf16"), ("fp32", "bf16")),
        note,
    )
    choice = "bf16" if timings["bf16"] < timings["fp32"] else "fp32"
    return {
        "precision": choice,
        "precision_reason": (
            f"auto: a ResNet-18 step took {timings['bf16']:.3g} s in bf16 and {timings['fp32']:.3g} s in fp32 on "
            f"{measured.cpu_model()} ({where})"
        ),
        "precision_fp32_s": timings["fp32"],
        "precision_bf16_s": timings["bf16"],
    }


def precision_choice(precision: str, device: str | torch.device) -> dict[str, Any]:
    """The resolved precision (``precision``) and why (``precision_reason``; on a CPU with auto, both times)."""
    if precision not in PRECISIONS:
        raise ValueError(f"--precision {precision!r} is unknown; expected one of {PRECISIONS}")
    if precision != "auto":
        return {"precision": precision, "precision_reason": f"--precision {precision}"}
    if torch.device(device).type == "cuda":
        fast = torch.cuda.is_bf16_supported()
        return {
            "precision": "bf16" if fast else "fp32",
            "precision_reason": f"auto: the GPU {'supports' if fast else 'does not support'} bf16",
        }
    return cpu_choice()


def resolve_precision(precision: str, device: str | torch.device) -> str:
    """``auto`` -> ``bf16`` or ``fp32`` by :func:`precision_choice`; others unchanged."""
    return precision_choice(precision, device)["precision"]


def resolve_channels_last(channels_last: str, precision: str) -> str:
    """``--channels-last auto`` -> ``on`` for a resolved bf16/fp16 precision, ``off`` for fp32; others unchanged."""
    if channels_last not in ("auto", "on", "off"):
        raise ValueError(f"--channels-last {channels_last!r} is unknown; expected auto, on or off")
    if channels_last != "auto":
        return channels_last
    return "on" if precision in ("bf16", "fp16") else "off"


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a resolved precision (None for fp32)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
