"""The decoded-image store (bt_hub/data/store.py): each file opened and decoded once, by the loader workers, for
pretraining, every extraction and every kept step of a learning curve; keyed, checked, resumable and refused when
stale."""

from __future__ import annotations

import collections
import errno
import json
import os
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from bt_hub.cli import main as cli_main
from bt_hub.common.artifacts import Segments, recorded_segments
from bt_hub.common.files import WriteError
from bt_hub.data import store as store_module
from bt_hub.data.datasets import ImageFolderDataset, is_builtin
from bt_hub.data.decode import decode_on_cpu
from bt_hub.data.store import StoreView, StoreWarning, open_store
from bt_hub.method.transforms import DeviceEvalTransform

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import file_opens  # noqa: E402

PRETRAIN = [
    "--arch", "resnet18", "--small-image-stem", "--image-size", "8", "--projector", "32-32", "--batch-size", "8",
    "--epochs", "2", "--warmup-epochs", "1", "--views", "batched", "--probe-max-dim", "0", "--log-every", "1",
    "--num-workers", "2", "--seed", "3",
]  # fmt: skip


def audited(tmp_path: Path, root: str, *argv: str) -> tuple[collections.Counter, list[str]]:
    """Run ``bt-hub argv`` under benchmarks/file_opens.py's audit hook: (opens per file, the decode lines)."""
    return file_opens.audit(root, list(argv), timeout=600)


def images_in(root: Path) -> list[str]:
    return sorted(str(p) for p in root.rglob("*.png"))


def test_pretraining_reads_each_file_once_and_equals_decoding_every_epoch(tmp_path, image_folder):
    data = image_folder(tmp_path / "data", classes=("a", "b"), per_class=12, size=8, splits=())
    store_dir = tmp_path / "stores"
    opens, decodes = audited(
        tmp_path, str(data), "pretrain", "--data", str(data), *PRETRAIN, "--out", str(tmp_path / "stored"),
        "--store", "disk", "--store-dir", str(store_dir),
    )  # fmt: skip
    assert sorted(opens) == images_in(data) and set(opens.values()) == {1}  # 2 epochs, each file opened once
    assert len(decodes) == len(opens) and not any(line.startswith("decode True") for line in decodes)
    assert len(list(store_dir.glob("*/manifest.json"))) == 1

    opens_off, decodes_off = audited(
        tmp_path, str(data), "pretrain", "--data", str(data), *PRETRAIN, "--out", str(tmp_path / "files"),
        "--store", "off",
    )  # fmt: skip
    assert set(opens_off.values()) == {2} and not any(line.startswith("decode True") for line in decodes_off)
    stored, files = (
        load_file(tmp_path / "stored/backbone.safetensors"),
        load_file(tmp_path / "files/backbone.safetensors"),
    )
    assert stored.keys() == files.keys() and all(torch.equal(stored[k], files[k]) for k in stored)


def test_a_learning_curve_opens_and_decodes_each_image_once(tmp_path, image_folder):
    small = image_folder(tmp_path / "small", classes=("a", "b"), per_class=12, size=8, splits=())
    run = tmp_path / "run"
    flags = [*PRETRAIN, "--store", "off", "--keep-every", "2", "--max-steps", "6"]
    assert cli_main(["pretrain", "--data", str(small), *flags, "--out", str(run)]) == 0
    data = image_folder(tmp_path / "data", classes=("a", "b"), per_class=100, size=8, seed=1)
    opens, decodes = audited(
        tmp_path, str(data), "eval", "compare", "--weights", str(run), "--over-steps", "--data", str(data),
        "--image-size", "8", "--protocols", "knn", "--baselines", "pixels", "random-init", "--seeds", "2",
        "--num-workers", "2", "--out", str(tmp_path / "curve"),
    )  # fmt: skip
    files = images_in(data)
    assert len(decodes) == len(files)  # once each (from the bytes read), for 3 steps, 2 baselines and 2 seeds
    assert not any(line.startswith("decode True") for line in decodes)  # the main process decodes nothing
    # besides that one read, only the splits' checks read bytes: 32 files a fingerprint, and the overlap check's
    # 64 test files with the training files of their sizes
    assert sorted(opens) == files and sum(opens.values()) <= 2 * len(files), opens


def _features(tmp_path: Path, data: Path, weights: Path, capsys, *flags: str) -> tuple[list[str], str]:
    """``eval knn`` with a feature cache: the store warnings it printed and its record."""
    out = tmp_path / f"knn{len(list(tmp_path.glob('knn*')))}"
    argv = ["eval", "knn", "--weights", str(weights), "--data", str(data), "--image-size", "8", "--out", str(out)]
    capsys.readouterr()
    assert cli_main([*argv, "--cache-dir", str(tmp_path / "cache"), *flags]) == 0
    printed = capsys.readouterr().err.splitlines()
    return [line for line in printed if "warning: decoded store" in line], (out / "results.json").read_text()


