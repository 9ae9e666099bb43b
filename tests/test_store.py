"""The decoded-image store (bt_hub/data/store.py): each file opened and decoded once, by the loader workers, for
pretraining, every extraction and every kept step of a learning curve; keyed, checked, resumable and refused when
stale."""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from bt_hub.cli import main as cli_main
from bt_hub.common.images import ImageFileError
from bt_hub.data import store as store_module
from bt_hub.data.datasets import ImageFolderDataset
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


def test_a_build_cut_short_continues_at_its_last_record_and_equals_a_whole_build(tmp_path, image_folder, monkeypatch):
    data = image_folder(tmp_path / "data", classes=("a", "b"), per_class=80, size=12, splits=())
    dataset = ImageFolderDataset(data)
    view = StoreView(8, 9)
    whole = open_store(dataset, view, tmp_path / "whole")
    broken = Path(dataset.samples[150][0])  # in the third batch of 64
    good = broken.read_bytes()
    broken.write_bytes(good[:40])
    monkeypatch.setattr(store_module, "SAVE_EVERY_S", 0.0)
    with pytest.raises(ImageFileError, match=f"image {broken} is corrupt"):
        open_store(dataset, view, tmp_path / "cut")
    partial = next((tmp_path / "cut").glob("*.partial"))
    assert not list((tmp_path / "cut").glob("*/manifest.json")) and (partial / "progress.json").exists()
    broken.write_bytes(good)
    os.utime(broken, ns=(Path(dataset.samples[0][0]).stat().st_mtime_ns,) * 2)
    resumed = open_store(ImageFolderDataset(data), view, tmp_path / "cut")
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
    with pytest.warns(StoreWarning, match=r"cannot be used \(.*pixels.u8 is not the file that was written"):
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
