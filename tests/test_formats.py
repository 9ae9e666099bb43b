"""Reading any checkpoint layout strictly and safely; exact round trips through every export format."""

from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from safetensors.torch import save_file

from bt_hub import cli
from bt_hub.common.files import read_file
from bt_hub.method.model import BarlowTwins
from bt_hub.weights import (
    CheckpointError,
    ExportConfig,
    export,
    load_backbone,
    read_backbone_state_dict,
    save_detectron2,
    save_safetensors,
    to_detectron2,
    weights_fingerprint,
)
from bt_hub.weights.formats import infer_architecture, torchvision_to_detectron2_key


@pytest.fixture(scope="module")
def resnet50_state() -> dict[str, torch.Tensor]:
    """A real torchvision ResNet-50 state dict (fc included), with BN statistics that are not the defaults."""
    torch.manual_seed(0)
    state = torchvision.models.resnet50().state_dict()
    for key, value in state.items():
        if key.endswith(("running_mean", "running_var")):
            value.uniform_(0.5, 1.5)
        elif key.endswith("num_batches_tracked"):
            value.fill_(7)
    return state


@pytest.fixture(scope="module")
def resnet50_file(resnet50_state, tmp_path_factory) -> Path:
    """The reference layout: a torchvision ResNet-50 state dict without fc, saved once."""
    path = tmp_path_factory.mktemp("weights") / "resnet50.pth"
    torch.save(_backbone(resnet50_state), path)
    return path


def _backbone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if not k.startswith("fc.")}


