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
- ``manifest.json``, written last: the key, every file's relative name, size, mtime, label and the sha256 of
  the bytes the worker decoded (no sampling), the view, and the size and sha256 of ``pixels.u8`` and
  ``index.npy``.

Checks: the key is the sha256 of the view and of every file's name, size, mtime and label, taken with ``stat``
(no file is opened to check it). A slot whose manifest has another key is stale: it is not used, a warning names
the first file that changed, and the store is decoded again. ``pixels.u8`` and ``index.npy`` are checked against
their recorded sizes and sha256 on every open, as the feature cache checks its files.

Writing: into ``<slot>.partial/`` under an exclusive lock, with the rows done recorded every few seconds; a kill
leaves a partial store that the next run continues from its last recorded row; the finished folder is renamed
into place, so a reader never sees half a store. Without a directory (``eval compare`` with no ``--out``), the
store is built the same way in memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
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

from bt_hub.common.files import atomic_write, atomic_write_json, file_sha256
from bt_hub.common.progress import announce, progress
from bt_hub.common.signals import ignore_group_signals
from bt_hub.data.decode import PackedItems, collate_packed, decode_on_cpu, read_encoded
from bt_hub.method.transforms import DeviceEvalTransform

STORE_MODES = ("auto", "off", "disk", "device")
STORE_FORMAT = 1
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
    """The common root of the files and each one's [relative name, size, mtime_ns, label] (``stat`` only)."""
    paths = [Path(p) for p, _ in samples]
    root = Path(os.path.commonpath([str(p.parent) for p in paths])) if paths else Path(".")
    rows = []
    for path, (_, label) in zip(paths, samples):
        st = path.stat()
        rows.append([path.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns, int(label)])
    return root, rows


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _first_change(old: list[list[Any]], new: list[list[Any]]) -> str:
    """The first file whose name, size, mtime or label differs, in one phrase."""
    if len(old) != len(new):
        return f"it holds {len(old)} files, the folder now {len(new)}"
    for (name, size, mtime, label), now in zip(old, new):
        if [name, size, mtime, label] != now:
            what = "size" if size != now[1] else "mtime" if mtime != now[2] else "name or label"
            return f"{name} changed ({what})"
    return "its list of files differs"


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


class _Progress:
    """A partial store's rows, offsets and file hashes so far, recorded atomically in ``progress.json``."""

    def __init__(self, folder: Path, key: str) -> None:
        self.folder, self.key = folder, key
        self.index: list[list[int]] = []
        self.hashes: list[str] = []
        self.bytes = 0

    def resume(self) -> None:
        """Take up what a killed build recorded (nothing when its key differs or its record is unreadable)."""
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            saved = json.loads((self.folder / "progress.json").read_text())
            if saved["key"] == self.key and len(saved["index"]) == len(saved["hashes"]):
                self.index, self.hashes, self.bytes = saved["index"], saved["hashes"], int(saved["bytes"])

    def save(self) -> None:
        state = {"key": self.key, "bytes": self.bytes, "index": self.index, "hashes": self.hashes}
        atomic_write(self.folder / "progress.json", lambda f: f.write(json.dumps(state).encode()))


