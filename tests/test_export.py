"""bt-hub export, each format x stem: the file loads where the format says it does, or the export is refused."""

from __future__ import annotations

import pickle

import pytest
import torch
import torchvision

from bt_hub import cli
from bt_hub.weights import ExportConfig, export, from_pretrained, load_backbone, save_torchvision, to_detectron2

FORMATS = {"torchvision": "bt.pth", "detectron2": "bt.pkl", "safetensors": "bt.safetensors", "hf": "bt_hf"}


def _state(path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in torch.load(path, weights_only=True).items() if not k.startswith("fc.")}


def _detectron2_r50_shapes() -> dict[str, tuple[int, ...]]:
    """The backbone parameters and BN buffers of detectron2's R50 (build_resnet_backbone, BottleneckBlock), by name.

    Written from detectron2's ResNet definition, not from bt_hub's key mapping: stem.conv1 is 7x7 with its norm,
    resN.B.conv1-3 (1x1, 3x3, 1x1) each with a norm, and a shortcut with a norm in each stage's first block.
    """
    shapes: dict[str, tuple[int, ...]] = {}

    def conv(name: str, out: int, inp: int, k: int) -> None:
        shapes[f"{name}.weight"] = (out, inp, k, k)
        for buffer in ("weight", "bias", "running_mean", "running_var"):
            shapes[f"{name}.norm.{buffer}"] = (out,)

    conv("stem.conv1", 64, 3, 7)
    inp = 64
    for stage, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512)), start=2):
        out = width * 4
        for b in range(blocks):
            conv(f"res{stage}.{b}.conv1", width, inp if b == 0 else out, 1)
            conv(f"res{stage}.{b}.conv2", width, width, 3)
            conv(f"res{stage}.{b}.conv3", out, width, 1)
            if b == 0:
                conv(f"res{stage}.{b}.shortcut", out, inp, 1)
        inp = out
    return shapes


@pytest.mark.parametrize("fmt", ["safetensors", "hf"])
@pytest.mark.parametrize("small", [False, True], ids=["standard_stem", "small_stem"])
def test_safetensors_and_hf_exports_carry_either_stem(fmt, small, seeded_weights, tmp_path):
    source = seeded_weights("resnet18", small_image_stem=small)
    written = export(ExportConfig(weights=str(source), format=fmt, out=str(tmp_path / FORMATS[fmt])))
    loaded = from_pretrained(written) if fmt == "hf" else load_backbone(written)
    assert loaded.weights_info["small_image_stem"] is small
    assert tuple(loaded.conv1.weight.shape[-2:]) == ((3, 3) if small else (7, 7))
    expected = _state(source)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in expected.items())


def test_torchvision_export_of_a_standard_stem_loads_into_torchvisions_resnet(resnet18_weights, tmp_path):
    written = export(ExportConfig(weights=str(resnet18_weights), format="torchvision", out=str(tmp_path / "bt.pth")))
    model = torchvision.models.resnet18()
    model.fc = torch.nn.Identity()
    model.load_state_dict(torch.load(written, weights_only=True), strict=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in _state(resnet18_weights).items())


def test_detectron2_export_of_a_standard_stem_has_every_r50_key_at_detectron2s_shape(seeded_weights, tmp_path):
    source = seeded_weights("resnet50")
    written = export(ExportConfig(weights=str(source), format="detectron2", out=str(tmp_path / "bt.pkl")))
    with open(written, "rb") as f:
        payload = pickle.load(f)
    model = {k: v for k, v in payload["model"].items() if not k.endswith("num_batches_tracked")}
    assert {k: tuple(v.shape) for k, v in model.items()} == _detectron2_r50_shapes()
    assert payload["matching_heuristics"] is True  # res5 lands in the C4 RoI head
    assert torch.equal(torch.from_numpy(model["stem.conv1.weight"]), _state(source)["conv1.weight"])


@pytest.mark.parametrize(("fmt", "library"), [("torchvision", "torchvision's resnet"), ("detectron2", "detectron2")])
def test_small_stem_export_to_a_7x7_stem_library_is_refused_in_one_sentence(
    fmt, library, small_stem_weights, tmp_path, capsys
):
    """Guards against a small-stem .pth / .pkl that torchvision / detectron2 cannot load (3x3 vs 7x7 conv1)."""
    out = tmp_path / "out" / FORMATS[fmt]
    args = ["export", "--weights", str(small_stem_weights), "--format", fmt, "--out", str(out)]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"bt-hub export: error: a {fmt} " in err and library in err and "small-image stem (3x3 conv1" in err
    assert "--format safetensors / --format hf" in err
    assert not out.parent.exists() or not any(out.parent.iterdir())


def test_small_stem_is_refused_by_the_python_api_too(small_stem_weights, tmp_path):
    state = _state(small_stem_weights)
    with pytest.raises(ValueError, match="a torchvision .pth cannot carry bt_hub's small-image stem"):
        save_torchvision(state, tmp_path / "bt.pth")
    with pytest.raises(ValueError, match="a detectron2 .pkl cannot carry bt_hub's small-image stem"):
        to_detectron2(state)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("given", ["bt.pth", "bt.pt", "bt"])
def test_a_torchvision_file_is_named_stem_hash_pth_whether_out_ends_in_pth_pt_or_nothing(given, tmp_path):
    # Guards: --out m.pt wrote m.pt-<hash>.pth.
    import torchvision

    target, sha = save_torchvision(torchvision.models.resnet18().state_dict(), tmp_path / given)
    assert target == tmp_path / f"bt-{sha[:8]}.pth" and target.is_file()
