"""Run directories and atomic file writes.

Every file bt_hub writes goes through ``atomic_write`` (temp file + rename), so a
crash never leaves a half-written checkpoint or result. A run directory records the
command line, the git sha, the package version and the resolved config, and takes
JSON-lines metrics.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch


def atomic_write(path: str | os.PathLike, write: Callable[[io.BufferedWriter], None]) -> Path:
    """Write a file through ``write(fileobj)`` into a temp file beside it, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write text atomically (UTF-8)."""
    return atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Write an object as indented JSON atomically."""
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save`` atomically."""
    return atomic_write(path, lambda f: torch.save(obj, f))


def git_state() -> dict[str, Any]:
    """The git sha and dirty flag of the bt_hub checkout, or empty values outside one."""
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=here, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return {"git_sha": None, "git_dirty": None}
    if sha.returncode != 0:
        return {"git_sha": None, "git_dirty": None}
    return {"git_sha": sha.stdout.strip(), "git_dirty": bool(dirty.stdout.strip())}


def package_version() -> str:
    """The installed bt_hub version (or 'unknown' when run from an uninstalled checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bt_hub")
    except PackageNotFoundError:
        return "unknown"


def config_dict(config: Any) -> dict[str, Any]:
    """A dataclass config (or a mapping) as a plain JSON-able dict."""
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    return dict(config)


class RunDir:
    """A run directory: ``run.json`` (command, git, version, config) and ``metrics.jsonl``.

    Args:
        path: the directory (created).
        config: the resolved config dataclass, saved as the run's record.
        write: False on non-zero ranks, which must not write.
    """

    def __init__(self, path: str | os.PathLike, config: Any = None, *, write: bool = True) -> None:
        self.path = Path(path)
        self.write = write
        if write:
            self.path.mkdir(parents=True, exist_ok=True)
            record = {
                "command": sys.argv,
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "bt_hub_version": package_version(),
                "torch_version": torch.__version__,
                **git_state(),
                "config": config_dict(config) if config is not None else None,
            }
            atomic_write_json(self.path / "run.json", record)

    def log(self, row: dict[str, Any], name: str = "metrics.jsonl") -> None:
        """Append one JSON line (only on the writing rank)."""
        if not self.write:
            return
        with open(self.path / name, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, default=float) + "\n")
