"""The decoded-image store: a folder's images decoded once, by loader workers, into one uint8 file that every
reader shares, instead of each of them opening and decoding every file again.

Who reads it: pretraining's batched views on a folder of small images (``bt-hub pretrain --store``), and every
feature extraction of an evaluation that reads a split more than once or keeps a feature cache (each protocol of
``eval all``, each kept step, seed and baseline of ``eval compare``; ``--store``), so a second network over the
same data decodes nothing.

What it holds (:class:`StoreView`): each image whole at its decoded size (``whole``: pretraining crops at random,
so it needs the whole image; small images cost little), or, for evaluation, the deterministic test crop at the
eval size (``crop``: resize the shorter side, centre-crop; the exact uint8 result of
:meth:`bt_hub.method.transforms.DeviceEvalTransform.crop` on the CPU), so a 500 x 375 JPEG costs 224 x 224 x 3
bytes and extraction from the store is one gather and a normalisation.

On disk (``<directory>/<slot>/``, one slot per list of files and view):

- ``pixels.u8``: every image's C x H x W bytes end to end (memory-mapped when read);
- ``index.npy``: N x 4 int64 rows (byte offset, C, H, W);
- ``manifest.json``, written last: the key, every file's stat row (relative name, size, mtime, ctime), label and
  the sha256 of the bytes the worker decoded (no sampling), the view, and the size and sha256 of ``pixels.u8`` and
  ``index.npy``.

Checks: the key is the key of the store's inputs (``inputs_key("decoded store", ...)`` of :mod:`bt_hub.common.reuse`):
the view and every file's stat row (name, size, mtime, ctime) and label, taken with ``stat``
(:mod:`bt_hub.common.artifacts` says which changes a stat row sees). The slot, the folder a store is kept in, is
named after the names, labels and view alone, so a changed file finds its stale store there. A whole store whose key
is this one is read without a lock and without writing (read-only storage serves). One whose rows differ for the same
names and labels has each moved file hashed again: same bytes (a ``chmod``), it is used and its manifest brought up
to date; other bytes, it is stale: not used, a warning names the first file that changed, and the store is decoded
again. ``pixels.u8`` and ``index.npy`` are checked against their recorded sizes and sha256 on every open, as the
feature cache checks its files.

Writing: into ``<slot>.partial/`` under an exclusive lock (a folder that cannot hold the lock is refused naming the
flag that moves it), in segments whose end and sha256 are recorded every few seconds
(:class:`~bt_hub.common.artifacts.Segments`); a kill leaves a partial store that the next run continues after its
last segment whose bytes are what was recorded; a full disk removes the partial files and says so; the finished
folder is renamed into place, so a reader never sees half a store. Without a directory (``eval compare`` with no
``--out``), the store is built the same way in memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import shutil
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from bt_hub.common.artifacts import (
    READ_ONLY,
    Segments,
    content_key,
    entry_problem,
    file_entry,
    locked,
    not_writable,
    same_content,
    stat_change,
    stat_row,
)
from bt_hub.common.files import FULL, WriteError, atomic_write, atomic_write_json, write_failure
from bt_hub.common.progress import announce, progress
from bt_hub.common.reuse import inputs_key
from bt_hub.common.signals import ignore_group_signals
from bt_hub.data.decode import PackedItems, collate_packed, decode_on_cpu, read_encoded
from bt_hub.method.transforms import DeviceEvalTransform

STORE_FORMAT = 2  # 2: stat rows with ctime, partial builds in verified segments
AUTO_MAX_BYTES = 64 * 2**30  # auto makes no store larger than this (nor than half the free disk)
DEVICE_SHARE = 0.3  # auto keeps a store in GPU memory when it takes at most this share of the free memory
SMALL_SIDE = 128  # auto keeps pretraining images whole only up to this side: larger ones decode faster than they read
SAVE_EVERY_S = 5.0  # a partial store records its progress this often (a kill loses at most these seconds)
BATCH = 64  # images a worker decodes per batch


class StoreWarning(UserWarning):
    """A decoded store that could not be used as it was (stale, damaged); it is decoded again."""


@dataclass(frozen=True)
class StoreView:
    """What each stored image is: whole at its decoded size (``crop`` None), or the eval test crop."""

    crop: int | None = None  # the crop side
    resize: int | None = None  # the shorter side before the crop

    @classmethod
    def for_eval(cls, transform: DeviceEvalTransform) -> StoreView:
        """The test crop that ``transform`` takes (it then only normalises)."""
        return cls(transform.image_size, transform.resize_size)

    def describe(self) -> str:
        """How the stored images were made, as the manifest and the messages say it."""
        if self.crop is None:
            return "whole images"
        return f"{self.crop} px centre crops of the shorter side resized to {self.resize} (bilinear, antialiased)"

    def apply(self, image: torch.Tensor) -> torch.Tensor:
        """A decoded 3 x H x W uint8 image as it is stored."""
        if self.crop is None:
            return image
        return DeviceEvalTransform(self.crop, self.resize).crop(image[None])[0].contiguous()


class DecodedImages(Dataset):
    """A store opened for reading: ``(image, label)`` items, and whole batches gathered in one call (:meth:`batch`).

    ``pixels`` is a 1-D uint8 tensor (a copy-on-write memory map of ``pixels.u8``, memory, or GPU memory).
    """

    def __init__(
        self,
        pixels: torch.Tensor,
        index: np.ndarray,
        targets: Sequence[int],
        classes: Sequence[str],
        view: StoreView,
        where: str,
    ) -> None:
        self.pixels, self.index, self.view, self.where = pixels, index, view, where
        self.targets, self.classes = list(targets), list(classes)
        same = len(index) and bool((index[:, 1:] == index[0, 1:]).all())
        self.shape = tuple(int(v) for v in index[0, 1:]) if same else None  # C, H, W of every image, or None
        self._stacked = pixels.view(len(index), *self.shape) if self.shape is not None and len(index) else None

    def __len__(self) -> int:
        return len(self.index)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored images."""
        return int(self.pixels.numel())

    def image(self, i: int) -> torch.Tensor:
        """Image ``i`` as a C x H x W view of the store."""
        offset, c, h, w = (int(v) for v in self.index[i])
        return self.pixels[offset : offset + c * h * w].view(c, h, w)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.image(i), self.targets[i]

    def batch(self, indices: Sequence[int], device: torch.device | str) -> torch.Tensor | list[torch.Tensor]:
        """Images ``indices`` on ``device``: one B x C x H x W tensor when they share a size (a view for a run of
        consecutive indices, as extraction reads them; else one gather), else a list."""
        if self._stacked is None:
            return [self.image(i).to(device, non_blocking=True) for i in indices]
        batch = self._stacked[rows(indices, self._stacked.device)]
        if batch.device.type == "cpu" and torch.device(device).type == "cuda":
            batch = batch.pin_memory()  # an asynchronous copy (the prefetch thread's stream overlaps it)
        return batch.to(device, non_blocking=True)

    def to(self, device: torch.device | str) -> DecodedImages:
        """The same store with its pixels in ``device``'s memory."""
        where = f"{self.where}, held in {device} memory"
        return DecodedImages(self.pixels.to(device), self.index, self.targets, self.classes, self.view, where)


