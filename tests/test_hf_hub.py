"""Hugging Face Hub: real huggingface_hub client against a loopback Hub, offline cache, pinned revisions, push, timm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchvision

pytest.importorskip("huggingface_hub")

from loopback import LoopbackHub  # noqa: E402

from bt_hub.method.model import BarlowTwins  # noqa: E402
from bt_hub.weights import from_pretrained, push_to_hub, save_pretrained  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


def _folder_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _run(script: str, env: dict[str, str]) -> str:
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


LOAD_SCRIPT = """
import torch
from bt_hub.weights import from_pretrained, load_backbone
main = from_pretrained("bt/barlowtwins-resnet50")
pinned = load_backbone("hf://bt/barlowtwins-resnet50@v1")
torch.save({"main": main.state_dict(), "pinned": pinned.state_dict()}, %r)
print(main.weights_info["file"])
"""


def test_weights_load_through_the_real_client_then_offline_with_a_pinned_revision(tmp_path):
    torch.manual_seed(0)
    resnet50 = {k: v for k, v in torchvision.models.resnet50().state_dict().items() if not k.startswith("fc.")}
    resnet18 = {k: v for k, v in torchvision.models.resnet18().state_dict().items() if not k.startswith("fc.")}
    folders = {}
    for name, state in (("main", resnet50), ("v1", resnet18)):
        backbone = torchvision.models.__dict__["resnet50" if name == "main" else "resnet18"]()
        backbone.fc = torch.nn.Identity()
        backbone.load_state_dict(state)
        folders[name] = _folder_files(save_pretrained(backbone, tmp_path / name, name="bt/barlowtwins-resnet50"))
    hub = LoopbackHub(
        {"bt/barlowtwins-resnet50": {"main": ("a" * 40, folders["main"]), "v1": ("b" * 40, folders["v1"])}}
    )
    env = {
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_OFFLINE": "0",
    }
    try:
        online = _run(LOAD_SCRIPT % str(tmp_path / "online.pt"), env)
    finally:
        hub.stop()
    assert "/snapshots/" + "a" * 40 + "/model.safetensors" in online
    assert ("GET", "/bt/barlowtwins-resnet50/resolve/v1/model.safetensors") in hub.requests
    offline = _run(LOAD_SCRIPT % str(tmp_path / "offline.pt"), {**env, "HF_HUB_OFFLINE": "1"})
    assert offline == online
    for run in ("online", "offline"):
        loaded = torch.load(tmp_path / f"{run}.pt", weights_only=True)
        for revision, expected in (("main", resnet50), ("pinned", resnet18)):
            assert set(loaded[revision]) == set(expected)
            assert all(torch.equal(loaded[revision][k], v) for k, v in expected.items()), (run, revision)


def test_push_to_hub_uploads_exactly_the_save_pretrained_folder(tmp_path, monkeypatch):
    import huggingface_hub

    torch.manual_seed(0)
    model = BarlowTwins("resnet18", "16-16")
    results = tmp_path / "results.json"
    results.write_text(
        json.dumps(
            {
                "protocol": "linear",
                "preset": "paper",
                "dataset": "imagenet",
                "metrics": {"top1": 73.5, "top5": 91.0},
                "weights_sha256": "0" * 64,
            }
        )
    )
    uploads = []

    def record_upload(self, *, repo_id, folder_path, **kwargs):
        uploads.append({"repo_id": repo_id, "files": _folder_files(Path(folder_path)), **kwargs})
        return "commit-info"

    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", record_upload)
    hub = LoopbackHub({})
    try:
        info = push_to_hub(model, "bt/pushed", private=True, token="hf_test", results=[results], endpoint=hub.url)
    finally:
        hub.stop()
    assert info == "commit-info"
    assert ("POST", "/api/repos/create") in hub.requests
    expected = _folder_files(save_pretrained(model, tmp_path / "pushed", results=[results], name="bt/pushed"))
    assert len(uploads) == 1 and uploads[0]["repo_id"] == "bt/pushed"
    assert sorted(uploads[0]["files"]) == ["README.md", "config.json", "model.safetensors", "projector.safetensors"]
    assert uploads[0]["files"] == expected


def test_model_card_and_config_carry_metadata_recipe_and_results(tmp_path):
    torch.manual_seed(0)
    model = BarlowTwins("resnet18", "16-16")
    run_config = {"dataset": "imagenet", "epochs": 1000, "recipe": {"batch_size": 2048, "optimizer": "LARS"}}
    results = [
        {"protocol": "linear", "preset": "paper", "dataset": "imagenet", "metrics": {"top1": 73.5, "top5": 91.0}},
        {"protocol": "voc07-svm", "dataset": "voc2007", "metrics": {"mAP": 86.2}},
    ]
    folder = save_pretrained(model, tmp_path / "card", config=run_config, results=results, name="bt/card")
    import huggingface_hub

    card = huggingface_hub.ModelCard.load(folder / "README.md")
    data = card.data.to_dict()
    assert data["library_name"] == "bt_hub" and data["license"] == "apache-2.0"
    assert {"barlow-twins", "self-supervised-learning", "image-feature-extraction"} <= set(data["tags"])
    assert data["datasets"] == ["imagenet"]
    metrics = {(r.task_name, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert metrics == {
        ("linear (preset paper)", "top1"): 73.5,
        ("linear (preset paper)", "top5"): 91.0,
        ("voc07-svm", "mAP"): 86.2,
    }
    assert 'from_pretrained("bt/card")' in card.text and "| epochs | 1000 |" in card.text
    config = json.loads((folder / "config.json").read_text())
    assert config["architecture"] == "resnet18" and config["projector"] == "16-16" and config["epochs"] == 1000
    assert config["num_classes"] == 0 and config["pretrained_cfg"]["classifier"] == "fc"


def test_from_pretrained_is_strict_and_round_trips_backbone_and_projector(tmp_path):
    torch.manual_seed(0)
    model = BarlowTwins("resnet18", "16-16")
    folder = save_pretrained(model, tmp_path / "folder")
    backbone = from_pretrained(folder)
    assert all(torch.equal(backbone.state_dict()[k], v) for k, v in model.backbone.state_dict().items())
    from bt_hub.weights import barlow_twins

    whole = barlow_twins(weights=str(folder))
    assert all(torch.equal(whole.state_dict()[k], v) for k, v in model.state_dict().items())
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    del state["layer4.1.bn2.weight"]
    save_file(state, folder / "model.safetensors")
    with pytest.raises(
        ValueError,
        match=r"model.safetensors does not fit resnet18: 1 keys are missing, first \['layer4.1.bn2.weight'\]",
    ):
        from_pretrained(folder)


def test_saved_folder_loads_in_timm_local_dir_with_the_same_features(tmp_path):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = BarlowTwins("resnet18", "16-16")
    with torch.no_grad():  # non-trivial BN statistics and residual BNs, so the comparison means something
        for module in model.backbone.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.weight.uniform_(0.5, 1.5)
                module.running_mean.uniform_(-0.1, 0.1)
                module.running_var.uniform_(0.5, 1.5)
    folder = save_pretrained(model, tmp_path / "timm")
    ours = from_pretrained(folder).eval()
    theirs = timm.create_model(f"local-dir:{folder}", pretrained=True, num_classes=0).eval()
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected, got = ours(images), theirs(images)
    assert got.shape == (2, 512) and expected.abs().max() > 0
    assert torch.allclose(got, expected, atol=1e-5)
