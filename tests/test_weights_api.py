"""The weights surface users of torchvision, torch.hub, timm and Hugging Face expect, through one resolve().

Offline: a seeded TORCH_HOME stands in for earlier downloads, a loopback server for the Hugging
Face Hub, and urllib is made to fail so any network access would show.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import urllib.request
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torchvision

from bt_hub import cli, cli_flags
from bt_hub.common.files import file_sha256
from bt_hub.method.model import BarlowTwins, build_backbone
from bt_hub.weights import (
    IMAGENET_STD,
    BarlowTwinsWeights,
    CheckpointError,
    DownloadError,
    barlow_twins,
    eval_transforms,
    get_weights,
    list_weights,
    load_backbone,
    read_projector_state_dict,
    resolve,
    save_pretrained,
    weights_fingerprint,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def offline_torch_home(torch_home, monkeypatch) -> Path:
    """An empty TORCH_HOME, and urllib refusing every request (so a test that reaches the network fails)."""

    def no_network(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    return torch_home


@pytest.fixture(scope="module")
def resnet50_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v for k, v in torchvision.models.resnet50().state_dict().items() if not k.startswith("fc.")}


def _listed(capsys) -> dict[str, list[str]]:
    assert cli.main(["weights", "list"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == ["name", "architecture", "cached", "sha256", "url", "cache", "path"]
    return {line.split()[0]: line.split() for line in lines[1:]}


def _seed_default(capsys, state: dict[str, torch.Tensor]) -> Path:
    """Put weights where `bt-hub weights list` says the loaders read barlowtwins-in1k."""
    row = _listed(capsys)["barlowtwins-in1k"]
    assert row[1:5] == ["resnet50", "no", "unverified", BarlowTwinsWeights.DEFAULT.url]
    path = Path(row[5])
    path.parent.mkdir(parents=True)
    torch.save(state, path)
    assert _listed(capsys)["barlowtwins-in1k"][2] == "yes"
    return path


def test_weights_list_names_every_registered_weight_and_its_cache_path(offline_torch_home, capsys):
    rows = _listed(capsys)
    assert list(rows) == list_weights() == ["barlowtwins-in1k", "barlowtwins-in1k-ljng", "barlowtwins-in1k-full"]
    for name, row in rows.items():
        assert Path(row[5]) == get_weights(name).cache_path() and Path(row[5]).is_relative_to(offline_torch_home)


def test_eval_and_detect_with_a_registered_name_read_the_listed_cache_path_offline(
    offline_torch_home, resnet50_state, tmp_path, capsys
):
    path = _seed_default(capsys, resnet50_state)
    out = tmp_path / "knn"
    argv = [
        "eval",
        "knn",
        "--weights",
        "barlowtwins-in1k",
        "--data",
        "synthetic:40",
        "--image-size",
        "16",
        "--k",
        "5",
        "--out",
        str(out),
    ]
    assert cli.main(argv) == 0, capsys.readouterr().err
    result = json.loads((out / "results.json").read_text())
    assert result["weights"] == {"name": "barlowtwins-in1k", "fingerprint": file_sha256(path)}
    from bt_hub.eval.config import load_weights
    from bt_hub.eval.detection.detect import prepare_weights  # bt-hub detect's converter goes through the same resolve

    pkl, tensors = prepare_weights(load_weights("barlowtwins-in1k"), tmp_path / "detect")
    assert Path(pkl) == tmp_path / "detect" / "weights.pkl" and "res5.2.conv3.norm.running_var" in tensors


def test_unknown_names_list_the_registered_ones_and_missing_paths_are_no_hub_errors(
    offline_torch_home, tmp_path, capsys
):
    assert cli.main(["eval", "knn", "--weights", "barlowtwins-in1k-typo", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip() == (
        "bt-hub eval knn: error: weights 'barlowtwins-in1k-typo' name no file or folder, URL, "
        "Hub repo (org/name) or registered "
        "weights; registered names: barlowtwins-in1k, barlowtwins-in1k-ljng, barlowtwins-in1k-full"
    )
    for typo in ("./hf_r5O", "runs/pretrain/backbone.safetensors", "~/weights.pth", "missing.pth"):
        with pytest.raises(CheckpointError, match=rf"^weights {re.escape(typo)}: no such file or folder \(/.+\)$"):
            resolve(typo)
    for command in (["export", "--out", str(tmp_path / "x.pth")], ["push", "--repo-id", "bt/x"]):
        assert cli.main(command + ["--weights", "./hf_r5O"]) == 2
        assert (
            capsys.readouterr()
            .err.strip()
            .endswith(f"weights ./hf_r5O: no such file or folder ({Path.cwd() / 'hf_r5O'})")
        )


def test_a_local_folder_wins_over_a_hub_id_of_the_same_spelling(tmp_path, monkeypatch):
    torch.manual_seed(0)
    save_pretrained(build_backbone("resnet18"), tmp_path / "org" / "name")
    monkeypatch.chdir(tmp_path)
    assert resolve("org/name").path == Path("org/name/model.safetensors")


def test_legacy_pretrained_true_warns_and_loads_the_default_weights_from_the_cache(
    offline_torch_home, resnet50_state, capsys
):
    _seed_default(capsys, resnet50_state)
    with pytest.warns(
        FutureWarning, match=r'resnet50\(pretrained=True\) is deprecated; use resnet50\(weights="barlowtwins-in1k"\)'
    ):
        model = torch.hub.load(str(REPO_ROOT), "resnet50", source="local", pretrained=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in resnet50_state.items())
    assert model.weights_info["weights"] == "barlowtwins-in1k"
    with pytest.warns(FutureWarning, match=r"use resnet50\(weights=None\)"):
        random = torch.hub.load(str(REPO_ROOT), "resnet50", source="local", pretrained=False)
    assert not hasattr(random, "weights_info")
    with pytest.raises(ValueError, match="got both weights="), warnings.catch_warnings():
        torch.hub.load(str(REPO_ROOT), "resnet50", source="local", weights="DEFAULT", pretrained=True)


def test_weights_none_is_the_default_and_never_touches_the_network(offline_torch_home):
    model = torch.hub.load(str(REPO_ROOT), "resnet50", source="local")
    assert isinstance(model.fc, torch.nn.Identity) and not hasattr(model, "weights_info")
    assert model.eval()(
        model.transforms(torchvision.transforms.functional.to_pil_image(torch.rand(3, 300, 260)))[None]
    ).shape == (1, 2048)
    assert not any(offline_torch_home.rglob("*.pth"))
    with pytest.raises(TypeError, match=r"resnet50\(\) got unexpected keyword arguments \['num_classes'\]"):
        torch.hub.load(str(REPO_ROOT), "resnet50", source="local", num_classes=10)


def test_enum_members_expose_url_transforms_meta_and_the_state_dict(offline_torch_home, resnet50_state, capsys):
    _seed_default(capsys, resnet50_state)
    member = BarlowTwinsWeights.DEFAULT
    assert member is BarlowTwinsWeights.IN1K_EP1000
    assert member.url.endswith("/ep1000_bs2048_lrw0.2_lrb0.0048_lambd0.0051/resnet50.pth")
    assert (
        member.meta["paper"]["imagenet_linear"] == {"top1": 73.2, "top5": 91.0}
        and member.meta["recipe"]["lambd"] == 0.0051
    )
    preset = member.transforms()
    assert (preset.resize_size, preset.crop_size) == ([256], [224])
    state = member.get_state_dict(progress=False)
    assert set(state) == set(resnet50_state) and all(torch.equal(state[k], v) for k, v in resnet50_state.items())
    for spelling in ("barlowtwins-in1k", "IN1K_EP1000", "DEFAULT", "BarlowTwinsWeights.IN1K_EP1000", member):
        assert BarlowTwinsWeights.verify(spelling) is member
    assert BarlowTwinsWeights.verify(None) is None
    with pytest.raises(TypeError, match="belong to ResNet50_Weights, expected BarlowTwinsWeights"):
        BarlowTwinsWeights.verify(torchvision.models.ResNet50_Weights.DEFAULT)


def test_torchvision_builders_refuse_barlow_twins_weights_and_download_nothing(offline_torch_home):
    """Guards: a plain Enum was a legacy truthy value to torchvision, which loaded supervised ImageNet weights."""
    member = BarlowTwinsWeights.DEFAULT
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torchvision's "equivalent to passing weights=ResNet50_Weights..." would raise
        for arch in ("ResNet50", "ResNet18"):
            with pytest.raises(TypeError, match=rf"expected {arch}_Weights but received BarlowTwinsWeights"):
                getattr(torchvision.models, arch.lower())(weights=member)
        with pytest.raises(TypeError, match="expected ResNet50_Weights but received BarlowTwinsWeights"):
            torchvision.models.get_model("resnet50", weights=member)
    assert list(offline_torch_home.rglob("*")) == []  # nothing fetched, nothing created
    assert isinstance(member, torchvision.models.WeightsEnum) and isinstance(member.value, torchvision.models.Weights)


def test_weights_transforms_are_bt_hubs_eval_transform_and_accept_tensors_as_torchvisions_do():
    """Guards: .transforms() ended in ToTensor, so a tensor image (torchvision's presets take them) was a TypeError."""
    torch.manual_seed(0)
    image = (torch.rand(3, 300, 260) * 255).to(torch.uint8)
    pil = torchvision.transforms.functional.to_pil_image(image)
    ours = eval_transforms(224)(pil)
    grey_levels = 2 / 255 / min(IMAGENET_STD)  # tensors are resized by torch, PIL images by PIL
    for member in BarlowTwinsWeights:
        preset = member.transforms()
        assert torch.equal(preset(pil), ours)
        single, batch = preset(image), preset(torch.stack([image, image]))
        assert single.shape == (3, 224, 224) and batch.shape == (2, 3, 224, 224) and single.dtype == torch.float32
        torch.testing.assert_close(single, ours, atol=grey_levels, rtol=0)
        torch.testing.assert_close(batch[1], single)
        torch.testing.assert_close(preset(image.float() / 255), single, atol=grey_levels, rtol=0)


def test_a_registered_file_is_recorded_at_first_use_and_a_later_swap_is_refused(
    offline_torch_home, resnet50_state, capsys
):
    """Guards: with no published hash, any file in a registered name's cache path loaded under that name."""
    path = _seed_default(capsys, resnet50_state)
    assert [row[3] for row in _listed(capsys).values()] == ["unverified"] * 3  # no hash is published for them
    sha = file_sha256(path)
    assert load_backbone("barlowtwins-in1k", progress=False).weights_info["sha256"] == sha
    record = path.with_name(path.name + ".sha256")
    assert record.read_text() == f"{sha}  {path.name}\n"  # sha256sum's format
    assert _listed(capsys)["barlowtwins-in1k"][3] == f"recorded:{sha[:16]}"  # was "unverified" for good
    torch.save({**resnet50_state, "conv1.weight": resnet50_state["conv1.weight"] + 1}, path)
    with pytest.raises(DownloadError) as err:
        load_backbone("barlowtwins-in1k", progress=False)
    assert str(err.value) == (
        f"cached file {path} has sha256 {file_sha256(path)[:16]}..., not the {sha[:16]}... recorded in {record.name} "
        f"beside it when it was first used for {BarlowTwinsWeights.DEFAULT.url}: it changed since; "
        "delete it to download it again"
    )
    for read in (read_projector_state_dict, weights_fingerprint):  # every reader of the file checks it
        with pytest.raises(DownloadError, match="it changed since"):
            read("barlowtwins-in1k")


def test_a_registered_file_is_hashed_once_per_load(offline_torch_home, resnet50_state, capsys, monkeypatch):
    """Guards: the cache check and weights_info each read and hashed the whole file (twice per load)."""
    import bt_hub.common.files

    path = _seed_default(capsys, resnet50_state)
    hashed: list[int] = []

    def counting_sha256(*args):
        hashed.append(1)
        return hashlib.sha256(*args)

    monkeypatch.setattr(bt_hub.common.files, "hashlib", SimpleNamespace(sha256=counting_sha256))
    first = load_backbone("barlowtwins-in1k", progress=False).weights_info["sha256"]  # records the sha256
    second = load_backbone("barlowtwins-in1k", progress=False).weights_info["sha256"]  # checks the record
    fingerprint = weights_fingerprint("barlowtwins-in1k")
    assert len(hashed) == 3
    assert first == second == fingerprint == hashlib.sha256(path.read_bytes()).hexdigest()


def test_every_loaded_model_carries_transforms_that_take_pil_images_tensors_and_batches(
    offline_torch_home, resnet50_state, tmp_path, capsys
):
    """Guards: models from a run folder, a Hugging Face folder or weights=None carried a PIL-only Compose (ToTensor),
    so a uint8 tensor batch was a TypeError; only registered weights took tensors."""
    from bt_hub.weights import from_pretrained

    _seed_default(capsys, resnet50_state)
    run, _ = _tiny_run(tmp_path)
    folder = save_pretrained(BarlowTwins("resnet18", "16-16"), tmp_path / "hf", config={"image_size": 32})
    models = {
        "registered": (torch.hub.load(str(REPO_ROOT), "resnet50", source="local", weights="DEFAULT"), 224),
        "weights=None": (torch.hub.load(str(REPO_ROOT), "resnet50", source="local", weights=None), 224),
        "run folder": (load_backbone(run), 16),
        "Hugging Face folder": (from_pretrained(folder), 32),
    }
    torch.manual_seed(0)
    image = (torch.rand(3, 60, 50) * 255).to(torch.uint8)
    pil = torchvision.transforms.functional.to_pil_image(image)
    grey_levels = 2 / 255 / min(IMAGENET_STD)  # tensors are resized by torch, PIL images by PIL
    for source, (model, size) in models.items():
        transforms = model.transforms
        assert torch.equal(transforms(pil), eval_transforms(size)(pil)), source
        single, batch = transforms(image), transforms(torch.stack([image, image]))
        assert single.shape == (3, size, size) and batch.shape == (2, 3, size, size), source
        torch.testing.assert_close(single, eval_transforms(size)(pil), atol=grey_levels, rtol=0)
        torch.testing.assert_close(batch[1], single)
    assert str(models["registered"][0].transforms) == str(BarlowTwinsWeights.DEFAULT.transforms())


def _tiny_run(tmp_path: Path) -> tuple[Path, BarlowTwins]:
    """A run directory as bt-hub pretrain leaves it: backbone.safetensors, config.json (λ = 0.1) and checkpoint.pth."""
    from bt_hub.weights import save_safetensors

    torch.manual_seed(3)
    model = BarlowTwins("resnet18", "32-16", lambd=0.1, small_image_stem=True)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d)):
                module.running_mean.uniform_(-0.1, 0.1)
                module.running_var.uniform_(0.5, 1.5)
    run = tmp_path / "run"
    save_safetensors(model.backbone.state_dict(), run / "backbone.safetensors", {"architecture": "resnet18"})
    (run / "config.json").write_text(
        json.dumps(
            {
                "architecture": "resnet18",
                "small_image_stem": True,
                "projector": "32-16",
                "lambd": 0.1,
                "image_size": 16,
                "epochs": 3,
                "dataset": "digits",
            }
        )
    )
    torch.save({"model": model.state_dict(), "optimizer": {}, "step": 9}, run / "checkpoint.pth")
    return run, model.eval()


