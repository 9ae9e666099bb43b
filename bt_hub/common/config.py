"""``RunConfig``: the settings every command that runs shares (``out``, ``overwrite``, device, seed,
threads), and the one device check.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import os
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import MISSING, dataclass, field
from typing import Any, ClassVar, TypeVar

import torch

from bt_hub.common import presets

C = TypeVar("C")
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


def check_image_size(size: int | None, command: str, flag: str = "--image-size") -> None:
    """Refuse an ``--image-size`` outside 2 to 2048 px (1 px breaks torch's antialiased resize and blur padding)."""
    if size is not None and not 2 <= size <= MAX_IMAGE_SIZE:
        bound = f"larger than {MAX_IMAGE_SIZE} px, the most" if size > 2 else "below 2 px, the least"
        raise ValueError(
            f"{flag} {size} is {bound} bt-hub {command} accepts (the paper uses 224); choose another {flag}"
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


def child(
    help: str,
    *,
    flat: Mapping[str, str | list[str]] | None = None,
    sets: Iterable[str] = (),
    own: Iterable[str] = (),
    **defaults: Any,
) -> Any:
    """A config field holding the config of a command this one runs (``eval compare``'s ``knn``, a ``KnnConfig``).

    Its settings are flags under its name (``--knn.k``) and a mapping under its key in a ``--config`` file
    (``knn: {k: [20]}``), except the settings named like one of this command's own (``--data``, ``--device``: this
    command's, passed down where given) and those it ``sets`` itself. ``flat`` names the flat spellings kept as
    aliases (``{"knn_k": "k"}``; ``["k"]``: one value of the list ``k``); ``own``, settings named like this command's
    that are the child's (eval all's fine-tuning batch); ``defaults``, this command's defaults for it (its
    ``preset`` among them)."""
    meta = {"flat": dict(flat or {}), "sets": tuple(sets), "own": tuple(own), "defaults": defaults}
    return field(default_factory=dict, metadata={"help": help, "child": meta})


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
    # setting -> the flag it was given by, where a command holding this config built it (``k`` -> ``--knn-k``), and
    # of a child's settings in the command holding it (``knn.k``): what ``flag`` names
    flag_names: ClassVar[Mapping[str, str]] = {}

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

    def flag(self, name: str) -> str:
        """The flag of setting ``name`` as the user gave it: ``--k``; in a command holding this config, ``--knn.k``
        or its flat alias ``--knn-k``."""
        known = {f.name: f.metadata.get("flag", f.name) for f in dataclasses.fields(self)}
        return self.flag_names.get(name) or "--" + known.get(name, name).replace("_", "-")

    def require_positive(self, *names: str, or_zero: bool = False) -> None:
        """Refuse the first field of ``names`` set below 1 (``or_zero``: below 0) in one sentence naming its flag."""
        for name in names:
            value = getattr(self, name)
            if value is not None and (value < 0 if or_zero else value <= 0):
                sign = "non-negative" if or_zero else "positive"
                raise ValueError(f"{self.flag(name)} must be {sign}, got {value}")

    def require_fraction(self, *names: str) -> None:
        """Refuse the first field of ``names`` outside (0, 1] (a share: of a crop's area, of the LR at a milestone) in
        one sentence naming its flag."""
        for name in names:
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{self.flag(name)} must be in (0, 1], got {getattr(self, name)}")

    def unused_flags(self) -> dict[str, str]:
        """Setting (``name``, or ``child`` / ``child.name`` of a child's) -> why this run would not read it; such a
        setting, when given, is refused, never ignored (:meth:`build_children`)."""
        return {}

    def shared_settings(self) -> dict[str, Any]:
        """This command's settings that a config it runs takes where it has one of their name: those given (changed
        from the defaults or preset, or required, such as ``--weights``); ``out`` is each run's own."""
        given = presets.overrides(self)
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.init
            and f.name not in ("out", *presets.children(type(self)))
            and (f.name in given or presets.required(f))
        }

    def passed_down(
        self,
        cls: type[C],
        values: Mapping[str, Any],
        *,
        own: Iterable[str] = (),
        flag_names: Mapping[str, str] | None = None,
    ) -> C:
        """A ``cls`` config this command runs: ``values`` (``preset`` among them), then this command's
        :meth:`shared_settings` that ``cls`` has (less ``own``: the child's own settings) and reads (not in its
        ``unused_flags``); its checks name its settings by ``flag_names``."""
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        shared = {k: v for k, v in self.shared_settings().items() if k in fields and k not in (*own, *values)}
        required = {k: v for k, v in shared.items() if presets.required(fields[k])}
        first = presets.build(cls, {**required, **values}, flag_names)
        trial = copy.copy(first)
        vars(trial).update(shared)
        unused = trial.unused_flags()
        return presets.build(cls, {**{k: v for k, v in shared.items() if k not in unused}, **values}, flag_names)

    def build_children(self) -> None:
        """Build each child field's config (:func:`child`) from what was given for it and this command's defaults
        and shared settings, so that its own checks run, naming its flags as given; then refuse a setting given that
        this run would not read (:meth:`unused_flags`)."""
        flag_names = dict(self.flag_names)
        for name, (cls, meta) in presets.children(type(self)).items():
            given = presets.nested(type(self), {name: getattr(self, name)})[name]
            typed = {k: given.typed.get(k, presets.child_flag(cls, name, k)) for k in presets.knobs(type(self), name)}
            values = {**meta["defaults"], **given}
            setattr(self, name, self.passed_down(cls, values, own=meta["own"], flag_names=typed))
            flag_names |= {f"{name}.{k}": flag for k, flag in typed.items()}
        self.flag_names = flag_names
        unused = self.unused_flags()
        for key in presets.overrides(self):
            why = unused.get(key) or unused.get(key.partition(".")[0])
            if why:
                raise ValueError(f"{self.flag(key)} {why}; leave it out")


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
