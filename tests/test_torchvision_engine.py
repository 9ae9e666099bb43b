"""The torchvision R50-C4 engine of `bt-hub detect`: needs no detectron2, so these run on every machine.

The model is checked against the paper's C4 settings written out below from docs/protocols.md §3
and detectron2's defaults (not read back from the YAMLs), every exported backbone tensor is
compared with the model's, and `bt-hub detect --engine torchvision` trains a few iterations
on generated shapes with a falling loss and writes the same results record as detectron2.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from detection_settings import DETECTRON2_FAST, FAST
from torch import nn
from torchvision.models.detection import FasterRCNN, MaskRCNN

from bt_hub.cli import main as cli_main
from bt_hub.eval.detection.config import FLAG_OWNED_KEYS, load_settings, resolve_config, scale_to_world_size
from bt_hub.eval.detection.detect import resolve_engine
from bt_hub.eval.detection.synthetic import DetectionDataConfig, make_detection_data
from bt_hub.eval.detection.torchvision_engine.model import (
    build_c4_model,
    c4_backbone_state_dict,
    unloaded_backbone_tensors,
)
from bt_hub.eval.detection.torchvision_engine.trainer import lr_factor, param_groups
from bt_hub.method.model import build_backbone

pytestmark = pytest.mark.usefixtures("one_thread")

VOC_TRAIN_SIZES = (480, 512, 544, 576, 608, 640, 672, 704, 736, 768, 800)
COCO_TRAIN_SIZES = (640, 672, 704, 736, 768, 800)


@pytest.fixture(scope="module")
def r50_weights(seeded_weights) -> Path:
    """A seeded, freshly initialised ResNet-50 (bt_hub's ``build_backbone``: residual branches zeroed).

    Enough for the few-iteration runs here; the installation check of docs/detection.md starts
    from torchvision's default initialisation instead (tests/test_detection_check.py).
    """
    return seeded_weights("resnet50")


@pytest.mark.parametrize("alias", ["voc", "coco"])
def test_shipped_config_builds_the_papers_c4_model(alias):
    model = build_c4_model(load_settings(resolve_config(alias)), build_backbone("resnet50"))
    classes = {"voc": 20, "coco": 80}[alias]
    assert type(model) is {"voc": FasterRCNN, "coco": MaskRCNN}[alias]
    # trunk conv1..layer3 (1024 channels, stride 16); res5 is the box head, with the extra BatchNorm
    assert [n for n, _ in model.backbone.named_children()] == [
        "conv1",
        "bn1",
        "relu",
        "maxpool",
        "layer1",
        "layer2",
        "layer3",
    ]
    assert model.backbone(torch.zeros(1, 3, 64, 96)).shape == (1, 1024, 4, 6)
    head = model.roi_heads.box_head
    assert len(head.res5) == 3 and head.res5[0].conv3.out_channels == 2048
    assert isinstance(head.norm, nn.BatchNorm2d) and head.norm.num_features == 2048
    assert head(torch.randn(3, 1024, 14, 14)).shape == (3, 2048)  # mean-pooled res5
    # one-level anchors 32..512 x 0.5/1/2
    anchors = model.rpn.anchor_generator
    assert anchors.sizes == ((32, 64, 128, 256, 512),) and anchors.aspect_ratios == ((0.5, 1.0, 2.0),)
    assert anchors.num_anchors_per_location() == [15]
    # RPN: 0.3/0.7 IoU, 256 anchors half positive, NMS 0.7, top-k 12000/2000 (train) and 6000/1000 (test)
    rpn = model.rpn
    assert (rpn.proposal_matcher.low_threshold, rpn.proposal_matcher.high_threshold) == (0.3, 0.7)
    assert (rpn.fg_bg_sampler.batch_size_per_image, rpn.fg_bg_sampler.positive_fraction, rpn.nms_thresh) == (
        256,
        0.5,
        0.7,
    )
    assert rpn._pre_nms_top_n == {"training": 12000, "testing": 6000} and rpn._post_nms_top_n == {
        "training": 2000,
        "testing": 1000,
    }
    # RoIs: 512 per image, a quarter foreground at IoU 0.5; RoIAlign aligned=True 14x14, adaptive sampling
    roi = model.roi_heads
    assert (roi.fg_bg_sampler.batch_size_per_image, roi.fg_bg_sampler.positive_fraction) == (512, 0.25)
    assert roi.proposal_matcher.high_threshold == roi.proposal_matcher.low_threshold == 0.5
    assert (
        roi.box_roi_pool.aligned and roi.box_roi_pool.output_size == (14, 14) and roi.box_roi_pool.sampling_ratio == 0
    )
    assert roi.box_coder.weights == (10.0, 10.0, 5.0, 5.0)
    assert (roi.score_thresh, roi.nms_thresh, roi.detections_per_img) == (0.05, 0.5, 100)
    assert roi.box_predictor.cls_score.out_features == classes + 1 and roi.box_predictor.bbox_pred.out_features == 4 * (
        classes + 1
    )
    if alias == "coco":  # the mask branch shares res5: 2x2 deconvolution 2048 -> 256, 1x1 predictor
        deconv, _, predictor = roi.mask_predictor
        assert (deconv.in_channels, deconv.out_channels, deconv.kernel_size, deconv.stride) == (
            2048,
            256,
            (2, 2),
            (2, 2),
        )
        assert (predictor.in_channels, predictor.out_channels, predictor.kernel_size) == (256, classes + 1, (1, 1))
        assert not list(roi.mask_roi_pool.parameters()) and not list(roi.mask_head.parameters())
    else:
        assert roi.mask_predictor is None
    # torchvision pixel mean/std; detectron2's separate train sizes (drawn per image) and test size
    transform = model.transform
    assert transform.image_mean == pytest.approx([0.485, 0.456, 0.406]) and transform.image_std == pytest.approx(
        [0.229, 0.224, 0.225]
    )
    assert (transform.min_size, transform.max_size) == ({"voc": VOC_TRAIN_SIZES, "coco": COCO_TRAIN_SIZES}[alias], 1333)
    model.eval()
    assert (transform.min_size, transform.max_size) == ((800,), 1333)
    # nothing frozen, plain (trainable) BatchNorm everywhere
    assert all(p.requires_grad for p in model.parameters())
    assert not any("Frozen" in type(m).__name__ for m in model.modules())


def test_every_exported_backbone_tensor_loads_into_the_model(bt_weights, tmp_path):
    source, state = bt_weights
    assert (
        cli_main(["export", "--weights", str(source), "--format", "torchvision", "--out", str(tmp_path / "tv.pth")])
        == 0
    )
    assert (
        cli_main(["export", "--weights", str(source), "--format", "detectron2", "--out", str(tmp_path / "d2.pkl")]) == 0
    )
    from bt_hub.weights import load_backbone

    settings = load_settings(resolve_config("coco"))
    for exported in (next(tmp_path.glob("tv-*.pth")), tmp_path / "d2.pkl"):
        model = build_c4_model(settings, load_backbone(exported, arch="resnet50", small_image_stem=False))
        assert unloaded_backbone_tensors(model, state) == [], exported
        ours = c4_backbone_state_dict(model)
        assert ours.keys() == state.keys() and len(ours) == 318  # every tensor of a ResNet-50 but fc, buffers included
        assert all(torch.equal(ours[k], state[k]) for k in state)
        assert torch.equal(model.roi_heads.box_head.res5[2].conv3.weight, state["layer4.2.conv3.weight"])
    with torch.no_grad():
        model.backbone.layer3[5].bn2.running_var.add_(1.0)
    assert unloaded_backbone_tensors(model, state) == ["layer3.5.bn2.running_var"]
    assert unloaded_backbone_tensors(model, {k: v for k, v in state.items() if k != "conv1.weight"}) == [
        "conv1.weight",
        "layer3.5.bn2.running_var",
    ]


def test_mask_branch_reuses_the_res5_rows_of_the_box_branch_in_training():
    torch.manual_seed(0)
    settings = load_settings(
        resolve_config("shapes-coco"),
        FAST[:8] + ["MODEL.ROI_HEADS.BATCH_SIZE_PER_IMAGE", "16", "MODEL.ROI_BOX_HEAD.POOLER_RESOLUTION", "4"],
    )
    model = build_c4_model(settings, build_backbone("resnet50"))
    calls, mask_inputs = [], []
    model.roi_heads.box_head.res5.register_forward_hook(lambda m, i, o: calls.append(o))
    model.roi_heads.mask_predictor.register_forward_hook(lambda m, i, o: mask_inputs.append(i[0]))
    masks = torch.zeros(2, 64, 64, dtype=torch.uint8)
    masks[0, 4:30, 4:30] = masks[1, 30:60, 20:50] = 1
    target = {
        "boxes": torch.tensor([[4.0, 4, 30, 30], [20, 30, 50, 60]]),
        "labels": torch.tensor([1, 3]),
        "masks": masks,
    }
    losses = model([torch.rand(3, 64, 64)], [target])
    assert set(losses) == {"loss_classifier", "loss_box_reg", "loss_mask", "loss_objectness", "loss_rpn_box_reg"}
    (box_maps,) = calls  # res5 ran once, on the sampled RoIs
    norm = model.roi_heads.box_head.norm
    fg = mask_inputs[0]
    assert 2 <= len(fg) < len(box_maps)  # the ground-truth boxes are foreground proposals
    rows = [next(j for j in range(len(box_maps)) if torch.allclose(norm(box_maps)[j], fg[i])) for i in range(len(fg))]
    assert len(set(rows)) == len(fg)
    model.eval()
    with torch.no_grad():
        (result,) = model([torch.rand(3, 64, 64)])
    assert len(calls) == 3 and result["masks"].shape[1:] == (1, 64, 64)  # inference: res5 for boxes, again for masks


def _rows(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _falls(values: list[float], factor: float) -> bool:
    return sum(values[-3:]) / 3 < factor * sum(values[:3]) / 3


def _detectron2_importable() -> bool:
    try:
        import detectron2  # noqa: F401
    except ImportError:
        return False
    return True


ENGINES = [
    "torchvision",
    pytest.param("detectron2", marks=pytest.mark.skipif(not _detectron2_importable(), reason="needs detectron2")),
]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("alias", ["shapes-voc", "shapes-coco"])
def test_detect_trains_with_falling_loss_and_writes_the_same_results_record_on_each_engine(
    engine, alias, r50_weights, tmp_path, capsys
):
    data = make_detection_data(DetectionDataConfig(out=str(tmp_path / "data"), train=2, test=2, size=64, seed=1))
    out = tmp_path / "out"
    opts = DETECTRON2_FAST if engine == "detectron2" else FAST
    code = cli_main(
        [
            "detect",
            "--engine",
            engine,
            "--weights",
            str(r50_weights),
            "--data",
            str(data),
            "--detection-config",
            alias,
            "--out",
            str(out),
            "--seed",
            "3",
            *opts,
        ]
    )
    assert code == 0
    if engine == "torchvision":  # Guards: its installation check printed nothing for ~5 minutes
        err = capsys.readouterr().err
        assert "detect train: 8/8 iter (100%)" in err and "detect predict: 2/2 image (100%)" in err, err
    # the same two images every step: the RPN's objectness loss (and the mask loss) fall within 8 steps; the RoI
    # losses may rise at first, as better proposals bring more foreground RoIs
    rows = _rows(out / "trial0")
    assert len(rows) == 8 and all(math.isfinite(r["total_loss"]) for r in rows)
    assert {"loss_cls", "loss_box_reg", "loss_rpn_cls", "loss_rpn_loc"} <= set(rows[0]) and (
        "loss_mask" in rows[0]
    ) == (alias == "shapes-coco")
    assert _falls([r["loss_rpn_cls"] for r in rows], 0.85), rows
    if alias == "shapes-coco":
        assert _falls([r["loss_mask"] for r in rows], 0.95), rows
    assert rows[0]["lr"] == pytest.approx(0.01 * 0.333) and rows[2]["lr"] == pytest.approx(0.01)

    record = json.loads((out / "results.json").read_text())
    tasks = ["bbox"] + (["segm"] if alias == "shapes-coco" else [])
    assert set(record["metrics"]) == {f"{t}_{m}" for t in tasks for m in ("AP", "AP50", "AP75")}
    assert all(isinstance(v, float) and 0.0 <= v <= 100.0 for v in record["metrics"].values()), record["metrics"]
    assert (record["protocol"], record["preset"], record["seed"]) == ("detect", alias, 3)
    assert record["hyperparameters"]["engine"] == record["notes"]["engine"] == engine
    assert record["weights"]["fingerprint"] == hashlib.sha256(r50_weights.read_bytes()).hexdigest()
    assert record["hyperparameters"]["resolved_config"]["SOLVER"]["MAX_ITER"] == 8
    preset_iters = load_settings(resolve_config(alias))["SOLVER.MAX_ITER"]
    assert record["overrides"]["SOLVER.MAX_ITER"] == {"value": 8, "preset": preset_iters}  # not read as the check
    assert [t["seed"] for t in record["notes"]["trials"]] == [3]
    if engine == "torchvision":
        assert torch.load(out / "trial0" / "checkpoint.pth", weights_only=True)["iter"] == 8
    elif alias == "shapes-voc":  # the generated devkit's own 4 classes, and the VOC07 11-point AP
        from detectron2.data import MetadataCatalog

        meta = MetadataCatalog.get("voc_2007_test")
        assert (meta.thing_classes, meta.year) == (["square", "disc", "triangle", "cross"], 2007)


def test_auto_engine_falls_back_to_torchvision_without_detectron2(monkeypatch):
    monkeypatch.setitem(sys.modules, "detectron2", None)  # `import detectron2` now raises ImportError
    assert resolve_engine("auto") == "torchvision"
    assert resolve_engine("detectron2") == "detectron2"


def test_torchvision_engine_refuses_detectron2_launcher_flags(capsys, tmp_path):
    code = cli_main(
        ["detect", "--engine", "torchvision", "--weights", "w.pth", "--data", str(tmp_path), "--num-gpus", "2"]
    )
    assert code == 2
    assert "--engine torchvision runs one process per GPU under torchrun" in capsys.readouterr().err


def test_schedule_and_weight_decay_follow_detectron2():
    voc = load_settings(resolve_config("voc"))
    # linear warm-up from 0.333 over 1000 iterations, then x0.1 at 18k and at 22k
    assert [lr_factor(i, voc) for i in (0, 500, 1000, 17999, 18000, 22000, 23999)] == pytest.approx(
        [0.333, 0.6665, 1, 1, 0.1, 0.01, 0.01]
    )
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 2))
    decayed, norms = param_groups(model, 1e-4, 0.0)
    assert (decayed["weight_decay"], norms["weight_decay"]) == (1e-4, 0.0)
    assert {id(p) for p in norms["params"]} == {id(model[1].weight), id(model[1].bias)} and len(decayed["params"]) == 4


def test_world_size_rescaling_keeps_two_images_per_process():
    voc = load_settings(resolve_config("voc"))
    four = scale_to_world_size(voc, 4)
    assert (
        four["SOLVER.IMS_PER_BATCH"],
        four["SOLVER.MAX_ITER"],
        four["SOLVER.STEPS"],
        four["SOLVER.WARMUP_ITERS"],
    ) == (8, 48000, [36000, 44000], 2000)
    assert four["SOLVER.BASE_LR"] == pytest.approx(0.05)
    assert scale_to_world_size(voc, 8).tree == voc.tree
    kept = load_settings(resolve_config("voc"), ["SOLVER.REFERENCE_WORLD_SIZE", "0"])
    assert scale_to_world_size(kept, 4)["SOLVER.IMS_PER_BATCH"] == 16


def test_opts_are_parsed_like_detectron2_and_checked_against_the_yaml(tmp_path):
    settings = load_settings(
        resolve_config("voc"), ["INPUT.MIN_SIZE_TRAIN", "(96, 128)", "SOLVER.BASE_LR", "1", "MODEL.RESNETS.NORM", "BN"]
    )
    assert (
        settings["INPUT.MIN_SIZE_TRAIN"] == [96, 128]
        and settings["SOLVER.BASE_LR"] == 1.0
        and settings["MODEL.RESNETS.NORM"] == "BN"
    )
    with pytest.raises(ValueError, match="opts key SOLVER.NOT_A_KEY is not set in the config"):
        load_settings(resolve_config("voc"), ["SOLVER.NOT_A_KEY", "1"])
    key = next(iter(FLAG_OWNED_KEYS))
    with pytest.raises(ValueError, match=f"opts may not set {key}"):
        load_settings(resolve_config("voc"), [key, "x"])
    partial = tmp_path / "partial.yaml"
    partial.write_text(f"_BASE_: {resolve_config('voc')}\n")
    settings = load_settings(partial)
    del settings.tree["MODEL"]["RPN"]["NMS_THRESH"]
    with pytest.raises(
        ValueError,
        match=r"partial.yaml has no MODEL.RPN.NMS_THRESH; the torchvision engine reads every setting from the YAML",
    ):
        build_c4_model(settings, build_backbone("resnet50"))
    with pytest.raises(ValueError, match="MODEL.BACKBONE.FREEZE_AT is 2 .* the torchvision engine implements only 0"):
        build_c4_model(
            load_settings(resolve_config("voc"), ["MODEL.BACKBONE.FREEZE_AT", "2"]), build_backbone("resnet50")
        )


TORCHRUN_TIMEOUT_S = 900


@pytest.mark.slow
@pytest.mark.ddp
def test_torchrun_two_gloo_processes_train_with_global_batchnorm_and_write_one_record(r50_weights, tmp_path):
    import os
    import subprocess

    source = r50_weights
    data = make_detection_data(DetectionDataConfig(out=str(tmp_path / "data"), train=8, test=2, size=64, seed=1))
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "bt_hub.cli",
        "detect",
        "--engine",
        "torchvision",
        "--weights",
        str(source),
        "--data",
        str(data),
        "--detection-config",
        "shapes-voc",
        "--out",
        str(out),
        *FAST,
        "SOLVER.MAX_ITER",
        "3",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((out / "results.json").read_text())
    assert set(record["metrics"]) == {"bbox_AP", "bbox_AP50", "bbox_AP75"}
    assert len((out / "results.jsonl").read_text().splitlines()) == 1  # rank 0 only
    config = json.loads((out / "trial0" / "run.json").read_text())["config"]
    assert config["SOLVER"]["IMS_PER_BATCH"] == 2 and len(_rows(out / "trial0")) == 3


def test_a_flipped_training_image_mirrors_its_boxes_and_leaves_the_record_as_it_was(tmp_path):
    import numpy as np
    from PIL import Image

    from bt_hub.eval.detection.data import DetectionDataset, Record

    Image.new("RGB", (10, 4)).save(tmp_path / "a.png")
    no = np.zeros(1, dtype=bool)
    record = Record(
        "a",
        str(tmp_path / "a.png"),
        4,
        10,
        np.array([[1, 0, 4, 3]], dtype=np.float32),
        np.zeros(1, dtype=np.int64),
        no,
        no,
    )
    seen = set()
    for seed in range(20):
        torch.manual_seed(seed)
        _, target = DetectionDataset([record], flip=True)[0]
        seen.add(tuple(target["boxes"][0].tolist()))
    assert seen == {(1.0, 0.0, 4.0, 3.0), (6.0, 0.0, 9.0, 3.0)}  # as it is, and mirrored in the 10-px width
    assert record.boxes.tolist() == [[1, 0, 4, 3]]
