"""How far a reader follows a command's config: the functions that receive it, from the CLI to the records written.

Runs one ``bt-hub`` command under a profiler and lists, in the order they are first called, the library functions
that take the command's config (an instance of its config class, or an object holding it as ``.config``, such as
the ``EvalRun``) as an argument. A *module visit* is a stretch of that list in one module: reading the path top to
bottom, each visit is one more file to open. Prints the path, the visits and the modules.

    python benchmarks/config_path.py eval knn --weights RUN --data digits --out /tmp/knn
    python benchmarks/config_path.py eval compare --weights RUN --over-steps --data digits --out /tmp/curve
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import FrameType
from typing import Any

from bt_hub import cli

ROOT = Path(cli.__file__).resolve().parents[1]
LIBRARY = (str(ROOT / "bt_hub"), str(ROOT / "eval"))


def follow(argv: list[str]) -> list[tuple[str, str]]:
    """(module file, function) of every library function that received the config, in first-call order."""
    found: dict[tuple[str, str], None] = {}
    config_class: list[type] = []

    def holds_config(value: Any) -> bool:
        if not config_class:
            return False
        return isinstance(value, config_class[0]) or isinstance(getattr(value, "config", None), config_class[0])

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if event == "return" and code.co_name == "build_config" and not config_class:
            config_class.append(type(arg))
            found[(code.co_filename, code.co_name)] = None
        if event != "call" or not code.co_filename.startswith(LIBRARY):
            return
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if any(holds_config(frame.f_locals.get(name)) for name in names):
            found[(code.co_filename, code.co_qualname)] = None

    sys.setprofile(profile)
    try:
        code = cli.main(argv)
    finally:
        sys.setprofile(None)
    if code != 0:
        raise SystemExit(f"bt-hub {' '.join(argv)} exited {code}")
    return [(str(Path(f).relative_to(ROOT)), name) for f, name in found]


def main() -> None:
    """Print the path of ``bt-hub ARGV``'s config, its module visits and its modules."""
    path = follow(sys.argv[1:])
    visits = [m for i, (m, _) in enumerate(path) if i == 0 or path[i - 1][0] != m]
    for module, function in path:
        print(f"  {module}: {function}")
    print(f"{len(visits)} module visits in {len(set(visits))} modules: {' -> '.join(visits)}")


if __name__ == "__main__":
    main()
