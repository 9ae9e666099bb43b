"""The on-disk feature cache: checksummed ``.npy`` files keyed by everything that changes the features."""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bt_hub.common.files import atomic_write, file_sha256


@dataclass(frozen=True)
class FeatureCache:
    """Where cached features live and what they were computed from: the weights, dataset and model fingerprints."""

    directory: str | os.PathLike
    weights: str
    dataset: str
    model: str = ""

    def key(self, transform: str, pool: str, dtype: str, precision: str = "fp32") -> str:
        """The file stem for features of these weights, model and data under a transform, pool, dtype and precision."""
        record = {
            "weights": self.weights,
            "model": self.model,
            "dataset": self.dataset,
            "transform": transform,
            "pool": pool,
            "dtype": dtype,
            "precision": precision,
        }
        return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:24]

    def paths(self, key: str) -> tuple[Path, Path, Path]:
        """(features .npy, labels .npy, meta .json) for a key; the meta file is written last."""
        d = Path(self.directory)
        return d / f"{key}.features.npy", d / f"{key}.labels.npy", d / f"{key}.meta.json"


def _npy_header(shape: tuple[int, ...], dtype: np.dtype) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape}
    )
    return buf.getvalue()


CACHE_MISSING = "missing"  # ``cache_problem`` of a key never computed: computed without a warning


def cache_problem(meta_path: Path, key: str) -> str | None:
    """None when the cached files of ``key`` are what was written; else what is wrong (``CACHE_MISSING``, ...)."""
    if not meta_path.exists():
        return CACHE_MISSING
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"{meta_path} is not readable JSON ({err})"
    files = meta.get("files") if isinstance(meta, dict) else None
    if meta.get("key") != key or not isinstance(files, dict) or set(files) != {"features", "labels"}:
        return f"{meta_path} does not record the checksums of key {key} (written by another bt_hub version?)"
    for entry in files.values():
        path = meta_path.parent / str(entry.get("file"))
        try:
            size = path.stat().st_size
            if size != entry.get("bytes"):
                return f"{path} is {size} bytes, {entry.get('bytes')} were written (truncated or changed)"
            if file_sha256(path) != entry.get("sha256"):
                return f"{path} does not match the sha256 recorded when it was written (changed since)"
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except FileNotFoundError:
            return f"{path} is missing"
        except (OSError, ValueError) as err:
            return f"{path} cannot be read ({err})"
        if list(array.shape) != entry.get("shape") or str(array.dtype) != entry.get("dtype"):
            return f"{path} holds {array.dtype} {list(array.shape)}, {entry.get('dtype')} {entry.get('shape')} written"
    return None


def read_cache(features_path: Path, labels_path: Path) -> tuple[np.ndarray, torch.Tensor]:
    """The verified cache files: features as a read-only memmap, labels as a tensor (never unpickled)."""
    features = np.load(features_path, mmap_mode="r", allow_pickle=False)
    return features, torch.from_numpy(np.load(labels_path, allow_pickle=False))


def write_cache(
    chunks: Iterator[tuple[torch.Tensor, torch.Tensor]], n: int, dtype: np.dtype, features_path: Path, labels_path: Path
) -> dict[str, dict[str, Any]]:
    """Stream feature chunks into an .npy file atomically; return its name, bytes, sha256, shape and dtype."""
    first_features, first_labels = next(chunks)
    labels = [first_labels]
    digest = hashlib.sha256()
    size = 0

    def write(f: io.BufferedWriter) -> None:
        nonlocal size
        for block in _feature_bytes(first_features, chunks, labels, n, dtype):
            digest.update(block)
            size += len(block)
            f.write(block)

    atomic_write(features_path, write)
    buf = io.BytesIO()
    label_array = torch.cat(labels).numpy()
    np.save(buf, label_array, allow_pickle=False)
    atomic_write(labels_path, lambda f: f.write(buf.getvalue()))
    return {
        "features": {
            "file": features_path.name,
            "bytes": size,
            "sha256": digest.hexdigest(),
            "shape": [n, int(first_features.shape[1])],
            "dtype": str(dtype),
        },
        "labels": {
            "file": labels_path.name,
            "bytes": len(buf.getvalue()),
            "sha256": hashlib.sha256(buf.getvalue()).hexdigest(),
            "shape": list(label_array.shape),
            "dtype": str(label_array.dtype),
        },
    }