def rows(indices: Sequence[int], device: torch.device) -> slice | torch.Tensor:
    """``indices`` as a slice when they are consecutive (indexing is then a view, no copy), else as a long tensor
    on ``device`` (copied there asynchronously, not through a synchronising copy from pageable memory)."""
    indices = list(indices)
    first = indices[0] if indices else 0
    if indices == list(range(first, first + len(indices))):
        return slice(first, first + len(indices))
    picked = torch.tensor(indices, dtype=torch.long)
    return picked.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else picked


# ----------------------------------------------------------------------------- keys


def _files(samples: Sequence[tuple[Any, int]]) -> tuple[Path, list[list[Any]]]:
    """The common root of the files and each one's stat row and label (``stat`` only): [name, size, mtime_ns,
    ctime_ns, label]."""
    paths = [Path(p) for p, _ in samples]
    root = Path(os.path.commonpath([str(p.parent) for p in paths])) if paths else Path(".")
    return root, [[*stat_row(path, root), int(label)] for path, (_, label) in zip(paths, samples)]


def _changes(manifest: dict[str, Any], root: Path, files: list[list[Any]]) -> tuple[list[list[Any]] | None, str]:
    """The manifest's rows brought up to ``files`` when every file whose stat row moved still holds the bytes whose
    sha256 the store recorded (a ``chmod`` moves ctime alone), else None and the first change in one phrase."""
    old = manifest.get("files", [])
    if len(old) != len(files):
        return None, f"it holds {len(old)} files, the folder now {len(files)}"
    rows = []
    for was, now in zip(old, files):
        name, label, sha = was[0], was[4], was[5]
        if [name, label] != [now[0], now[4]]:
            return None, f"{name} is now {now[0]} (label {now[4]})" if name != now[0] else f"{name} changed label"
        what = stat_change(was, now)
        if what == "size" or (what is not None and not same_content(root / name, sha)):
            return None, f"{name} changed ({what}, and its bytes)" if what != "size" else f"{name} changed (size)"
        rows.append([*now, sha])
    return rows, ""


