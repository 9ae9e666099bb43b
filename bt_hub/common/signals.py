"""SIGTERM, what a cluster scheduler sends before it kills a job: Ctrl-C's path (:class:`Terminated`), or, in
a training loop, a flag read at each step boundary (:func:`deferred_sigterm`) so every rank stops together.

``timeout``, SLURM's scancel and a terminal's Ctrl-C signal the whole process group, DataLoader workers
included: every DataLoader bt_hub builds passes ``worker_init_fn=ignore_group_signals``, so only the main
process acts on the signal (checkpoints, says what it kept) and then shuts its workers down as it always does.
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
def _noted(signums: list[int]) -> Iterator[list[int]]:
    """Within the block ``signums`` only append to the yielded list (in the main thread: only it may set
    handlers; elsewhere nothing changes), then their handlers are restored."""
    received: list[int] = []
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in signums if main}
    try:
        yield received
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


@contextlib.contextmanager
def deferred_sigterm(device: torch.device) -> Iterator[Callable[[], bool]]:
    """Within the block SIGTERM only sets a flag; yields ``requested()`` (a collective under torchrun)."""
    from bt_hub.common.distributed import any_rank

    with _noted([signal.SIGTERM]) as received:
        yield lambda: any_rank(bool(received), device)


@contextlib.contextmanager
def held_signals() -> Iterator[None]:
    """Within the block Ctrl-C and SIGTERM are only noted, then raised at its end (KeyboardInterrupt, Terminated):
    one landing inside ``import torch`` breaks that import into errors that no longer say they were an interrupt."""
    with _noted([s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not signal.SIG_IGN]) as received:
        yield
    if received:
        raise Terminated if received[0] == signal.SIGTERM else KeyboardInterrupt


def ignore_group_signals(worker_id: int) -> None:
    """A DataLoader ``worker_init_fn``: the worker ignores SIGTERM and SIGINT, which its main process handles.

    torch's workers die of a SIGTERM that their parent did not send, and the main process then fails with
    "DataLoader worker (pid ...) is killed by signal: Terminated" before it could checkpoint or answer. A worker
    that ignores them still ends when the main process shuts the loader down, or, if that process is gone, by
    torch's watch on its parent.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
