"""bt_hub.eval.features: order, pools, transforms, fingerprints, the on-disk cache, and extraction through the
pretraining pipeline (decode, resize and crop on the device) and in bf16."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image
from torch import nn

from bt_hub import cli
from bt_hub.common.artifacts import recorded_segments
from bt_hub.common.images import open_rgb
from bt_hub.data.datasets import ArrayImageDataset, build_dataset, dataset_fingerprint
from bt_hub.data.decode import decode_images, read_encoded
from bt_hub.eval.feature_cache import FeatureCache
from bt_hub.eval.features import (
    as_float32,
    extract_features,
    module_fingerprint,
    train_transform,
)
from bt_hub.eval.heads import score_heads, train_heads
from bt_hub.eval.knn import knn_classify
from bt_hub.eval.splits import load_splits
from bt_hub.method.model import build_backbone
from bt_hub.method.transforms import IMAGENET_STD, DeviceEvalTransform, eval_transforms


def _dataset(n: int = 10, size: int = 8, seed: int = 0) -> ArrayImageDataset:
    rng = np.random.default_rng(seed)
    return ArrayImageDataset(
        rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8), np.arange(n) % 3, ["a", "b", "c"]
    )


class MeanColour(nn.Module):
    """A 'backbone' whose feature is the per-channel mean: easy to check by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x.mean(dim=(2, 3)) * self.scale


def _to_tensor(image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1)


def test_features_come_back_in_dataset_order_with_labels():
    data = _dataset(10)
    feats, labels = extract_features(MeanColour(), data, transform=_to_tensor, batch_size=3)
    expected = torch.from_numpy(data.images.astype(np.float32).mean(axis=(1, 2)))
    assert feats.dtype == torch.float32 and feats.shape == (10, 3)
    torch.testing.assert_close(feats, expected)
    assert labels.tolist() == data.targets


def test_voc_res5_pool_is_8192_dimensional_at_224_and_averages_6x6_windows_of_res5():
    backbone = build_backbone("resnet50")
    x = torch.randn(1, 3, 224, 224)
    res5, _ = extract_features(backbone, [(x[0], 0)], transform=lambda t: t, pool="voc_res5")
    assert res5.shape == (1, 8192)
    with torch.no_grad():
        backbone.eval()  # extraction restored training mode
        m = backbone.layer4(
            backbone.layer3(
                backbone.layer2(backbone.layer1(backbone.maxpool(backbone.relu(backbone.bn1(backbone.conv1(x))))))
            )
        )
    assert m.shape[-2:] == (7, 7)
    grid = res5[0].view(2048, 2, 2)  # channel-major flatten of the 2x2 map, as VISSL
    torch.testing.assert_close(grid[:, 0, 0], m[0, :, :6, :6].mean(dim=(1, 2)))
    torch.testing.assert_close(grid[:, 1, 0], m[0, :, 1:, :6].mean(dim=(1, 2)))


def test_voc_res5_pool_rejects_a_res5_map_smaller_than_6x6():
    with pytest.raises(ValueError, match="at least 6x6"):
        extract_features(
            build_backbone("resnet18"), [(torch.randn(3, 64, 64), 0)], transform=lambda t: t, pool="voc_res5"
        )


def test_extraction_restores_training_mode_and_uses_eval_mode_inside():
    class ModeProbe(MeanColour):
        def forward(self, x):
            assert not self.training
            return super().forward(x)

    net = ModeProbe().train()
    extract_features(net, _dataset(4), transform=_to_tensor, batch_size=2)
    assert net.training


def test_second_call_with_the_same_cache_key_does_not_run_the_model(tmp_path):
    data = _dataset(7)
    net = MeanColour()
    cache = FeatureCache(tmp_path / "cache", module_fingerprint(net), dataset_fingerprint(data))
    first, labels1 = extract_features(net, data, transform=_to_tensor, batch_size=3, cache=cache)
    calls = net.calls
    assert calls == 3
    second, labels2 = extract_features(net, data, transform=_to_tensor, batch_size=3, cache=cache)
    assert net.calls == calls
    assert isinstance(second, np.memmap)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second))
    assert labels1.tolist() == labels2.tolist() == data.targets
    # the key holds across processes: no memory address of the transform goes into it
    from bt_hub.eval.features import describe_transform

    assert "0x" not in describe_transform(_to_tensor) and "_to_tensor" in describe_transform(_to_tensor)
    # another pool or dtype is another key: the model runs again
    extract_features(net, data, transform=_to_tensor, batch_size=3, cache=cache, dtype="float16")
    assert net.calls == calls + 3


