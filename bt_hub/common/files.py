"""Files written atomically (never through a symbolic link) and read without executing code."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import json
import os
import pickle
import re
import secrets
import warnings
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

# the temp names of atomic_write (and of earlier versions, which used tempfile.mkstemp)
TEMP_FILE = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")
_FULL = {errno.ENOSPC: "no space is left on the device", errno.EDQUOT: "the disk quota is exceeded"}
FULL = (*_FULL, errno.EFBIG)  # a write that stopped for want of space (or of the size a process may write)
# the metadata that marks a safetensors file as bt_hub's (so bt_hub may replace it)
WRITTEN_BY = {"written_by": "bt_hub"}


class WriteError(OSError):
    """A file could not be written; the message names it, the reason and the fix (``errno`` is the cause's)."""


def write_failure(path: Path, err: OSError, kept: str | None = None) -> WriteError:
    """One sentence for an OSError met while writing ``path`` (what happened, what to do, what was kept: ``kept``,
    else whether ``path`` is as it was)."""
    if err.errno in _FULL:
        fix = f"{_FULL[err.errno]}; free space on the file system of {path.parent} and run again"
    elif err.errno == errno.EFBIG:
        fix = "the file is larger than this process may write (ulimit -f); raise the limit and run again"
    else:
        fix = f"{err.strerror or err}; check that {path.parent} is writable"
    kept = kept or (f"the previous {path.name} is unchanged" if path.exists() else "nothing was written")
    failure = WriteError(f"could not write {path}: {fix} ({kept})")
    failure.errno = err.errno
    return failure


def symlink_refused(path: Path) -> WriteError:
    """One sentence refusing to write through (or over) the symbolic link at ``path``."""
    try:
        target = f" (to {os.readlink(path)})"
    except OSError:
        target = ""
    return WriteError(
        f"refused to write {path}: it is a symbolic link{target}, which bt_hub neither follows nor replaces; "
        "remove the link and run again"
    )


def open_no_follow(path: str | os.PathLike, flags: int, mode: int = 0o666) -> int:
    """``os.open`` that refuses (``WriteError``) a symbolic link at ``path``: for files bt_hub writes in place."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise symlink_refused(Path(path)) from None
        raise


def _os_error(err: BaseException) -> OSError | None:
    """The OSError behind ``err``: itself, or one torch wrapped (torch.save reports it as a RuntimeError)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _open_temp(path: Path) -> tuple[Path, int]:
    """A new temp file beside ``path`` (mode 0666, so that the umask applies), ``flock``-ed: a live writer's."""
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        except FileExistsError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_nlink:  # not removed as a leftover in the moment before the lock
                return tmp, fd
        except BaseException:  # Ctrl-C included: the file goes with the fd
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            os.close(fd)
            raise
        os.close(fd)
    raise FileExistsError(f"could not create a temp file beside {path}")


def remove_stale_temp_files(path: str | os.PathLike, *, of: str | None = None) -> list[Path]:
    """Delete (and return) the temp files interrupted atomic writes left in ``path`` (of the file named ``of``
    only, when given) that no live writer holds.

    Whatever their age: a writer locks its temp file before writing and starts again if it was removed first.
    """
    removed = []
    folder = Path(path)
    entries = list(folder.iterdir()) if folder.is_dir() and not folder.is_symlink() else []
    for entry in entries:
        if not TEMP_FILE.match(entry.name) or entry.is_symlink() or not entry.is_file():
            continue
        if of is not None and entry.name.rsplit(".", 2)[0] != f".{of}":
            continue
        try:
            fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            entry.unlink(missing_ok=True)
            removed.append(entry)
        except OSError:  # held by a live writer (or gone): not a leftover
            pass
        finally:
            os.close(fd)
    return removed


def atomic_write(path: str | os.PathLike, write: Callable[[io.BufferedWriter], None]) -> Path:
    """Write a file through ``write(fileobj)`` into a temp file beside it, then rename.

    Raises:
        WriteError: disk full, a limit hit, a directory not writable or ``path`` a symbolic link; the
            previous file is untouched and no temp file is left.
    """
    path = Path(path)
    tmp: Path | None = None
    try:
        if path.is_symlink():
            raise symlink_refused(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp, fd = _open_temp(path)
        lock = os.dup(fd)  # keeps the temp file's flock past the close, until the rename
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            if path.is_symlink():  # placed while this file was being written
                raise symlink_refused(path)
            os.replace(tmp, path)
        finally:
            os.close(lock)
    except BaseException as err:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        cause = _os_error(err)
        if cause is None or isinstance(err, WriteError):
            raise
        raise write_failure(path, cause) from err
    with contextlib.suppress(OSError):  # what interrupted writes of this file left, also outside a run folder
        remove_stale_temp_files(path.parent, of=path.name)
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


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the headless Agg backend, imported when a figure is drawn (not with bt_hub)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig: Any, path: str | os.PathLike) -> Path:
    """Write a matplotlib figure (drawn with :func:`pyplot`) as PNG atomically and close it."""
    import matplotlib.pyplot as plt

    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110, bbox_inches="tight"))
    plt.close(fig)
    return Path(path)


