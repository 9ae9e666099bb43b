"""The CUDA paths: loss, pretraining under autocast, features, kNN, linear probe, fine-tuning, the demo.

Marked ``gpu`` (deselected by default; ``python -m pytest -m gpu`` on a machine with CUDA).
Each check compares the CUDA result with the CPU one or runs the public CLI with
``--device cuda`` and reads what it wrote.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bt_hub import cli
from bt_hub.data.datasets import build_dataset
from bt_hub.eval.features import extract_features
from bt_hub.eval.heads import train_heads
from bt_hub.eval.knn import knn_search
from bt_hub.method.loss import barlow_twins_loss
from bt_hub.method.model import build_backbone
from bt_hub.method.transforms import eval_transforms
from bt_hub.weights import load_backbone

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PRETRAIN = [
    "pretrain",
    "--data",
    "synthetic:64",
    "--arch",
    "resnet18",
    "--small-image-stem",
    "--image-size",
    "16",
    "--projector",
    "256-256",
    "--batch-size",
    "16",
    "--epochs",
    "1",
    "--warmup-epochs",
    "1",
    "--log-every",
    "1",
    "--device",
    "cuda",
]


@pytest.mark.parametrize("method", ["dense", "gram"])
def test_loss_and_its_gradients_on_cuda_equal_the_cpu_ones(method):
    torch.manual_seed(0)
    z_a, z_b = torch.randn(64, 512), torch.randn(64, 512)
    results = {}
    for device in ("cpu", "cuda"):
        a, b = (z.to(device).requires_grad_() for z in (z_a.clone(), z_b.clone()))
        loss = barlow_twins_loss(a, b, lambd=0.005, method=method).loss
        loss.backward()
        results[device] = (loss.item(), a.grad.cpu(), b.grad.cpu())
    assert results["cuda"][0] == pytest.approx(results["cpu"][0], rel=1e-5)
    for grad_cuda, grad_cpu in zip(results["cuda"][1:], results["cpu"][1:]):
        torch.testing.assert_close(grad_cuda, grad_cpu, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_loss_under_autocast_is_float32_and_close_to_full_precision(dtype):
    torch.manual_seed(0)
    z_a, z_b = torch.randn(128, 1024, device="cuda"), torch.randn(128, 1024, device="cuda")
    exact = barlow_twins_loss(z_a, z_b, lambd=0.005).loss
    with torch.autocast("cuda", dtype=dtype):
        low = barlow_twins_loss(z_a.to(dtype), z_b.to(dtype), lambd=0.005).loss
    assert low.dtype == torch.float32
    assert low.item() == pytest.approx(exact.item(), rel=2e-2)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_pretrain_on_cuda_writes_a_backbone_that_loads_on_the_cpu(tmp_path, precision):
    out = tmp_path / "run"
    assert cli.main([*PRETRAIN, "--precision", precision, "--channels-last", "on", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = json.loads((out / "config.json").read_text())["steps"]
    assert steps >= 3 and [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(np.isfinite(r["loss"]) for r in rows)
    backbone = load_backbone(out, progress=False)
    assert next(backbone.parameters()).device.type == "cpu"
    assert np.load(out / "cross_correlation_end.npy").shape == (256, 256)


def test_features_on_cuda_equal_the_cpu_features():
    torch.manual_seed(0)
    net = build_backbone("resnet18", small_image_stem=True)
    data = build_dataset("synthetic:48", "train", image_size=16)
    cpu, labels_cpu = extract_features(net, data, transform=eval_transforms(16), batch_size=16, device="cpu")
    cuda, labels_cuda = extract_features(net, data, transform=eval_transforms(16), batch_size=16, device="cuda")
    assert torch.equal(labels_cpu, labels_cuda)
    torch.testing.assert_close(cuda.cpu().float(), cpu.float(), rtol=1e-3, atol=1e-3)


def test_knn_on_cuda_finds_the_faiss_neighbours():
    pytest.importorskip("faiss")  # an optional extra: the GPU machines of benchmarks/gpu_check.sh lack it
    g = torch.Generator().manual_seed(0)
    train_x, test_x = torch.randn(5000, 64, generator=g), torch.randn(300, 64, generator=g)
    cpu_sims, cpu_idx = knn_search(train_x, test_x, 20, backend="faiss")
    cuda_sims, cuda_idx = knn_search(train_x, test_x, 20, backend="auto", device="cuda", train_chunk=1024)
    assert torch.equal(cuda_idx, cpu_idx)
    torch.testing.assert_close(cuda_sims, cpu_sims, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stored", ["tensor", "memmap"])
def test_linear_heads_trained_on_cuda_from_host_features_equal_the_cpu_heads(stored, tmp_path):
    # the features move to the GPU once (eval/heads._on_device), so a 100-epoch grid reads no row from the host
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(600, 32, generator=g), torch.randint(0, 5, (600,), generator=g)
    if stored == "memmap":
        np.save(tmp_path / "x.npy", x.numpy())
        x = np.load(tmp_path / "x.npy", mmap_mode="r")
    settings = {"lrs": [0.1, 1.0], "weight_decays": [0.0, 1e-4], "epochs": 3, "batch_size": 64, "progress": False}
    cpu = train_heads(x, y, 5, device="cpu", **settings)
    cuda = train_heads(x, y, 5, device="cuda", **settings)
    assert cuda.weight.is_cuda and torch.allclose(cuda.weight.cpu(), cpu.weight, atol=1e-5)
    assert torch.allclose(cuda.bias.cpu(), cpu.bias, atol=1e-5)


def test_eval_all_on_cuda_writes_every_protocol(resnet18_weights, tmp_path):
    out = tmp_path / "all"
    assert (
        cli.main(
            [
                "eval",
                "all",
                "--weights",
                str(resnet18_weights),
                "--data",
                "synthetic:60",
                "--image-size",
                "32",
                "--batch-size",
                "16",
                "--linear.epochs",
                "3",
                "--semi.epochs",
                "1",
                "--knn.k",
                "5",
                "--device",
                "cuda",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    summary = json.loads((out / "results.json").read_text())
    assert [r["protocol"] for r in summary["results"]] == ["knn", "linear", "semi", "semi"]
    assert all(0 <= r["metrics"]["top1"] <= 100 for r in summary["results"])


def test_full_linear_probe_on_cuda(resnet18_weights, tmp_path):
    out = tmp_path / "linear"
    assert (
        cli.main(
            [
                "eval",
                "linear",
                "--weights",
                str(resnet18_weights),
                "--data",
                "synthetic:60",
                "--image-size",
                "32",
                "--batch-size",
                "16",
                "--search",
                "fixed",
                "--epochs",
                "1",
                "--device",
                "cuda",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    record = json.loads((out / "results.json").read_text())
    assert record["mode"] == "loop" and 0 <= record["metrics"]["top1"] <= 100


def test_shortened_demo_on_cuda(tmp_path):
    out = tmp_path / "demo"
    assert (
        cli.main(
            [
                "demo",
                "--out",
                str(out),
                "--device",
                "cuda",
                "--pretrain.epochs",
                "1",
                "--pretrain.max-steps",
                "4",
                "--linear.epochs",
                "10",
            ]
        )
        == 0
    )
    table = json.loads((out / "results.json").read_text())["table"]
    assert min(table["random-init"]["linear"]["per_seed"]) >= 80
    assert (out / "report.md").exists()


def test_the_image_loops_in_bf16_score_as_fp32_does_on_the_digits(small_stem_weights):
    # guards: the linear loop and fine-tuning ran fp16 autocast on CUDA whatever --precision said (bf16 nowhere)
    from bt_hub.eval import evaluate

    scores = {}
    for precision in ("fp32", "bf16"):
        common = {"image_size": 16, "device": "cuda", "precision": precision}
        semi = evaluate(small_stem_weights, "digits", "semi", preset="small", fraction=10, epochs=5, **common)
        linear = evaluate(small_stem_weights, "digits", "linear", search="fixed", epochs=3, **common)
        assert semi.records[0]["settings"]["precision"] == precision
        scores[precision] = (semi.rows[0]["top1"], linear.rows[0]["top1"])
    # 360 test digits: 3 points is 11 images, within the seed-to-seed spread of these runs
    assert all(abs(b - f) <= 3 for b, f in zip(scores["bf16"], scores["fp32"])), scores