# ----------------------------------------------------------------------------- building


class _StoreItems(Dataset):
    """A loader worker's item: the file read once, its sha256, and the image decoded and stored as ``view`` says."""

    def __init__(self, paths: Sequence[Path], view: StoreView) -> None:
        self.paths, self.view = paths, view

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, str]:
        item = read_encoded(self.paths[i])
        return self.view.apply(decode_on_cpu(item)), hashlib.sha256(item.data.numpy()).hexdigest()


def _collate(items: list[tuple[torch.Tensor, str]]) -> tuple[PackedItems, list[str]]:
    return collate_packed([image for image, _ in items]), [sha for _, sha in items]


class _InMemory:
    """The sink of a store without a folder: its bytes in memory, and its items ([offset, C, H, W, sha256])."""

    def __init__(self) -> None:
        self.buffer, self.items, self.size = io.BytesIO(), [], 0

    def write(self, data: memoryview, items: Sequence[Any]) -> None:
        self.buffer.write(data)
        self.size += len(data)
        self.items.extend(items)

    def commit(self) -> None:
        """Nothing to record: a store in memory does not outlive its process."""


def _build(paths: Sequence[Path], view: StoreView, sink: Segments | _InMemory, num_workers: int, desc: str) -> None:
    """Decode the ``paths`` the sink does not hold yet in loader workers, appending each batch's bytes and items
    ([offset, C, H, W, sha256 of the file]) to ``sink``, committed every ``SAVE_EVERY_S``."""
    loader = DataLoader(
        _StoreItems(paths[len(sink.items) :], view),
        batch_size=BATCH,
        num_workers=num_workers,
        collate_fn=_collate,
        worker_init_fn=ignore_group_signals,  # a group SIGTERM is the main process's to answer
    )
    last_save = time.monotonic()
    for packed, hashes in progress(loader, desc, unit="batch"):
        offset, items = sink.size, []
        for shape, sha in zip(packed.shapes, hashes):
            items.append([offset, *(int(v) for v in shape), sha])
            offset += shape.numel()
        sink.write(memoryview(packed.data.numpy()), items)
        if time.monotonic() - last_save >= SAVE_EVERY_S:
            sink.commit()
            last_save = time.monotonic()


def _size_note(n: int, view: StoreView, where: str, per_image: int | None) -> str:
    size = f"{n * per_image / 2**20:,.2f} MiB" if per_image else "a size known after the first batch"
    return f"decoding {n} images once into a store of {view.describe()}, {size}, {where} (--store off: no store)"


