"""SIGTERM, what a cluster scheduler sends before it kills a job: Ctrl-C's path, or a stop at a step boundary.

``bt-hub`` turns SIGTERM into :class:`Terminated`, a ``KeyboardInterrupt``, so every command ends
as on Ctrl-C, saying in one line what it kept (exit code ``EXIT_CODE``). A training loop that can
stop cleanly defers the signal instead (:func:`deferred_sigterm`): it only sets a flag, which the
loop reads at each step boundary; under torchrun the ranks agree through one all-reduce, so all of
them stop after the same step.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from bt_hub.common.distributed import any_rank

EXIT_CODE = 143  # 128 + SIGTERM: what a shell reports for a job that SIGTERM ended


class Terminated(KeyboardInterrupt):
    """The process received SIGTERM."""


def raise_terminated(signum: int, frame: Any) -> None:
    """A SIGTERM handler: raise :class:`Terminated` wherever the program is."""
    raise Terminated


@contextlib.contextmanager
def deferred_sigterm(device: torch.device) -> Iterator[Callable[[], bool]]:
    """Within the block SIGTERM only sets a flag; yields ``requested()``: True once any rank got SIGTERM.

    ``requested()`` is a collective under torchrun: every rank calls it at the same points.
    """
    received: list[int] = []
    main = threading.current_thread() is threading.main_thread()  # only the main thread may set handlers
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum)) if main else None
    try:
        yield lambda: any_rank(bool(received), device)
    finally:
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
