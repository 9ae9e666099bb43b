"""SIGTERM, what a cluster scheduler sends before it kills a job: Ctrl-C's path (:class:`Terminated`), or, in
a training loop, a flag read at each step boundary (:func:`deferred_sigterm`) so every rank stops together.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads with the command, after the CLI's handlers are set
    import torch

EXIT_CODE = 143  # 128 + SIGTERM: what a shell reports for a job that SIGTERM ended


class Terminated(KeyboardInterrupt):
    """The process received SIGTERM."""


def raise_terminated(signum: int, frame: Any) -> None:
    """A SIGTERM handler: raise :class:`Terminated` wherever the program is."""
    raise Terminated


@contextlib.contextmanager
def deferred_sigterm(device: torch.device) -> Iterator[Callable[[], bool]]:
    """Within the block SIGTERM only sets a flag; yields ``requested()`` (a collective under torchrun)."""
    from bt_hub.common.distributed import any_rank

    received: list[int] = []
    main = threading.current_thread() is threading.main_thread()  # only the main thread may set handlers
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum)) if main else None
    try:
        yield lambda: any_rank(bool(received), device)
    finally:
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
