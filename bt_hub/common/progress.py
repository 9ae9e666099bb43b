"""Progress of long loops: a tqdm bar on a terminal, a plain log line every so often elsewhere
(tqdm alone leaves CI, Slurm and ``nohup`` logs silent for hours).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, Any

from tqdm import tqdm

from bt_hub.common.distributed import is_main_process

EVERY_PERCENT = 10.0
PERCENT_ENV = "BT_HUB_PROGRESS_EVERY"


class LineProgress:
    """tqdm's interface for logs: ``desc: n/total unit (pct%), rate, elapsed, ETA, postfix`` every ``every`` steps."""

    def __init__(
        self,
        total: int | None,
        desc: str,
        *,
        initial: int = 0,
        unit: str = "it",
        every: int = 10,
        file: IO[str] | None = None,
        iterable: Iterable[Any] | None = None,
    ) -> None:
        self.total, self.desc, self.n, self.unit, self.every = total, desc, initial, unit, every
        self.file = file if file is not None else sys.stderr
        self.iterable = iterable
        self.postfix: dict[str, Any] = {}
        self._start, self._start_n, self._last_line = time.monotonic(), initial, None

    def __iter__(self) -> Iterator[Any]:
        if self.iterable is None:
            raise TypeError("LineProgress was made without an iterable")
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def set_postfix(self, **values: Any) -> None:
        """Values shown at the end of the next line (replacing the previous ones)."""
        self.postfix = values

    def update(self, n: int = 1) -> None:
        """Count ``n`` steps; write a line on reaching a multiple of ``every`` (or, without a total, a power of two)."""
        before, self.n = self.n, self.n + n
        if self.total is None:
            crossed = self.n.bit_length() > before.bit_length()
        else:
            crossed = self.n // self.every > before // self.every
        if crossed:
            self._write()

    def close(self) -> None:
        """Write the final line if the last step has not been written yet."""
        if self._last_line != self.n and self.n > self._start_n:
            self._write()

    def _write(self) -> None:
        elapsed = time.monotonic() - self._start
        done = self.n - self._start_n
        rate = done / elapsed if elapsed > 0 else 0.0
        if self.total:
            eta = f", ETA {elapsed / done * (self.total - self.n):.0f} s" if done and self.n < self.total else ""
            head = f"{self.n}/{self.total} {self.unit} ({100 * self.n / self.total:.0f}%)"
        else:
            eta, head = "", f"{self.n} {self.unit}"
        extra = "".join(f", {k}={v}" for k, v in self.postfix.items())
        self.file.write(f"{self.desc}: {head}, {rate:.3g} {self.unit}/s, {elapsed:.0f} s{eta}{extra}\n")
        self.file.flush()
        self._last_line = self.n


def progress(
    iterable: Iterable[Any] | None,
    desc: str,
    *,
    total: int | None = None,
    initial: int = 0,
    unit: str = "it",
    every: int | None = None,
    leave: bool = True,
    stream: IO[str] | None = None,
) -> Any:
    """Report the progress of ``iterable`` (or of ``update`` calls) as ``desc``: a tqdm bar, or lines off a terminal.

    Lines every ``every`` steps, else every ``BT_HUB_PROGRESS_EVERY`` percent (10); silent on non-zero ranks.
    """
    stream = stream if stream is not None else sys.stderr
    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    silent = tqdm(iterable, total=total, initial=initial, desc=desc, unit=unit, disable=True)
    if not is_main_process():
        return silent
    if _is_terminal(stream):
        return tqdm(
            iterable, desc=desc, total=total, initial=initial, unit=unit, leave=leave, file=stream, dynamic_ncols=True
        )
    if every is None:
        try:
            percent = float(os.environ.get(PERCENT_ENV, EVERY_PERCENT))
        except ValueError:
            raise ValueError(
                f"{PERCENT_ENV}={os.environ[PERCENT_ENV]!r} is not a number of percent (0 silences the progress lines)"
            ) from None
        if percent <= 0:
            return silent
        every = max(1, math.ceil((total or 0) * percent / 100))
    return LineProgress(total, desc, initial=initial, unit=unit, every=every, file=stream, iterable=iterable)


def note(bar: Any, text: str) -> None:
    """Say what ``bar``'s loop does next, before a step that may take long: a line off a terminal, the bar's
    postfix on one, nothing where the bar is silent."""
    if isinstance(bar, LineProgress):
        bar.file.write(f"{bar.desc}: {text}\n")
        bar.file.flush()
    elif isinstance(bar, tqdm) and not bar.disable:
        bar.set_postfix_str(text)


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def announce(message: str, stream: IO[str] | None = None) -> None:
    """One line on stderr from the main process, saying what a long step is about to do (and what it will cost)."""
    if is_main_process():
        stream = stream if stream is not None else sys.stderr
        stream.write(message + "\n")
        stream.flush()
