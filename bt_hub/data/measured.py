"""The cache of every choice bt_hub makes by measuring it on the machine at hand (``--precision auto``'s fp32 and bf16
steps, ``--decode auto``'s decoders): each measurement kept per machine in a JSON file of its own beside bt_hub's
download cache, so it is measured once; and the CPU facts the machine keys are made of.

A measurement is reused only for the same machine (``INPUTS["measurement"]`` of :mod:`bt_hub.common.reuse`): an
entry is filed under :func:`~bt_hub.common.reuse.inputs_key` of its machine key and holds that key in words beside
what was measured, so the file stays readable. One process measures at a time (a lock beside the file, as every
cache of bt_hub takes); the others wait and read what it wrote. What is read is checked before it is used: a file
that cannot be parsed, an entry of another machine, or a value its user refuses (a timing that is not a positive
finite number, a decoder not installed here) is no measurement: it is measured again, with one warning naming the
file. A cache that cannot be written is measured without being kept, with one warning. A choice's reason names
the file, never its folder: reasons go into results.json and model cards, which hold no absolute path.
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import warnings
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import torch

from bt_hub.common.artifacts import locked
from bt_hub.common.files import atomic_write_json
from bt_hub.common.progress import announce
from bt_hub.common.reuse import inputs_key

FLAG = "TORCH_HOME"  # what moves the cache's folder (<torch hub dir>/checkpoints/bt_hub)


class MeasurementWarning(UserWarning):
    """A measured choice's cache held no usable measurement or could not be written, or a measured choice failed
    its check: what was done instead."""


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
    """The cache file ``name`` of measured choices, beside bt_hub's download cache (``<torch hub dir>/checkpoints/
    bt_hub``, which ``TORCH_HOME`` moves)."""
    return Path(torch.hub.get_dir()) / "checkpoints" / "bt_hub" / name


def measured(
    machine: str, measure: Callable[[], Mapping[str, Any]], name: str, problem: Callable[[Any], str | None], note: str
) -> tuple[dict[str, Any], str]:
    """What was measured on ``machine`` (a key in words), from the cache file ``name`` (:func:`cache_file`) where it
    holds an entry of that machine in which ``problem`` finds nothing wrong (``problem`` returns None, else what is
    wrong, as ``<file> <problem>`` reads), else ``measure()``'s, announced first with ``note`` (what is timed and how
    long it takes) and kept in the file; and where it came from: ``cached in <name>`` or ``measured now``."""
    path = cache_file(name)
    key = inputs_key("measurement", {"machine": machine})
    with contextlib.ExitStack() as held:
        unwritable = _lock(path, held)
        cache, wrong = _read(path)
        entry = cache.get(key)
        if isinstance(entry, dict) and entry.get("machine") == machine:
            wrong = problem(entry.get("measured"))
            if wrong is None:
                return dict(entry["measured"]), f"cached in {name}"
        elif entry is not None:
            wrong = "holds an entry under this machine's key that is not of this machine"
        if wrong is not None:
            warnings.warn(f"{path} {wrong}; measuring again", MeasurementWarning, stacklevel=3)
        announce(note)
        value = dict(measure())
        if (bad := problem(value)) is not None:
            raise RuntimeError(f"the measurement for {name} on this machine {bad}")
        if unwritable is None:
            try:
                atomic_write_json(path, {**cache, key: {"machine": machine, "measured": value}})
                return value, "measured now"
            except OSError as err:
                unwritable = err
    warnings.warn(
        f"{path} cannot be written ({unwritable}); measured now without keeping it ({FLAG} moves the cache)",
        MeasurementWarning,
        stacklevel=3,
    )
    return value, f"measured now, not cached ({name} is not writable)"


def _lock(path: Path, held: contextlib.ExitStack) -> OSError | None:
    """Take the lock of the cache file ``path`` (None), or say why it cannot be taken (the folder is not writable)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        held.enter_context(locked(path.with_name(path.name + ".lock"), FLAG))
    except OSError as err:
        return err
    return None


def _read(path: Path) -> tuple[dict[str, Any], str | None]:
    """The entries of the cache file ``path`` ({} when there is none) and, when it cannot be used, why."""
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError):  # none yet (or no folder to hold one)
        return {}, None
    except (OSError, UnicodeDecodeError) as err:
        return {}, f"cannot be read ({err})"
    except RecursionError:
        return {}, "nests its JSON deeper than Python's JSON reader goes (bt_hub did not write it so)"
    except ValueError as err:
        return {}, f"is not JSON ({err})"
    return (found, None) if isinstance(found, dict) else ({}, "does not hold a JSON object of entries")


def timings_problem(seconds: Any, required: Collection[str], at_hand: Collection[str]) -> str | None:
    """None when ``seconds`` maps names (every one of ``required``, none but ``at_hand``) to positive finite numbers
    of seconds; else what is wrong with it."""
    if not isinstance(seconds, Mapping) or not seconds:
        return "holds no timings for this machine"
    for name, value in seconds.items():
        if name not in at_hand:
            return f"holds a timing of {name}, which is not installed or cannot run here"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            return f"holds {value!r} s for {name}, not a positive finite number of seconds"
    missing = [name for name in required if name not in seconds]
    return f"holds no timing of {', '.join(missing)}" if missing else None