def test_features_from_the_store_equal_the_files_and_a_changed_file_makes_it_stale(
    tmp_path, image_folder, small_stem_weights, capsys
):
    data = image_folder(tmp_path / "data", classes=("a", "b"), per_class=6, size=(10, 7))
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    assert _features(ref_dir, data, small_stem_weights, capsys, "--store", "off")[0] == []
    stale, record = _features(tmp_path, data, small_stem_weights, capsys, "--store", "disk")
    assert stale == [] and "images read from" in record
    made = sorted((tmp_path / "cache").glob("*.features.npy"))
    for ref, new in zip(sorted((ref_dir / "cache").glob("*.features.npy")), made, strict=True):
        assert ref.name == new.name and np.array_equal(np.load(ref), np.load(new))  # the same bytes, bit for bit

    changed = data / "train" / "a" / "a_1.png"
    Image.fromarray(np.full((10, 7, 3), 9, np.uint8)).save(changed)
    os.utime(changed, ns=(1, 1))
    stale, _ = _features(tmp_path, data, small_stem_weights, capsys, "--store", "disk")
    assert len(stale) == 1 and "is stale: a/a_1.png changed" in stale[0] and "decoding again" in stale[0]
    assert _features(tmp_path, data, small_stem_weights, capsys, "--store", "disk")[0] == []  # rebuilt, current again


def _interrupted_at(monkeypatch, stop: Path) -> None:
    """Make the next store build stop, as a Ctrl-C stops it, when its loader reaches the file ``stop``."""
    real = store_module._StoreItems.__getitem__

    def item(self, i):
        if self.paths[i] == stop:
            monkeypatch.setattr(store_module._StoreItems, "__getitem__", real)  # once
            raise KeyboardInterrupt
        return real(self, i)

    monkeypatch.setattr(store_module._StoreItems, "__getitem__", item)
    monkeypatch.setattr(store_module, "SAVE_EVERY_S", 0.0)


def test_a_build_cut_short_continues_at_its_last_record_and_equals_a_whole_build(tmp_path, image_folder, monkeypatch):
    data = image_folder(tmp_path / "data", classes=("a", "b"), per_class=80, size=12, splits=())
    dataset = ImageFolderDataset(data)
    view = StoreView(8, 9)
    whole = open_store(dataset, view, tmp_path / "whole")
    _interrupted_at(monkeypatch, Path(dataset.samples[150][0]))  # in the third batch of 64
    with pytest.raises(KeyboardInterrupt):
        open_store(dataset, view, tmp_path / "cut")
    partial = next((tmp_path / "cut").glob("*.partial"))
    assert not list((tmp_path / "cut").glob("*/manifest.json")) and (partial / "pixels.u8.progress.jsonl").exists()
    calls = []
    monkeypatch.setattr(store_module, "decode_on_cpu", lambda item: calls.append(item) or decode_on_cpu(item))
    resumed = open_store(ImageFolderDataset(data), view, tmp_path / "cut")
    assert len(calls) == 160 - 128  # after the two batches recorded
    assert not partial.exists() and len(resumed) == len(whole) == 160
    assert torch.equal(resumed.pixels, whole.pixels) and np.array_equal(resumed.index, whole.index)
    decoded = [torch.from_numpy(np.array(Image.open(p).convert("RGB"))).permute(2, 0, 1) for p, _ in dataset.samples]
    assert torch.equal(resumed.batch(range(5), "cpu"), DeviceEvalTransform(8, 9).crop(torch.stack(decoded[:5])))


def test_a_damaged_store_is_decoded_again_with_a_warning(tmp_path, image_folder):
    data = image_folder(tmp_path / "data", classes=("a",), per_class=5, size=8, splits=())
    dataset = ImageFolderDataset(data)
    first = open_store(dataset, StoreView(), tmp_path / "s")
    expected = first.pixels.clone()
    pixels = next((tmp_path / "s").glob("*/pixels.u8"))
    pixels.write_bytes(b"\0" * pixels.stat().st_size)
    damaged = r"cannot be used \(.*pixels.u8 does not match the sha256 recorded when it was written"
    with pytest.warns(StoreWarning, match=damaged):
        again = open_store(dataset, StoreView(), tmp_path / "s")
    assert torch.equal(again.pixels, expected) and again.shape == (3, 8, 8)


