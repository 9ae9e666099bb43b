"""``RunConfig``: the settings every command that runs shares (``out``, ``overwrite``, device, seed,
threads), where each setting came from (:class:`Origin`), the configs a composite command holds (:func:`child`),
and the one device check.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import re
import sys
import typing
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import MISSING, dataclass, field
from typing import Any, ClassVar, TypeVar

import torch

from bt_hub.common.presets import (
    SettingError,
    check_values,
    preset_values,
    presets_of,
    required,
    shown,
    unknown_setting,
)

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


def check_seed(seed: int) -> None:
    """Refuse a seed that is not an integer from 0 to 2**32 - 1 (the range every seeded library accepts)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise ValueError(f"--seed must be an integer from 0 to {SEED_MAX}, got {shown(seed)}")


def check_out(out: str) -> None:
    """Refuse an output folder that is empty (the working directory) or holds a NUL byte (no file system takes it)."""
    if not str(out).strip():
        raise ValueError("--out must name a directory, got an empty string")
    if "\0" in str(out):
        raise ValueError(f"--out must be a path without NUL bytes, got {str(out)!r}")


def check_image_size(size: int | None, command: str, flag: str = "--image-size") -> None:
    """Refuse an ``--image-size`` outside 2 to 2048 px (1 px breaks torch's antialiased resize and blur padding)."""
    if size is not None and not 2 <= size <= MAX_IMAGE_SIZE:
        bound = f"larger than {MAX_IMAGE_SIZE} px, the most" if size > 2 else "below 2 px, the least"
        raise ValueError(
            f"{flag} {size} is {bound} bt-hub {command} accepts (the paper uses 224); choose another {flag}"
        )


def option(default: Any, help: str, **metadata: Any) -> Any:
    """A config field that is a flag: its default (``REQUIRED`` for none; a list is copied for each config), its
    ``--help`` text and the rest of its ``metadata`` (``flag``, ``aliases``, ``choices``, ``positional``, ``nargs``:
    how the command line spells and parses it)."""
    if isinstance(default, list):
        return field(default_factory=default.copy, metadata={"help": help, **metadata})
    return field(default=default, metadata={"help": help, **metadata})


def child(help: str, *, sets: Iterable[str] = (), own: Iterable[str] = (), **defaults: Any) -> Any:
    """A config field holding the config of a command this one runs (``eval compare``'s ``knn``, a ``KnnConfig``).

    Its settings are flags under its name (``--knn.k``) and a mapping under its key in a ``--config`` file
    (``knn: {k: [20]}``), except the settings named like one of this command's own (``--data``, ``--device``: this
    command's, passed down where given) and those it ``sets`` itself. ``own`` names settings named like this
    command's that are the child's (eval all's fine-tuning batch); ``defaults``, this command's defaults for it (its
    ``preset`` among them)."""
    meta = {"sets": tuple(sets), "own": tuple(own), "defaults": defaults}
    return field(default_factory=dict, metadata={"help": help, "child": meta})


def children(cls: type) -> dict[str, tuple[type, Mapping[str, Any]]]:
    """The child fields of a config class (:func:`child`): name -> (its config class, metadata)."""
    found = [f for f in dataclasses.fields(cls) if "child" in f.metadata]
    hints = typing.get_type_hints(cls) if found else {}
    return {f.name: (hints[f.name], f.metadata["child"]) for f in found}


def knobs(cls: type, name: str) -> list[str]:
    """The settings child ``name`` of ``cls`` takes as its own flags: its fields less ``config_file``, those ``cls``
    sets itself and those named like a field of ``cls`` but ``preset`` (unless they are the child's ``own``)."""
    child, meta = children(cls)[name]
    taken = {f.name for f in dataclasses.fields(cls)} - {"preset", *meta["own"]} | {"config_file", *meta["sets"]}
    return [f.name for f in dataclasses.fields(child) if f.init and f.name not in taken]


def out_field(default: str, help: str) -> Any:
    """The ``out`` field of a command: its default folder and what it writes there (keyword-only, as in the base)."""
    return field(default=default, kw_only=True, metadata={"help": help})


@dataclass(frozen=True)
class Origin:
    """Where a config's settings came from, kept by ``dataclasses.replace`` (a field of :class:`RunConfig`): the
    prefix of its flags in the command holding it (``knn.``: ``--knn.k``); each setting given, by the flag as typed
    (``--knn-k``) or by the ``--config`` file (its name, ``run.yaml``: records hold no absolute path), the last one
    given; and the settings it inherited from the command holding it. The Python API gives none."""

    prefix: str = ""
    given: Mapping[str, str] = field(default_factory=dict)
    inherited: frozenset[str] = frozenset()

    def file(self, name: str) -> str:
        """The ``--config`` file that set setting ``name`` (its name), else ``""``."""
        where = self.given.get(name, "")
        return "" if where.startswith("--") else where

    def key(self, name: str) -> str:
        """How a check of its type names setting ``name``: ``key knn.k of run.yaml`` where a file set it, else
        ``knn.k``."""
        return f"key {self.prefix}{name} of {self.file(name)}" if self.file(name) else self.prefix + name

    def flag(self, name: str, spelled: str | None = None) -> str:
        """How a message names setting ``name`` (whose flag is ``--spelled``, by default ``--name``): the flag as
        typed, its key where a file set it, else its flag under the prefix (``--knn.k``)."""
        if name in self.given:
            return self.key(name) if self.file(name) else self.given[name]
        return "--" + f"{self.prefix}{spelled or name}".replace("_", "-")


