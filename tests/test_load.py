"""Weights files that are wrong never load silently.

Existing export targets, NaN/inf tensors, non-checkpoints, pickled code.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from bt_hub import cli
from bt_hub.method.model import BarlowTwins, build_backbone
from bt_hub.train.resume import load_checkpoint
from bt_hub.weights import CheckpointError, barlow_twins, load_backbone, save_pretrained


@pytest.fixture
def resnet18_file(resnet18_weights) -> Path:
    return resnet18_weights  # the standard stem: torchvision and detectron2 files cannot carry the small one


# ---------------------------------------------------------------- export never overwrites a file silently


@pytest.mark.parametrize("fmt,name", [("safetensors", "bt.safetensors"), ("detectron2", "bt.pkl")])
def test_export_refuses_an_existing_file_unless_forced(fmt, name, resnet18_file, tmp_path, capsys):
    target = tmp_path / name
    target.write_bytes(b"the user's own file")
    argv = ["export", "--weights", str(resnet18_file), "--format", fmt, "--out", str(target)]
    assert cli.main(argv) == 2
    assert (
        capsys.readouterr().err.strip() == f"bt-hub export: error: {target} already exists; pass --force to replace it"
    )
    assert target.read_bytes() == b"the user's own file"
    assert cli.main(argv + ["--force"]) == 0
    assert load_backbone(target).weights_info["architecture"] == "resnet18"


def test_export_torchvision_refuses_the_hash_named_file_it_would_write(resnet18_file, tmp_path, capsys):
    argv = ["export", "--weights", str(resnet18_file), "--out", str(tmp_path / "bt.pth")]
    assert cli.main(argv) == 0
    written = next(tmp_path.glob("bt-*.pth"))
    capsys.readouterr()
    assert cli.main(argv) == 2
    assert (
        capsys.readouterr().err.strip() == f"bt-hub export: error: {written} already exists; pass --force to replace it"
    )
    assert cli.main(argv + ["--force"]) == 0


@pytest.mark.parametrize(
    "name,said",
    [
        ("../../x", "must be 'org/name', got '../../x'"),
        ("org/a/b", "must be 'org/name', got 'org/a/b'"),
        ("..\\x/y", "'..\\\\x/y' is not a name the Hub accepts"),
        ("../x", "'../x' is not a name the Hub accepts"),
        ("org/x\nlicense: other", "'org/x\\nlicense: other' is not a name the Hub accepts"),
    ],
)
def test_export_name_that_is_no_hub_id_is_refused_naming_the_flag(name, said, resnet18_file, tmp_path, capsys):
    """Guards: --name went unchecked into the model card (a path, or a newline that rewrites its YAML header)."""
    out = tmp_path / "hf"
    argv = ["export", "--weights", str(resnet18_file), "--format", "hf", "--out", str(out), "--name", name]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"bt-hub export: error: --name {said}") and err.count("\n") == 1, err
    assert not out.exists()


def test_export_hf_keeps_files_bt_hub_did_not_write_even_with_force(resnet18_file, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "README.md").write_text("# my notes about this model\n")
    argv = ["export", "--weights", str(resnet18_file), "--format", "hf", "--out", str(out)]
    assert cli.main(argv) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            f"folder {out} is not empty; pass --force to replace the files bt_hub wrote there (other files are kept)"
        )
    )
    assert cli.main(argv + ["--force"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            f"{out / 'README.md'} was not written by bt_hub, so even --force does not replace it; "
            "move it away or export to another folder"
        )
    )
    assert sorted(p.name for p in out.iterdir()) == ["README.md"]
    assert (out / "README.md").read_text() == "# my notes about this model\n"

    os.unlink(out / "README.md")
    save_pretrained(BarlowTwins("resnet18", "8-8", small_image_stem=True), out)  # bt_hub's own folder, with a projector
    (out / "notes.txt").write_text("kept")
    assert cli.main(argv + ["--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors", "notes.txt"]
    assert (out / "notes.txt").read_text() == "kept" and "projector" not in json.loads(
        (out / "config.json").read_text()
    )


def test_a_config_json_naming_an_unknown_architecture_names_the_file_the_key_and_the_known_ones(tmp_path, capsys):
    """Guards: a config.json naming resnet9000 failed as "backbone 'resnet9000' is unknown", naming no file."""
    folder = save_pretrained(build_backbone("resnet18", small_image_stem=True), tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architecture": "resnet9000"}))
    expected = (
        f"config file {folder / 'config.json'} names architecture 'resnet9000' (key \"architecture\"); "
        "expected one of resnet18, resnet34, resnet50, resnet101"
    )
    with pytest.raises(CheckpointError) as err:
        load_backbone(folder)
    assert str(err.value) == expected
    out = tmp_path / "x.safetensors"
    assert cli.main(["export", "--weights", str(folder), "--format", "safetensors", "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == f"bt-hub export: error: {expected}"


# ---------------------------------------------------------------- non-finite weights are refused on load


@pytest.fixture
def diverged_file(tmp_path) -> Path:
    """A ResNet-18 whose BatchNorm running_var went NaN/inf, as a diverged run leaves it."""
    torch.manual_seed(0)
    state = build_backbone("resnet18", small_image_stem=True).state_dict()
    state["layer1.0.bn1.running_var"][0] = float("nan")
    state["layer3.1.bn2.running_var"][:] = float("inf")
    path = tmp_path / "diverged.pth"
    torch.save(state, path)
    return path


def test_non_finite_weights_are_refused_by_load_backbone_unless_allowed(diverged_file):
    with pytest.raises(CheckpointError) as err:
        load_backbone(diverged_file)
    assert str(err.value) == (
        f"weights file {diverged_file} holds NaN or inf in 2 tensors, "
        "first ['layer1.0.bn1.running_var', 'layer3.1.bn2.running_var'], "
        "so bt_hub refuses to load it (pass --allow-non-finite / allow_non_finite=True to inspect such weights anyway)"
    )
    model = load_backbone(diverged_file, allow_non_finite=True)
    assert torch.isnan(model.layer1[0].bn1.running_var[0])


def test_eval_and_export_refuse_non_finite_weights_and_the_flag_allows_them(diverged_file, tmp_path, capsys):
    knn = [
        "eval",
        "knn",
        "--weights",
        str(diverged_file),
        "--data",
        "synthetic:20",
        "--image-size",
        "8",
        "--k",
        "3",
        "--out",
        str(tmp_path / "knn"),
    ]
    assert cli.main(knn) == 2
    assert "holds NaN or inf in 2 tensors, first ['layer1.0.bn1.running_var'" in capsys.readouterr().err
    assert not (tmp_path / "knn" / "results.json").exists()
    assert cli.main(knn + ["--allow-non-finite"]) == 0
    export = [
        "export",
        "--weights",
        str(diverged_file),
        "--format",
        "safetensors",
        "--out",
        str(tmp_path / "x.safetensors"),
    ]
    assert cli.main(export) == 2 and not (tmp_path / "x.safetensors").exists()
    assert "holds NaN or inf" in capsys.readouterr().err
    assert cli.main(export + ["--allow-non-finite"]) == 0


def test_a_projector_with_nan_is_refused_too(tmp_path):
    torch.manual_seed(0)
    model = BarlowTwins("resnet18", "8-8", small_image_stem=True)
    state = model.state_dict()
    state["projector.1.running_var"][0] = float("nan")
    torch.save({"model": state}, tmp_path / "checkpoint.pth")
    with pytest.raises(
        CheckpointError, match=r"checkpoint.pth holds NaN or inf in 1 tensor, first \['1.running_var'\]"
    ):
        barlow_twins(weights=str(tmp_path / "checkpoint.pth"))


# ---------------------------------------------------------------- what a file is, said plainly


@pytest.mark.parametrize(
    "content,looks",
    [
        (
            b"<!DOCTYPE html>\n<html><head><title>404</title></head></html>\n",
            "looks like HTML, perhaps an error or login page saved in its place",
        ),
        (b"  <html><body>Sign in</body></html>", "looks like HTML, perhaps an error or login page saved in its place"),
        (bytes(range(7, 250)) * 3, "unrecognised bytes"),
        (b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 102\n", "looks like text"),
    ],
)
def test_files_that_are_no_checkpoint_say_what_they_look_like(content, looks, tmp_path):
    """Guards: random bytes or an HTML page saved as a .pth were reported as 'holds pickled code'."""
    path = tmp_path / "resnet50.pth"
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as err:
        load_backbone(path)
    assert str(err.value) == f"weights file {path} is not a torch checkpoint ({looks})"


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickled_code_is_refused_in_plain_words_without_torchs_weights_only_advice(tmp_path):
    """Guards: a refused checkpoint showed torch's own text suggesting to re-run with weights_only=False."""
    marker = tmp_path / "executed"
    zipped = tmp_path / "checkpoint.pth"
    torch.save(
        {"model": {"conv1.weight": _Payload(marker)}, "optimizer": {}, "step": 1, "config": {}, "rng": {}}, zipped
    )
    plain = tmp_path / "plain.pth"
    with open(plain, "wb") as f:
        pickle.dump({"model": _Payload(marker)}, f, protocol=4)
    for path, read in ((zipped, load_backbone), (zipped, load_checkpoint), (plain, load_backbone)):
        with pytest.raises(CheckpointError) as err:
            read(path)
        text = str(err.value)
        assert text == (
            f"weights file {path} holds pickled code ('posix.system'), so bt_hub refuses to load it; "
            "only tensors, arrays and plain containers are read"
        )
        assert err.value.__cause__ is None and err.value.__suppress_context__
    assert not marker.exists()