def test_float16_cache_holds_half_precision_rows_readable_as_float32(tmp_path):
    data = _dataset(5)
    net = MeanColour()
    full, _ = extract_features(net, data, transform=_to_tensor)
    cache = FeatureCache(tmp_path, "w", dataset_fingerprint(data))
    half, _ = extract_features(net, data, transform=_to_tensor, cache=cache, dtype="float16")
    assert half.dtype == np.float16
    torch.testing.assert_close(as_float32(half, 1, 4), full[1:4], atol=0.2, rtol=1e-3)
    assert len(list(tmp_path.glob("*.npy"))) == 2 and len(list(tmp_path.glob("*.meta.json"))) == 1


def test_dataset_fingerprint_changes_with_pixels_labels_and_files(tmp_path):
    a, b = _dataset(6, seed=0), _dataset(6, seed=0)
    assert dataset_fingerprint(a) == dataset_fingerprint(b)
    b.targets[0] = 2
    assert dataset_fingerprint(a) != dataset_fingerprint(b)
    assert dataset_fingerprint(a) != dataset_fingerprint(_dataset(6, seed=1))
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "1.png").write_bytes(b"12")
    before = dataset_fingerprint(tmp_path)
    (tmp_path / "x" / "2.png").write_bytes(b"3")
    assert dataset_fingerprint(tmp_path) != before


def test_module_fingerprint_follows_the_weights():
    net = MeanColour()
    before = module_fingerprint(net)
    with torch.no_grad():
        net.scale.add_(1)
    assert module_fingerprint(net) != before


def test_eval_transform_is_resize_256_center_crop_224_and_train_transform_crops_at_size():
    from PIL import Image

    image = Image.fromarray(np.zeros((300, 400, 3), dtype=np.uint8))
    t = eval_transforms(224)
    assert t.transforms[0].size == 256 and t.transforms[1].size == (224, 224)
    assert t(image).shape == (3, 224, 224)
    assert eval_transforms(32).transforms[0].size == round(32 * 256 / 224)
    assert train_transform(64)(image).shape == (3, 64, 64)


def test_global_batches_interleave_ranks_so_gathered_steps_are_in_dataset_order():
    from bt_hub.eval.features import _global_batches

    n, batch, world = 10, 3, 2
    per_rank = [_global_batches(n, batch, world, r) for r in range(world)]
    assert per_rank[1][-1] == [9, 9, 9]  # padded to equal shapes for the gather
    order = []
    for step in zip(*per_rank):
        gathered = [i for rank_batch in step for i in rank_batch]
        order += gathered[: min(len(gathered), n - len(order))]
    assert order == list(range(n))


