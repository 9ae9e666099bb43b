"""The settings every command that runs shares, and their one check.

``RunConfig`` is the base of the config dataclasses of ``bt-hub pretrain``, ``eval``,
``detect`` and ``demo``: where the run writes (``out``, with ``overwrite``), on which
device, with which seed, on how many CPU threads. Each command keeps its own default
``out`` and says what it writes there; the device is checked here and nowhere else.
What a run computes from (weights, data) differs by command and lives in its config.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

OVERWRITE_HELP = "write into an --out that is not empty and was not created by bt-hub (same-named files are replaced)"


def check_device(device: str) -> None:
    """Refuse a ``--device`` that is not ``cpu``, ``cuda`` or ``cuda:N``, and CUDA where there is none."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ValueError(f"--device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device} was asked for but CUDA is not available; use --device cpu")


def out_field(default: str, help: str) -> Any:
    """The ``out`` field of a command: its default folder and what it writes there (keyword-only, as in the base)."""
    return field(default=default, kw_only=True, metadata={"help": help})


@dataclass(kw_only=True)
class RunConfig:
    """Output folder, device, seed and CPU threads of a run; subclasses set their own ``out`` default."""

    # Fields that say where or how a run executes, not what it computes: results do not list
    # them as changes from a preset (the record holds them all under "hyperparameters").
    RUN_FIELDS: ClassVar[tuple[str, ...]] = ("out", "overwrite", "device", "seed", "threads")

    out: str = field(default="runs", metadata={"help": "output directory"})
    overwrite: bool = field(default=False, metadata={"help": OVERWRITE_HELP})
    device: str = field(default="cpu", metadata={"help": "'cpu', 'cuda' or 'cuda:N' (autocast is used on CUDA)"})
    seed: int = field(default=0, metadata={"help": "seed of every random choice of the run"})
    threads: int = field(
        default=0, metadata={"help": "CPU threads of torch in this process (0: torch's default, the number of cores)"}
    )

    def __post_init__(self) -> None:
        check_device(self.device)
        if self.threads < 0:
            raise ValueError(f"--threads must be non-negative, got {self.threads}")


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the body on ``threads`` CPU threads of torch (0: leave torch's setting), then restore it."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
