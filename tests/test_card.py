"""The model card: model-index entries, the paper column, seeds, the training length and timm's preprocessing."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("huggingface_hub")

import huggingface_hub  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from bt_hub.common.records import card_table  # noqa: E402
from bt_hub.method.model import build_backbone  # noqa: E402
from bt_hub.method.transforms import eval_transforms  # noqa: E402
from bt_hub.weights import ExportConfig, export, save_pretrained  # noqa: E402


def _record(protocol, metrics, *, seed=0, name="digits", split="test", size=360, preset=None, task=None, **extra):
    return {
        "protocol": protocol,
        "preset": preset,
        "paper_task": task,
        "seed": seed,
        "dataset": {"name": name, "test": {"split": split, "size": size}, "holdout": extra.pop("holdout", None)},
        "weights": {"name": "bt.safetensors", "fingerprint": "ab" * 32},
        "metrics": metrics,
        **extra,
    }


def _index(folder) -> list[dict]:
    """The card's model-index entries as written (huggingface_hub's ModelCardData would merge them on re-writing)."""
    (entry,) = huggingface_hub.metadata_load(folder / "README.md")["model-index"]
    parsed = huggingface_hub.ModelCard.load(folder / "README.md").data.eval_results
    assert [(r.task_name, r.dataset_name, r.metric_type) for r in parsed] == [
        (e["task"]["name"], e["dataset"]["name"], m["type"]) for e in entry["results"] for m in e["metrics"]
    ]
    return entry["results"]


def test_model_index_has_one_entry_per_protocol_and_dataset_with_the_hubs_schema(tmp_path):
    """Guards against one entry named after kNN that held the linear probe's metrics too (same task and data)."""
    records = [
        _record("knn", {"top1": 80.0, "top5": 95.0}),
        _record("linear", {"top1": 90.0, "top5": 99.0}),
        _record("linear", {"top1": 70.0}, name="cifar10", split="val", size=10000),
    ]
    model = build_backbone("resnet18")
    results = _index(save_pretrained(model, tmp_path / "hf", results=records, name="bt/r18"))
    assert [(r["task"]["name"], r["dataset"]["name"]) for r in results] == [
        ("knn", "digits"),
        ("linear", "digits"),
        ("linear", "cifar10"),
    ]
    for entry in results:
        assert entry["task"]["type"] == "image-classification"
        assert set(entry["dataset"]) == {"name", "type", "split"}
        assert all(set(m) == {"type", "value", "name"} for m in entry["metrics"])
    knn, linear, _ = ({m["type"]: m["value"] for m in r["metrics"]} for r in results)
    assert knn == {"top1": 80.0, "top5": 95.0} and linear == {"top1": 90.0, "top5": 99.0}
    assert results[2]["dataset"]["split"] == "val"


def test_several_seeds_give_mean_and_std_and_one_seed_says_so(tmp_path):
    records = [_record("linear", {"top1": v}, seed=s) for s, v in enumerate((90.0, 91.0, 95.0))]
    records.append(_record("knn", {"top1": 80.0}))
    table = card_table(records)
    assert "| linear | — | digits | Top-1 | 92.0 ± 2.6 | 3 seeds | — |" in table
    assert "| knn | — | digits | Top-1 | 80.0 | 1 seed | — |" in table
    results = _index(save_pretrained(build_backbone("resnet18"), tmp_path / "hf", results=records, name="bt/r18"))
    assert [r["task"]["name"] for r in results] == ["linear", "knn"]
    assert results[0]["metrics"] == [{"type": "top1", "value": 92.0, "name": "Top-1 (mean ± 2.6 std over 3 seeds)"}]
    assert results[1]["metrics"] == [{"type": "top1", "value": 80.0, "name": "Top-1 (1 seed)"}]


def test_seeded_label_subsets_of_each_seed_share_one_row():
    records = [
        _record(
            "semi",
            {"top1": v},
            seed=s,
            preset="paper",
            labels={"fraction": 1, "source": "seeded", "seed": s},
            holdout={"fraction": 0.2, "seed": s},
        )
        for s, v in enumerate((50.0, 60.0))
    ]
    rows = [line for line in card_table(records).splitlines() if line.startswith("| semi")]
    assert rows == [
        "| semi | 1% labels (seeded class-balanced, one subset per seed); preset paper; test: held-out 20% of train "
        "(seed of each run) | digits | Top-1 | 55.0 ± 7.1 | 2 seeds | — |"
    ]


def test_paper_numbers_sit_only_beside_the_papers_protocol_on_the_papers_data():
    """Guards against the paper's ImageNet 73.2 printed beside a digits result of the imagenet preset."""
    imagenet = dict(preset="imagenet", task="imagenet_linear")
    table = card_table(
        [
            _record("linear", {"top1": 91.0}, **imagenet),
            _record("linear", {"top1": 72.0}, name="ILSVRC2012", split="val", size=50000, **imagenet),
            _record("linear", {"top1": 60.0}, name="imagenet", split="val", size=1000, **imagenet),
            _record("linear", {"top1": 65.0}, name="imagenet", split="holdout", size=5000, **imagenet),
        ]
    ).splitlines()
    assert [line.rsplit("|", 2)[1].strip() for line in table[2:]] == ["—", "73.2", "—", "—"]


def _run_folder(tmp_path, source) -> str:
    """A pretraining run folder as bt-hub pretrain writes it: stopped by --max-steps 20 of a 10-epoch schedule."""
    run = tmp_path / "run"
    run.mkdir()
    save_file(source.state_dict(), str(run / "backbone.safetensors"))
    config = {
        "architecture": "resnet18",
        "feature_dim": 512,
        "small_image_stem": False,
        "projector": "32-32",
        "lambd": 0.0051,
        "image_size": 32,
        "dataset": "digits",
        "num_samples": 1437,
        "epochs": 10,
        "steps": 20,
        "recipe": {"optimizer": "LARS", "batch_size": 128},
        "format": "torchvision",
    }
    (run / "config.json").write_text(json.dumps(config))
    return str(run)


def test_card_states_steps_and_epochs_done_against_the_schedule(tmp_path):
    """Guards against "epochs 10" on the card of a run stopped at step 20 of 110."""
    run = _run_folder(tmp_path, build_backbone("resnet18"))
    folder = export(ExportConfig(weights=run, format="hf", out=str(tmp_path / "hf")))
    text = (folder / "README.md").read_text()
    assert (
        "| training length | 20 of 110 steps (1.82 of 10 epochs, 11 steps per epoch); "
        "stopped before the end of the schedule |" in text
    )
    assert "| epochs |" not in text


@pytest.mark.parametrize("size", [16, 32, 96, 224])
def test_timm_transform_from_the_exported_config_equals_bt_hubs(size, tmp_path):
    """Guards against crop_pct rounded to 4 digits, which gave timm Resize(36) where bt_hub uses Resize(37) at 32 px."""
    timm = pytest.importorskip("timm")
    folder = save_pretrained(build_backbone("resnet18"), tmp_path / "hf", config={"image_size": size})
    model = timm.create_model(f"local-dir:{folder}", pretrained=True, num_classes=0)
    theirs = timm.data.create_transform(**timm.data.resolve_data_config(model=model))
    rng = np.random.default_rng(size)
    image = Image.fromarray(rng.integers(0, 256, (size * 2 + 5, size * 3 - 1, 3), dtype=np.uint8))
    expected = eval_transforms(size)(image)
    assert torch.equal(theirs(image), expected)
