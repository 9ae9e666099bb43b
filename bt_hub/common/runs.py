"""Run directories: who owns a folder (its marker and kind), who may write into it, and what it records."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from bt_hub.common.artifacts import record_holder, timestamp, whose
from bt_hub.common.config import config_dict
from bt_hub.common.files import (
    WRITTEN_BY,
    WriteError,
    atomic_write_json,
    atomic_write_text,
    open_no_follow,
    read_json,
    remove_stale_temp_files,
    safetensors_metadata,
    write_failure,
)

MARKER_NAME = ".bt_hub_run"
LOCK_NAME = ".bt_hub_run.lock"


class RunDirBusyError(RuntimeError):
    """Another live run holds the run directory's lock."""


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


def _regular_file(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def owned_by_bt_hub(path: str | os.PathLike) -> bool:
    """Whether bt_hub wrote ``path``, the one ownership rule of run folders and of the files bt_hub replaces: a folder
    holding bt_hub's marker (or a run.json / results.json an earlier bt_hub wrote); a file that says so itself (the
    safetensors metadata ``written_by: bt_hub``, a JSON record with ``bt_hub_version``, a model card whose front
    matter names ``library_name: bt_hub``)."""
    path = Path(path)
    if path.is_dir():
        return _regular_file(path / MARKER_NAME) or any(owned_by_bt_hub(path / n) for n in ("run.json", "results.json"))
    try:
        if path.suffix == ".safetensors":
            return safetensors_metadata(path).get("written_by") == WRITTEN_BY["written_by"]
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json":
            record = json.loads(text)
            return isinstance(record, dict) and "bt_hub_version" in record
        return text.startswith("---") and "library_name: bt_hub" in text.split("\n---", 1)[0]
    except (OSError, ValueError):
        return False


def run_kind(path: str | os.PathLike) -> str | None:
    """The kind of run folder ``path`` is (from its marker, else ``run.json``), or None when it records none."""
    path = Path(path)
    marker = read_json(path / MARKER_NAME) if _regular_file(path / MARKER_NAME) else None
    record = read_json(path / "run.json")
    for found in (marker, record):
        if isinstance(found, dict) and isinstance(found.get("kind"), str):
            return found["kind"]
    config = record.get("config") if isinstance(record, dict) else None
    if isinstance(config, dict) and {"projector", "lr_weights"} <= set(config):
        return "pretrain"
    return None


def lock_holder(path: str | os.PathLike) -> dict[str, Any] | None:
    """What the live run holding ``path``'s lock wrote there (pid, host, started, command; {} if unreadable), or
    None when no live process holds it (probed with a shared lock, released at once)."""
    lock = Path(path) / LOCK_NAME
    if not os.path.lexists(lock):
        return None
    fd = open_no_follow(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = read_json(lock)
        return holder if isinstance(holder, dict) else {}
    finally:
        os.close(fd)
    return None


def _busy(directory: Path, lock: Path) -> str:
    return (
        f"--out {directory} is in use by another bt-hub run ({whose(read_json(lock))}); wait for it to end or stop "
        "it, or choose another --out"
    )


def check_run_dir(path: str | os.PathLike, *, kind: str, overwrite: bool = False) -> Path:
    """Refuse, before any heavy work, an output directory a run of ``kind`` must not write into.

    ValueError for a file, a non-empty folder without bt_hub's marker (unless ``overwrite``) or of another
    kind; RunDirBusyError while a live run holds its lock; WriteError for a symbolic-link lock file.
    """
    path = Path(path)
    for ancestor in (path, *path.parents):
        if ancestor.exists() and not ancestor.is_dir():
            where = "is an existing file" if ancestor == path else f"lies under {ancestor}, which is a file"
            raise ValueError(f"--out {path} {where}; expected a directory for the run's outputs: choose another --out")
        if ancestor.exists():
            break
    if not overwrite and path.is_dir() and any(path.iterdir()) and not owned_by_bt_hub(path):
        raise ValueError(
            f"--out {path} is not empty and was not created by bt-hub (it has no {MARKER_NAME}); "
            f"choose another --out, or pass --overwrite to write into it anyway (files of the same names are replaced)"
        )
    if path.is_dir():
        if (found := run_kind(path)) not in (None, kind):
            raise ValueError(
                f"--out {path} holds a bt-hub {found} run, and bt-hub {kind} does not write into a folder of another "
                "kind of run; choose another --out"
            )
        if lock_holder(path) is not None:  # a live run holds its lock
            raise RunDirBusyError(_busy(path, path / LOCK_NAME))
    return path


def claim_run_dir(path: str | os.PathLike, *, kind: str, overwrite: bool = False) -> Path:
    """``check_run_dir``, then create the directory and its marker (idempotent) and remove stale temp files."""
    path = check_run_dir(path, kind=kind, overwrite=overwrite)
    marker = path / MARKER_NAME
    if _regular_file(marker):
        if run_kind(path) is None:  # a folder of an earlier bt_hub: from now on it says its kind
            atomic_write_json(marker, {**(read_json(marker) or {}), "kind": kind})
        remove_stale_temp_files(path)
        return path
    try:  # written in place, not atomically: its existence is what counts, even if a crash cuts its text short
        path.mkdir(parents=True, exist_ok=True)
        with open(marker, "x", encoding="utf-8") as f:  # O_EXCL: never through a symbolic link
            json.dump(
                {
                    "created_by": "bt_hub",
                    "kind": kind,
                    "bt_hub_version": package_version(),
                    "created": timestamp(),
                    "host": socket.gethostname(),
                },
                f,
            )
    except FileExistsError:
        pass
    except OSError as err:
        raise WriteError(f"could not create --out {path}: {err.strerror or err}; choose a writable --out") from err
    remove_stale_temp_files(path)
    return path


def release_claim(path: str | os.PathLike, *, created: bool) -> None:
    """Take back a claim on ``path`` under which nothing was written: its marker and lock go, and the folder too
    when the claim ``created`` it; a folder holding anything else is left as it is."""
    path = Path(path)
    if not path.is_dir() or any(p.name not in (MARKER_NAME, LOCK_NAME) for p in path.iterdir()):
        return
    for name in (LOCK_NAME, MARKER_NAME):
        (path / name).unlink(missing_ok=True)
    if created:
        with contextlib.suppress(OSError):
            path.rmdir()


@contextlib.contextmanager
def claimed_run_dir(path: str | os.PathLike, *, kind: str, overwrite: bool = False) -> Iterator[Path]:
    """:func:`claim_run_dir` for the length of a command, holding the folder's :class:`RunLock` all along (a
    second command into it fails at once, naming this one); if the command fails, a claim it made is taken back
    (:func:`release_claim`), so a failed command leaves no folder holding only bt_hub's marker."""
    path = Path(path)
    created, claimed = not os.path.lexists(path), not os.path.lexists(path / MARKER_NAME)
    new_lock = not os.path.lexists(path / LOCK_NAME)
    claim_run_dir(path, kind=kind, overwrite=overwrite)
    main = os.environ.get("RANK", "0") == "0"  # the main process claims and locks it (torchrun sets RANK)
    lock = RunLock(path) if main else None  # refused here, the claim is the live holder's: nothing taken back
    try:
        yield path
    except BaseException:
        if claimed and main:
            release_claim(path, created=created)
        elif new_lock and main:  # a folder claimed before keeps what it held, and no more
            (path / LOCK_NAME).unlink(missing_ok=True)
        raise
    finally:
        if lock is not None:
            lock.release()


class RunLock:
    """An advisory ``flock`` on ``<dir>/.bt_hub_run.lock`` holding this process's pid and host."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.path = Path(directory) / LOCK_NAME
        try:
            fd = open_no_follow(self.path, os.O_RDWR | os.O_CREAT)
        except WriteError:
            raise
        except OSError as err:  # a read-only file system or folder
            raise WriteError(
                f"--out {directory} is not writable ({err.strerror or err}: could not open its {LOCK_NAME}); "
                "choose a writable --out"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirBusyError(_busy(Path(directory), self.path)) from None
        record_holder(fd)
        self._fd: int | None = fd

    def release(self) -> None:
        """Drop the lock (also done by the kernel when the process ends)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a JSON-lines log; a last line cut short by a crash is dropped with a warning."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            if n == len(lines):
                warnings.warn(
                    f"{path}: dropped its last line, cut short by an interrupted write ({line[:40]!r}...)", stacklevel=2
                )
                break
            raise ValueError(
                f"{path} line {n} is not JSON; fix or delete that line (expected one JSON object per line)"
            ) from None
    return rows


class RunDir:
    """A run directory: ``run.json`` (command, host, git, version, config, later starts) and JSON-lines logs."""

    def __init__(
        self,
        path: str | os.PathLike,
        config: Any = None,
        *,
        write: bool = True,
        overwrite: bool | None = None,
        lock: bool = False,
        kind: str,
        claimed: bool = False,
    ) -> None:
        self.path = Path(path)
        self.write = write
        self.kind = kind
        self._lock: RunLock | None = None
        self._started = False
        self.run_id = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}-{os.urandom(3).hex()}"
        self._new = not self.path.exists()  # created by this claim: removed again if the run fails before it starts
        if not write:
            return
        if not claimed:  # ``claimed``: the command holds the folder already (claimed_run_dir), lock and all
            claim_run_dir(
                self.path,
                overwrite=bool(getattr(config, "overwrite", False)) if overwrite is None else overwrite,
                kind=self.kind,
            )
        if lock:
            self._lock = RunLock(self.path)
        if config is not None:
            self.start(config)

    @classmethod
    def for_training(cls, path: str | os.PathLike, *, kind: str, overwrite: bool = False) -> RunDir:
        """Called by every rank: the main process claims and locks ``path``; if that fails every rank raises."""
        from bt_hub.common.distributed import broadcast_object, is_main_process

        run, error = None, None
        if is_main_process():
            try:
                run = cls(path, write=True, overwrite=overwrite, lock=True, kind=kind)
            except (ValueError, RuntimeError, OSError) as err:
                error = err
        error = broadcast_object(error)
        if error is not None:
            raise error
        return run if run is not None else cls(path, write=False, kind=kind)

    def start(
        self, config: Any, step: int | None = None, *, fresh: bool = False, facts: Mapping[str, Any] | None = None
    ) -> None:
        """Record this start in ``run.json``; with ``step`` (the step it resumes from) cut ``metrics.jsonl`` back to it.

        Later starts go to its ``resumes`` (or ``runs``) list; a ``fresh`` one keeps earlier ones under ``replaced``.
        ``facts`` are what this start decided beyond its config (e.g. why ``--precision auto`` chose what it did).
        """
        if not self.write:
            return
        self._started = True
        path = self.path / "run.json"
        record = read_json(path)
        now = {
            "command": sys.argv,
            "started": timestamp(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "bt_hub_version": package_version(),
            **git_state(),
            "run_id": self.run_id,
            "config": config_dict(config) if config is not None else None,
            **(facts or {}),
        }
        earlier = isinstance(record, dict) and "started" in record
        if earlier and not fresh and step is None:
            record.setdefault("runs", []).append(now)
        elif earlier and not fresh:
            changed = {k: v for k, v in (now["config"] or {}).items() if (record.get("config") or {}).get(k) != v}
            record.setdefault("resumes", []).append({**now, "config": changed, "resumed_from_step": step})
        else:
            replaced = [*record.pop("replaced", []), record] if earlier else []
            record = {**now, "kind": self.kind, "torch_version": torch.__version__}
            if replaced:
                record["replaced"] = replaced
        atomic_write_json(path, record)
        if step is not None:
            self.truncate_log(step)

    def truncate_log(self, step: int, name: str = "metrics.jsonl") -> None:
        """Keep exactly the rows with ``step`` at most ``step`` (the rest will be logged again by a resumed run)."""
        path = self.path / name
        if not self.write or not path.exists():
            return
        rows = read_jsonl(path) if step > 0 else []
        atomic_write_text(path, "".join(json.dumps(r, default=float) + "\n" for r in rows if r.get("step", 0) <= step))

    def log(self, row: dict[str, Any], name: str = "metrics.jsonl") -> None:
        """Append one JSON line (only on the writing rank); a failed append leaves the file as it was."""
        if not self.write:
            return
        path = self.path / name
        data = (json.dumps({**row, "run_id": self.run_id}, default=float) + "\n").encode("utf-8")
        fd = open_no_follow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            size = os.fstat(fd).st_size
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            except OSError as err:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)
                raise write_failure(path, err) from err
        finally:
            os.close(fd)

    def close(self) -> None:
        """Release the directory's lock (if this run holds it)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        self.close()
        if exc_type is not None and self.write and self._new and not self._started:
            release_claim(self.path, created=True)  # a check failed before anything but its marker was written