def from_preset(cls: type[C], name: str | None = None, /, **given: Any) -> C:
    """A ``cls`` config (the Python API's): dataclass defaults, then preset ``name`` (default: the ``preset`` field's
    default, else none: the plain defaults), then ``given``, each checked against its field's type (a child's
    settings as a mapping, ``knn={"k": [5]}``)."""
    given = dict(given)
    name = given.pop("preset", name)
    return build(cls, check_values(cls, given, literals=False), preset=name)


def build(cls: type[C], values: Mapping[str, Any], *, preset: Any = None, origin: Origin | None = None) -> C:
    """A ``cls`` config of ``values`` checked against their fields' types (:func:`from_preset`, a ``--config``
    file, the flags) over preset ``preset``'s (``preset`` among ``values`` or apart), where ``origin`` says they came
    from (for a config that keeps it: :class:`RunConfig`)."""
    values = dict(values)
    name = values.pop("preset", preset)
    if name is not None and not isinstance(name, str):
        raise SettingError(f"preset must be the name of a preset (a string), got {shown(name)}")
    field = next((f for f in dataclasses.fields(cls) if f.name == "preset"), None)
    if name is None and field is not None and field.default is not MISSING:
        name = field.default  # the preset used when none is named
    flag = "--preset" if origin is None else origin.flag("preset")
    given = merged(preset_values(cls, name, flag) if name is not None else {}, values)
    if name is not None and field is not None:
        given["preset"] = name
    config = cls(**given, **({} if origin is None else {"origin": origin}))
    named = str if origin is None else origin.key  # what __post_init__ let through of a Literal field's values:
    check_values(cls, {k: getattr(config, k) for k in values}, named, "only")
    return config


def merged(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of ``layers`` in one, each over the ones before it; a child's (a mapping) key by key."""
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            both = isinstance(value, Mapping) and isinstance(out.get(key), Mapping)
            out[key] = {**out[key], **value} if both else value
    return out


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
    origin: Origin = field(default_factory=Origin, repr=False, compare=False)  # not a setting: where they came from

    def __post_init__(self) -> None:
        if self.out is not None:  # None: the Python API writes no folder
            check_out(self.out)
        check_device(self.device)
        check_seed(self.seed)
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or not 0 <= self.threads <= THREADS_MAX:
            raise ValueError(
                f"--threads must be an integer from 0 (torch's default) to {THREADS_MAX}, got {shown(self.threads)}"
            )
        if not 0 <= (workers := getattr(self, "num_workers", 0)) <= THREADS_MAX:  # each one a forked process
            raise ValueError(f"--num-workers must be an integer from 0 to {THREADS_MAX}, got {shown(workers)}")

    def given_from(self, name: str, flag: str) -> str:
        """Where setting ``name``, given, came from: the ``--config`` file by its name where that file set it (or the
        command holding this config had it from one), else ``flag``."""
        return self.origin.file(name) or flag

    def flag(self, name: str) -> str:
        """The flag of setting ``name`` as the user gave it (:meth:`Origin.flag`): ``--k``; in a command holding this
        config, ``--knn.k`` or ``--knn-k`` as typed; ``knn.k``: child ``knn``'s setting ``k``."""
        child, _, name = name.rpartition(".")
        if child:
            return getattr(self, child).flag(name)
        return self.origin.flag(
            name, next((f.metadata.get("flag") for f in dataclasses.fields(self) if f.name == name), None)
        )

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
        setting, when given, is refused, never ignored (:meth:`settle`)."""
        return {}

    def shared_settings(self) -> dict[str, Any]:
        """This command's settings that a config it runs takes where it has one of their name: those given (changed
        from the defaults or preset, or required, such as ``--weights``); ``out`` is each run's own."""
        given = overrides(self)
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.init and f.name not in ("out", *children(type(self))) and (f.name in given or required(f))
        }

    def passed_down(
        self,
        cls: type[C],
        values: Mapping[str, Any],
        *,
        child: str = "",
        own: Iterable[str] = (),
        given: Mapping[str, str] | None = None,
    ) -> C:
        """A ``cls`` config this command runs, built once: ``values`` (``preset`` among them) over the
        :meth:`shared_settings` it inherits (those ``cls`` has, less ``own``: its own of the same name), each with
        where it came from; as ``child``, its flags are ``--child.*`` (``given``: where its own values came from)."""
        fields = {f.name for f in dataclasses.fields(cls) if f.init}
        inherited = {k: v for k, v in self.shared_settings().items() if k in fields and k not in (*own, *values)}
        prefix = f"{child}." if child else ""
        where = {k: v for k, v in self.origin.given.items() if k in inherited}
        where |= {k.removeprefix(prefix): v for k, v in self.origin.given.items() if child and k.startswith(prefix)}
        origin = Origin(prefix, {**where, **(given or {})}, frozenset(inherited))
        return build(cls, {**inherited, **values}, origin=origin)

    def build_children(self) -> None:
        """Build each child field's config (:func:`child`) once, from what was given for it over this command's
        defaults for it, with the shared settings it inherits (:meth:`passed_down`); then :meth:`settle`."""
        for name, (cls, meta) in children(type(self)).items():
            given, where, names = getattr(self, name), {}, knobs(type(self), name)
            if isinstance(given, cls):  # built for another command (the demo's, handed to compare): its settings
                where = {k: v for k, v in given.origin.given.items() if k in names}
                given = {k: getattr(given, k) for k in names}
            for key in given:
                if key not in names:
                    known = {f.name: f for f in dataclasses.fields(cls) if f.name in names}
                    raise SettingError(unknown_setting(f"{name}.{key}", known, self.origin.key, name))
            values = {**meta["defaults"], **given}
            setattr(self, name, self.passed_down(cls, values, child=name, own=meta["own"], given=where))
        self.settle()

    def settle(self) -> None:
        """Refuse a setting given that this run would not read (:meth:`unused_flags`), naming its flag; one inherited
        from the command holding this config goes back to its preset's value: the run reads and records its own."""
        unused, preset = self.unused_flags(), getattr(self, "preset", None)
        for key in overrides(self):
            why = unused.get(key) or unused.get(key.partition(".")[0])
            if why and key in self.origin.inherited:
                setattr(self, key, baseline(type(self), preset if preset in presets_of(type(self)) else None)[key])
            elif why:
                raise ValueError(f"{self.flag(key)} {why}; leave it out")