def test_export_hf_of_a_run_keeps_the_projector_and_lambda_and_the_card_its_name_and_preprocessing(tmp_path, capsys):
    run, model = _tiny_run(tmp_path)
    results = tmp_path / "results.json"
    weights = {"name": "run", "fingerprint": file_sha256(run / "backbone.safetensors")}
    results.write_text(
        json.dumps({"protocol": "knn", "dataset": "digits", "weights": weights, "metrics": {"top1": 88.6}})
    )
    out = tmp_path / "hf"
    assert (
        cli.main(
            [
                "export",
                "--weights",
                str(run),
                "--format",
                "hf",
                "--out",
                str(out),
                "--name",
                "bt/digits",
                "--results",
                str(results),
            ]
        )
        == 0
    )
    assert "projector.safetensors" in capsys.readouterr().out
    loaded = barlow_twins(weights=out).eval()
    assert loaded.lambd == 0.1 and loaded.config["projector"] == "32-16"
    images = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(loaded.backbone(images), model.backbone(images))
        assert torch.equal(loaded.embed(images), model.embed(images))
    card = (out / "README.md").read_text()
    assert "# bt/digits" in card and 'from_pretrained("bt/digits")' in card
    assert (
        "resize to 18 (bilinear),\ncentre crop 16" in card
        and "| knn [resnet18, 3x3 small-image stem, 16 px] | — | digits | Top-1 | 88.6 | 1 seed | — |" in card
    )
    assert "it is a bt_hub-only layout" in card and "timm.create_model(" not in card


