"""``RunConfig``: the settings every command that runs shares (``out``, ``overwrite``, device, seed,
threads), and the one device check.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import MISSING, dataclass, field
from typing import Any, ClassVar

import torch

REQUIRED: Any = MISSING  # the default of an ``option`` the command cannot run without
OVERWRITE_HELP = "write into an --out that is not empty and was not created by bt-hub (same-named files are replaced)"


SEED_MAX = 2**32 - 1  # numpy's legacy seeding takes 32 bits; torch, random and seed + epoch sums stay in range
THREADS_MAX = 1024
MAX_IMAGE_SIZE = 2048  # largest --image-size: batches are N x 3 x size^2 floats; the paper uses 224


def check_device(device: str) -> None:
    """Refuse a ``--device`` that is not ``cpu``, ``cuda`` or ``cuda:N``, CUDA where there is none, a missing GPU."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ValueError(f"--device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device} was asked for but CUDA is not available; use --device cpu")
    if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        raise ValueError(
            f"--device {device} names GPU {device[5:]} but this machine has {torch.cuda.device_count()} "
            f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})"
        )


def check_seed(seed: int, flag: str = "--seed") -> None:
    """Refuse a seed that is not an integer from 0 to 2**32 - 1 (the range every seeded library accepts)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise ValueError(f"{flag} must be an integer from 0 to {SEED_MAX}, got {_shown(seed)}")


def check_out(out: str, flag: str = "--out") -> None:
    """Refuse an output folder that is empty (the working directory) or holds a NUL byte (no file system takes it)."""
    if not str(out).strip():
        raise ValueError(f"{flag} must name a directory, got an empty string")
    if "\0" in str(out):
        raise ValueError(f"{flag} must be a path without NUL bytes, got {str(out)!r}")


def check_image_size(size: int | None, command: str) -> None:
    """Refuse an ``--image-size`` outside 2 to 2048 px (1 px breaks torch's antialiased resize and blur padding)."""
    if size is not None and not 2 <= size <= MAX_IMAGE_SIZE:
        bound = f"larger than {MAX_IMAGE_SIZE} px, the most" if size > 2 else "below 2 px, the least"
        raise ValueError(
            f"--image-size {size} is {bound} bt-hub {command} accepts (the paper uses 224); choose another --image-size"
        )


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{text[:12]}...{text[-6:]} ({len(text)} characters)" if len(text) > 30 else text


def option(default: Any, help: str, **metadata: Any) -> Any:
    """A config field that is a flag: its default (``REQUIRED`` for none; a list is copied for each config), its
    ``--help`` text and the rest of its ``metadata`` (``flag``, ``aliases``, ``choices``, ``positional``, ``nargs``:
    how the command line spells and parses it)."""
    if isinstance(default, list):
        return field(default_factory=default.copy, metadata={"help": help, **metadata})
    return field(default=default, metadata={"help": help, **metadata})


def out_field(default: str, help: str) -> Any:
    """The ``out`` field of a command: its default folder and what it writes there (keyword-only, as in the base)."""
    return field(default=default, kw_only=True, metadata={"help": help})


@dataclass(kw_only=True)
class RunConfig:
    """Output folder, device, seed and CPU threads of a run; subclasses set their own ``out`` default."""

    # Fields that say where or how a run executes, not what it computes: results do not list
    # them as changes from a preset (the record holds them all under "hyperparameters").
    RUN_FIELDS: ClassVar[tuple[str, ...]] = ("out", "overwrite", "device", "seed", "threads", "config_file")

    out: str | None = option("runs", "output directory")
    overwrite: bool = option(False, OVERWRITE_HELP)
    device: str = option("cpu", "'cpu', 'cuda' or 'cuda:N' (autocast is used on CUDA)")
    seed: int = option(0, "seed of every random choice of the run")
    threads: int = option(0, "CPU threads of torch in this process (0: torch's default, the number of cores)")
    config_file: str | None = option(
        None, "the YAML file of settings that --config read (recorded with them)", flag="config"
    )
    # the settings that file set and no flag overrode (set where --config is read): given_from names the file for them
    file_settings: ClassVar[frozenset[str]] = frozenset()

    def __post_init__(self) -> None:
        if self.out is not None:  # None: the Python API writes no folder
            check_out(self.out)
        check_device(self.device)
        check_seed(self.seed)
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or not 0 <= self.threads <= THREADS_MAX:
            raise ValueError(
                f"--threads must be an integer from 0 (torch's default) to {THREADS_MAX}, got {_shown(self.threads)}"
            )
        if not 0 <= (workers := getattr(self, "num_workers", 0)) <= THREADS_MAX:  # each one a forked process
            raise ValueError(f"--num-workers must be an integer from 0 to {THREADS_MAX}, got {_shown(workers)}")

    def given_from(self, name: str, flag: str) -> str:
        """Where setting ``name``, given, came from: the ``--config`` file by its name (``run.yaml``: a record holds
        no absolute path) where that file set it, else ``flag``."""
        return os.path.basename(self.config_file) if self.config_file and name in self.file_settings else flag

    def require_positive(self, *names: str, or_zero: bool = False) -> None:
        """Refuse the first field of ``names`` set below 1 (``or_zero``: below 0) in one sentence naming its flag."""
        for name in names:
            value = getattr(self, name)
            if value is not None and (value < 0 if or_zero else value <= 0):
                sign = "non-negative" if or_zero else "positive"
                raise ValueError(f"--{name.replace('_', '-')} must be {sign}, got {value}")

    def require_fraction(self, *names: str) -> None:
        """Refuse the first field of ``names`` outside (0, 1] (a share: of a crop's area, of the LR at a milestone) in
        one sentence naming its flag."""
        for name in names:
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"--{name.replace('_', '-')} must be in (0, 1], got {getattr(self, name)}")


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


GLIBC_MMAP_MAX, GLIBC_TRIM_THRESHOLD = -4, -1  # mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Have glibc's malloc reuse freed memory instead of handing each large block back to the kernel.

    glibc serves every block over 32 MiB with a fresh ``mmap`` and unmaps it when freed, so each step's weight
    casts, gradients and activations come back as new pages the kernel must zero: on a CPU that was a quarter
    of a pretraining step. Served from the heap and never trimmed, they are reused; the process keeps its peak
    memory. Linux with glibc only, and not where the user set ``MALLOC_MMAP_MAX_`` or ``MALLOC_TRIM_THRESHOLD_``;
    True if applied.
    """
    if not sys.platform.startswith("linux") or {"MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_"} & set(os.environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mallopt(GLIBC_MMAP_MAX, 0)) and bool(mallopt(GLIBC_TRIM_THRESHOLD, 2**31 - 1))
