"""``--precision auto``: bfloat16 where the hardware computes it fast (CUDA with bf16, CPUs with avx512_bf16 or
AMX), float32 elsewhere, where emulated bf16 autocast is slower than float32.
"""

from __future__ import annotations

from pathlib import Path

import torch

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
FAST_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def fast_bf16(device: str | torch.device) -> bool:
    """True when ``device`` computes bfloat16 natively (a CUDA GPU with bf16, or a CPU with avx512_bf16/AMX)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return any(flag in cpu_flags() for flag in FAST_BF16_CPU_FLAGS)


def resolve_precision(precision: str, device: str | torch.device) -> str:
    """``auto`` -> ``bf16`` on hardware with fast bfloat16 (:func:`fast_bf16`), else ``fp32``; others unchanged."""
    if precision not in PRECISIONS:
        raise ValueError(f"--precision {precision!r} is unknown; expected one of {PRECISIONS}")
    if precision != "auto":
        return precision
    return "bf16" if fast_bf16(device) else "fp32"


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