def open_store(
    dataset: Any,
    view: StoreView,
    directory: str | os.PathLike | None,
    *,
    num_workers: int = 0,
    desc: str = "decode",
    flag: str = "--store-dir",
) -> DecodedImages:
    """The decoded store of ``dataset``'s files (an ImageFolder-style ``samples`` list) as ``view`` says:
    read from ``directory`` when a whole, current store is there (without writing: read-only storage serves), else
    decoded now (continuing a partial one); ``flag`` names the option that moves ``directory``."""
    samples = list(dataset.samples)
    if not samples:
        raise ValueError("a decoded store needs at least one image file")
    root, files = _files(samples)
    targets, classes = [label for _, label in samples], list(getattr(dataset, "classes", []))
    per_image = 3 * view.crop * view.crop if view.crop else None
    if directory is None:
        announce(_size_note(len(files), view, "in memory", per_image))
        sink = _InMemory()
        _build([root / f[0] for f in files], view, sink, num_workers, desc)
        pixels = torch.frombuffer(bytearray(sink.buffer.getbuffer()), dtype=torch.uint8)
        index = np.asarray([item[:4] for item in sink.items], dtype=np.int64)
        return DecodedImages(pixels, index, targets, classes, view, "in memory")
    name = content_key(STORE_FORMAT, view.describe(), [[f[0], f[4]] for f in files], str(root))[:24]
    key = inputs_key("decoded store", {"files": files, "view": view.describe()})
    slot = _Slot(Path(directory) / name, key, root, files, view)
    found = slot.read("exact")  # no lock and no write: a whole store on read-only storage serves
    if found is None:
        try:
            slot.folder.parent.mkdir(parents=True, exist_ok=True)
            with locked(slot.folder.with_name(name + ".lock"), flag):
                found = slot.read("refresh")
                if found is None:
                    note = _size_note(len(files), view, f"at {slot.folder}", per_image)
                    found = slot.decode(num_workers, desc, note)
        except OSError as err:
            if err.errno not in READ_ONLY:
                raise
            found = slot.read("check")
            if found is None:
                raise err if isinstance(err, WriteError) else not_writable(slot.folder.parent, err, flag) from None
    return DecodedImages(found.pixels, found.index, targets, classes, view, found.where)


@dataclass
class _Slot:
    """One store on disk: its folder, its key, and the files (stat rows and labels, under ``root``) it is made of."""

    folder: Path
    key: str
    root: Path
    files: list[list[Any]]
    view: StoreView

    def read(self, mode: str) -> DecodedImages | None:
        """The store when it is whole and current, else None. ``exact``: its key equals this one (no file is hashed);
        ``check``: also when every file whose stat row moved still holds its recorded bytes; ``refresh``: as
        ``check``, and the caller holds the lock: such a manifest is brought up to date, and a stale or damaged store
        is named in a warning (it is decoded again)."""
        manifest_path = self.folder / "manifest.json"
        if not manifest_path.exists():
            return None
        try:
            manifest = json.loads(manifest_path.read_text())
            if manifest.get("key") != self.key:
                if mode == "exact":
                    return None
                rows, change = _changes(manifest, self.root, self.files)
                if rows is None:
                    if mode == "refresh":
                        warnings.warn(
                            f"decoded store {self.folder} is stale: {change} since it was written; decoding again",
                            StoreWarning,
                            stacklevel=4,
                        )
                    return None
                manifest.update(key=self.key, files=rows)
                if mode == "refresh":
                    atomic_write_json(manifest_path, manifest)
            for problem in (entry_problem(self.folder, manifest[name]) for name in ("pixels", "index")):
                if problem is not None:
                    raise ValueError(problem)
            index = np.load(self.folder / "index.npy", allow_pickle=False)
            size = int(manifest["pixels"]["bytes"])
            array = np.memmap(self.folder / "pixels.u8", dtype=np.uint8, mode="c") if size else np.zeros(0, np.uint8)
        except (OSError, ValueError, KeyError, TypeError, IndexError) as err:
            if mode == "refresh":
                warnings.warn(f"decoded store {self.folder} cannot be used ({err}); decoding again", StoreWarning, 4)
            return None
        return DecodedImages(torch.from_numpy(array), index, [], [], self.view, f"read from {self.folder}")

    def decode(self, num_workers: int, desc: str, note: str) -> DecodedImages:
        """Decode the store into ``<folder>.partial`` (continuing after what an earlier build recorded and its bytes
        confirm), then rename it into place. A full disk removes the partial files and says so."""
        partial = self.folder.with_name(self.folder.name + ".partial")
        try:
            partial.mkdir(exist_ok=True)
            pixels = Segments(partial / "pixels.u8", self.key).open()
            try:
                if pixels.dropped:
                    warnings.warn(
                        f"partial decoded store {partial}: {pixels.dropped}; decoding again from row "
                        f"{len(pixels.items)}",
                        StoreWarning,
                        stacklevel=4,
                    )
                announce(note + (f", from row {len(pixels.items)}" if pixels.items else ""))
                _build([self.root / f[0] for f in self.files], self.view, pixels, num_workers, desc)
            finally:
                pixels.close()
        except OSError as err:
            if err.errno not in FULL:
                raise
            size = sum(f.stat().st_size for f in partial.glob("*") if f.is_file()) if partial.is_dir() else 0
            shutil.rmtree(partial, ignore_errors=True)
            removed = f"the partial store ({size / 2**20:,.1f} MiB at {partial}) was removed"
            raise write_failure(self.folder, err, kept=removed) from err
        self._publish(partial, pixels)
        store = self.read("refresh")
        if store is None:
            raise OSError(f"decoded store {self.folder} failed its checks right after it was written; remove it")
        return store

    def _publish(self, partial: Path, pixels: Segments) -> None:
        """Write ``index.npy`` and the manifest into the partial folder and rename it into place (a stale slot
        first removed: it holds bt_hub's own files only)."""
        items = pixels.items
        if len(items) != len(self.files):
            raise OSError(f"partial decoded store {partial} holds {len(items)} of {len(self.files)} images; run again")
        index = np.asarray([item[:4] for item in items], dtype=np.int64)
        hashes = [item[4] for item in items]
        atomic_write(partial / "index.npy", lambda f: np.save(f, index, allow_pickle=False))
        pixels.record.unlink(missing_ok=True)
        manifest = {
            "format": STORE_FORMAT,
            "key": self.key,
            "view": dataclasses.asdict(self.view),
            "describe": self.view.describe(),
            "root": str(self.root),
            "files": [[*f, sha] for f, sha in zip(self.files, hashes)],
            "content_sha256": content_key(hashes, [f[4] for f in self.files], self.view.describe()),
            "pixels": file_entry(partial / "pixels.u8"),
            "index": file_entry(partial / "index.npy"),
        }
        atomic_write_json(partial / "manifest.json", manifest)
        if self.folder.exists():
            shutil.rmtree(self.folder)
        os.replace(partial, self.folder)


