"""eval.report: results.json fields, the results.jsonl history and the paper-style tables."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from eval.report import render_table, write_results

FIELDS = {
    "protocol", "preset", "hyperparameters", "weights", "weights_sha256", "dataset", "dataset_fingerprint",
    "seed", "metrics", "wall_time_s", "bt_hub_version", "git_sha", "git_dirty", "timestamp",
}


@dataclass
class FakeConfig:
    weights: str = "w.safetensors"
    fraction: int = 1
    lr: float = 0.3


def _write(out, **overrides):
    kwargs = dict(
        protocol="linear", preset="imagenet", config=FakeConfig(), metrics={"top1": 71.25, "top5": 90.0},
        weights="runs/a/w.safetensors", weights_sha256="abcdef0123456789", dataset="digits",
        dataset_fingerprint="f" * 64, seed=3, wall_time_s=12.5,
    )
    kwargs.update(overrides)
    return write_results(out, **kwargs)


def test_results_json_has_every_documented_field(tmp_path):
    record = _write(tmp_path)
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert set(on_disk) == FIELDS
    assert on_disk == json.loads(json.dumps(record))
    assert on_disk["hyperparameters"] == {"weights": "w.safetensors", "fraction": 1, "lr": 0.3}
    assert on_disk["metrics"] == {"top1": 71.25, "top5": 90.0}
    assert on_disk["seed"] == 3 and on_disk["weights_sha256"] == "abcdef0123456789"


def test_each_run_appends_a_row_and_tables_show_the_paper_row(tmp_path):
    _write(tmp_path)
    _write(tmp_path, protocol="semi", preset="paper", metrics={"top1": 40.0, "top5": 70.0})
    _write(tmp_path, protocol="knn", preset=None, metrics={"top1": 60.0, "top5": 80.0, "top1_k20": 60.0, "top5_k20": 80.0, "top1_k200": 58.0, "top5_k200": 81.0})
    _write(tmp_path, protocol="voc07-svm", preset=None, metrics={"mAP": 50.0, "mAP_11point": 48.0})
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert [json.loads(line)["protocol"] for line in lines] == ["linear", "semi", "knn", "voc07-svm"]
    md = (tmp_path / "results.md").read_text()
    assert "| Barlow Twins (paper: ResNet-50, 1000 epochs) | paper | ImageNet | paper | 73.2 | 91.0 | — |" in md
    assert "| 55.0 | 79.2 | 69.7 | 89.3 |" in md  # Table 2 of the paper
    assert "| 54.1 | 86.2 | — | 46.5 |" in md  # Table 3: Places-205, VOC07, (11-point), iNat18
    assert "| ours: semi | w.safetensors (abcdef01) | digits | paper | 40.0 | 70.0 | — | — | 12.5 |" in md
    assert "| ours: voc07-svm | w.safetensors (abcdef01) | digits | — | — | 50.0 | 48.0 | — | 12.5 |" in md
    assert "| ours: knn | w.safetensors (abcdef01) | digits | — | 60.0 | 80.0 | 58.0 | 81.0 | 12.5 |" in md


def test_transfer_presets_land_in_their_paper_columns():
    base = {"weights": "w", "weights_sha256": "", "dataset": "places", "wall_time_s": 1.0}
    md = render_table([{**base, "protocol": "transfer", "preset": "inat18", "metrics": {"top1": 30.0}}])
    assert md.splitlines()[-1].startswith("| ours: transfer") and md.splitlines()[-1].endswith("| — | — | — | 30.0 | 1.0 |")


def test_unknown_protocols_get_a_table_of_their_own_metrics():
    md = render_table([{"protocol": "retrieval", "metrics": {"recall_at_1": 12.0}, "wall_time_s": 2.0}])
    assert md.splitlines()[0] == "### retrieval"
    assert md.splitlines()[2] == "| Method | Weights | Data | Preset | recall_at_1 | Wall time (s) |"
    assert md.splitlines()[-1].endswith("| 12.0 | 2.0 |")


def test_non_numeric_metrics_are_rejected_naming_them(tmp_path):
    with pytest.raises(ValueError, match="flat dict of numbers"):
        _write(tmp_path, metrics={"top1": {"k20": 1.0}})
    assert not (tmp_path / "results.json").exists()