def test_timm_loads_a_resnet50_folder_with_identical_features_and_refuses_a_small_stem_by_name(tmp_path):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    backbone = build_backbone("resnet50")
    with torch.no_grad():
        for module in backbone.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.weight.uniform_(0.5, 1.5)
                module.running_var.uniform_(0.5, 1.5)
    folder = save_pretrained(backbone, tmp_path / "r50", name="bt/r50")
    theirs = timm.create_model(f"local-dir:{folder}", pretrained=True, num_classes=0).eval()
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(theirs(images), backbone.eval()(images), atol=1e-5, rtol=1e-5)
    assert 'timm.create_model("hf-hub:bt/r50"' in (folder / "README.md").read_text()
    run, _ = _tiny_run(tmp_path)
    small = save_pretrained(str(run), tmp_path / "small")
    with pytest.raises(TypeError, match="unexpected keyword argument 'bt_hub_small_image_stem'"):
        timm.create_model(f"local-dir:{small}", pretrained=True, num_classes=0)


HUB_SCRIPT = """
import json, sys
from bt_hub import cli
from bt_hub.weights import barlow_twins
model = barlow_twins(weights="bt/digits")
print(json.dumps({"lambd": model.lambd, "projector": model.config["projector"]}))
sys.exit(cli.main(["eval", "knn", "--weights", "bt/digits", "--data", "synthetic:40", \
"--image-size", "16", "--k", "5", "--out", sys.argv[1]]))
"""