# ----------------------------------------------------------------------------- where it lives


def default_directory() -> Path:
    """Where pretraining keeps its stores: ``$BT_HUB_CACHE/decoded``, else ``$XDG_CACHE_HOME/bt_hub/decoded``, else
    ``~/.cache/bt_hub/decoded``."""
    base = os.environ.get("BT_HUB_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bt_hub"
    return Path(base) / "decoded"


def small_images(dataset: Any) -> int | None:
    """Bytes of the first image of ``dataset`` decoded as RGB when its longer side is at most ``SMALL_SIDE`` (read
    from its header only), else None."""
    from PIL import Image

    refused = (OSError, ValueError, Image.DecompressionBombError)  # named by the loader's one-sentence error later
    with contextlib.suppress(*refused), Image.open(dataset.samples[0][0]) as first:
        if max(first.size) <= SMALL_SIDE:
            return 3 * first.size[0] * first.size[1]
    return None


def store_device(mode: str, nbytes: int, device: torch.device) -> torch.device:
    """Where a store's pixels are read from: the GPU for ``device``, and for ``auto`` on CUDA when they take at
    most ``DEVICE_SHARE`` of its free memory; the CPU (memory-mapped) otherwise."""
    if device.type != "cuda" or mode == "disk":
        return torch.device("cpu")
    if mode == "device":
        return device
    free, _ = torch.cuda.mem_get_info(device)
    return device if nbytes <= DEVICE_SHARE * free else torch.device("cpu")


def fits_auto(n: int, per_image: int, directory: str | os.PathLike | None) -> bool:
    """Whether ``auto`` makes a store of ``n`` images of about ``per_image`` bytes: at most ``AUTO_MAX_BYTES`` and
    half the free space of ``directory`` (of the memory available, without one)."""
    if directory is None:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    else:
        existing = Path(directory)
        while not existing.exists():
            existing = existing.parent
        free = shutil.disk_usage(existing).free
    return n * per_image <= min(AUTO_MAX_BYTES, free / 2)
