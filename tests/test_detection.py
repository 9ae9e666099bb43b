"""Detection transfer against the real detectron2 (skipped when it is not importable).

The shipped configs build on CPU, the exported Barlow Twins backbone loads into every
backbone and res5 tensor, and `bt-hub detect` trains 20 iterations on synthetic VOC and
COCO data with a falling loss and writes AP numbers to results.json. The configs' SyncBN
runs as plain BN in a single CPU process (no process group), so it is not overridden here.
The training runs shrink the input (96 px), the RoIs (8 per image, 4x4 pooling) and the
proposals so that 20 iterations take seconds; everything else is the shipped config.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("detectron2")

from detectron2.checkpoint import DetectionCheckpointer  # noqa: E402
from detectron2.data import MetadataCatalog  # noqa: E402
from detectron2.modeling import build_model  # noqa: E402

from bt_hub.cli import main as cli_main  # noqa: E402
from bt_hub.model import build_backbone  # noqa: E402
from eval.detection.config import build_cfg, resolve_config  # noqa: E402
from eval.detection.synthetic import write_coco, write_voc  # noqa: E402
from eval.detection.train_net import prepare_weights  # noqa: E402
from eval.detection.trainer import run_trial, unloaded_parameters  # noqa: E402

pytestmark = pytest.mark.detectron2

FAST = [
    "INPUT.MIN_SIZE_TRAIN", "(96,)", "INPUT.MAX_SIZE_TRAIN", "96",
    "INPUT.MIN_SIZE_TEST", "96", "INPUT.MAX_SIZE_TEST", "96",
    "SOLVER.IMS_PER_BATCH", "2", "SOLVER.REFERENCE_WORLD_SIZE", "0",
    "SOLVER.BASE_LR", "0.0125", "SOLVER.MAX_ITER", "20", "SOLVER.STEPS", "(15,)", "SOLVER.WARMUP_ITERS", "5",
    "SOLVER.CHECKPOINT_PERIOD", "100000",
    "MODEL.ROI_BOX_HEAD.POOLER_RESOLUTION", "4", "MODEL.ROI_HEADS.BATCH_SIZE_PER_IMAGE", "8",
    "MODEL.RPN.PRE_NMS_TOPK_TRAIN", "256", "MODEL.RPN.POST_NMS_TOPK_TRAIN", "32",
    "MODEL.RPN.PRE_NMS_TOPK_TEST", "50", "MODEL.RPN.POST_NMS_TOPK_TEST", "10",
    "MODEL.ROI_HEADS.SCORE_THRESH_TEST", "0.0", "TEST.PRECISE_BN.NUM_ITER", "1", "DATALOADER.NUM_WORKERS", "0",
]


@pytest.fixture(scope="module")
def bt_weights(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A Barlow Twins ResNet-50 backbone whose every tensor differs from detectron2's initial values."""
    torch.manual_seed(0)
    state = build_backbone("resnet50").state_dict()
    for name, tensor in state.items():
        if tensor.is_floating_point():
            tensor.copy_(torch.rand_like(tensor) + 0.5 if "running_var" in name else torch.randn_like(tensor) * 0.05)
    path = tmp_path_factory.mktemp("weights") / "bt_resnet50.pth"
    torch.save(state, path)
    return path, state


@pytest.fixture(autouse=True)
def _few_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("alias", ["voc", "coco"])
def test_shipped_config_builds_on_cpu_and_loads_every_backbone_tensor(alias, bt_weights, tmp_path):
    source, state = bt_weights
    pkl, expected = prepare_weights(str(source), tmp_path)
    cfg = build_cfg(resolve_config(alias), [], weights=pkl, device="cpu", seed=0, output_dir=tmp_path)
    model = build_model(cfg)
    assert isinstance(model.roi_heads.res5.norm, torch.nn.SyncBatchNorm) and model.roi_heads.res5.norm.num_features == 2048
    assert hasattr(model.roi_heads, "mask_head") == (alias == "coco")
    DetectionCheckpointer(model).load(pkl)

    assert unloaded_parameters(model, expected) == []
    loaded = [k for k in model.state_dict() if k.startswith(("backbone.", "roi_heads.res5.")) and "res5.norm." not in k and "num_batches_tracked" not in k]
    assert len(loaded) == len([k for k in expected if "num_batches_tracked" not in k]) == 265
    assert torch.equal(model.backbone.stem.conv1.weight, state["conv1.weight"])
    assert torch.equal(model.backbone.res4[5].conv2.norm.running_var, state["layer3.5.bn2.running_var"])
    assert torch.equal(model.roi_heads.res5[0].shortcut.norm.running_mean, state["layer4.0.downsample.1.running_mean"])

    with torch.no_grad():
        model.roi_heads.res5[2].conv3.weight.add_(1.0)
    assert unloaded_parameters(model, expected) == ["roi_heads.res5.2.conv3.weight"]


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["total_loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("alias", ["voc", "coco"])
def test_detect_trains_twenty_iterations_with_falling_loss_and_writes_ap(alias, bt_weights, tmp_path):
    source, _ = bt_weights
    if alias == "voc":
        data = write_voc(tmp_path / "data", size=96, seed=1)
        opts = FAST
    else:
        data = write_coco(tmp_path / "data", size=96, seed=1)
        opts = FAST + ["MODEL.ROI_HEADS.NUM_CLASSES", "3"]
    out = tmp_path / "out"
    code = cli_main(["detect", "--weights", str(source), "--data", str(data), "--config", alias, "--out", str(out), "--seed", "3", *opts])
    assert code == 0

    losses = _losses(out / "trial0")
    assert len(losses) == 20 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5, losses

    record = json.loads((out / "results.json").read_text())
    tasks = ["bbox"] + (["segm"] if alias == "coco" else [])
    assert set(record["metrics"]) == {f"{t}_{m}" for t in tasks for m in ("AP", "AP50", "AP75")}
    assert all(isinstance(v, float) and 0.0 <= v <= 100.0 for v in record["metrics"].values()), record["metrics"]
    assert (record["protocol"], record["preset"], record["seed"]) == ("detect", alias, 3)
    assert record["weights"]["fingerprint"] == hashlib.sha256(source.read_bytes()).hexdigest()
    assert [t["seed"] for t in record["notes"]["trials"]] == [3]
    assert record["hyperparameters"]["detectron2"]["SOLVER"]["MAX_ITER"] == 20
    if alias == "voc":  # detectron2's VOC evaluator uses the 11-point AP for the 2007 test set
        assert MetadataCatalog.get("voc_2007_test").year == 2007


def test_class_count_that_does_not_match_the_data_is_refused(tmp_path):
    data = write_coco(tmp_path / "data", splits={"train2017": 2, "val2017": 1})
    cfg = build_cfg(resolve_config("coco"), FAST, weights="", device="cpu", seed=0, output_dir=tmp_path / "trial0")
    with pytest.raises(ValueError, match=r"NUM_CLASSES is 80 but dataset coco_2017_val has 3 classes; pass `MODEL.ROI_HEADS.NUM_CLASSES 3`"):
        run_trial(cfg, str(data), None, False)


def test_missing_devkit_year_is_named(tmp_path):
    data = write_voc(tmp_path / "data", splits={"2007": {"trainval": 2, "test": 1}})
    cfg = build_cfg(resolve_config("voc"), FAST, weights="", device="cpu", seed=0, output_dir=tmp_path / "trial0")
    with pytest.raises(FileNotFoundError, match=r"dataset voc_2012_trainval needs .*VOC2012/ImageSets/Main/trainval.txt"):
        run_trial(cfg, str(data), None, False)
