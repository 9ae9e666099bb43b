"""What every cache of bt_hub stands on: a content key, the stat rows of the files it was made from, a lock that
read-only storage does not need and that says who holds it, and a file built in verified segments that a killed build
continues.

A key says which changes it sees. The stat rows of a file are its name, size, mtime and ctime: any write to a
file's bytes moves its ctime to the present, and no user can set a ctime back (``touch -r`` and ``os.utime`` set
mtime and atime only; a restore from a backup writes the file, so it moves ctime too). Where a row differs but the
name does not, a cache that recorded each file's sha256 hashes the file again before calling it changed (a
``chmod`` or ``chown`` moves ctime alone).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from bt_hub.common.files import WriteError, atomic_write, file_sha256, read_json
from bt_hub.common.progress import announce

READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)  # a folder this process may not write in
SAY_WAIT_S = 3.0  # a wait on a lock longer than this says once whose lock it is


def content_key(*parts: Any) -> str:
    """The sha256 of ``parts`` as sorted JSON: a cache's key from everything that changes what it holds."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def stat_row(path: Path, root: Path) -> list[Any]:
    """``[name relative to root, size, mtime_ns, ctime_ns]`` of ``path``, from ``stat`` alone."""
    st = path.stat()
    return [path.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def stat_change(old: Sequence[Any], new: Sequence[Any]) -> str | None:
    """What differs between two stat rows of one name (``size``, ``mtime``, ``ctime``), or None."""
    for what, i in (("size", 1), ("mtime", 2), ("ctime", 3)):
        if old[i] != new[i]:
            return what
    return None


def same_content(path: Path, sha256: str) -> bool:
    """Whether ``path`` still holds the bytes whose sha256 was recorded (False when it cannot be read)."""
    try:
        return file_sha256(path) == sha256
    except OSError:
        return False


def file_entry(path: Path) -> dict[str, Any]:
    """A manifest's entry for a file a cache wrote: its name, bytes and sha256."""
    return {"file": path.name, "bytes": path.stat().st_size, "sha256": file_sha256(path)}


def entry_problem(folder: Path, entry: dict[str, Any]) -> str | None:
    """None when the file a manifest entry names (in ``folder``) is what was written; else what is wrong."""
    path = folder / str(entry.get("file"))
    try:
        size = path.stat().st_size
        if size != entry.get("bytes"):
            return f"{path} is {size} bytes, {entry.get('bytes')} were written (truncated or changed)"
        if file_sha256(path) != entry.get("sha256"):
            return f"{path} does not match the sha256 recorded when it was written (changed since)"
    except FileNotFoundError:
        return f"{path} is missing"
    except OSError as err:
        return f"{path} cannot be read ({err})"
    return None


def not_writable(folder: Path, err: OSError, flag: str) -> WriteError:
    """One sentence for a cache folder this process may not write in, naming the flag that moves it."""
    reason = os.strerror(err.errno) if err.errno else str(err)
    return WriteError(
        f"cannot write in {folder} ({reason}): the cache there is read without writing only when it is whole and "
        f"current; give {flag} a writable folder"
    )


def timestamp() -> str:
    """The local time as bt_hub's records and locks write it (``2026-11-26T07:00:00+0000``)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def record_holder(fd: int) -> None:
    """Write into the lock file open as ``fd`` who holds it (pid, host, since when, command): what a second run
    waiting for it or refused by it says. A courtesy to the next caller: the ``flock`` is what counts."""
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": timestamp(), "command": sys.argv}
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(holder).encode())


def whose(holder: Any, *, command: bool = True) -> str:
    """A lock's holder in words, from what :func:`record_holder` wrote: ``pid 4242 on host node7, started
    2026-11-26T07:00:00+0000: bt-hub eval knn --data d`` (``?`` where it is not known; without ``command``, what a
    record may hold: no command line, whose paths may be absolute)."""
    holder = holder if isinstance(holder, dict) else {}
    who = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {holder.get('started', '?')}"
    argv = holder.get("command")
    if command and isinstance(argv, list) and argv:
        line = " ".join([Path(str(argv[0])).name, *map(str, argv[1:])])
        who += f": {line[:200]}{'...' * (len(line) > 200)}"
    return who


def _take(fd: int, path: Path, said: bool) -> bool:
    """Take the exclusive ``flock`` on ``fd``, waiting as long as it takes; a wait longer than ``SAY_WAIT_S`` says
    once whose lock it is, unless ``said`` (a holder stopped with Ctrl-Z, or on a hung file system, would leave the
    waiter silent). Whether it has been said."""
    since = time.monotonic()
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return said
        except BlockingIOError:
            pass
        if not said and time.monotonic() - since >= SAY_WAIT_S:
            said = True
            announce(
                f"waiting for {path}, the lock of a cache entry another bt-hub run is writing "
                f"({whose(read_json(path))}); this run reads that entry when it is let go (a run stopped by Ctrl-Z "
                "holds it until it is continued or ended)"
            )
        time.sleep(0.1)


@contextlib.contextmanager
def locked(path: Path, flag: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created, and removed on leaving): one process builds a cache entry while
    the others wait, then read it. The holder writes who it is into the lock (:func:`record_holder`); a wait longer
    than a few seconds says so once, naming it. A waiter whose lock file was removed meanwhile locks the new one. A
    folder that may not be written in is refused in one sentence naming ``flag``."""
    said = False
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as err:
            if err.errno in READ_ONLY:
                raise not_writable(path.parent, err, flag) from None
            raise
        said = _take(fd, path, said)
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                break
        os.close(fd)
    record_holder(fd)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)