# ---------------------------------------------------------------- the hash is of the bytes that were loaded


def test_weights_replaced_while_loading_are_fingerprinted_by_the_bytes_that_were_loaded(
    resnet18_file, tmp_path, monkeypatch
):
    """Guards: the file was hashed again after it was loaded, so weights replaced in between keyed the feature cache
    and the record with the new file's hash beside the old file's features."""
    import hashlib

    import bt_hub.weights.formats
    from bt_hub.eval.config import load_weights

    path = tmp_path / "weights.pth"
    loaded = resnet18_file.read_bytes()
    path.write_bytes(loaded)
    torch.manual_seed(1)
    torch.save(build_backbone("resnet18").state_dict(), tmp_path / "other.pth")
    extract = bt_hub.weights.formats.extract_backbone

    def replace_then_extract(obj, name):
        os.replace(tmp_path / "other.pth", path)  # after the read, before anything could hash the file again
        return extract(obj, name)

    monkeypatch.setattr(bt_hub.weights.formats, "extract_backbone", replace_then_extract)
    weights = load_weights(str(path))
    backbone, fingerprint = weights.network, weights.sha256
    expected = torch.load(resnet18_file, weights_only=True)
    assert all(torch.equal(backbone.state_dict()[k], v) for k, v in expected.items() if k in backbone.state_dict())
    assert fingerprint == backbone.weights_info["sha256"] == hashlib.sha256(loaded).hexdigest()


@pytest.mark.parametrize("mode", ["L", "LA", "P", "I;16", "RGBA"])
def test_a_loaded_models_transforms_take_greyscale_and_other_modes_as_rgb(small_stem_weights, mode):
    """Guards: ``model.transforms`` raised a RuntimeError traceback on a greyscale PNG (mode L), as many small-image
    sets are, where every reader of bt_hub turns any mode into RGB."""
    from PIL import Image

    from bt_hub.weights import get_weights

    image = Image.new(mode, (40, 30))
    assert load_backbone(small_stem_weights).transforms(image).shape == (3, 224, 224)
    assert get_weights("barlowtwins-in1k").transforms()(image).shape == (3, 224, 224)
    assert load_backbone(small_stem_weights).transforms(torch.zeros(1, 40, 30, dtype=torch.uint8)).shape[0] == 3
