"""The on-disk feature cache: checksummed ``.npy`` files keyed by everything that changes the features (the inputs
of ``features`` in :mod:`bt_hub.common.reuse`), one writer a key at a time."""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bt_hub.common.artifacts import (
    READ_ONLY,
    Segments,
    content_key,
    entry_problem,
    file_entry,
    locked,
    not_writable,
    recorded_segments,
)
from bt_hub.common.files import atomic_write, atomic_write_json
from bt_hub.common.reuse import inputs_key
from bt_hub.eval.config import EvalWarning


@dataclass(frozen=True)
class FeatureCache:
    """Where cached features live and what they were computed from: the weights, dataset and model fingerprints."""

    directory: str | os.PathLike
    weights: str
    dataset: str
    model: str = ""

    def key(self, transform: str, pool: str, dtype: str, precision: str = "fp32") -> str:
        """The file stem for features of these weights, model and data under a transform, pool, dtype and precision:
        the key of their inputs (``inputs_key``), the transform standing for all four."""
        transform_input = {"transform": transform, "pool": pool, "dtype": dtype, "precision": precision}
        inputs = {"weights": self.weights, "dataset": self.dataset, "model": self.model, "transform": transform_input}
        return inputs_key("features", inputs)[:24]

    def lock(self, key: str) -> contextlib.AbstractContextManager[None]:
        """The lock of ``key`` (``<key>.lock``), held while its files are written: a second run asking for the same
        features waits, then reads them. A folder that cannot hold it is refused in one sentence naming
        ``--cache-dir``."""
        directory = Path(self.directory)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise not_writable(directory, err, "--cache-dir") if err.errno in READ_ONLY else err from None
        return locked(directory / f"{key}.lock", "--cache-dir")

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
        problem = entry_problem(meta_path.parent, entry)
        if problem is not None:
            return problem
        path = meta_path.parent / str(entry.get("file"))
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as err:
            return f"{path} cannot be read ({err})"
        if list(array.shape) != entry.get("shape") or str(array.dtype) != entry.get("dtype"):
            return f"{path} holds {array.dtype} {list(array.shape)}, {entry.get('dtype')} {entry.get('shape')} written"
    return None


def read_cache(features_path: Path, labels_path: Path) -> tuple[np.ndarray, torch.Tensor]:
    """The verified cache files: features as a read-only memmap, labels as a tensor (never unpickled)."""
    features = np.load(features_path, mmap_mode="r", allow_pickle=False)
    return features, torch.from_numpy(np.load(labels_path, allow_pickle=False))


PART_ROWS = 8192  # rows of each checksummed part an extraction in progress keeps (whole batches)...
PART_SECONDS = 30.0  # ...or fewer: the batches of this many seconds, so an interruption loses at most about that


class Extraction:
    """An extraction in progress, written straight into its features file: ``<key>.features.npy.partial`` holds the
    ``.npy`` header and the rows so far, in checksummed parts (:class:`~bt_hub.common.artifacts.Segments`, whose
    items are the rows' labels) of whole global batches, so a rerun continues after the last good part with
    features equal, bit for bit, to an uninterrupted extraction's. :meth:`finish` renames the file into place.
    """

    def __init__(self, cache: FeatureCache, key: str, global_batch: int, dtype: np.dtype, n: int) -> None:
        self.cache, self.key = cache, key
        self.features_path, self.labels_path, self.meta_path = cache.paths(key)
        self.dtype, self.n = np.dtype(dtype), n
        partial = self.features_path.with_name(self.features_path.name + ".partial")
        self.parts = Segments(partial, content_key(key, global_batch, str(self.dtype)))

    def resume(self) -> int:
        """The first row still to extract: after the parts whose bytes are what was written (a part cut short or
        changed, and every later one, is extracted again with a warning)."""
        self.parts.open()
        if self.parts.dropped:
            warnings.warn(
                f"partial features {self.parts.path}: {self.parts.dropped}; extracting again from row "
                f"{len(self.parts.items)}",
                EvalWarning,
                stacklevel=3,
            )
        return len(self.parts.items)

    def extend(self, chunks: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write ``chunks`` (the batches from :meth:`resume`'s row on), closing a part at ``PART_ROWS`` rows or
        ``PART_SECONDS`` after the previous one, whichever comes first (a slow extraction of 8192 rows took minutes,
        all lost to a Ctrl-C); a part always holds whole global batches."""
        rows, since = 0, time.monotonic()
        for features, labels in chunks:
            header = _npy_header((self.n, features.shape[1]), self.dtype) if self.parts.size == 0 else b""
            self.parts.write(header + features.numpy().astype(self.dtype).tobytes(), labels.tolist())
            rows += len(features)
            if rows >= PART_ROWS or time.monotonic() - since >= PART_SECONDS:
                self.parts.commit()
                rows, since = 0, time.monotonic()
        self.parts.commit()

    def finish(self, **settings: str) -> None:
        """Rename the whole features file into place beside its labels, then write the meta file, last: the key, what
        the features were computed from (the cache's fingerprints and ``settings``: transform, pool, dtype,
        precision), and the files' names, bytes, sha256, shapes and dtypes that :func:`cache_problem` checks."""
        self.parts.close()
        labels = np.asarray(self.parts.items, dtype=np.int64)
        buffer = io.BytesIO()
        np.save(buffer, labels, allow_pickle=False)
        atomic_write(self.labels_path, lambda f: f.write(buffer.getvalue()))
        os.replace(self.parts.path, self.features_path)
        self.parts.record.unlink(missing_ok=True)
        features = np.load(self.features_path, mmap_mode="r", allow_pickle=False)
        files = {
            name: {**file_entry(path), "shape": list(array.shape), "dtype": str(array.dtype)}
            for name, path, array in (("features", self.features_path, features), ("labels", self.labels_path, labels))
        }
        cache = self.cache
        inputs = {"weights": cache.weights, "model": cache.model, "dataset": cache.dataset, **settings}
        atomic_write_json(self.meta_path, {"key": self.key, **inputs, "num_samples": self.n, "files": files})


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
    for record in sorted(directory.glob("*.features.npy.partial.progress.jsonl")):
        rows = sum(len(segment["items"]) for segment in recorded_segments(record))
        partial += [rows] if rows else []
    return whole, partial
