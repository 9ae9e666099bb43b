"""Detection transfer against the real detectron2 (skipped when it is not importable).

The shipped configs build on CPU, the exported Barlow Twins backbone loads into every
backbone and res5 tensor, detectron2 reads every value of the YAMLs exactly as the
torchvision engine does, and misconfigurations are named. The training run of
`bt-hub detect --engine detectron2` on generated shapes is the detectron2 case of the
engine-parametrised test in tests/test_torchvision_engine.py. The configs' SyncBN runs as
plain BN in a single CPU process (no process group), so it is not overridden here.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("detectron2")

from detection_settings import DETECTRON2_FAST as FAST  # noqa: E402
from detectron2.checkpoint import DetectionCheckpointer  # noqa: E402
from detectron2.modeling import build_model  # noqa: E402

from bt_hub.eval.config import load_weights  # noqa: E402
from bt_hub.eval.detection.config import CONFIGS, build_cfg, load_settings, resolve_config  # noqa: E402
from bt_hub.eval.detection.detect import prepare_weights  # noqa: E402
from bt_hub.eval.detection.detectron2_engine.trainer import run_trial, unloaded_parameters  # noqa: E402
from bt_hub.eval.detection.synthetic import write_coco, write_voc  # noqa: E402

pytestmark = [pytest.mark.detectron2, pytest.mark.usefixtures("one_thread")]


@pytest.mark.parametrize("alias", ["voc", "coco"])
def test_shipped_config_builds_on_cpu_and_loads_every_backbone_tensor(alias, bt_weights, tmp_path):
    source, state = bt_weights
    pkl, expected = prepare_weights(load_weights(str(source)), tmp_path)
    cfg = build_cfg(resolve_config(alias), [], weights=pkl, device="cpu", seed=0, output_dir=tmp_path)
    model = build_model(cfg)
    assert (
        isinstance(model.roi_heads.res5.norm, torch.nn.SyncBatchNorm) and model.roi_heads.res5.norm.num_features == 2048
    )
    assert hasattr(model.roi_heads, "mask_head") == (alias == "coco")
    DetectionCheckpointer(model).load(pkl)

    assert unloaded_parameters(model, expected) == []
    loaded = [
        k
        for k in model.state_dict()
        if k.startswith(("backbone.", "roi_heads.res5.")) and "res5.norm." not in k and "num_batches_tracked" not in k
    ]
    assert len(loaded) == len([k for k in expected if "num_batches_tracked" not in k]) == 265
    assert torch.equal(model.backbone.stem.conv1.weight, state["conv1.weight"])
    assert torch.equal(model.backbone.res4[5].conv2.norm.running_var, state["layer3.5.bn2.running_var"])
    assert torch.equal(model.roi_heads.res5[0].shortcut.norm.running_mean, state["layer4.0.downsample.1.running_mean"])

    with torch.no_grad():
        model.roi_heads.res5[2].conv3.weight.add_(1.0)
    assert unloaded_parameters(model, expected) == ["roi_heads.res5.2.conv3.weight"]


def _normalise(value):
    return [_normalise(v) for v in value] if isinstance(value, (list, tuple)) else value


def _leaves(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        out.update(_leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


@pytest.mark.parametrize("alias", list(CONFIGS))
def test_detectron2_reads_every_yaml_value_as_the_torchvision_engine_does(alias, tmp_path):
    settings = load_settings(resolve_config(alias))
    cfg = build_cfg(resolve_config(alias), [], weights="", device="cpu", seed=0, output_dir=tmp_path)
    leaves = {k: v for k, v in _leaves(settings.tree).items() if k != "VERSION"}
    assert len(leaves) > 50
    for key, value in leaves.items():
        node = cfg
        for part in key.split("."):
            node = node[part]
        assert _normalise(node) == _normalise(value), key


def test_class_count_that_does_not_match_the_data_is_refused(tmp_path):
    data = write_coco(tmp_path / "data", splits={"train2017": 2, "val2017": 1})
    cfg = build_cfg(resolve_config("coco"), FAST, weights="", device="cpu", seed=0, output_dir=tmp_path / "trial0")
    with pytest.raises(
        ValueError,
        match=r"NUM_CLASSES is 80 but dataset coco_2017_val has 4 classes; pass `MODEL.ROI_HEADS.NUM_CLASSES 4`",
    ):
        run_trial(cfg, str(data), None, False)


def test_missing_devkit_year_is_named(tmp_path):
    data = write_voc(tmp_path / "data", splits={"2007": {"trainval": 2, "test": 1}})
    cfg = build_cfg(resolve_config("voc"), FAST, weights="", device="cpu", seed=0, output_dir=tmp_path / "trial0")
    with pytest.raises(
        FileNotFoundError, match=r"dataset voc_2012_trainval needs .*VOC2012/ImageSets/Main/trainval.txt"
    ):
        run_trial(cfg, str(data), None, False)
