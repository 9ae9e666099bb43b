"""torch.hub entry points: downloads through torch.hub's cache with hash checks, offline reloads, named weights."""

from __future__ import annotations

import functools
import hashlib
import http.server
import os
import re
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import pytest
import torch
import torchvision

from bt_hub.method.model import BarlowTwins
from bt_hub.weights import BarlowTwinsWeights, CheckpointError, DownloadError, cache_path, get_weights

REPO_ROOT = Path(__file__).resolve().parents[1]


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def hub_dir(tmp_path):
    """torch.hub's cache in tmp_path, restored afterwards."""
    previous = torch.hub.get_dir()
    torch.hub.set_dir(str(tmp_path / "hub"))
    yield tmp_path / "hub"
    torch.hub.set_dir(previous)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A loopback HTTP server over a folder holding a torchvision ResNet-50 state dict (hash-prefixed name)."""
    root = tmp_path_factory.mktemp("www")
    torch.manual_seed(0)
    state = torchvision.models.resnet50().state_dict()
    torch.save(state, root / "tmp.pth")
    sha = hashlib.sha256((root / "tmp.pth").read_bytes()).hexdigest()
    (root / "tmp.pth").rename(root / f"resnet50-{sha[:8]}.pth")
    (root / "forged-deadbeef.pth").write_bytes((root / f"resnet50-{sha[:8]}.pth").read_bytes())
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    yield {"url": url, "name": f"resnet50-{sha[:8]}.pth", "state": state, "server": server}
    server.shutdown()
    server.server_close()


def _same_backbone(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> bool:
    loaded = model.state_dict()
    expected = {k: v for k, v in state.items() if not k.startswith("fc.")}
    return set(loaded) == set(expected) and all(torch.equal(loaded[k], v) for k, v in expected.items())


def test_file_whose_hash_prefix_does_not_match_is_refused(served, hub_dir):
    url = f"{served['url']}/forged-deadbeef.pth"
    with pytest.raises(DownloadError) as err:
        torch.hub.load(str(REPO_ROOT), "resnet50", source="local", weights=url, progress=False)
    said = str(err.value)
    assert re.search(
        r"forged-deadbeef.pth has sha256 [0-9a-f]{16}\.\.\., not the hash prefix in its file name "
        r"deadbeef, so it was refused; ",
        said,
    ), said
    assert "retry, or" not in said  # a retry fetches the same bytes: not advice for a mismatch
    assert said.endswith(
        "a retry fetches the same bytes: check that the URL names the file you meant (a replaced or forged file fails "
        "this check), or place at that path a file whose sha256 starts with deadbeef"
    )
    assert not cache_path(url).exists() and list(cache_path(url).parent.iterdir()) == []


def test_weights_from_url_land_in_the_hub_cache_and_load_again_offline(served, hub_dir):
    url = f"{served['url']}/{served['name']}"
    model = torch.hub.load(str(REPO_ROOT), "resnet50", source="local", weights=url, progress=False)
    assert isinstance(model.fc, torch.nn.Identity)
    assert _same_backbone(model, served["state"])
    assert cache_path(url).is_file() and cache_path(url).is_relative_to(hub_dir / "checkpoints")
    served["server"].shutdown()  # no server: the second load can only come from the cache
    again = torch.hub.load(str(REPO_ROOT), "resnet50", source="local", weights=url, progress=False)
    assert _same_backbone(again, served["state"])


def test_named_weights_resolve_to_the_reference_release_through_the_cache(tmp_path, hub_dir):
    record = get_weights("barlowtwins-in1k")
    assert record is BarlowTwinsWeights.DEFAULT is BarlowTwinsWeights.IN1K_EP1000
    assert record.url == (
        "https://dl.fbaipublicfiles.com/barlowtwins/ep1000_bs2048_lrw0.2_lrb0.0048_lambd0.0051/resnet50.pth"
    )
    assert record.sha256 is None and record.meta["release"]["imagenet_linear"] == {"top1": 73.5, "top5": 91.0}
    assert get_weights("barlowtwins-in1k-full").has_projector
    state = {k: v for k, v in torchvision.models.resnet50().state_dict().items() if not k.startswith("fc.")}
    record.cache_path().parent.mkdir(parents=True)
    torch.save(state, record.cache_path())  # as if downloaded before
    model = torch.hub.load(str(REPO_ROOT), "resnet50", source="local", weights="DEFAULT")
    assert _same_backbone(model, state)
    with pytest.raises(
        ValueError, match="weights 'barlowtwins-in1k-typo' are unknown; registered names: barlowtwins-in1k, "
    ):
        get_weights("barlowtwins-in1k-typo")


def test_weights_none_gives_the_architecture_with_identity_fc():
    model = torch.hub.load(str(REPO_ROOT), "resnet50", source="local", weights=None)
    assert isinstance(model.fc, torch.nn.Identity)
    assert model.eval()(torch.zeros(1, 3, 32, 32)).shape == (1, 2048)


def test_barlow_twins_entry_loads_backbone_and_projector_from_a_reference_checkpoint(tmp_path):
    torch.manual_seed(0)
    reference = BarlowTwins("resnet18", "32-32")
    torch.save(
        {"epoch": 1, "model": {"module." + k: v for k, v in reference.state_dict().items()}},
        tmp_path / "checkpoint.pth",
    )
    model = torch.hub.load(str(REPO_ROOT), "barlow_twins", source="local", weights=str(tmp_path / "checkpoint.pth"))
    assert model.config["projector"] == "32-32" and model.config["backbone"] == "resnet18"
    assert all(torch.equal(model.state_dict()[k], v) for k, v in reference.state_dict().items())
    torch.save(reference.backbone.state_dict(), tmp_path / "backbone.pth")
    with pytest.raises(CheckpointError, match="backbone.pth carry no projector; use resnet50"):
        torch.hub.load(str(REPO_ROOT), "barlow_twins", source="local", weights=str(tmp_path / "backbone.pth"))


def test_kwargs_contradicting_the_weights_raise_naming_both(tmp_path):
    torch.save(torchvision.models.resnet18().state_dict(), tmp_path / "r18.pth")
    with pytest.raises(CheckpointError, match="r18.pth does not fit resnet50 \\(it looks like resnet18\\)"):
        torch.hub.load(str(REPO_ROOT), "resnet50", source="local", weights=str(tmp_path / "r18.pth"))
    with torch.device("meta"):
        state = torchvision.models.resnet50().state_dict()
    torch.save({k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}, tmp_path / "r50.pth")
    with pytest.raises(
        ValueError, match="small_image_stem=True contradicts the weights .*r50.pth, which have small_image_stem=False"
    ):
        torch.hub.load(
            str(REPO_ROOT), "resnet50", source="local", weights=str(tmp_path / "r50.pth"), small_image_stem=True
        )


def test_hubconf_works_from_a_checkout_without_bt_hub_installed(tmp_path):
    """site-packages is put on sys.path without its .pth files, so the editable install of bt_hub is invisible."""
    script = (
        f"import sys, importlib.util; sys.path.append({sysconfig.get_paths()['purelib']!r});"
        "assert importlib.util.find_spec('bt_hub') is None, 'bt_hub is importable';"
        f"import torch; m = torch.hub.load({str(REPO_ROOT)!r}, 'resnet50', source='local', weights=None);"
        "print(type(m.fc).__name__, 'bt_hub' in sys.modules)"
    )
    env = {
        k: v for k, v in os.environ.items() if k != "PYTHONPATH"
    }  # a worktree on PYTHONPATH would make bt_hub importable
    result = subprocess.run(
        [sys.executable, "-S", "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["Identity", "True"]


@pytest.mark.parametrize(("arch", "dim"), [("resnet18", 512), ("resnet34", 512), ("resnet101", 2048)])
def test_resnet18_34_101_entries_load_the_weights_given_and_build_the_architecture_without(arch, dim, tmp_path):
    """Guards: hubconf listed resnet50 alone; Barlow Twins runs of the other depths had no torch.hub entry."""
    bare = torch.hub.load(str(REPO_ROOT), arch, source="local", weights=None)
    assert isinstance(bare.fc, torch.nn.Identity) and bare.eval()(torch.zeros(1, 3, 32, 32)).shape == (1, dim)
    if arch == "resnet101":  # the loading path is the one resnet18 and resnet34 take
        return
    torch.manual_seed(0)
    state = {k: v for k, v in getattr(torchvision.models, arch)().state_dict().items() if not k.startswith("fc.")}
    torch.save(state, tmp_path / f"{arch}.pth")
    model = torch.hub.load(str(REPO_ROOT), arch, source="local", weights=str(tmp_path / f"{arch}.pth"))
    assert _same_backbone(model, state) and callable(model.transforms)


@pytest.mark.parametrize(
    "weights", ["DEFAULT", "barlowtwins-in1k", BarlowTwinsWeights.IN1K_LJNG, {"pretrained": True}], ids=str
)
def test_an_architecture_without_published_weights_says_there_are_none(weights, hub_dir):
    """A registered name, DEFAULT or pretrained=True for resnet18 would be ResNet-50 weights: refused, never fetched."""
    kwargs = weights if isinstance(weights, dict) else {"weights": weights}
    with pytest.raises(ValueError, match="no Barlow Twins weights are published for resnet18 \\(the registered ones: "):
        torch.hub.load(str(REPO_ROOT), "resnet18", source="local", **kwargs)
    assert not hub_dir.exists() or not any(hub_dir.rglob("*.pth"))


def test_resnet18_entry_refuses_resnet50_weights_naming_both(tmp_path):
    torch.save(torchvision.models.resnet50().state_dict(), tmp_path / "r50.pth")
    with pytest.raises(CheckpointError, match="r50.pth does not fit resnet18 \\(it looks like resnet50\\)"):
        torch.hub.load(str(REPO_ROOT), "resnet18", source="local", weights=str(tmp_path / "r50.pth"))


@pytest.mark.parametrize("builder", ["resnet18", "resnet50", "barlow_twins"])
@pytest.mark.parametrize("weights", [5, 0.5, True, ["w.pth"]], ids=repr)
def test_weights_of_another_type_are_refused_in_one_sentence_naming_weights(builder, weights):
    """Guards: ``resnet18(weights=5)`` raised os.fspath's "expected str, bytes or os.PathLike object, not int"."""
    with pytest.raises(TypeError) as err:
        torch.hub.load(str(REPO_ROOT), builder, source="local", weights=weights)
    assert str(err.value) == (
        "weights must be a BarlowTwinsWeights member or its name, a file or run folder, a URL, a Hugging Face Hub id "
        f"(hf://org/name or org/name) or None, got a value of type {type(weights).__name__}"
    )