def test_a_run_of_consecutive_images_is_a_view_of_the_store_and_any_other_batch_a_gather(tmp_path, image_folder):
    data = image_folder(tmp_path / "data", classes=("a", "b"), per_class=4, size=6, splits=())
    store = open_store(ImageFolderDataset(data), StoreView(), None)
    assert store.where == "in memory" and store.shape == (3, 6, 6) and len(store) == 8
    run = store.batch(range(2, 6), "cpu")
    assert run.data_ptr() == store.image(2).data_ptr()  # no copy
    shuffled = store.batch([5, 0, 7], "cpu")
    assert all(torch.equal(shuffled[k], store.image(i)) for k, i in enumerate([5, 0, 7]))
    decoded = np.array(Image.open(ImageFolderDataset(data).samples[7][0]).convert("RGB"))
    assert torch.equal(store.image(7), torch.from_numpy(decoded).permute(2, 0, 1))


def _swap_bytes_keeping_stat_times(a: Path, b: Path) -> None:
    """Exchange the bytes of two files of one size and put their atime and mtime back (``touch -r``, a restore)."""
    times = [(p.stat().st_atime_ns, p.stat().st_mtime_ns) for p in (a, b)]
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    for path, ns in zip((a, b), times):
        os.utime(path, ns=ns)


def _flat_folder(root: Path, per_class: int = 6) -> Path:
    """Dark images in class a and bright ones in class b, every PNG stored uncompressed (one size for all)."""
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c, low in (("a", 0), ("b", 160)):
            (root / split / c).mkdir(parents=True)
            for i in range(per_class):
                image = rng.integers(low, low + 96, (8, 8, 3), dtype=np.uint8)
                Image.fromarray(image).save(root / split / c / f"{c}_{i}.png", compress_level=0)
    return root


def test_bytes_swapped_between_classes_with_their_mtimes_put_back_are_decoded_again(
    tmp_path, small_stem_weights, capsys
):
    # Guards: the store's key was each file's name, size, mtime and label, so same-size files whose bytes were
    # swapped and whose mtimes were put back (touch -r, a restore from a backup) were served from the stale store:
    # kNN scored 100 again where the changed folder scores far lower, and the record said the features were new.
    data = _flat_folder(tmp_path / "data")
    _, before = _features(tmp_path, data, small_stem_weights, capsys, "--store", "disk")
    for i in range(6):
        _swap_bytes_keeping_stat_times(data / "train/a" / f"a_{i}.png", data / "train/b" / f"b_{i}.png")
    stale, after = _features(tmp_path, data, small_stem_weights, capsys, "--store", "disk")
    fresh = tmp_path / "fresh"
    argv = ["eval", "knn", "--weights", str(small_stem_weights), "--data", str(data), "--image-size", "8"]
    assert cli_main([*argv, "--store", "off", "--out", str(fresh)]) == 0
    top1 = [json.loads(text)["metrics"]["top1"] for text in (before, after)]
    assert top1[1] == json.loads((fresh / "results.json").read_text())["metrics"]["top1"] != top1[0]
    assert len(stale) == 1 and "changed (ctime, and its bytes)" in stale[0]


