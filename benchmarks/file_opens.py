"""How many times a bt-hub command opens and decodes each image file, counted in every process.

    python benchmarks/file_opens.py DATA_DIR -- eval compare --weights RUN --over-steps --data DATA_DIR ...

An audit hook (``sys.addaudithook``, inherited by the forked loader workers) logs every ``open`` of a file
under DATA_DIR, and a wrapper of PIL's ``ImageFile.load`` logs every image decoded and whether the main
process decoded it. Prints opens per file (mean, max), decodes per file and the main process's decodes.
tests/test_store.py holds bt_hub to one decode per file through this hook.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

AUDITED = textwrap.dedent(
    """
    import os, sys
    root, log = sys.argv[1], sys.argv[2]
    busy, main_pid = [False], os.getpid()

    def write(line):
        busy[0] = True
        try:
            with open(log, "a") as f:
                f.write(line + "\\n")
        finally:
            busy[0] = False

    def hook(event, args):
        if event == "open" and not busy[0] and isinstance(args[0], str) and args[0].startswith(root):
            write(f"open {os.getpid() == main_pid} {args[0]}")

    import PIL.ImageFile
    load = PIL.ImageFile.ImageFile.load

    def audited_load(self):
        if not busy[0]:
            write(f"decode {os.getpid() == main_pid} {getattr(self, 'filename', '') or '<bytes>'}")
        return load(self)

    PIL.ImageFile.ImageFile.load = audited_load
    sys.addaudithook(hook)
    from bt_hub.cli import main
    sys.exit(main(sys.argv[3:]))
    """
)


def audit(root: str | os.PathLike, argv: list[str], timeout: float = 3600) -> tuple[collections.Counter, list[str]]:
    """Run ``bt-hub argv``: (opens per file under ``root``, one ``decode <in main process> <file>`` line a decode)."""
    with tempfile.TemporaryDirectory() as work:
        log = Path(work) / "audit.log"
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
        done = subprocess.run(
            [sys.executable, "-c", AUDITED, str(Path(root).resolve()), str(log), *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode != 0:
            raise RuntimeError(f"bt-hub {' '.join(argv)} exited {done.returncode}: {done.stderr[-2000:]}")
        lines = log.read_text().splitlines() if log.exists() else []
    opens = collections.Counter(line.split(" ", 2)[2] for line in lines if line.startswith("open "))
    return opens, [line for line in lines if line.startswith("decode ")]


def main() -> None:
    if "--" not in sys.argv[1:] or sys.argv.index("--") != 2:
        sys.exit("usage: python benchmarks/file_opens.py DATA_DIR -- <bt-hub arguments>")
    root = sys.argv[1]
    files = [p for p in Path(root).rglob("*") if p.is_file() and not p.name.startswith(".")]
    opens, decodes = audit(root, sys.argv[3:])
    in_main = sum(line.startswith("decode True") for line in decodes)
    print(f"bt-hub {' '.join(sys.argv[3:])}")
    print(f"{len(files)} files under {root}")
    print(f"opens per file: mean {sum(opens.values()) / max(len(files), 1):.2f}, max {max(opens.values(), default=0)}")
    print(f"decodes per file: {len(decodes) / max(len(files), 1):.2f}; decoded in the main process: {in_main}")


if __name__ == "__main__":
    main()
