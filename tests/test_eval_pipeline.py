"""Feature extraction through the pretraining pipeline (decode, resize and crop on the device) and in bf16."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image
from torch import nn

from bt_hub import cli
from bt_hub.common.images import open_rgb
from bt_hub.data.datasets import build_dataset
from bt_hub.data.decode import decode_images, read_encoded
from bt_hub.eval.features import extract_features
from bt_hub.eval.heads import score_heads, train_heads
from bt_hub.eval.knn import knn_classify
from bt_hub.eval.splits import load_splits
from bt_hub.method.model import build_backbone
from bt_hub.method.transforms import IMAGENET_STD, DeviceEvalTransform, eval_transforms

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
