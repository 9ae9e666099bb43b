"""Progress of long loops: a tqdm bar on a terminal, a log line every N percent elsewhere.

tqdm turns itself off when stderr is not a terminal, which leaves CI and Slurm logs
silent for hours. ``progress`` keeps the bar on a terminal and, off one, writes plain
lines such as ``features train: 40% (2/5 batch, 3.1 s, ETA 4.6 s)`` to stderr every
``every`` percent (and at the end). Only the main process reports.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import IO, Iterable, Iterator, Optional, TypeVar

from tqdm import tqdm

from bt_hub.distributed import is_main_process

T = TypeVar("T")
EVERY_PERCENT = 10


def progress(
    iterable: Iterable[T],
    desc: str,
    *,
    total: Optional[int] = None,
    unit: str = "it",
    every: float = EVERY_PERCENT,
    leave: bool = True,
    stream: Optional[IO[str]] = None,
) -> Iterable[T]:
    """``iterable`` with progress reports named ``desc``.

    Args:
        iterable: the loop to report on.
        desc: what the loop does, e.g. ``"features train"`` or ``"linear (cached)"``.
        total: number of items (default ``len(iterable)`` when it has one).
        unit: the item's name in the report.
        every: off a terminal, a line every this many percent (``BT_HUB_PROGRESS_EVERY``
            overrides it; 0 silences the lines).
        leave: keep the finished bar on the terminal.
        stream: where reports go (default stderr).
    """
    stream = stream if stream is not None else sys.stderr
    if not is_main_process():
        return iterable
    if total is None:
        total = len(iterable) if hasattr(iterable, "__len__") else None  # type: ignore[arg-type]
    if _is_terminal(stream):
        return tqdm(iterable, desc=desc, total=total, unit=unit, leave=leave, file=stream)
    every = float(os.environ.get("BT_HUB_PROGRESS_EVERY", every))
    if every <= 0:
        return iterable
    return _log_lines(iterable, desc, total, unit, every, stream)


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _log_lines(iterable: Iterable[T], desc: str, total: Optional[int], unit: str, every: float, stream: IO[str]) -> Iterator[T]:
    """Yield from ``iterable``, writing a line each time another ``every`` percent is done."""
    start = time.perf_counter()
    done, next_mark = 0, every
    for item in iterable:
        yield item
        done += 1
        elapsed = time.perf_counter() - start
        if total:
            percent = 100.0 * done / total
            if percent + 1e-9 >= next_mark or done == total:
                eta = elapsed / done * (total - done)
                stream.write(f"{desc}: {math.floor(percent)}% ({done}/{total} {unit}, {elapsed:.1f} s, ETA {eta:.1f} s)\n")
                stream.flush()
                next_mark = (math.floor(percent / every) + 1) * every
        elif done & (done - 1) == 0:  # no total: lines after 1, 2, 4, 8, ... items
            stream.write(f"{desc}: {done} {unit} ({elapsed:.1f} s)\n")
            stream.flush()