def _feature_bytes(
    first: torch.Tensor,
    rest: Iterator[tuple[torch.Tensor, torch.Tensor]],
    labels: list[torch.Tensor],
    n: int,
    dtype: np.dtype,
) -> Iterator[bytes]:
    """The .npy header, then every chunk's rows as ``dtype`` bytes; the chunks' labels are appended to ``labels``."""
    yield _npy_header((n, first.shape[1]), dtype)
    yield first.numpy().astype(dtype).tobytes()
    for feats, labs in rest:
        yield feats.numpy().astype(dtype).tobytes()
        labels.append(labs)


PART_ROWS = 8192  # rows of each checksummed part an extraction in progress keeps (whole batches)...
PART_SECONDS = 30.0  # ...or fewer: the batches of this many seconds, so an interruption loses at most about that


class Parts:
    """The checksummed parts of an extraction in progress: what a cut run kept, and where a rerun continues.

    Each ``<key>.part<first row>.npz`` holds whole global batches and is listed with its sha256 in
    ``<key>.parts.json``; a rerun continues after the last good part, so its features equal, bit for bit,
    an uninterrupted extraction's.
    """

    def __init__(self, cache: FeatureCache, key: str, global_batch: int, dtype: np.dtype) -> None:
        self.directory, self.key, self.global_batch, self.dtype = Path(cache.directory), key, global_batch, dtype
        self.index = self.directory / f"{key}.parts.json"
        self.parts: list[dict[str, Any]] = []

    def resume(self) -> int:
        """The first row still to extract: after the listed parts whose files still hold what was written."""
        try:
            listed = json.loads(self.index.read_text())
        except (OSError, ValueError):
            listed = {}
        if listed.get("global_batch") != self.global_batch or listed.get("dtype") != str(self.dtype):
            listed = {}
        for part in listed.get("parts", []):
            path = self.directory / part["file"]
            if part["first"] != self.rows or not path.is_file() or file_sha256(path) != part["sha256"]:
                break
            self.parts.append(part)
        return self.rows

    @property
    def rows(self) -> int:
        """Rows the kept parts hold."""
        return self.parts[-1]["stop"] if self.parts else 0

    def extend(self, chunks: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write ``chunks`` (the batches from :meth:`resume`'s row on) as parts, each listed once it is whole.

        A part closes at ``PART_ROWS`` rows or ``PART_SECONDS`` after the previous one, whichever comes first (a
        slow extraction of 8192 rows took minutes, all lost to a Ctrl-C); it always holds whole global batches.
        """
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        since = time.monotonic()
        for chunk in chunks:
            pending.append(chunk)
            if sum(len(f) for f, _ in pending) >= PART_ROWS or time.monotonic() - since >= PART_SECONDS:
                self._write(pending)
                pending, since = [], time.monotonic()
        if pending:
            self._write(pending)

    def _write(self, chunks: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        features = torch.cat([f for f, _ in chunks]).numpy().astype(self.dtype)
        labels = torch.cat([lab for _, lab in chunks]).numpy()
        buffer = io.BytesIO()
        np.savez(buffer, features=features, labels=labels)
        data = buffer.getvalue()
        path = atomic_write(self.directory / f"{self.key}.part{self.rows}.npz", lambda f: f.write(data))
        sha = hashlib.sha256(data).hexdigest()
        self.parts.append({"file": path.name, "first": self.rows, "stop": self.rows + len(features), "sha256": sha})
        listing = {"global_batch": self.global_batch, "dtype": str(self.dtype), "parts": self.parts}
        atomic_write(self.index, lambda f: f.write(json.dumps(listing).encode()))

    def read(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every part's (features, labels) in row order, as ``write_cache`` takes them."""
        for part in self.parts:
            with np.load(self.directory / part["file"], allow_pickle=False) as data:
                yield torch.from_numpy(data["features"]), torch.from_numpy(data["labels"])

    def remove(self) -> None:
        """Delete the parts and their list once the whole features file is written (bt_hub's own names only)."""
        for part in self.parts:
            (self.directory / part["file"]).unlink(missing_ok=True)
        self.index.unlink(missing_ok=True)


def kept_features(directory: str | os.PathLike, since: float) -> tuple[list[int], list[int]]:
    """What ``directory`` keeps for a rerun: the rows of each whole features file written at or after ``since``
    (a ``time.time()``), and the rows that the listed parts of each extraction in progress hold."""
    directory = Path(directory)
    whole, partial = [], []
    for meta in sorted(directory.glob("*.meta.json")):
        try:
            if meta.stat().st_mtime >= since:
                whole.append(int(json.loads(meta.read_text(encoding="utf-8"))["num_samples"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    for index in sorted(directory.glob("*.parts.json")):
        try:
            parts = json.loads(index.read_text(encoding="utf-8"))["parts"]
            partial += [int(parts[-1]["stop"])] if parts else []
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            continue
    return whole, partial
