"""Shared fixtures: offline, CPU-only, small data made at test time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    """Destroy any process group a test left behind."""
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="session")
def resnet18_weights(tmp_path_factory) -> Path:
    """A seeded random-init ResNet-18 backbone saved as a plain torchvision state dict."""
    from bt_hub.method.model import build_backbone

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("weights") / "resnet18.pth"
    torch.save(build_backbone("resnet18").state_dict(), path)
    return path


@pytest.fixture(scope="session")
def small_stem_weights(tmp_path_factory) -> Path:
    """A seeded random-init ResNet-18 with the 3x3 small-image stem (fast on 8-px images)."""
    from bt_hub.method.model import build_backbone

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("weights") / "resnet18_small_stem.pth"
    torch.save(build_backbone("resnet18", small_image_stem=True).state_dict(), path)
    return path


@pytest.fixture
def torch_home(tmp_path, monkeypatch) -> Path:
    """A fresh, empty TORCH_HOME (and no hub directory left set by an earlier torch.hub.set_dir)."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    monkeypatch.setattr(torch.hub, "_hub_dir", None)
    return tmp_path / "torch_home"


@pytest.fixture
def shared_data() -> Path:
    """../shared/data beside the repository (reference data, never copied in)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is not present beside the repository")
    return SHARED_DATA


@pytest.fixture(scope="module")
def bt_weights(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A ResNet-50 state dict whose every tensor differs from a fresh initialisation (and from detectron2's)."""
    from bt_hub.method.model import build_backbone

    torch.manual_seed(0)
    state = build_backbone("resnet50").state_dict()
    for name, tensor in state.items():
        if tensor.is_floating_point():
            tensor.copy_(torch.rand_like(tensor) + 0.5 if "running_var" in name else torch.randn_like(tensor) * 0.05)
        else:
            tensor.fill_(7)
    path = tmp_path_factory.mktemp("weights") / "bt_resnet50.pth"
    torch.save(state, path)
    return path, state


@pytest.fixture
def one_thread():
    """One torch thread (the detection tests): on a loaded machine, waiting OpenMP threads spin and multiply the CPU time."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