def test_a_file_whose_ctime_alone_moved_is_hashed_again_and_the_store_kept(tmp_path, image_folder, monkeypatch):
    data = image_folder(tmp_path / "data", classes=("a", "b"), per_class=3, size=6, splits=())
    first = open_store(ImageFolderDataset(data), StoreView(), tmp_path / "s")
    for path in data.rglob("*.png"):
        os.chmod(path, 0o600)  # moves ctime, not the bytes
    monkeypatch.setattr(store_module, "_build", lambda *a: pytest.fail("decoded again"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", StoreWarning)
        again = open_store(ImageFolderDataset(data), StoreView(), tmp_path / "s")
    assert torch.equal(again.pixels, first.pixels)
    manifest = json.loads(next((tmp_path / "s").glob("*/manifest.json")).read_text())
    ctimes = [Path(p).stat().st_ctime_ns for p, _ in ImageFolderDataset(data).samples]
    assert [row[3] for row in manifest["files"]] == ctimes  # brought up to date: the next open hashes nothing


def test_a_partial_store_cut_inside_its_recorded_rows_decodes_them_again_never_as_zeros(
    tmp_path, image_folder, monkeypatch
):
    # Guards: a killed build whose pixels.u8 was cut to half its recorded length continued after the record, the
    # gap filled with zeros (black images) in a store that then passed every check.
    data = image_folder(tmp_path / "data", classes=("a", "b"), per_class=80, size=12, splits=())
    dataset = ImageFolderDataset(data)
    view = StoreView(8, 9)
    whole = open_store(dataset, view, tmp_path / "whole")
    _interrupted_at(monkeypatch, Path(dataset.samples[150][0]))  # in the third batch of 64: two segments recorded
    with pytest.raises(KeyboardInterrupt):
        open_store(dataset, view, tmp_path / "cut")
    pixels = next((tmp_path / "cut").glob("*.partial")) / "pixels.u8"
    recorded = recorded_segments(pixels.with_name("pixels.u8.progress.jsonl"))[-1]["end"]
    os.truncate(pixels, recorded // 2)
    damaged = r"bytes from 12,288 on are not what was recorded \(cut or changed\); decoding again from row 64"
    with pytest.warns(StoreWarning, match=damaged):  # the first batch's segment (64 images of 8 x 8 x 3) is kept
        resumed = open_store(ImageFolderDataset(data), view, tmp_path / "cut")
    assert torch.equal(resumed.pixels, whole.pixels) and np.array_equal(resumed.index, whole.index)


def test_a_store_that_fills_the_disk_removes_its_partial_files_and_says_so(tmp_path, image_folder, monkeypatch):
    data = image_folder(tmp_path / "data", classes=("a",), per_class=70, size=8, splits=())
    written = []

    def full(self, data, items=()):
        if written:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written.append(len(data))
        real_write(self, data, items)

    real_write = Segments.write
    monkeypatch.setattr(Segments, "write", full)
    full_disk = r"no space is left on the device; .*\(the partial store \(.* MiB at .*\.partial\) was removed\)"
    with pytest.raises(WriteError, match=full_disk):
        open_store(ImageFolderDataset(data), StoreView(), tmp_path / "s")
    assert list((tmp_path / "s").iterdir()) == []  # no partial file is left filling the disk, nor a lock


def _listing(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*")}


def test_a_whole_store_on_read_only_storage_is_read_without_writing_and_anything_else_refused(
    tmp_path, image_folder, read_only, capsys
):
    # Guards: a shared, read-only store folder gave a raw "[Errno 30] Read-only file system: '...lock'".
    data = image_folder(tmp_path / "data", classes=("a", "b"), per_class=3, size=6, splits=())
    first = open_store(ImageFolderDataset(data), StoreView(), tmp_path / "s")
    before = _listing(tmp_path / "s")
    read_only(tmp_path / "s")
    again = open_store(ImageFolderDataset(data), StoreView(), tmp_path / "s")
    assert torch.equal(again.pixels, first.pixels) and _listing(tmp_path / "s") == before
    other = image_folder(tmp_path / "other", classes=("a", "b"), per_class=8, size=6, splits=())
    argv = ["pretrain", "--data", str(other), *PRETRAIN, "--out", str(tmp_path / "run"), "--store", "disk"]
    capsys.readouterr()
    assert cli_main([*argv, "--store-dir", str(tmp_path / "s")]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "Read-only file system" in said[0] and "give --store-dir a writable folder" in said[0]
    assert _listing(tmp_path / "s") == before


def test_eval_with_a_cache_dir_on_read_only_storage_reads_what_is_whole_and_names_the_flag_otherwise(
    tmp_path, small_stem_weights, read_only, capsys
):
    # guards: features not in a read-only --cache-dir ended in "[Errno 30] Read-only file system: '....partial'"
    data = _flat_folder(tmp_path / "data", per_class=3)
    _, first = _features(tmp_path, data, small_stem_weights, capsys, "--store", "disk")
    read_only(tmp_path / "cache")
    _, again = _features(tmp_path, data, small_stem_weights, capsys, "--store", "disk")
    assert json.loads(again)["metrics"] == json.loads(first)["metrics"]
    argv = ["eval", "knn", "--weights", str(small_stem_weights), "--data", str(data), "--image-size", "16"]
    for store in ("disk", "off"):  # a new store, or new features, would have to be written there
        out = ["--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / f"k16{store}"), "--store", store]
        capsys.readouterr()
        assert cli_main([*argv, *out]) == 2
        said = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(said) == 1 and "(Read-only file system)" in said[0] and "give --cache-dir a writable" in said[0]


def test_a_folder_whose_name_starts_with_synthetic_is_read_as_a_folder(tmp_path, image_folder, monkeypatch):
    # Guards: "is --data a built-in set?" was spelled five ways, and pretraining took any name starting with
    # "synthetic" for the built-in set: --data synthetic_shapes (a folder) was decoded in the main process, its
    # --store disk ignored without a word.
    monkeypatch.chdir(tmp_path)
    image_folder(tmp_path / "synthetic_shapes", classes=("a", "b"), per_class=8, size=8, splits=())
    argv = ["pretrain", "--data", "synthetic_shapes", *PRETRAIN, "--max-steps", "1", "--out", "run"]
    assert cli_main([*argv, "--store", "disk", "--store-dir", "stores"]) == 0
    assert len(list((tmp_path / "stores").glob("*/manifest.json"))) == 1
    assert is_builtin("synthetic:40") and is_builtin("digits") and not is_builtin("synthetic_shapes")