def baseline(cls: type, name: str | None) -> dict[str, Any]:
    """Every field's value under preset ``name`` alone (fields without a default, child configs and the
    :class:`Origin` are left out)."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            values[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            values[f.name] = f.default_factory()
    if name is not None:
        values.update(preset_values(cls, name))
    return {k: v for k, v in values.items() if k not in children(cls) and k != "origin"}


def child_defaults(cls: type, name: str, preset: str | None = None, child_preset: str | None = None) -> dict[str, Any]:
    """What ``cls`` (under its preset ``preset``) gives its child ``name`` where nothing is given: its defaults for
    the child and its preset's (the child's ``preset`` among them), over the child class's defaults under that
    preset (or ``child_preset``, the one the child was given)."""
    child, meta = children(cls)[name]
    given = {**meta["defaults"], **(preset_values(cls, preset).get(name, {}) if preset in presets_of(cls) else {})}
    expected = given.pop("preset", baseline(child, None).get("preset"))
    return {**baseline(child, child_preset or expected), **given, "preset": expected}


def overrides(config: Any, ignore: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
    """``{field: {"value": run's value, "preset": the preset's value, "from": where it came from}}`` for every field
    that differs; a child's settings under ``child.name`` (against this config's defaults for it, its own preset
    apart). ``from`` is the flag as typed or the ``--config`` file (:class:`Origin`), where the config knows it.

    The preset is ``config.preset`` when the config has one, else the defaults; ``ignore`` names fields
    that say where or how a run executes rather than what it computes.
    """
    cls = type(config)
    name = getattr(config, "preset", None)
    name = name if name in presets_of(cls) else None
    reference = baseline(cls, name)
    compared = set(reference) - set(ignore) - {"preset"}
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(cls) if f.name in compared}
    given = dict(config.origin.given) if isinstance(config, RunConfig) else {}
    for child in (c for c in children(cls) if dataclasses.is_dataclass(getattr(config, c))):
        settings = getattr(config, child)  # its settings against its own preset's, its preset against the expected
        expected = child_defaults(cls, child, name, getattr(settings, "preset", None))
        for knob in knobs(cls, child):
            values[f"{child}.{knob}"], reference[f"{child}.{knob}"] = getattr(settings, knob), expected.get(knob)
        given |= {f"{child}.{knob}": where for knob, where in settings.origin.given.items()}
    changed = {k: {"value": v, "preset": reference[k]} for k, v in values.items() if not _same(v, reference[k])}
    return {k: {**v, "from": given[k]} if k in given else v for k, v in changed.items()}


def config_dict(config: Any) -> dict[str, Any]:
    """A dataclass config as a plain dict, a child config as the mapping of its own settings (what ``--config``
    reads back); a mapping or a namespace as a dict."""
    if not dataclasses.is_dataclass(config):
        return dict(config) if hasattr(config, "keys") else dict(vars(config))
    cls, kids = type(config), children(type(config))
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(cls) if f.name != "origin"}
    return {k: {n: getattr(v, n) for n in knobs(cls, k)} if k in kids else v for k, v in values.items()}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return a == b


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