def read_json(path: Path) -> Any:
    """The parsed JSON in ``path``, or None when it is missing or not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


class CheckpointError(ValueError):
    """A checkpoint could not be read as a ResNet backbone; the message names the file. ``reason``: what is wrong
    with it, without its name (``is not a torch checkpoint (...)``), where a message is of that shape."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


def unreadable(path: Path, reason: str) -> CheckpointError:
    """``weights file <path> <reason>``, keeping ``reason`` for a caller that names the file otherwise (a URL)."""
    return CheckpointError(f"weights file {path} {reason}", reason)


class _RestrictedUnpickler(pickle.Unpickler):
    """Admits numpy arrays and plain containers only (the detectron2 ``.pkl`` payload)."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # how pickle protocols 0-2 store the arrays' bytes (torch's safe reader admits it too)
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "tuple"),
        ("builtins", "list"),
        ("builtins", "dict"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        refused = pickle.UnpicklingError(f"global '{module}.{name}' is forbidden")
        refused.global_name = f"{module}.{name}"
        raise refused


def _looks_like_safetensors(head: bytes) -> bool:
    return len(head) >= 10 and head[8:10] in (b'{"', b"{ ")


def _not_a_checkpoint(head: bytes) -> str | None:
    """What the first bytes of a file that is neither a zip archive nor a pickle look like, or None."""
    if head.startswith((b"PK\x03\x04", b"\x80")):
        return None
    if head.lstrip().startswith(b"<"):
        return "looks like HTML, perhaps an error or login page saved in its place"
    if all(32 <= byte < 127 or byte in b"\t\r\n" for byte in head):
        return "looks like text"
    return "unrecognised bytes"


def _pickled_globals(source: Path | io.BytesIO) -> list[str]:
    """The ``module.name`` globals a pickle stream refers to, read with pickletools (nothing is executed)."""
    import pickletools

    found: list[str] = []
    with _opened(source) as f:
        for _ in range(8):  # torch's legacy format is several pickles in a row, then raw bytes
            strings: list[str] = []
            try:
                for opcode, arg, _pos in pickletools.genops(f):
                    if opcode.name == "GLOBAL":
                        found.append(str(arg).replace(" ", "."))
                    elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                        found.append(f"{strings[-2]}.{strings[-1]}")
                    elif isinstance(arg, str):
                        strings.append(arg)
            except (ValueError, EOFError, UnicodeDecodeError):
                break
    return found


def _unsafe_globals(source: Path | io.BytesIO, is_zip: bool) -> list[str]:
    """The globals of a torch file that torch's safe reader does not admit, found without executing anything: torch's
    own list for a zip archive, pickletools' for the legacy format (torch's lister reads zip archives only)."""
    if not is_zip:
        return [g for g in _pickled_globals(source) if not g.startswith(_SAFE_GLOBAL_PREFIXES)]
    with contextlib.suppress(Exception), _opened(source) as f:  # a damaged archive lists nothing: said later
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(f))
    return []


_SAFE_GLOBAL_PREFIXES = (
    "torch.",
    "collections.OrderedDict",
    "builtins.set",
    "builtins.frozenset",
    "_codecs.encode",
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct",
    "numpy.ndarray",
    "numpy.dtype",
)


def read_file(path: Path) -> Any:
    """The object stored in a weights file, read without executing code (CheckpointError says why it is not one)."""
    if not path.is_file():
        raise unreadable(path, "does not exist")
    return _read(path, path)


def read_file_and_sha256(path: Path) -> tuple[Any, str]:
    """``read_file``, and the sha256 of the very bytes it parsed (one read, so the two always belong together)."""
    if not path.is_file():
        raise unreadable(path, "does not exist")
    data = path.read_bytes()
    return _read(path, io.BytesIO(data)), hashlib.sha256(data).hexdigest()


def _rewound(source: Path | io.BytesIO) -> Path | io.BytesIO:
    if isinstance(source, io.BytesIO):
        source.seek(0)
    return source


def _opened(source: Path | io.BytesIO) -> contextlib.AbstractContextManager[Any]:
    return open(source, "rb") if isinstance(source, Path) else contextlib.nullcontext(_rewound(source))


def _read(path: Path, source: Path | io.BytesIO) -> Any:
    with _opened(source) as f:
        head = f.read(64)
    if not head:
        raise unreadable(path, "is empty")
    is_zip = zipfile.is_zipfile(_rewound(source))
    if path.suffix == ".safetensors" or _looks_like_safetensors(head):
        from safetensors.torch import load, load_file

        in_memory = isinstance(source, io.BytesIO)
        kind, read = "safetensors file", lambda: load(source.getvalue()) if in_memory else load_file(str(path))
    elif path.suffix == ".pkl" and not is_zip:
        kind, read = "pickle", lambda: _unpickle(source)
    else:
        kind, read = "torch file", lambda: torch.load(_rewound(source), map_location="cpu", weights_only=True)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return read()
    except Exception as err:  # torch, pickle and safetensors raise many unrelated types for a bad file
        raise _explain(path, source, head, kind, err, is_zip) from None


def _unpickle(source: Path | io.BytesIO) -> Any:
    with _opened(source) as f:
        return _RestrictedUnpickler(f, encoding="latin1").load()


def _explain(
    path: Path, source: Path | io.BytesIO, head: bytes, kind: str, err: Exception, is_zip: bool
) -> CheckpointError:
    code = getattr(err, "global_name", None)  # the restricted unpickler's refusal (a .pkl)
    if code is None and kind == "torch file":  # first: a protocol-0 pickle of code is plain text too
        code = next(iter(_unsafe_globals(source, is_zip)), None)
    if code:
        return _code_refused(path, code)
    looks = _not_a_checkpoint(head) if kind != "safetensors file" or head.lstrip().startswith(b"<") else None
    if looks:
        what = "safetensors file" if kind == "safetensors file" else "torch checkpoint"
        return unreadable(path, f"is not a {what} ({looks})")
    return unreadable(path, f"is not a readable {kind}, perhaps truncated ({_first_line(err)})")


def _code_refused(path: Path, global_name: str) -> CheckpointError:
    return unreadable(
        path,
        f"holds pickled code ('{global_name}'), so bt_hub refuses to load it; only tensors, arrays and plain "
        "containers are read",
    )


def _first_line(err: BaseException) -> str:
    # torch's safe reader refuses a file's contents with an UnpicklingError whose only mark is this wording (no
    # attribute or subclass tells it from a cut-short pickle); tests/test_formats.py pins the wording
    if isinstance(err, pickle.UnpicklingError) and "Weights only load failed" in str(err):
        return "torch's safe reader rejected its contents"
    text = str(err).strip().splitlines()
    return text[0].split(". ")[0].rstrip(".") if text else type(err).__name__


def non_finite_tensors(state: Any, prefix: str = "") -> list[str]:
    """Names of the floating-point tensors holding NaN or inf in a (nested) state dict."""
    if isinstance(state, torch.Tensor):
        return [prefix] if state.is_floating_point() and not bool(torch.isfinite(state).all()) else []
    if isinstance(state, Mapping):
        return [name for k, v in state.items() for name in non_finite_tensors(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(state, (list, tuple)):
        return [name for i, v in enumerate(state) for name in non_finite_tensors(v, f"{prefix}.{i}")]
    return []


def file_sha256(path: Path) -> str:
    """The sha256 (hex) of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _sorted_metadata(data: bytes) -> bytes:
    """safetensors bytes with the ``__metadata__`` keys sorted, so the same weights always hash the same."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    metadata = header.pop("__metadata__", None)
    ordered = {"__metadata__": dict(sorted(metadata.items())), **header} if metadata else header
    text = json.dumps(ordered, separators=(",", ":")).encode("utf-8")
    return data[:8] + text.ljust(size, b" ") + data[8 + size :]


def safetensors_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file (only its header is read); ``{}`` when it has none or is no file."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(min(size, 1 << 24)))
    except (OSError, ValueError):
        return {}
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return {str(k): str(v) for k, v in metadata.items()} if isinstance(metadata, dict) else {}


def write_safetensors(
    tensors: Mapping[str, torch.Tensor], path: str | os.PathLike, metadata: Mapping[str, str] | None = None
) -> Path:
    """Write tensors as safetensors atomically, marked ``written_by: bt_hub``, with sorted (reproducible) metadata."""
    from safetensors.torch import save

    data = _sorted_metadata(save(dict(tensors), metadata={**(metadata or {}), **WRITTEN_BY}))
    return atomic_write(path, lambda f: f.write(data))