def _assert_same_backbone(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    loaded = model.state_dict()
    expected = _backbone(state)
    assert set(loaded) == set(expected)
    mismatched = [k for k in expected if not torch.equal(loaded[k], expected[k])]
    assert mismatched == []


def _prefixed(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {prefix + k: v for k, v in state.items()}


LAYOUTS = {
    # name: (file name, builder of the object saved, format description expected)
    "torchvision with fc": ("tv.pth", lambda s: s, "torchvision state dict"),
    "reference resnet50.pth": ("resnet50.pth", _backbone, "torchvision state dict"),
    "reference checkpoint.pth": (
        "checkpoint.pth",
        lambda s: {
            "epoch": 1000,
            "optimizer": {"state": {}, "param_groups": [{"lr": 0.2, "params": [0]}]},
            "model": {
                **_prefixed(_backbone(s), "module.backbone."),
                "module.projector.0.weight": torch.ones(16, 2048),
                "module.projector.1.running_mean": torch.zeros(16),
                "module.bn.running_mean": torch.zeros(16),
            },
        },
        "under 'model.module.backbone.'",
    ),
    "VISSL trunk": (
        "model_final_checkpoint_phase999.torch",
        lambda s: {
            "classy_state_dict": {
                "base_model": {
                    "model": {
                        "trunk": _prefixed(_backbone(s), "_feature_blocks."),
                        "heads": {"0.projection.weight": torch.ones(2, 2)},
                    }
                }
            },
            "phase_idx": 999,
        },
        "VISSL trunk",
    ),
    "lightly backbone.": (
        "lightly.ckpt",
        lambda s: {
            "state_dict": {
                **_prefixed(_backbone(s), "backbone."),
                "projection_head.layers.0.weight": torch.ones(4, 2048),
            }
        },
        "under 'state_dict.backbone.'",
    ),
    "solo-learn backbone. + momentum": (
        "solo.ckpt",
        lambda s: {
            "state_dict": {
                **_prefixed(_backbone(s), "backbone."),
                **_prefixed({k: v * 0 for k, v in _backbone(s).items()}, "momentum_backbone."),
            }
        },
        "under 'state_dict.backbone.'",
    ),
    "Lightning model.backbone.": (
        "lightning.ckpt",
        lambda s: {"epoch": 3, "state_dict": _prefixed(_backbone(s), "model.backbone.")},
        "under 'state_dict.model.backbone.'",
    ),
    "encoder.": ("encoder.pth", lambda s: {"state_dict": _prefixed(s, "encoder.")}, "under 'state_dict.encoder.'"),
    "module.": ("ddp.pth", lambda s: _prefixed(s, "module."), "under 'module.'"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_foreign_layout_loads_with_zero_missing_keys(layout, resnet50_state, tmp_path):
    name, build, described = LAYOUTS[layout]
    path = tmp_path / name
    torch.save(build(resnet50_state), path)
    model = load_backbone(path)
    _assert_same_backbone(model, resnet50_state)
    assert isinstance(model.fc, torch.nn.Identity)
    assert model.weights_info["architecture"] == "resnet50"
    assert described in model.weights_info["format"]


def test_detectron2_pkl_and_safetensors_load_exactly(resnet50_state, tmp_path):
    pkl = tmp_path / "model.pkl"
    with open(pkl, "wb") as f:
        pickle.dump(to_detectron2(resnet50_state), f)
    save_file(_backbone(resnet50_state), tmp_path / "w.safetensors")
    for source in (pkl, tmp_path / "w.safetensors"):
        _assert_same_backbone(load_backbone(source), resnet50_state)


@pytest.mark.parametrize("protocol", [0, 1, 2])
def test_detectron2_pkl_of_an_old_pickle_protocol_loads_and_code_in_one_is_still_refused(
    protocol, resnet50_state, tmp_path
):
    """Guards: a valid protocol-2 .pkl (plain numpy arrays, as Python 2 era model zoos wrote) was refused as pickled
    code ('_codecs.encode', which protocols 0-2 use to rebuild the arrays' bytes)."""
    pkl = tmp_path / "model.pkl"
    with open(pkl, "wb") as f:
        pickle.dump(to_detectron2(resnet50_state), f, protocol=protocol)
    _assert_same_backbone(load_backbone(pkl), resnet50_state)
    marker = tmp_path / "executed"
    with open(pkl, "wb") as f:
        pickle.dump({"model": {"stem.conv1.weight": _Shell(marker)}}, f, protocol=protocol)
    with pytest.raises(CheckpointError, match=r"holds pickled code \('posix.system'\), so bt_hub refuses to load it"):
        load_backbone(pkl)
    assert not marker.exists()


class _Shell:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_trained_detectron2_model_with_res5_in_roi_heads_loads(resnet50_state, tmp_path):
    payload = to_detectron2(resnet50_state)["model"]
    renamed = {("roi_heads." if k.startswith("res5.") else "backbone.bottom_up.") + k: v for k, v in payload.items()}
    renamed["roi_heads.box_predictor.cls_score.weight"] = np.zeros((21, 2048), dtype=np.float32)
    path = tmp_path / "model_final.pkl"
    with open(path, "wb") as f:
        pickle.dump({"model": renamed, "__author__": "detectron2"}, f)
    model = load_backbone(path)
    _assert_same_backbone(model, resnet50_state)
    assert model.weights_info["dropped"] == ["model.roi_heads.box_predictor.cls_score.weight"]


def test_run_directory_and_its_training_checkpoint_load(tmp_path):
    torch.manual_seed(1)
    bt = BarlowTwins("resnet18", "16-16", small_image_stem=True)
    state = bt.backbone.state_dict()
    run = tmp_path / "run"
    run.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, run / "backbone.safetensors")
    (run / "config.json").write_text('{"architecture": "resnet18", "small_image_stem": true}')
    torch.save(
        {"model": bt.state_dict(), "optimizer": {}, "step": 5, "config": {}, "rng": {"torch": torch.get_rng_state()}},
        run / "checkpoint.pth",
    )
    for source in (run, run / "checkpoint.pth"):
        model = load_backbone(source)
        assert model.conv1.kernel_size == (3, 3) and isinstance(model.maxpool, torch.nn.Identity)
        _assert_same_backbone(model, state)


def test_architecture_is_inferred_from_keys_and_shapes():
    with torch.device("meta"):
        for arch in ("resnet18", "resnet34", "resnet50", "resnet101"):
            state = getattr(torchvision.models, arch)().state_dict()
            assert infer_architecture(state, "x.pth") == (arch, False)
        small = torchvision.models.resnet18().state_dict()
    small["conv1.weight"] = torch.empty(64, 3, 3, 3)
    assert infer_architecture(small, "x.pth") == ("resnet18", True)


def test_pickle_that_would_execute_code_is_refused(tmp_path):
    marker = tmp_path / "executed"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    for name in ("model.pkl", "model.pth"):
        path = tmp_path / name
        with open(path, "wb") as f:
            pickle.dump({"model": {"conv1.weight": Payload()}}, f)
        with pytest.raises(CheckpointError, match=f"{name} holds pickled code") as err:
            load_backbone(path)
        assert "\n" not in str(err.value)
    torch.save({"x": Payload()}, tmp_path / "zipped.pth")
    with pytest.raises(CheckpointError, match=r"zipped.pth holds pickled code \('posix.system'\)"):
        load_backbone(tmp_path / "zipped.pth")
    assert not marker.exists()


def _one_sentence_naming(err: pytest.ExceptionInfo, name: str) -> str:
    text = str(err.value)
    assert name in text and "\n" not in text
    return text


def test_truncated_file_is_one_sentence_naming_the_file(resnet50_file, tmp_path):
    (tmp_path / "cut.pth").write_bytes(resnet50_file.read_bytes()[: resnet50_file.stat().st_size // 2])
    with pytest.raises(CheckpointError) as err:
        load_backbone(tmp_path / "cut.pth")
    assert "perhaps truncated" in _one_sentence_naming(err, "cut.pth")
    save_file({"conv1.weight": torch.zeros(64, 3, 7, 7)}, tmp_path / "w.safetensors")
    (tmp_path / "cut.safetensors").write_bytes((tmp_path / "w.safetensors").read_bytes()[:5000])
    with pytest.raises(CheckpointError) as err:
        load_backbone(tmp_path / "cut.safetensors")
    assert "perhaps truncated" in _one_sentence_naming(err, "cut.safetensors")


def test_resnet18_weights_into_resnet50_is_one_sentence(tmp_path):
    torch.save(torchvision.models.resnet18().state_dict(), tmp_path / "r18.pth")
    with pytest.raises(CheckpointError) as err:
        load_backbone(tmp_path / "r18.pth", arch="resnet50")
    text = _one_sentence_naming(err, "r18.pth")
    assert "does not fit resnet50 (it looks like resnet18)" in text
    assert "layer1.0.conv1.weight (64, 64, 3, 3) vs (64, 64, 1, 1)" in text
    assert "keys are missing, first ['layer1.0.conv3.weight'" in text


def test_missing_backbone_keys_are_listed_never_partially_loaded(resnet50_state, tmp_path):
    state = _backbone(resnet50_state)
    del state["layer4.2.bn3.running_var"], state["layer4.2.conv3.weight"]
    torch.save(state, tmp_path / "partial.pth")
    with pytest.raises(CheckpointError) as err:
        load_backbone(tmp_path / "partial.pth")
    text = _one_sentence_naming(err, "partial.pth")
    assert "2 keys are missing, first ['layer4.2.conv3.weight', 'layer4.2.bn3.running_var']" in text


def test_unknown_layout_is_one_sentence_naming_the_file(tmp_path):
    torch.save({"encoder": {"blocks.0.attn.qkv.weight": torch.zeros(3, 3)}}, tmp_path / "vit.pth")
    with pytest.raises(CheckpointError) as err:
        load_backbone(tmp_path / "vit.pth")
    assert "no ResNet backbone in a known key layout" in _one_sentence_naming(err, "vit.pth")


def test_read_backbone_state_dict_reports_what_it_recognised(resnet50_state, tmp_path):
    torch.save(resnet50_state, tmp_path / "tv.pth")
    state, info = read_backbone_state_dict(tmp_path / "tv.pth")
    assert set(state) == set(_backbone(resnet50_state))
    assert info["format"] == "torchvision state dict" and info["dropped"] == ["fc.weight", "fc.bias"]
    assert weights_fingerprint(tmp_path / "tv.pth") == hashlib.sha256((tmp_path / "tv.pth").read_bytes()).hexdigest()


def test_a_torchvision_export_of_weights_trained_at_another_size_says_which_size_to_evaluate_at(
    resnet18_weights, tmp_path
):
    """Guards: the .pth of a 32-px run carries no image size, and was scored at 224 px with no word at export."""
    from bt_hub.method.transforms import input_metadata

    state = torch.load(resnet18_weights, weights_only=True)
    meta = input_metadata(architecture="resnet18", small_image_stem=False, image_size=32)
    sized = save_safetensors(state, tmp_path / "r.safetensors", meta)
    with pytest.warns(UserWarning, match=r"pretrained at 32 px.*--image-size 32"):
        written = export(ExportConfig(weights=str(sized), format="torchvision", out=str(tmp_path / "r.pth")))
    assert load_backbone(written).weights_info.get("image_size") is None  # the plain state dict torchvision loads


@pytest.mark.parametrize(
    "fmt,out", [("torchvision", "bt.pth"), ("safetensors", "bt.safetensors"), ("detectron2", "bt.pkl"), ("hf", "hf")]
)
def test_export_round_trip_is_exact(fmt, out, resnet50_state, resnet50_file, tmp_path, capsys):
    written = export(ExportConfig(weights=str(resnet50_file), format=fmt, out=str(tmp_path / out)))
    _assert_same_backbone(load_backbone(written), resnet50_state)
    assert capsys.readouterr().out == ""  # the library returns what it wrote; the CLI prints it
    if fmt == "torchvision":
        sha = hashlib.sha256(written.read_bytes()).hexdigest()
        again = ["export", "--weights", str(resnet50_file), "--format", fmt, "--out", str(tmp_path / out), "--force"]
        assert cli.main(again) == 0
        hint = "it holds no fc: set model.fc = nn.Identity() before load_state_dict, or pass strict=False"
        assert written.name == f"bt-{sha[:8]}.pth"
        assert capsys.readouterr().out == f"wrote {written} (sha256 {sha}); {hint}\n"  # a strict load needs the hint
        model = torchvision.models.resnet50()
        model.fc = torch.nn.Identity()
        model.load_state_dict(torch.load(written, weights_only=True))  # strict, as the hint says
    if fmt == "detectron2":
        with open(written, "rb") as f:
            payload = pickle.load(f)
        assert payload["__author__"] and payload["matching_heuristics"] is True
        model = payload["model"]
        assert all(isinstance(v, np.ndarray) for v in model.values()) and not any("fc" in k for k in model)
        for key in (
            "stem.conv1.weight",
            "stem.conv1.norm.running_var",
            "res2.0.conv1.norm.weight",
            "res3.0.shortcut.weight",
            "res5.2.conv3.norm.bias",
            "res4.0.shortcut.norm.running_mean",
        ):
            assert key in model


def test_cli_export_prints_hash_and_fails_with_one_line(resnet50_file, tmp_path, capsys):
    source = resnet50_file
    assert cli.main(["export", "--weights", str(source), "--out", str(tmp_path / "bt.pth")]) == 0
    written = next(tmp_path.glob("bt-*.pth"))
    assert hashlib.sha256(written.read_bytes()).hexdigest() in capsys.readouterr().out
    assert cli.main(["export", "--weights", str(tmp_path / "nope.pth"), "--out", str(tmp_path / "x.pth")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"bt-hub export: error: weights {tmp_path / 'nope.pth'}: no such file or folder"
    assert (
        cli.main(["export", "--weights", str(source), "--format", "detectron2", "--out", str(tmp_path / "x.pth")]) == 2
    )
    assert "--out for --format detectron2 must end in .pkl" in capsys.readouterr().err


def test_exported_pkl_loads_into_detectron2_r50_c4_with_nothing_unloaded(resnet50_state, tmp_path):
    pytest.importorskip("detectron2")
    from detectron2.checkpoint import DetectionCheckpointer
    from detectron2.config import get_cfg
    from detectron2.modeling import build_model

    import bt_hub.eval.detection.detectron2_engine.roi_heads  # noqa: F401  (registers Res5ROIHeadsExtraNorm)

    pkl = save_detectron2(resnet50_state, tmp_path / "bt.pkl")
    cfg = get_cfg()
    cfg.merge_from_file(str(Path(__file__).resolve().parents[1] / "detection_configs" / "Base-RCNN-C4-BN.yaml"))
    cfg.MODEL.RESNETS.NORM = "BN"
    cfg.MODEL.DEVICE = "cpu"
    model = build_model(cfg)
    DetectionCheckpointer(model).load(str(pkl))
    loaded = model.state_dict()
    expected = {}
    for key, value in _backbone(resnet50_state).items():
        name = torchvision_to_detectron2_key(key)
        expected[("roi_heads." if name.startswith("res5.") else "backbone.") + name] = value
    targets = [
        k
        for k in loaded
        if (k.startswith("backbone.") or k.startswith("roi_heads.res5.")) and not k.startswith("roi_heads.res5.norm.")
    ]
    assert sorted(targets) == sorted(expected)
    unloaded = [k for k in targets if not torch.equal(loaded[k].cpu(), expected[k])]
    assert unloaded == []


def test_safetensors_files_are_byte_identical_across_saves(tmp_path):
    """Guards against safetensors writing metadata keys in random (hash map) order, which changed the sha256."""
    state = {"conv1.weight": torch.arange(6.0).reshape(1, 1, 2, 3)}
    meta = {"format": "pt", "architecture": "resnet50", "small_image_stem": "False", "source_format": "x"}
    digests = {
        hashlib.sha256(save_safetensors(state, tmp_path / f"{i}.safetensors", meta).read_bytes()).hexdigest()
        for i in range(8)
    }
    assert len(digests) == 1


def test_torchs_safe_reader_still_words_a_refusal_as_bt_hub_reads_it(tmp_path):
    # bt_hub tells torch's refusal of a file's contents from a cut-short pickle by its wording alone (torch raises
    # the same UnpicklingError type for both): a torch release that rewords it must fail here, not in a message.
    # The global it refuses is named from torch's lister of a checkpoint's globals, not from the message.
    import pickle

    path = tmp_path / "slice.pth"
    torch.save({"w": slice(1, 2)}, path)  # a builtin that torch's safe reader does not admit
    with pytest.raises(pickle.UnpicklingError, match="^Weights only load failed"):
        torch.load(path, weights_only=True)
    with pytest.raises(CheckpointError, match=r"slice.pth holds pickled code \('builtins.slice'\)"):
        read_file(path)