def test_a_bare_hub_id_works_in_eval_and_barlow_twins_through_a_loopback_hub(tmp_path):
    pytest.importorskip("huggingface_hub")
    from loopback import LoopbackHub

    run, _ = _tiny_run(tmp_path)
    folder = save_pretrained(str(run), tmp_path / "folder", name="bt/digits")
    files = {p.name: p.read_bytes() for p in folder.iterdir()}
    hub = LoopbackHub({"bt/digits": {"main": ("c" * 40, files)}})
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "0",
    }
    try:
        result = subprocess.run(
            [sys.executable, "-c", HUB_SCRIPT, str(tmp_path / "knn")],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
    finally:
        hub.stop()
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[0]) == {"lambd": 0.1, "projector": "32-16"}
    record = json.loads((tmp_path / "knn" / "results.json").read_text())
    assert record["weights"] == {
        "name": "bt/digits",
        "fingerprint": hashlib.sha256(files["model.safetensors"]).hexdigest(),
    }
    commit = "c" * 40  # the projector comes from the commit the weights came from
    assert ("GET", f"/bt/digits/resolve/{commit}/projector.safetensors") in hub.requests


def test_cli_version_one_architecture_flag_and_defaults_of_on_off_flags(capsys):
    from bt_hub import __version__

    assert cli.main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"bt-hub {__version__}"
    for path in (["pretrain"], ["demo"], ["eval", "knn"], ["export"]):
        with pytest.raises(SystemExit):
            cli.main(path + ["--help"])
        text, flag = capsys.readouterr().out, "--pretrain.arch" if path == ["demo"] else "--arch"  # the demo's child
        assert flag in text and flag.replace("arch", "backbone") not in text, path
    with pytest.raises(SystemExit):
        cli.main(["pretrain", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--flip, --no-flip random horizontal flips" in text and "(default: on)" in text and "(default: off)" in text
    from bt_hub.train.pretrain import PretrainConfig

    parser = cli_flags.argparse.ArgumentParser()
    cli_flags.add_dataclass_arguments(parser, PretrainConfig)
    assert cli_flags.build_config(PretrainConfig, parser.parse_args(["--backbone", "resnet18"])).backbone == "resnet18"
    assert cli_flags.build_config(PretrainConfig, parser.parse_args(["--arch", "resnet34"])).backbone == "resnet34"


def test_the_weights_wing_loads_its_names_on_first_use_and_keeps_every_public_name():
    # Guards: bt_hub/weights/__init__.py imported every module of the wing (download, export, hf, card) on any
    # import of bt_hub.weights.*; its names now load on first use, and `export` / `download` stay the functions
    # when their modules load (the import system sets a package attribute to each submodule).
    names = (
        "IMAGENET_MEAN IMAGENET_STD PAPER_RESULTS RECIPE BarlowTwinsWeights CheckpointError DownloadError ExportConfig "
        "PushConfig PushError ResolvedWeights Weights barlow_twins cache_path download eval_transforms export "
        "from_pretrained get_weights list_weights load_backbone push push_to_hub read_backbone_state_dict "
        "read_projector_state_dict resolve save_detectron2 save_hf_folder resnet18 resnet34 resnet50 resnet101 "
        "save_pretrained save_safetensors save_torchvision to_detectron2 transforms_for weights_fingerprint"
    ).split()
    code = (
        "import sys, types, bt_hub.weights as w;"
        "first = sorted(m for m in sys.modules if m.startswith('bt_hub.weights'));"
        "import bt_hub.weights.export, bt_hub.weights.download; from bt_hub.weights import *;"
        "assert not isinstance(w.export, types.ModuleType) and not isinstance(w.download, types.ModuleType);"
        "from bt_hub.weights import export, download; assert export.__module__ == 'bt_hub.weights.export';"
        "assert [n for n in w.__all__ if n not in globals()] == [];"
        "assert download.__module__ == 'bt_hub.weights.download';"
        "print(first, sorted(w.__all__))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"{['bt_hub.weights']} {sorted(names)}"