def recorded_segments(record: Path, key: str | None = None) -> list[dict[str, Any]]:
    """The segments a :class:`Segments` record lists (of ``key``, when given), up to its first unreadable line."""
    segments: list[dict[str, Any]] = []
    with contextlib.suppress(OSError, UnicodeDecodeError):
        lines = record.read_text().splitlines()
        head = json.loads(lines[0]) if lines else {}
        if key is not None and head.get("key") != key:
            return []
        for line in lines[1:]:
            try:
                segment = json.loads(line)
                segments.append(
                    {"end": int(segment["end"]), "sha256": str(segment["sha256"]), "items": segment["items"]}
                )
            except (ValueError, KeyError, TypeError):
                break  # a line a kill cut short, and whatever follows it
    return segments


class Segments:
    """A file written front to back in segments, each recorded once it is on disk: its end, the sha256 of its bytes
    and the caller's items for it, one JSON line each appended to ``<file>.progress.jsonl`` (first line: the key).

    A rerun (:meth:`open`) reads the file against the record and continues after the last segment whose bytes are
    still what was written: bytes a kill left past the record are cut, and a file cut short or changed inside a
    recorded segment loses that segment and every later one (they are made again), never read as zeros.
    """

    def __init__(self, path: Path, key: str) -> None:
        self.path, self.key = path, key
        self.record = path.with_name(path.name + ".progress.jsonl")
        self.segments: list[dict[str, Any]] = []
        self.size = 0
        self.dropped: str | None = None  # why recorded segments were not kept, when some were not
        self._hash = hashlib.sha256()
        self._pending: list[Any] = []
        self._file: Any = None
        self._log: Any = None

    @property
    def items(self) -> list[Any]:
        """The items of every kept segment, in order."""
        return [item for segment in self.segments for item in segment["items"]]

    def open(self) -> Segments:
        """Open the file, keeping what an earlier build recorded and its bytes confirm."""
        recorded = recorded_segments(self.record, self.key)
        self._file = open(self.path, "r+b" if self.path.exists() else "w+b")  # closed by close()
        start = 0
        for i, segment in enumerate(recorded):
            self._file.seek(start)
            data = self._file.read(segment["end"] - start)
            if len(data) != segment["end"] - start or hashlib.sha256(data).hexdigest() != segment["sha256"]:
                self.dropped = f"its bytes from {start:,} on are not what was recorded (cut or changed)"
                recorded = recorded[:i]
                break
            start = segment["end"]
        self.segments, self.size = recorded, start
        self._file.truncate(self.size)
        self._file.seek(self.size)
        lines = [json.dumps({"key": self.key}), *(json.dumps(segment) for segment in recorded)]
        atomic_write(self.record, lambda f: f.write("".join(line + "\n" for line in lines).encode()))
        self._log = open(self.record, "ab")  # closed by close()
        return self

    def write(self, data: memoryview | bytes, items: Sequence[Any] = ()) -> None:
        """Append ``data`` and the items it holds to the open segment."""
        self._file.write(data)
        self._hash.update(data)
        self.size += len(data)
        self._pending.extend(items)

    def commit(self) -> None:
        """Close the open segment: its bytes on disk, then its line in the record (a kill after this loses none of
        it; one during the line's write leaves a line the next :meth:`open` drops)."""
        if not self._pending and (self.segments[-1]["end"] if self.segments else 0) == self.size:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        segment = {"end": self.size, "sha256": self._hash.hexdigest(), "items": self._pending}
        self._log.write((json.dumps(segment) + "\n").encode())
        self._log.flush()
        os.fsync(self._log.fileno())
        self.segments.append(segment)
        self._hash, self._pending = hashlib.sha256(), []

    def close(self) -> None:
        """Commit the open segment and close the file; the record stays until the caller publishes the file."""
        if self._file is not None:
            self.commit()
            self._file.close()
            self._log.close()
            self._file = self._log = None
