"""The cache of every choice bt_hub makes by measuring it on the machine at hand (``--precision auto``'s fp32 and bf16
steps, ``--decode auto``'s decoders): timings kept per machine key in a JSON file of their own beside bt_hub's
download cache, so each is measured once; and the CPU facts those keys are made of.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from bt_hub.common.files import atomic_write_json, read_json


def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    return frozenset(_cpuinfo("flags").split())


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo, else what the platform says), the key of the precision cache."""
    return _cpuinfo("model name") or platform.processor() or platform.machine() or "unknown CPU"


def _cpuinfo(field: str) -> str:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    for line in text.splitlines():
        if line.split(":", 1)[0].strip() == field:
            return line.split(":", 1)[1].strip()
    return ""


def cache_file(name: str) -> Path:
    """Where the measured choices are kept: beside bt_hub's download cache (``<torch hub dir>/checkpoints/bt_hub``)."""
    return Path(torch.hub.get_dir()) / "checkpoints" / "bt_hub" / name


def measured(
    key: str, measure: Callable[[], Mapping[str, float]], path: Path, names: Sequence[str] = ()
) -> tuple[dict[str, float], str]:
    """The timings cached under ``key`` in ``path`` (a JSON file of such entries) when they hold every one of
    ``names``, else ``measure()``'s, cached there now; and where they came from, for a choice's reason."""
    cache = read_json(path)
    cache = cache if isinstance(cache, dict) else {}
    found = cache.get(key)
    if isinstance(found, dict) and found and all(isinstance(v, (int, float)) for v in found.values()):
        if all(name in found for name in names):
            # the file by name: the reason goes into results.json and model cards, which hold no absolute path
            return {name: float(v) for name, v in found.items()}, f"cached in {path.name}"
    timings, where = {name: float(v) for name, v in measure().items()}, "measured now"
    try:
        atomic_write_json(path, {**cache, key: timings})
    except OSError:
        where += f", not cached ({path} is not writable)"
    return timings, where
