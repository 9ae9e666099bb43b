"""Progress of long loops: a tqdm bar on a terminal, a plain log line every N steps elsewhere.

tqdm switches itself off when stderr is not a terminal, which leaves CI, Slurm and
``nohup`` logs silent for hours; :func:`progress` returns a tqdm bar on a terminal and
otherwise a :class:`LineProgress` with the same ``update`` / ``set_postfix`` / ``close``
methods that writes one self-contained line every ``every`` steps (and at the end).
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from tqdm import tqdm


class LineProgress:
    """tqdm's interface for logs: ``desc: n/total unit (pct%), rate, elapsed, postfix`` every ``every`` steps.

    Args:
        total: steps in all.
        desc: what is running.
        initial: steps already done (a resumed run).
        unit: name of a step.
        every: steps between lines.
        file: where lines go (stderr by default).
    """

    def __init__(self, total: int, desc: str, initial: int = 0, unit: str = "it", every: int = 10, file: TextIO | None = None) -> None:
        if every <= 0:
            raise ValueError(f"every must be positive, got {every}")
        self.total, self.desc, self.n, self.unit, self.every = total, desc, initial, unit, every
        self.file = file if file is not None else sys.stderr
        self.postfix: dict[str, Any] = {}
        self._start, self._start_n, self._last_line = time.monotonic(), initial, None

    def set_postfix(self, **values: Any) -> None:
        """Values shown at the end of the next line (replacing the previous ones)."""
        self.postfix = values

    def update(self, n: int = 1) -> None:
        """Count ``n`` steps; write a line when a multiple of ``every`` is reached."""
        before, self.n = self.n, self.n + n
        if self.n // self.every > before // self.every:
            self._write()

    def close(self) -> None:
        """Write the final line if the last step has not been written yet."""
        if self._last_line != self.n and self.n > self._start_n:
            self._write()

    def _write(self) -> None:
        elapsed = time.monotonic() - self._start
        rate = (self.n - self._start_n) / elapsed if elapsed > 0 else 0.0
        percent = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        extra = "".join(f", {k}={v}" for k, v in self.postfix.items())
        self.file.write(f"{self.desc}: {self.n}/{self.total} {self.unit}{percent}, {rate:.3g} {self.unit}/s, {elapsed:.0f} s{extra}\n")
        self.file.flush()
        self._last_line = self.n


def progress(total: int, desc: str, *, initial: int = 0, unit: str = "it", every: int = 10, enabled: bool = True, file: TextIO | None = None) -> Any:
    """A tqdm bar when ``file`` (stderr) is a terminal, else a :class:`LineProgress`; a silent bar when not ``enabled``."""
    stream = file if file is not None else sys.stderr
    if not enabled:
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, disable=True)
    if getattr(stream, "isatty", lambda: False)():
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=stream, dynamic_ncols=True)
    return LineProgress(total, desc, initial=initial, unit=unit, every=every, file=stream)