def _ddp_worker(rank: int, init_file: str, out_dir: str) -> None:
    import traceback
    from pathlib import Path

    try:
        torch.set_num_threads(1)
        torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
        data = _dataset(11)
        feats, labels = extract_features(MeanColour(), data, transform=_to_tensor, batch_size=2)
        cache = FeatureCache(Path(out_dir) / "cache", "w", dataset_fingerprint(data))
        cached, cached_labels = extract_features(MeanColour(), data, transform=_to_tensor, batch_size=2, cache=cache)
        torch.save(
            {
                "feats": feats,
                "labels": labels,
                "cached": torch.from_numpy(np.array(cached)),
                "cached_labels": cached_labels,
            },
            Path(out_dir) / f"rank{rank}.pt",
        )
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@pytest.mark.ddp
def test_two_ranks_shard_extraction_and_both_get_every_feature_in_dataset_order(tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_ddp_worker, args=(r, str(tmp_path / "init"), str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
        if p.is_alive():
            p.kill()
    errors = {f.name: f.read_text() for f in tmp_path.glob("rank*.err")}
    assert all(p.exitcode == 0 for p in procs), errors
    data = _dataset(11)
    expected, _ = extract_features(MeanColour(), data, transform=_to_tensor)
    for r in range(2):
        out = torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
        torch.testing.assert_close(out["feats"], expected)
        torch.testing.assert_close(out["cached"], expected)
        assert out["labels"].tolist() == out["cached_labels"].tolist() == data.targets
    assert len(list((tmp_path / "cache").glob("*.meta.json"))) == 1


def test_cache_key_covers_weights_model_data_transform_pool_dtype_and_precision():
    base = FeatureCache("c", "w", "d", "m").key("t", "avg", "float32", "float32")
    others = [
        FeatureCache("c", "w2", "d", "m").key("t", "avg", "float32", "float32"),
        FeatureCache("c", "w", "d", "m2").key("t", "avg", "float32", "float32"),
        FeatureCache("c", "w", "d2", "m").key("t", "avg", "float32", "float32"),
        FeatureCache("c", "w", "d", "m").key("t2", "avg", "float32", "float32"),
        FeatureCache("c", "w", "d", "m").key("t", "voc_res5", "float32", "float32"),
        FeatureCache("c", "w", "d", "m").key("t", "avg", "float16", "float32"),
        FeatureCache("c", "w", "d", "m").key("t", "avg", "float32", "autocast float16"),
    ]
    assert len({base, *others}) == 8


def test_another_pool_with_the_same_cache_runs_the_model_again(tmp_path):
    backbone = build_backbone("resnet18")
    data = [(torch.randn(3, 224, 224), 0)]
    cache = FeatureCache(tmp_path, module_fingerprint(backbone), "d")
    avg, _ = extract_features(backbone, data, transform=lambda t: t, cache=cache)
    res5, _ = extract_features(backbone, data, transform=lambda t: t, cache=cache, pool="voc_res5")
    assert (avg.shape, res5.shape) == ((1, 512), (1, 2048))
    assert len(list(tmp_path.glob("*.features.npy"))) == 2


def test_cli_cache_recomputes_for_another_image_size_or_weights_and_reuses_otherwise(
    image_folder, seeded_weights, tmp_path
):
    import json

    from bt_hub import cli

    image_folder(tmp_path / "data", classes=("a", "b"), per_class=3, size=12)
    weights = {seed: seeded_weights("resnet18", seed=seed, small_image_stem=True) for seed in (0, 1)}
    cache = tmp_path / "cache"

    def knn(seed: int, size: int, out: str) -> dict:
        argv = [
            "eval",
            "knn",
            "--weights",
            str(weights[seed]),
            "--data",
            str(tmp_path / "data"),
            "--image-size",
            str(size),
            "--k",
            "1",
            "--cache-dir",
            str(cache),
            "--out",
            str(tmp_path / out),
        ]
        assert cli.main(argv) == 0
        return json.loads((tmp_path / out / "results.json").read_text())

    def cached_files() -> int:
        return len(list(cache.glob("*.features.npy")))

    first = knn(0, 8, "a")
    assert cached_files() == 2
    assert knn(0, 8, "b")["metrics"] == first["metrics"] and cached_files() == 2  # the same request reuses the files
    knn(0, 12, "c")
    assert cached_files() == 4  # another --image-size is another transform: computed again
    knn(1, 8, "d")
    assert cached_files() == 6  # other weights: computed again
    metas = [json.loads(p.read_text()) for p in cache.glob("*.meta.json")]
    assert len({m["transform"] for m in metas}) == 2 and len({m["weights"] for m in metas}) == 2


def test_a_rerun_removes_the_stale_temp_files_interrupted_writes_left_in_the_cache_dir_and_out(
    image_folder, seeded_weights, tmp_path
):
    # Guards: a killed extraction's temp file (a full-size features file) stayed in --cache-dir for good.
    import fcntl
    import os

    from bt_hub import cli

    image_folder(tmp_path / "data", classes=("a", "b"), per_class=3, size=12)
    cache, out = tmp_path / "cache", tmp_path / "ev"
    argv = ["eval", "knn", "--weights", str(seeded_weights("resnet18", small_image_stem=True)), "--k", "1"]
    argv += ["--data", str(tmp_path / "data"), "--image-size", "8", "--cache-dir", str(cache), "--out", str(out)]
    assert cli.main(argv) == 0
    left = [cache / ".0123abcd.features.npy.0a1b2c3d.tmp", out / ".results.json.1b2c3d4e.tmp"]
    for path in left:
        path.write_bytes(b"\x93NUMPY cut short")
        os.utime(path, (path.stat().st_mtime - 3600,) * 2)
    left.append(cache / ".0123abcd.labels.npy.3d4e5f6a.tmp")  # a write killed a moment ago: no lock, a leftover
    left[-1].write_bytes(b"")
    live = cache / ".0123abcd.features.npy.2c3d4e5f.tmp"
    with open(live, "wb") as writer:
        fcntl.flock(writer, fcntl.LOCK_EX)  # as atomic_write holds it until its rename
        assert cli.main(argv) == 0
    assert not [p for p in left if p.exists()] and live.exists()


def test_a_same_size_edit_of_any_training_image_invalidates_the_cached_features(
    small_stem_weights, image_folder, tmp_path
):
    # guards: the cache key hashed 32 sampled files, so after same-size edits of other training images a cached
    # evaluation reported 100.0 where the true result was 0.0, with no warning
    import os

    from bt_hub.eval.knn import KnnConfig
    from bt_hub.eval.runner import evaluation

    root = image_folder(tmp_path / "data", classes=("a", "b"), per_class=40, size=8)
    config = KnnConfig(
        weights=str(small_stem_weights), data=str(root), image_size=8, out=None, cache_dir=str(tmp_path / "c")
    )
    with evaluation(config) as run:
        first, _ = run.features("train")
        first = np.array(first)
    victim = sorted((root / "train" / "a").iterdir())[1]  # not one of the sampled files
    before = victim.stat()
    other = sorted((root / "train" / "b").iterdir())[1].read_bytes()
    victim.write_bytes(other[: before.st_size].ljust(before.st_size, b"\0") if len(other) >= before.st_size else other)
    os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    with evaluation(config) as run:
        second, _ = run.features("train")
        assert run.features_used["train"].startswith("computed, images read from")  # the store, decoded again
    row = sorted(p.name for p in (root / "train" / "a").iterdir()).index(victim.name)
    assert not np.allclose(np.asarray(second)[row], first[row])


def test_an_extraction_cut_short_continues_from_its_last_whole_part_to_the_same_features(
    small_stem_weights, tmp_path, monkeypatch
):
    # guards: Ctrl-C said "run the same command again to continue", but the rerun extracted from batch 1 again
    import bt_hub.eval.feature_cache as feature_cache
    from bt_hub.eval.knn import KnnConfig
    from bt_hub.eval.runner import evaluation

    monkeypatch.setattr(feature_cache, "PART_ROWS", 16)  # a part every 2 batches of 8
    config = dict(weights=str(small_stem_weights), data="synthetic:80", image_size=8, batch_size=8, out=None)
    with evaluation(KnnConfig(**config, cache_dir=str(tmp_path / "whole"))) as run:
        whole = np.array(run.features("train")[0])
    cut = KnnConfig(**config, cache_dir=str(tmp_path / "cut"))
    with evaluation(cut) as run:
        net, calls = run.weights.network, []
        forward = net.forward

        def stop_at_the_fifth_batch(x):
            calls.append(len(x))
            if len(calls) == 5:
                raise KeyboardInterrupt
            return forward(x)

        monkeypatch.setattr(net, "forward", stop_at_the_fifth_batch)
        with pytest.raises(KeyboardInterrupt):
            run.features("train")
    (record,) = (tmp_path / "cut").glob("*.features.npy.partial.progress.jsonl")
    assert [len(part["items"]) for part in recorded_segments(record)] == [16, 16]  # rows 0-31: 4 whole batches
    with evaluation(cut) as run:
        resumed = np.array(run.features("train")[0])
        assert run.features_used["train"] == "computed, continued at row 32 of a cut run"
    np.testing.assert_array_equal(resumed, whole)
    assert not list((tmp_path / "cut").glob("*.partial*"))  # the record goes once the whole file is in place


def test_a_damaged_part_of_a_cut_extraction_is_extracted_again_with_the_stores_warning(
    small_stem_weights, tmp_path, monkeypatch
):
    # guards: a partial features file changed inside a kept part was extracted again without a word
    import bt_hub.eval.feature_cache as feature_cache
    from bt_hub.eval.config import EvalWarning
    from bt_hub.eval.knn import KnnConfig
    from bt_hub.eval.runner import evaluation

    monkeypatch.setattr(feature_cache, "PART_ROWS", 16)  # a part every 2 batches of 8
    config = KnnConfig(weights=str(small_stem_weights), data="synthetic:80", image_size=8, batch_size=8, out=None)
    config.cache_dir = str(tmp_path)
    with evaluation(config) as run:
        whole = np.array(run.features("train")[0])
    for path in tmp_path.iterdir():
        path.unlink()
    with evaluation(config) as run:
        forward, calls = run.weights.network.forward, []

        def stop_at_the_fifth_batch(x):
            calls.append(len(x))
            if len(calls) == 5:
                raise KeyboardInterrupt
            return forward(x)

        monkeypatch.setattr(run.weights.network, "forward", stop_at_the_fifth_batch)
        with pytest.raises(KeyboardInterrupt):
            run.features("train")
    (partial,) = tmp_path.glob("*.features.npy.partial")
    first_part_ends = recorded_segments(Path(f"{partial}.progress.jsonl"))[0]["end"]
    with open(partial, "r+b") as f:  # one byte of the second part (rows 16 to 31) changed
        f.seek(first_part_ends + 100)
        byte = f.read(1)
        f.seek(first_part_ends + 100)
        f.write(bytes([byte[0] ^ 1]))
    said = (
        f"partial features {partial}: its bytes from {first_part_ends:,} on are not what was recorded (cut or "
        "changed); extracting again from row 16"
    )
    with evaluation(config) as run, pytest.warns(EvalWarning, match=re.escape(said)):
        resumed = np.array(run.features("train")[0])
    assert run.features_used["train"] == "computed, continued at row 16 of a cut run"
    np.testing.assert_array_equal(resumed, whole)


def test_two_evaluations_extracting_the_same_features_into_one_cache_dir_both_finish_with_the_same_scores(
    tmp_path, image_folder, resnet18_weights
):
    # guards: a second eval knn into the --cache-dir a first one was writing failed after all its work ("No such file
    # or directory: '...features.npy.partial'", rc 2), and a wait on a stopped lock holder was silent
    data = image_folder(tmp_path / "data", per_class=50, size=32)
    cmd = ["eval", "knn", "--weights", str(resnet18_weights), "--arch", "resnet18", "--data", str(data)]
    cmd += ["--test-split", "val", "--image-size", "32", "--batch-size", "2", "--cache-dir", str(tmp_path / "c")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "BT_HUB_PROGRESS_EVERY": "1"}
    runs, logs = [], [tmp_path / "first.txt", tmp_path / "second.txt"]

    def start(i: int) -> subprocess.Popen:
        with open(logs[i], "w") as stderr:
            argv = [sys.executable, "-m", "bt_hub.cli", *cmd, "--out", str(tmp_path / f"ev{i}")]
            runs.append(subprocess.Popen(argv, env=env, stderr=stderr, start_new_session=True))
        return runs[-1]

    def wait_for(i: int, text: str) -> None:
        deadline = time.monotonic() + 240
        while text not in logs[i].read_text():
            assert runs[i].poll() is None and time.monotonic() < deadline, logs[i].read_text()[-2000:]
            time.sleep(0.02)

    try:
        first = start(0)
        wait_for(0, "features train: ")  # extracting under the key's lock...
        os.killpg(first.pid, signal.SIGSTOP)  # ...and stopped there, as by Ctrl-Z
        start(1)
        wait_for(1, "waiting for ")
        os.killpg(first.pid, signal.SIGCONT)
        for run in runs:
            run.wait(timeout=300)
    finally:
        for run in runs:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.wait()
    errs = [log.read_text() for log in logs]
    assert [run.returncode for run in runs] == [0, 0], errs[1][-2000:]
    waited = [line for line in errs[1].splitlines() if line.startswith("waiting for ")]
    assert waited and f"(pid {first.pid} on host " in waited[0] and "cli.py eval knn --weights" in waited[0]
    scores = [json.loads((tmp_path / f"ev{i}" / "results.json").read_text())["metrics"] for i in (0, 1)]
    assert scores[0] == scores[1] and scores[0]


def test_a_kill_as_the_cache_is_completed_leaves_no_part_files_after_the_rerun(
    small_stem_weights, tmp_path, monkeypatch
):
    # guards: killed after the cache's files were in place but before its meta file, the parts stayed for good
    # beside a cache that the rerun made again
    import bt_hub.eval.feature_cache as feature_cache
    from bt_hub.eval.knn import KnnConfig
    from bt_hub.eval.runner import evaluation

    config = KnnConfig(weights=str(small_stem_weights), data="synthetic:40", image_size=8, batch_size=8, out=None)
    config.cache_dir = str(tmp_path)
    write = feature_cache.atomic_write_json

    def killed(*args):  # the meta file, which Extraction.finish writes last
        monkeypatch.setattr(feature_cache, "atomic_write_json", write)
        raise KeyboardInterrupt

    monkeypatch.setattr(feature_cache, "atomic_write_json", killed)
    with evaluation(config) as run, pytest.raises(KeyboardInterrupt):
        run.features("train")
    with evaluation(config) as run:
        run.features("train")
    assert sorted(p.name.split(".", 1)[1] for p in tmp_path.iterdir()) == ["features.npy", "labels.npy", "meta.json"]


def test_an_extraction_leaves_the_network_in_its_layout_so_what_follows_computes_as_after_a_cache_hit(
    small_stem_weights,
):
    # guards: extraction turned the run's network to channels_last for good, so eval all's fine-tuning after a
    # fresh extraction scored otherwise (semi 10%: 32.5 vs 32.2 top-1 on digits) than a rerun that read the cache
    from bt_hub.eval.knn import KnnConfig
    from bt_hub.eval.runner import evaluation

    config = KnnConfig(weights=str(small_stem_weights), data="synthetic:16", image_size=8, batch_size=8, out=None)
    with evaluation(config) as run:
        run.features("train")
        assert all(p.is_contiguous() for p in run.weights.network.parameters())


FORMATS = {
    "jpeg 4:4:4": ("jpg", {"quality": 95, "subsampling": 0}),
    "jpeg 4:2:0": ("jpg", {"quality": 90}),
    "png": ("png", {}),
}


def _photo(h: int, w: int, seed: int) -> np.ndarray:
    """Smooth gradients plus noise: what a small photo's pixels look like to a decoder."""
    y, x = np.mgrid[0:h, 0:w]
    image = np.stack([x * 255 / w, y * 255 / h, (x + y) * 127 / (h + w)], -1)
    return np.clip(image + np.random.default_rng(seed).normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)


def _files(root: Path) -> Path:
    """An ImageFolder tree (train/ and val/) of JPEGs (4:4:4 and 4:2:0) and PNGs of several sizes and aspects."""
    for split, offset in (("train", 0), ("val", 100)):
        for c, (h, w) in enumerate([(20, 28), (37, 53), (64, 48), (16, 16), (100, 75)]):
            folder = root / split / f"class{c % 2}"
            folder.mkdir(parents=True, exist_ok=True)
            for i, (suffix, options) in enumerate(FORMATS.values()):
                Image.fromarray(_photo(h, w, offset + 10 * c + i)).save(folder / f"{c}_{i}.{suffix}", **options)
    return root


def _pixel_levels(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| of two normalised batches in 8-bit levels."""
    return (a - b).abs() * torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) * 255


@pytest.mark.parametrize("size", [16, 32])
def test_device_preprocessing_of_files_equals_pil_within_one_level(size, tmp_path):
    """CPU decode (libjpeg-turbo; PIL for PNG) and tensor resize + crop vs PIL (nvJPEG's tolerance: test_decode)."""
    paths = sorted((_files(tmp_path) / "train").rglob("*.*"))
    device = DeviceEvalTransform(size)(decode_images([read_encoded(p) for p in paths], "cpu"))
    pil = torch.stack([eval_transforms(size)(open_rgb(p)) for p in paths])
    assert device.shape == pil.shape == (len(paths), 3, size, size)
    assert _pixel_levels(device, pil).max() <= 1.001 and _pixel_levels(device, pil).mean() < 0.05


def test_features_from_files_on_the_device_path_equal_the_pil_path(tmp_path):
    data = build_dataset(str(_files(tmp_path) / "train"), "train", image_size=None)  # files at their own sizes
    torch.manual_seed(0)
    net = build_backbone("resnet18", small_image_stem=True)
    pil, pil_labels = extract_features(net, data, transform=eval_transforms(16), batch_size=8)
    device, labels = extract_features(net, data, transform=DeviceEvalTransform(16), batch_size=8)
    assert labels.tolist() == pil_labels.tolist() == data.targets
    assert torch.linalg.vector_norm(device - pil) / torch.linalg.vector_norm(pil) < 0.01  # inputs within one level


def test_cli_decode_device_and_precision_are_recorded_and_change_the_cache_key(small_stem_weights, tmp_path):
    data = _files(tmp_path / "data")
    common = ["eval", "knn", "--weights", str(small_stem_weights), "--data", str(data), "--image-size", "16"]
    common += ["--k", "1", "--cache-dir", str(tmp_path / "cache")]
    records = {}
    for decode, precision in (("workers", "fp32"), ("device", "fp32"), ("device", "bf16")):
        out = tmp_path / f"{decode}_{precision}"
        assert cli.main([*common, "--decode", decode, "--precision", precision, "--out", str(out)]) == 0
        records[decode, precision] = json.loads((out / "results.json").read_text())
        assert records[decode, precision]["hyperparameters"]["decode"] == decode
        assert records[decode, precision]["hyperparameters"]["precision"] == precision
    assert len(list((tmp_path / "cache").glob("*.meta.json"))) == 6  # each pipeline and precision its own features
    assert records["device", "fp32"]["metrics"] == records["workers", "fp32"]["metrics"]


def test_cli_decode_auto_and_nvimgcodec_record_who_decoded_and_score_as_device_does(
    small_stem_weights, tmp_path, with_nvimgcodec
):
    data = _files(tmp_path / "data")
    common = ["eval", "knn", "--weights", str(small_stem_weights), "--data", str(data), "--image-size", "16"]
    common += ["--k", "1", "--precision", "fp32", "--num-workers", "1"]  # a worker process decodes
    records = {}
    for decode in ("device", "nvimgcodec", None):
        out = tmp_path / str(decode)
        assert cli.main([*common, *(["--decode", decode] if decode else []), "--out", str(out)]) == 0
        records[decode] = json.loads((out / "results.json").read_text())
    assert records["nvimgcodec"]["settings"]["decode_from"] == "--decode nvimgcodec"
    auto = records[None]["settings"]  # the default: the faster of PIL and nvImageCodec in the workers, timed here
    assert auto["decode"] in ("pil", "nvimgcodec") and records[None]["hyperparameters"]["decode"] == auto["decode"]
    assert (auto["decoder"], auto["decoded_on"]) == (auto["decode"], "loader workers")
    assert auto["decode_agreement"] == {"nvimgcodec": {"max": 0, "mean": 0.0}}  # libjpeg-turbo's pixels, as PIL's
    assert (
        auto["decode_from"].startswith("auto: a loader worker decoded ~") and "images/s with pil" in auto["decode_from"]
    )
    assert records["device"]["metrics"] == records["nvimgcodec"]["metrics"] == records[None]["metrics"]


def test_on_a_cpu_where_pil_wins_decode_auto_records_pil_in_the_loader_workers(
    small_stem_weights, tmp_path, monkeypatch
):
    # guards (case 6): --decode auto recorded decode "device" for the loader workers decoding with PIL, and the
    # choice went on to the extractor as that string, parsed back into a Decoding
    from bt_hub.data import decode_auto, measured

    monkeypatch.setattr(measured, "cache_file", lambda name: tmp_path / name)  # measured here, not the session's
    timed = decode_auto.time_decoders
    monkeypatch.setattr(decode_auto, "time_decoders", lambda *a: {n: 1e-4 if n == "pil" else 1e-3 for n in timed(*a)})
    data = _files(tmp_path / "data")
    argv = ["eval", "knn", "--weights", str(small_stem_weights), "--data", str(data), "--image-size", "16", "--k", "1"]
    assert cli.main([*argv, "--precision", "fp32", "--out", str(tmp_path / "auto")]) == 0
    record = json.loads((tmp_path / "auto" / "results.json").read_text())
    settings = record["settings"]
    assert (settings["decode"], settings["decoder"], settings["decoded_on"]) == ("pil", "pil", "loader workers")
    assert record["hyperparameters"]["decode"] == "pil" and settings["decode_share"] == 0.0
    assert (
        settings["decode_from"].startswith("auto: a loader worker decoded ~")
        and "10,000 images/s with pil" in settings["decode_from"]
    )
    assert cli.main([*argv, "--precision", "fp32", "--decode", "pil", "--out", str(tmp_path / "pil")]) == 0
    again = json.loads((tmp_path / "pil" / "results.json").read_text())  # the recorded mode runs the same again
    assert again["metrics"] == record["metrics"] and again["settings"]["decoder"] == "pil"


def test_bf16_knn_and_linear_are_within_half_a_point_of_fp32_on_the_digits():
    """bf16 autocast (what --precision auto picks on AMX / avx512_bf16 CPUs) must not move the scores."""
    splits = load_splits("digits", test_split="test", image_size=8)
    torch.manual_seed(0)
    net = torchvision.models.resnet18()  # torchvision's default initialisation: features worth scoring
    net.conv1, net.maxpool, net.fc = nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.Identity(), nn.Identity()
    scores = {}
    for precision in ("fp32", "bf16"):
        train = extract_features(net, splits.train, transform=eval_transforms(8), precision=precision)
        test = extract_features(net, splits.test, transform=eval_transforms(8), precision=precision)
        knn = knn_classify(*train, *test, k=20, backend="torch")["top1"]
        # the paper's probe, converged
        fc = train_heads(*train, 10, lrs=[0.3], weight_decays=[1e-6], epochs=100, progress=False)
        scores[precision] = (knn, score_heads(fc, *test)[0]["top1"])
    assert min(scores["fp32"]) > 85  # scores worth comparing
    assert abs(scores["bf16"][0] - scores["fp32"][0]) <= 0.5 and abs(scores["bf16"][1] - scores["fp32"][1]) <= 0.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device_path_with_prefetch_stream_equals_the_cpu_device_path(tmp_path):
    data = build_dataset(str(_files(tmp_path) / "train"), "train", image_size=None)  # files at their own sizes
    torch.manual_seed(0)
    net = build_backbone("resnet18", small_image_stem=True)
    cpu, cpu_labels = extract_features(net, data, transform=DeviceEvalTransform(16), batch_size=4)
    cuda, labels = extract_features(net, data, transform=DeviceEvalTransform(16), batch_size=4, device="cuda")
    assert labels.tolist() == cpu_labels.tolist()
    assert torch.linalg.vector_norm(cuda - cpu) / torch.linalg.vector_norm(cpu) < 0.03  # nvJPEG 4:2:0, TF32
    bf16, _ = extract_features(
        net, data, transform=DeviceEvalTransform(16), batch_size=4, device="cuda", precision="bf16"
    )
    assert torch.linalg.vector_norm(bf16 - cpu) / torch.linalg.vector_norm(cpu) < 0.05
