"""SIGTERM, what a cluster scheduler sends before it kills a job: Ctrl-C's path (:class:`Terminated`), or, in
a training loop, a flag read at each step boundary (:func:`deferred_stop`) so every rank stops together.

SIGUSR1, SIGUSR2 and SIGHUP stop a command the same way (:data:`STOP_SIGNALS`): they are the warnings schedulers send
ahead of a time limit or a preemption (Slurm's ``--signal=USR1@120``, submitit's SIGUSR2, SGE's ``-notify``), and a
closing terminal's hang-up, whose default action would end the process on the spot, with no checkpoint and no line.
The command exits with 128 + the signal's number, what a shell reports for a job that signal ended (143 for SIGTERM,
138 for SIGUSR1), so a job script can tell a stop it asked for (and requeue with ``--resume auto``) from a failure.
A signal ignored when bt-hub starts (``nohup`` ignores SIGHUP) stays ignored.

``timeout``, SLURM's scancel and a terminal's Ctrl-C signal the whole process group, DataLoader workers
included: every DataLoader bt_hub builds passes ``worker_init_fn=ignore_group_signals``, so only the main
process acts on the signal (checkpoints, says what it kept) and then shuts its workers down as it always does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads with the command, after the CLI's handlers are set
    import torch

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
# a Ctrl-C this soon after the first is the same one again: a terminal's reaches every torchrun worker, and the agent
# then forwards its own copy
SAME_CTRL_C_S = 0.5


class Terminated(KeyboardInterrupt):
    """The process received one of :data:`STOP_SIGNALS` (``signum``; SIGTERM by default)."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = signal.Signals(signum)

    @property
    def exit_code(self) -> int:
        """128 + the signal's number: what a shell reports for a job that this signal ended."""
        return 128 + self.signum


def _handled(signums: tuple[int, ...]) -> list[int]:
    """``signums`` but those ignored now (``nohup`` ignores SIGHUP; a job script may ignore others): they stay so."""
    return [s for s in signums if signal.getsignal(s) is not signal.SIG_IGN]


def stop_on_signals() -> dict[int, Any]:
    """Make each of :data:`STOP_SIGNALS` not ignored now raise :class:`Terminated`, and Ctrl-C (where Python's own
    handler has it) KeyboardInterrupt, in this process only (main thread only); returns the handlers they had, for
    :func:`restore_signals`."""
    owner = os.getpid()

    def stop(signum: int, frame: Any) -> None:
        # a loader worker forked from this process runs this handler until its worker_init_fn ignores the signal: a
        # group signal landing in between printed the worker's traceback above the command's one line
        if os.getpid() == owner:
            raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)

    previous = {signal.SIGINT: signal.getsignal(signal.SIGINT)}
    if previous[signal.SIGINT] is signal.default_int_handler:
        signal.signal(signal.SIGINT, stop)
    return previous | {s: signal.signal(s, stop) for s in _handled(STOP_SIGNALS)}


def restore_signals(previous: dict[int, Any], *, ignore: bool) -> None:
    """Put back the handlers of :func:`stop_on_signals` (Ctrl-C's among them), or, with ``ignore``, ignore those
    signals: a command that is ending (its work done, or its one line about an interruption being written) is not
    cut short by a second signal into a traceback."""
    for s, handler in previous.items():
        signal.signal(s, signal.SIG_IGN if ignore else signal.SIG_DFL if handler is None else handler)


@contextlib.contextmanager
def _noted(signums: list[int], *, again_stops: bool = False) -> Iterator[list[int]]:
    """Within the block ``signums`` only append to the yielded list (in the main thread: only it may set
    handlers; elsewhere nothing changes), then their handlers are restored. With ``again_stops`` a second Ctrl-C
    raises KeyboardInterrupt at once, unless it comes within :data:`SAME_CTRL_C_S` of the first."""
    received: list[int] = []
    first_ctrl_c: list[float] = []
    main = threading.current_thread() is threading.main_thread()

    def note(signum: int, frame: Any) -> None:
        if again_stops and signum == signal.SIGINT:
            if first_ctrl_c and time.monotonic() - first_ctrl_c[0] > SAME_CTRL_C_S:
                raise KeyboardInterrupt  # Ctrl-C twice: stop now, without what the first one waits for
            first_ctrl_c[:] = first_ctrl_c or [time.monotonic()]
        received.append(signum)

    previous = {s: signal.signal(s, note) for s in signums if main}
    try:
        yield received
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


@contextlib.contextmanager
def deferred_stop(device: torch.device) -> Iterator[Callable[[], int]]:
    """Within the block Ctrl-C and :data:`STOP_SIGNALS` only set a flag; yields ``requested()``, the number of the
    signal received (0 for none; under torchrun, a collective: the highest any rank received).

    Ctrl-C waits for the step boundary too: LSF's ``bkill`` sends SIGINT first (then SIGTERM, then SIGKILL), and
    torchrun forwards a Ctrl-C to its workers and SIGKILLs them 30 s later; a second Ctrl-C stops at once.
    """
    from bt_hub.common.distributed import max_over_ranks

    with _noted(_handled((signal.SIGINT, *STOP_SIGNALS)), again_stops=True) as received:
        yield lambda: max_over_ranks(received[0] if received else 0, device)


@contextlib.contextmanager
def held_signals() -> Iterator[None]:
    """Within the block Ctrl-C and :data:`STOP_SIGNALS` are only noted, then raised at its end (KeyboardInterrupt,
    Terminated): one landing inside ``import torch`` breaks that import into errors that no longer say they were an
    interrupt."""
    with _noted(_handled((signal.SIGINT, *STOP_SIGNALS))) as received:
        yield
    if received:
        raise KeyboardInterrupt if received[0] == signal.SIGINT else Terminated(received[0])


def ignore_group_signals(worker_id: int) -> None:
    """A DataLoader ``worker_init_fn``: the worker ignores Ctrl-C and :data:`STOP_SIGNALS`, which its main process
    handles.

    torch's workers die of a SIGTERM that their parent did not send, and the main process then fails with
    "DataLoader worker (pid ...) is killed by signal: Terminated" before it could checkpoint or answer. A worker
    that ignores them still ends when the main process shuts the loader down, or, if that process is gone, by
    torch's watch on its parent.
    """
    for signum in (signal.SIGINT, *STOP_SIGNALS):
        signal.signal(signum, signal.SIG_IGN)