def _build(
    paths: Sequence[Path], view: StoreView, sink: Any, done: _Progress, num_workers: int, desc: str, save: Any
) -> None:
    """Decode ``paths[len(done.index):]`` in loader workers, appending each batch's bytes to ``sink``."""
    first = len(done.index)
    loader = DataLoader(
        _StoreItems(paths[first:], view),
        batch_size=BATCH,
        num_workers=num_workers,
        collate_fn=_collate,
        worker_init_fn=ignore_group_signals,  # a group SIGTERM is the main process's to answer
    )
    last_save = time.monotonic()
    for packed, hashes in progress(loader, desc, unit="batch"):
        sink.write(memoryview(packed.data.numpy()))
        for shape in packed.shapes:
            done.index.append([done.bytes, *(int(v) for v in shape)])
            done.bytes += shape.numel()
        done.hashes.extend(hashes)
        if save is not None and time.monotonic() - last_save >= SAVE_EVERY_S:
            save()
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
) -> DecodedImages:
    """The decoded store of ``dataset``'s files (an ImageFolder-style ``samples`` list) as ``view`` says:
    read from ``directory`` when a whole, current store is there, else decoded now (continuing a partial one)."""
    samples = list(dataset.samples)
    if not samples:
        raise ValueError("a decoded store needs at least one image file")
    root, files = _files(samples)
    paths = [root / f[0] for f in files]
    key = _digest(STORE_FORMAT, view.describe(), files)
    targets, classes = [label for _, label in samples], list(getattr(dataset, "classes", []))
    per_image = 3 * view.crop * view.crop if view.crop else None
    if directory is None:
        announce(_size_note(len(paths), view, "in memory", per_image))
        buffer = io.BytesIO()
        done = _Progress(Path("."), key)
        _build(paths, view, buffer, done, num_workers, desc, None)
        pixels = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
        return DecodedImages(pixels, np.asarray(done.index, dtype=np.int64), targets, classes, view, "in memory")
    slot = Path(directory) / _digest(STORE_FORMAT, view.describe(), [[f[0], f[3]] for f in files], str(root))[:24]
    slot.parent.mkdir(parents=True, exist_ok=True)
    with _locked(slot):
        found = _read(slot, key, files, targets, classes, view)
        if found is not None:
            return found
        partial = slot.with_name(slot.name + ".partial")
        partial.mkdir(exist_ok=True)
        done = _Progress(partial, key)
        done.resume()
        announce(
            _size_note(len(paths), view, f"at {slot}", per_image)
            + (f", from row {len(done.index)}" if done.index else "")
        )
        with open(partial / "pixels.u8", "r+b" if (partial / "pixels.u8").exists() else "wb") as f:
            f.truncate(done.bytes)  # what a killed build wrote past its last record
            f.seek(done.bytes)

            def save() -> None:
                f.flush()
                os.fsync(f.fileno())
                done.save()

            _build(paths, view, f, done, num_workers, desc, save)
            save()
        _finish(partial, slot, key, root, files, done, view)
        store = _read(slot, key, files, targets, classes, view)
        if store is None:
            raise OSError(f"decoded store {slot} failed its checks right after it was written; remove it and run again")
        return store


@contextlib.contextmanager
def _locked(slot: Path) -> Any:
    """An exclusive lock on ``<slot>.lock``: one process builds a store at a time; the others wait, then read it."""
    fd = os.open(slot.with_name(slot.name + ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _finish(
    partial: Path, slot: Path, key: str, root: Path, files: list[list[Any]], done: _Progress, view: StoreView
) -> None:
    """Write ``index.npy`` and the manifest into the partial folder and rename it into place (a stale slot first
    removed: it holds bt_hub's own files only)."""
    index = np.asarray(done.index, dtype=np.int64)
    atomic_write(partial / "index.npy", lambda f: np.save(f, index, allow_pickle=False))
    (partial / "progress.json").unlink(missing_ok=True)
    manifest = {
        "format": STORE_FORMAT,
        "key": key,
        "view": dataclasses.asdict(view),
        "describe": view.describe(),
        "root": str(root),
        "files": [[*f, sha] for f, sha in zip(files, done.hashes)],
        "content_sha256": _digest([sha for sha in done.hashes], [f[3] for f in files], view.describe()),
        "pixels": {"bytes": done.bytes, "sha256": file_sha256(partial / "pixels.u8")},
        "index": {"bytes": (partial / "index.npy").stat().st_size, "sha256": file_sha256(partial / "index.npy")},
    }
    atomic_write_json(partial / "manifest.json", manifest)
    if slot.exists():
        shutil.rmtree(slot)
    os.replace(partial, slot)


def _read(
    slot: Path, key: str, files: list[list[Any]], targets: list[int], classes: list[str], view: StoreView
) -> DecodedImages | None:
    """The store in ``slot`` when it is whole and current; None (with a warning when one was there) otherwise."""
    manifest_path = slot / "manifest.json"
    if not manifest_path.exists():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("key") != key:
            old = [f[:4] for f in manifest.get("files", [])]
            warnings.warn(
                f"decoded store {slot} is stale: {_first_change(old, files)} since it was written; decoding again",
                StoreWarning,
                stacklevel=3,
            )
            return None
        for name in ("pixels.u8", "index.npy"):
            entry = manifest["pixels" if name == "pixels.u8" else "index"]
            path = slot / name
            if path.stat().st_size != entry["bytes"] or file_sha256(path) != entry["sha256"]:
                raise ValueError(f"{path} is not the file that was written (size or sha256 differ)")
        index = np.load(slot / "index.npy", allow_pickle=False)
        size = int(manifest["pixels"]["bytes"])
        array = np.memmap(slot / "pixels.u8", dtype=np.uint8, mode="c") if size else np.zeros(0, np.uint8)
    except (OSError, ValueError, KeyError, TypeError) as err:
        warnings.warn(f"decoded store {slot} cannot be used ({err}); decoding again", StoreWarning, stacklevel=3)
        return None
    return DecodedImages(torch.from_numpy(array), index, targets, classes, view, f"read from {slot}")


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
