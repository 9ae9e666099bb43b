"""How far a reader follows a command's config: the functions that receive it, from the CLI to the records written.

Runs one ``bt-hub`` command under a profiler and lists, in the order they are first called, the library functions
that take the command's config as an argument, from the parsed flags on: an instance of its config class, or of the
class of a child whose flags the command line gives (``--knn.k``'s owner, ``KnnConfig``, under ``eval compare``); an
object holding one as ``.config``, such as the ``EvalRun``; or, before there is a config, the parsed flags or a
mapping of settings that carries such a child's flag (``knn.k``, or ``knn: {k: ...}``). ``--to FUNCTION`` ends the
path at the first call of that function, the last stop (where a knob ends: ``--to knn_hits`` for ``--knn.k``). A
*module visit* is a stretch of that list in one module: reading the path top to bottom, each visit is one more file
to open. Prints the path, the visits and the modules.

    python benchmarks/config_path.py eval knn --weights RUN --data digits --out /tmp/knn
    python benchmarks/config_path.py --to knn_hits eval compare --weights RUN --knn.k 5 --out /tmp/compare
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Any

from bt_hub import cli

ROOT = Path(cli.__file__).resolve().parents[1]
LIBRARY = (str(ROOT / "bt_hub"), str(ROOT / "eval"))


def config_classes(argv: list[str]) -> tuple[type, ...]:
    """The config class of ``bt-hub ARGV`` and those of the children whose flags ARGV gives (``--knn.k``: knn's)."""
    _, command, _ = cli._resolve(argv)
    if not isinstance(command, cli.Command):
        raise SystemExit(f"{' '.join(argv) or '(nothing)'} names no bt-hub command; see --help")
    config_class = getattr(importlib.import_module(command.module), command.config)
    hints, given = typing.get_type_hints(config_class), {child for child, _ in child_flags(argv)}
    children = [f.name for f in dataclasses.fields(config_class) if "child" in f.metadata and f.name in given]
    return (config_class, *(hints[name] for name in children))


def child_flags(argv: list[str]) -> list[tuple[str, str]]:
    """(child, setting) of each child's flag ARGV gives: ``--knn.k`` -> ``("knn", "k")``."""
    flags = [word[2:].partition("=")[0] for word in argv if word.startswith("--") and "." in word]
    return [tuple(flag.replace("-", "_").split(".", 1)) for flag in flags]  # type: ignore[misc]


def follow(argv: list[str], to: str | None = None) -> list[tuple[str, str]]:
    """(module file, function) of every library function that received the config, in first-call order, up to the
    first call of ``to``."""
    found: dict[tuple[str, str], None] = {}
    classes = config_classes(argv)
    arrived: list[bool] = []

    knobs = child_flags(argv)

    def carries_flag(value: Any) -> bool:
        values = vars(value) if isinstance(value, argparse.Namespace) else value
        if not isinstance(values, Mapping):
            return False
        return any(f"{c}.{k}" in values or isinstance(values.get(c), Mapping) and k in values[c] for c, k in knobs)

    def holds_config(value: Any) -> bool:
        return isinstance(value, classes) or isinstance(getattr(value, "config", None), classes) or carries_flag(value)

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if arrived or event != "call" or not code.co_filename.startswith(LIBRARY):
            return
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if code.co_name == to or any(holds_config(frame.f_locals.get(name)) for name in names):
            found[(code.co_filename, code.co_qualname)] = None
        if code.co_name == to:
            arrived.append(True)

    sys.setprofile(profile)
    try:
        code = cli.main(argv)
    finally:
        sys.setprofile(None)
    if code != 0:
        raise SystemExit(f"bt-hub {' '.join(argv)} exited {code}")
    return [(str(Path(f).relative_to(ROOT)), name) for f, name in found]


def main() -> None:
    """Print the path of ``bt-hub ARGV``'s config (``--to FUNCTION``: up to that function), its module visits and
    its modules."""
    argv = sys.argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        raise SystemExit(__doc__)
    to = argv[1] if argv[:1] == ["--to"] else None
    path = follow(argv[2:] if to else argv, to)
    visits = [m for i, (m, _) in enumerate(path) if i == 0 or path[i - 1][0] != m]
    for module, function in path:
        print(f"  {module}: {function}")
    print(f"{len(visits)} module visits in {len(set(visits))} modules: {' -> '.join(visits)}")


if __name__ == "__main__":
    main()
