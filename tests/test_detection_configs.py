"""The detection YAMLs carry docs/protocols.md §3, the generated shapes set is what it claims, and
`bt-hub detect --engine detectron2` without detectron2 says how to install it.

None of these tests needs detectron2: the YAMLs are read with PyYAML and their ``_BASE_``
chain is merged by hand. The expected values are written out below from docs/protocols.md §3,
not read back from the files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from bt_hub.cli import main as cli_main
from bt_hub.eval.detection.config import CONFIGS, configs_dir, resolve_config
from bt_hub.eval.detection.data import load_records, locate
from bt_hub.eval.detection.detect import PAPER_ROWS, TABLES, aggregate_trials
from bt_hub.eval.detection.synthetic import (
    CLASSES,
    COLOURS,
    DetectionDataConfig,
    make_detection_data,
    rasterize,
    write_coco,
    write_voc,
)

PIXEL_MEAN = [123.675, 116.280, 103.530]
PIXEL_STD = [58.395, 57.120, 57.375]

# docs/protocols.md §3: the shared C4 base (MoCo's Base-RCNN-C4-BN + torchvision weights).
BASE = {
    "MODEL.META_ARCHITECTURE": "GeneralizedRCNN",
    "MODEL.BACKBONE.FREEZE_AT": 0,
    "MODEL.RESNETS.DEPTH": 50,
    "MODEL.RESNETS.NORM": "SyncBN",
    "MODEL.RESNETS.STRIDE_IN_1X1": False,
    "MODEL.ROI_HEADS.NAME": "Res5ROIHeadsExtraNorm",
    "MODEL.PIXEL_MEAN": PIXEL_MEAN,
    "MODEL.PIXEL_STD": PIXEL_STD,
    "INPUT.FORMAT": "RGB",
    "TEST.PRECISE_BN.ENABLED": True,
    "SOLVER.IMS_PER_BATCH": 16,
}

EXPECTED = {
    "voc": {
        **BASE,
        "MODEL.MASK_ON": False,
        "MODEL.ROI_HEADS.NUM_CLASSES": 20,
        "DATASETS.TRAIN": ["voc_2007_trainval", "voc_2012_trainval"],
        "DATASETS.TEST": ["voc_2007_test"],
        "SOLVER.MAX_ITER": 24000,
        "SOLVER.BASE_LR": 0.1,
        "SOLVER.STEPS": [18000, 22000],
        "SOLVER.WARMUP_ITERS": 1000,
        "SOLVER.WARMUP_FACTOR": 0.333,
        "INPUT.MIN_SIZE_TRAIN": [480, 512, 544, 576, 608, 640, 672, 704, 736, 768, 800],
        "INPUT.MIN_SIZE_TEST": 800,
    },
    "coco": {
        **BASE,
        "MODEL.MASK_ON": True,
        "DATASETS.TRAIN": ["coco_2017_train"],
        "DATASETS.TEST": ["coco_2017_val"],
        "SOLVER.MAX_ITER": 90000,
        "SOLVER.BASE_LR": 0.03,
        "SOLVER.STEPS": [60000, 80000],
        "INPUT.MIN_SIZE_TRAIN": [640, 672, 704, 736, 768, 800],
        "INPUT.MIN_SIZE_TEST": 800,
    },
}


def _merge(base: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in child.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _load(path: Path) -> dict[str, Any]:
    """A YAML with its ``_BASE_`` chain merged, as detectron2 does it (child wins)."""
    data = yaml.safe_load(path.read_text())
    base = data.pop("_BASE_", None)
    return _merge(_load(path.parent / base), data) if base else data


def _get(tree: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree[part]
    return tree


@pytest.mark.parametrize("alias", ["voc", "coco"])
def test_config_carries_the_protocol_values(alias):
    cfg = _load(resolve_config(alias))
    for key, expected in EXPECTED[alias].items():
        value = _get(cfg, key)
        if isinstance(expected, float) or (isinstance(expected, list) and expected and isinstance(expected[0], float)):
            assert value == pytest.approx(expected), key
        else:
            assert value == expected, key


def test_configs_scale_linearly_from_eight_gpus():
    """The schedules are written for 8 GPUs x 2 images; detectron2 rescales them from that reference."""
    base = _load(configs_dir() / "Base-RCNN-C4-BN.yaml")
    assert base["SOLVER"]["REFERENCE_WORLD_SIZE"] == 8
    assert base["SOLVER"]["IMS_PER_BATCH"] // base["SOLVER"]["REFERENCE_WORLD_SIZE"] == 2


def test_every_non_default_value_has_a_comment_saying_where_it_comes_from():
    for path in sorted(configs_dir().glob("*.yaml")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            if (
                not stripped
                or stripped.startswith("#")
                or stripped.endswith(":")
                or stripped.startswith(("_BASE_", "VERSION"))
            ):
                continue
            above = [lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()]
            commented = "#" in line or any(a.startswith("#") for a in above[:3])
            assert commented, f"{path.name}:{i + 1} {stripped!r} has no source comment near it"


def test_aliases_resolve_to_shipped_files_and_unknown_configs_are_refused(tmp_path):
    assert {p.name for p in configs_dir().glob("*.yaml")} >= set(CONFIGS.values()) | {"Base-RCNN-C4-BN.yaml"}
    own = tmp_path / "mine.yaml"
    own.write_text("_BASE_: x.yaml\n")
    assert resolve_config(str(own)) == own
    with pytest.raises(
        FileNotFoundError,
        match="--detection-config must be 'voc', 'coco', 'shapes-voc', 'shapes-coco' or a detectron2 YAML file",
    ):
        resolve_config(str(tmp_path / "absent.yaml"))


@pytest.mark.parametrize("alias", ["shapes-voc", "shapes-coco"])
def test_installation_check_configs_fit_the_generated_set(alias):
    cfg = _load(resolve_config(alias))
    assert cfg["MODEL"]["ROI_HEADS"]["NUM_CLASSES"] == len(CLASSES)
    assert cfg["MODEL"]["MASK_ON"] == (alias == "shapes-coco")
    layout = {
        "shapes-voc": (["voc_2007_trainval"], ["voc_2007_test"]),
        "shapes-coco": (["coco_2017_train"], ["coco_2017_val"]),
    }[alias]
    assert (cfg["DATASETS"]["TRAIN"], cfg["DATASETS"]["TEST"]) == layout
    # the paper's model: only sizes (the anchors halved with the input), RoI/proposal counts and the schedule
    # differ from the base
    base = _load(configs_dir() / "Base-RCNN-C4-BN.yaml")
    for key in (
        "MODEL.ANCHOR_GENERATOR.ASPECT_RATIOS",
        "MODEL.ROI_HEADS.NAME",
        "MODEL.RESNETS.NORM",
        "MODEL.BACKBONE.FREEZE_AT",
        "MODEL.PIXEL_MEAN",
    ):
        assert _get(cfg, key) == _get(base, key), key
    assert _get(cfg, "MODEL.ANCHOR_GENERATOR.SIZES") == [
        [side // 2 for side in _get(base, "MODEL.ANCHOR_GENERATOR.SIZES")[0]]
    ]


def test_detect_with_detectron2_engine_but_without_detectron2_fails_with_the_install_sentence(
    monkeypatch, capsys, tmp_path
):
    monkeypatch.setitem(sys.modules, "detectron2", None)  # `import detectron2` now raises ImportError
    code = cli_main(["detect", "--engine", "detectron2", "--weights", str(tmp_path / "w.pth"), "--data", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1
    assert "needs detectron2, which is not installed" in err[0]
    assert "pip install --no-build-isolation 'git+https://github.com/facebookresearch/detectron2.git'" in err[0]


def test_detect_flags_are_validated_before_anything_runs(capsys, tmp_path):
    code = cli_main(["detect", "--weights", "w.pth", "--data", str(tmp_path), "--trials", "0"])
    assert code == 2
    assert "--trials must be >= 1, got 0" in capsys.readouterr().err
    code = cli_main(["detect", "--weights", "w.pth", "--data", str(tmp_path), "--num-machines", "2"])
    assert code == 2
    assert "--dist-url must be tcp://HOST:PORT" in capsys.readouterr().err


def test_detect_refuses_an_out_it_did_not_create_before_reading_anything(capsys, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "results.json").write_text("my own notes")
    code = cli_main(
        [
            "detect",
            "--weights",
            "w.pth",
            "--data",
            str(tmp_path),
            "--detection-config",
            "shapes-voc",
            "--out",
            str(mine),
        ]
    )
    assert code == 2
    assert f"--out {mine} is not empty and was not created by bt-hub" in capsys.readouterr().err
    assert (mine / "results.json").read_text() == "my own notes" and sorted(p.name for p in mine.iterdir()) == [
        "results.json"
    ]


def test_trials_report_mean_and_sample_std():
    trials = [
        {"bbox_AP": 50.0, "bbox_AP50": 80.0},
        {"bbox_AP": 52.0, "bbox_AP50": 82.0},
        {"bbox_AP": 54.0, "bbox_AP50": 81.0},
    ]
    assert aggregate_trials(trials) == pytest.approx(
        {"bbox_AP": 52.0, "bbox_AP_std": 2.0, "bbox_AP50": 81.0, "bbox_AP50_std": 1.0}
    )
    assert aggregate_trials(trials[:1]) == {"bbox_AP": 50.0, "bbox_AP50": 80.0}


def test_synthetic_data_is_seeded_and_in_the_documented_layouts(tmp_path):
    write_voc(tmp_path / "a", seed=5)
    write_voc(tmp_path / "b", seed=5)
    ids = (tmp_path / "a" / "VOC2007" / "ImageSets" / "Main" / "test.txt").read_text().split()
    assert len(ids) == 4 and all((tmp_path / "a" / "VOC2007" / "JPEGImages" / f"{i}.jpg").is_file() for i in ids)
    xml_a = (tmp_path / "a" / "VOC2007" / "Annotations" / f"{ids[0]}.xml").read_text()
    assert xml_a == (tmp_path / "b" / "VOC2007" / "Annotations" / f"{ids[0]}.xml").read_text()
    assert "<difficult>0</difficult>" in xml_a and "<name>" in xml_a
    assert (tmp_path / "a" / "VOC2007" / "classes.txt").read_text().split() == list(CLASSES)
    assert len((tmp_path / "a" / "VOC2012" / "ImageSets" / "Main" / "trainval.txt").read_text().split()) == 8

    coco = json.loads((write_coco(tmp_path / "c", seed=5) / "annotations" / "instances_val2017.json").read_text())
    assert [c["name"] for c in coco["categories"]] == list(CLASSES)
    assert len(coco["images"]) == 4 and coco["annotations"]
    for ann in coco["annotations"]:
        x, y, w, h = ann["bbox"]
        xs, ys = ann["segmentation"][0][0::2], ann["segmentation"][0][1::2]
        assert (min(xs), min(ys), max(xs), max(ys)) == pytest.approx((x, y, x + w, y + h))  # the box bounds the polygon
        assert 0 < ann["area"] <= w * h


def test_make_detection_data_writes_the_same_images_in_both_layouts(tmp_path):
    root = make_detection_data(DetectionDataConfig(out=str(tmp_path / "shapes"), train=6, test=5, size=96, seed=2))
    for voc, coco in (("voc_2007_trainval", "coco_2017_train"), ("voc_2007_test", "coco_2017_val")):
        voc_records, voc_names, _ = load_records(locate(voc, root))
        coco_records, coco_names, _ = load_records(locate(coco, root))
        assert voc_names == coco_names == CLASSES
        assert len(voc_records) == len(coco_records)
        for v, c in zip(voc_records, coco_records):
            assert v.boxes.tolist() == c.boxes.tolist() and v.labels.tolist() == c.labels.tolist()
    records = load_records(locate("coco_2017_val", root))[0] + load_records(locate("coco_2017_train", root))[0]
    counts = [len(r.labels) for r in records]
    sides = [min(b[2] - b[0], b[3] - b[1]) for r in records for b in r.boxes]
    assert min(counts) >= 2 and max(counts) <= 5 and sum(counts) / len(counts) > 2.5  # several objects per image
    assert min(sides) < 32 and max(sides) > 32  # COCO-small objects and larger ones
    for r in records:  # objects never overlap, so every box is fully visible
        for i in range(len(r.boxes)):
            for j in range(i):
                a, b = r.boxes[i], r.boxes[j]
                assert a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1]
    # the drawn pixels are the polygons: inside each mask the colour is its class's colour
    from PIL import Image

    coco = json.loads((root / "annotations" / "instances_val2017.json").read_text())
    for ann in coco["annotations"]:
        image = next(i for i in coco["images"] if i["id"] == ann["image_id"])
        pixels = np.asarray(Image.open(root / "val2017" / image["file_name"]).convert("RGB"), dtype=np.float32)
        inside = pixels[rasterize(ann["segmentation"][0], image["height"], image["width"])].mean(axis=0)
        assert np.abs(inside - COLOURS[CLASSES[ann["category_id"] - 1]]).max() < 45, (
            ann
        )  # colour jitter 15 + JPEG at thin edges
    # the same flags again leave the folder as it is; other contents are never overwritten
    assert make_detection_data(DetectionDataConfig(out=str(root), train=6, test=5, size=96, seed=2)) == root
    with pytest.raises(FileExistsError, match="is not an empty folder"):
        make_detection_data(DetectionDataConfig(out=str(root), train=7, test=5, size=96, seed=2))


def test_interrupted_make_detection_data_leaves_out_untouched_and_a_rerun_clears_its_partial_folder(
    tmp_path, monkeypatch
):
    import bt_hub.eval.detection.synthetic as synthetic

    out, config = tmp_path / "shapes", DetectionDataConfig(out=str(tmp_path / "shapes"), train=3, test=2, size=64)
    out.mkdir()  # an empty --out is allowed, and stays empty until the set is complete

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(synthetic, "write_coco", interrupted)  # after the VOC devkit, before the COCO files
    with pytest.raises(KeyboardInterrupt):
        make_detection_data(config)
    partial = tmp_path / ".shapes.bt_hub-partial"
    assert list(out.iterdir()) == [] and (partial / "VOC2007" / "JPEGImages").is_dir()
    monkeypatch.undo()
    with pytest.warns(UserWarning, match=r"removed .*\.shapes\.bt_hub-partial, the partial output of an interrupted"):
        assert make_detection_data(config) == out
    assert not partial.exists() and sorted(p.name for p in out.iterdir()) == [
        "VOC2007",
        "annotations",
        "bt_hub_detection_data.json",
        "train2017",
        "val2017",
    ]
    assert len(list((out / "val2017").iterdir())) == 2
    # a folder of the partial name that bt_hub did not make is never removed
    (tmp_path / ".other.bt_hub-partial").mkdir()
    (tmp_path / ".other.bt_hub-partial" / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match=r"\.other\.bt_hub-partial exists but is not a partial output"):
        make_detection_data(DetectionDataConfig(out=str(tmp_path / "other"), train=3, test=2, size=64))
    assert (tmp_path / ".other.bt_hub-partial" / "mine.txt").read_text() == "keep"


@pytest.mark.parametrize("shortened", [True, False], ids=["shortened-run", "execution-opts-only"])
def test_detection_record_lists_every_override_and_the_table_marks_a_run_that_is_not_its_preset(shortened, tmp_path):
    from bt_hub.eval.config import LoadedWeights
    from bt_hub.eval.detection.detect import DetectConfig, _write

    weights, data = tmp_path / "r50.pth", tmp_path / "VOCdevkit"  # the paper's data, by its folder name
    weights.write_bytes(b"weights")
    data.mkdir()
    opts = ["DATALOADER.NUM_WORKERS", "0", "SOLVER.BASE_LR", "0.1"]  # the lr is the YAML's own: no change
    if shortened:
        opts += ["SOLVER.MAX_ITER", "3", "SOLVER.STEPS", "(2,)", "MODEL.RPN.NMS_THRESH", "0.5"]
    config = DetectConfig(
        weights=str(weights), data=str(data), detection_config="voc", out=str(tmp_path / "out"), trials=2, opts=opts
    )
    config.config_file = str(tmp_path / "run.yaml")  # as --config run.yaml sets it
    trials = [{"seed": s, "metrics": {"bbox_AP": 1.0}, "config": {}} for s in (0, 1)]
    loaded = LoadedWeights(str(weights), None, "ab" * 32, {})  # the record reads only the source and sha256
    record = _write(config, loaded, "torchvision", resolve_config("voc"), trials, start=0.0)
    expected = {"trials": {"value": 2, "preset": 1}, "DATALOADER.NUM_WORKERS": {"value": 0, "preset": 4}}
    if shortened:
        expected |= {
            "SOLVER.MAX_ITER": {"value": 3, "preset": 24000},
            "SOLVER.STEPS": {"value": [2], "preset": [18000, 22000]},
            "MODEL.RPN.NMS_THRESH": {"value": 0.5, "preset": 0.7},
        }
    for written in (record, json.loads((tmp_path / "out" / "results.json").read_text())):
        assert written["overrides"] == expected
        hyper = written["hyperparameters"]  # the --config file and the detectron2 YAML, each under its own name
        assert (hyper["config_file"], hyper["detection_config_file"]) == (
            "run.yaml",
            "voc0712_faster_rcnn_R_50_C4_24k.yaml",
        )
        assert written["paper"] == (None if shortened else PAPER_ROWS["voc"].block())
    (line,) = (tmp_path / "out" / "results.jsonl").read_text().splitlines()
    assert json.loads(line)["overrides"] == expected
    table = (tmp_path / "out" / "results.md").read_text()
    assert "preset voc; DATALOADER.NUM_WORKERS 0 (preset 4), " in table and "trials 2 (preset 1)" in table
    if shortened:  # a 3-iteration run is marked as such and gets no paper row to be compared with
        assert "SOLVER.MAX_ITER 3 (preset 24000), SOLVER.STEPS [2] (preset [18000, 22000])" in table
        assert "56.8" not in table
    else:
        assert "56.8" in table


def test_detection_results_get_the_papers_rows_in_the_report():
    from bt_hub.eval.report import render_table

    def record(preset, **metrics):
        return {
            "protocol": "detect",
            "preset": preset,
            "paper": PAPER_ROWS[preset].block() if preset in PAPER_ROWS else None,
            "table": TABLES.get(preset, TABLES[None]).block(),
            "metrics": metrics,
            "weights": {"name": "bt.pth", "fingerprint": "ab"},
            "dataset": {"name": "coco" if preset == "coco" else "voc"},  # the paper's data, by folder name
            "wall_time_s": 1.0,
            "seed": 0,
        }

    text = render_table(
        [
            record("voc", bbox_AP=50.0, bbox_AP50=80.0, bbox_AP75=55.0),
            record("coco", bbox_AP=38.0, bbox_AP50=58.0, bbox_AP75=41.0, segm_AP=33.0, segm_AP50=55.0, segm_AP75=35.0),
            record("shapes-voc", bbox_AP=60.0, bbox_AP50=90.0, bbox_AP75=70.0),
        ]
    )
    voc, coco, other = text.split("### ")[1:]
    assert "VOC07+12 Faster R-CNN" in voc and "| box AP | box AP50 | box AP75 | Wall time (s) |" in voc
    assert "| 56.8 | 82.6 | 63.4 | — |" in voc and "| preset voc | bt.pth (ab) | voc |" in voc
    assert "| 50.0 | 80.0 | 55.0 | 1.0 |" in voc
    assert "| mask AP | mask AP50 | mask AP75 |" in coco
    assert (
        "| 39.2 | 59.0 | 42.5 | 34.3 | 56.0 | 36.5 | — |" in coco
        and "| 38.0 | 58.0 | 41.0 | 33.0 | 55.0 | 35.0 | 1.0 |" in coco
    )
    assert (
        "paper" not in other.split("|---")[1]
        and "| preset shapes-voc | bt.pth (ab) | voc |" in other
        and "| 60.0 | 90.0 | 70.0 | 1.0 |" in other
    )
