"""``eval compare`` at label budgets, with RankMe beside every frozen score, and the per-image results its verdicts
test (issue 48, items 2, 4 and 5)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bt_hub import cli
from bt_hub.common.config import from_preset
from bt_hub.data.datasets import ArrayImageDataset
from bt_hub.eval.compare_config import Column, CompareConfig
from bt_hub.eval.comparison import Source, compare, compare_and_write
from bt_hub.eval.comparison_report import Comparison, plot_curve
from bt_hub.eval.config import Settings
from bt_hub.eval.knn import knn_classify
from bt_hub.eval.label_subsets import subset_indices
from bt_hub.eval.runner import EvalRun
from bt_hub.eval.splits import Splits

KNN, RANKME = Column("knn"), Column("rankme")


def _planted(classes: int = 4, per_class: int = 50, test: int = 40) -> tuple[Splits, dict[str, tuple]]:
    """Splits of ``classes`` x ``per_class`` training images, and the features of a row whose class shows (``w``) and
    of a noisier baseline (``pixels``)."""

    def part(n: int) -> ArrayImageDataset:
        return ArrayImageDataset(np.zeros((n, 2, 2, 3), np.uint8), np.arange(n) % classes, list("abcd")[:classes])

    splits = Splits(
        part(classes * per_class), part(test), {"name": "p", "path": "p", "fingerprint": "f", "holdout": None}
    )
    g = torch.Generator().manual_seed(5)
    centres = torch.randn(classes, 16, generator=g)
    features = {}
    for name, signal in (("w", 3.0), ("pixels", 0.7)):
        out = []
        for split in (splits.train, splits.test):
            y = torch.tensor(split.targets)
            out += [signal * centres[y] + torch.randn(len(y), 16, generator=g), y]
        features[name] = tuple(out)
    return splits, features


def _compare(config: CompareConfig, seeds=(0, 1)) -> tuple[Comparison, dict[str, tuple]]:
    splits, features = _planted()
    sources = [
        Source("w", lambda s: torch.nn.Identity()),
        Source("pixels", lambda s: torch.nn.Flatten(), baseline=True),
    ]
    settings = Settings("resnet18", False, 2, "default", "fp32", "workers", "cpu")
    run = EvalRun(config, None, torch.device("cpu"), [], settings, given_splits=splits)
    found = compare(
        sources, run, columns=config.columns(), seeds=list(seeds), features=lambda s, n, k: features[s.name]
    )
    return found, features


def _config(**values) -> CompareConfig:
    return from_preset(
        CompareConfig, weights=["planted"], knn={"k": [5]}, linear={"epochs": 5}, batch_size=32, out=None, **values
    )


def test_label_budgets_score_knn_and_linear_on_semis_subsets_the_same_for_every_row():
    # guards: the kNN and linear columns of eval compare could not be asked at 1% or 10% of the labels, where the
    # paper's claim is (issue 48, item 4)
    config = _config(label_fractions=[10, 100])
    assert [str(c) for c in config.columns()] == ["kNN 10%", "kNN 100%", "linear 10%", "linear 100%", "RankMe"]
    result, features = _compare(config)
    splits, _ = _planted()
    default, _ = _compare(_config())
    for seed in (0, 1):
        labelled = subset_indices(splits.train, percent=10, seed=seed)  # what bt-hub eval semi draws at this seed
        assert len(labelled) == 20
        for row, (train_x, train_y, test_x, test_y) in features.items():
            alone = knn_classify(train_x[labelled], train_y[labelled], test_x, test_y, k=5, backend="torch")
            assert result.values[row][Column("knn", 10)][seed] == alone["top1"], (row, seed)
            # 100% of the labels is the column of before budgets, record for record
            for protocol in ("knn", "linear"):
                assert result.values[row][Column(protocol, 100)][seed] == default.values[row][Column(protocol)][seed]
    at_ten = [r for r in result.records if r["notes"]["compare"]["column"] == "linear 10%"]
    assert {(r["seed"], r["labels"]["count"], r["labels"]["source"]) for r in at_ten} == {
        (0, 20, "seeded"),
        (1, 20, "seeded"),
    }
    # the grid chooses on a validation split of the budget's own 20 labels, never on more
    assert {r["notes"]["validation"]["train_size"] + r["notes"]["validation"]["val_size"] for r in at_ten} == {20}
    for column in ("kNN 10%", "linear 10%"):  # a kNN cell on another subset at each seed is no deterministic vote
        assert all(
            not r["notes"].get("deterministic") for r in result.records if r["notes"]["compare"]["column"] == column
        )
    assert {str(c): result.verdict("w", c)["baseline"] for c in result.accuracy_columns} == dict.fromkeys(
        ["kNN 10%", "kNN 100%", "linear 10%", "linear 100%"], "pixels"
    )  # a verdict per budget, against the baseline at that budget


def test_the_default_budget_keeps_the_columns_of_before_and_refuses_what_it_cannot_score():
    # guards: the default (all the labels) must leave existing compare commands' columns and records as they were
    assert _config().columns() == _config(label_fractions=[100]).columns() == [Column("knn"), Column("linear"), RANKME]
    with pytest.raises(
        ValueError, match=r"--label-fractions must be distinct percentages in \(0, 100\], got \[10, 10\]"
    ):
        _config(label_fractions=[10, 10])
    with pytest.raises(ValueError, match="RankMe comes beside the frozen columns unasked"):
        _config(protocols=["rankme"])
    semi = from_preset(CompareConfig, weights=["planted"], protocols=["semi"], out=None)
    assert semi.columns() == [Column("semi", 1), Column("semi", 10)]  # no frozen column: no RankMe, no budget


def test_every_frozen_cell_carries_its_per_image_results_and_they_make_its_top1():
    # guards: a verdict tests two rows' per-image results on the same test images; each cell must give them, in the
    # test split's order (kNN's vote and the linear grid's chosen head here; fine-tuning below)
    result, _ = _compare(_config(label_fractions=[10, 100]))
    for row, columns in result.values.items():
        for column, values in columns.items():
            for value, hits in zip(values, result.correct[row][column], strict=True):
                if column == RANKME:
                    assert hits is None  # a label-free value has no per-image results
                else:
                    assert len(hits) == 40 and 100.0 * hits.mean() == pytest.approx(value, abs=1e-9)


def test_compare_gives_rankme_for_every_row_the_baselines_included_without_a_verdict(small_stem_weights, tmp_path):
    # guards: eval compare gave no label-free number beside its frozen scores (issue 48, item 2)
    out = tmp_path / "cmp"
    flags = ["--data", "synthetic:60", "--image-size", "8", "--precision", "fp32"]
    argv = ["eval", "compare", "--weights", str(small_stem_weights), "--seeds", "2", "--knn-k", "5"]
    assert cli.main([*argv, "--linear-epochs", "2", *flags, "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    rankme = {(r["notes"]["compare"]["row"], r["seed"]): r for r in records if r["protocol"] == "rankme"}
    assert set(rankme) == {(row, s) for row in (small_stem_weights.name, "pixels", "random-init") for s in (0, 1)}
    assert all(r["notes"]["compare"]["column"] == "RankMe" and "top1" not in r["metrics"] for r in rankme.values())
    alone = tmp_path / "rankme"
    assert cli.main(["eval", "rankme", "--weights", str(small_stem_weights), *flags, "--out", str(alone)]) == 0
    expected = json.loads((alone / "results.json").read_text())["metrics"]["rankme"]
    assert rankme[(small_stem_weights.name, 0)]["metrics"]["rankme"] == expected  # the protocol's own value
    summary = json.loads((out / "results.json").read_text())
    assert list(summary["verdicts"][small_stem_weights.name]) == ["kNN", "linear"]  # no verdict on RankMe
    assert summary["table"]["pixels"]["RankMe"]["per_seed"] == [
        rankme[("pixels", s)]["metrics"]["rankme"] for s in (0, 1)
    ]
    assert (
        "| representation | kNN | linear | RankMe | better than the best baseline? |"
        in (out / "compare.md").read_text()
    )


def test_the_curve_plots_rankme_on_its_own_axis(tmp_path, monkeypatch):
    # guards: a RankMe of hundreds drawn on the accuracy axis (0-100) of the curve, or left out of it
    from bt_hub.common import files

    values = {
        "step 1": {KNN: [50.0], RANKME: [120.0]},
        "step 2": {KNN: [60.0], RANKME: [250.0]},
        "pixels": {KNN: [55.0], RANKME: [40.0]},
    }
    result = Comparison([0], [KNN, RANKME], values, ["pixels"], 100)
    result.positions = {"step 1": {"step": 1, "seconds": 1.0}, "step 2": {"step": 2, "seconds": 2.0}}
    drawn = []
    monkeypatch.setattr(files, "save_png", lambda fig, path: drawn.append(fig) or path)
    plot_curve(result, tmp_path / "curve.png")
    axes = drawn[0].axes
    labels = [ax.get_ylabel() for ax in axes]
    assert labels == ["kNN test top-1 (%)", "RankMe of the training features"] * 2
    rankme_axis = axes[1]
    assert rankme_axis.get_ylim()[1] > 200 and axes[0].get_ylim()[1] < 100  # each on its own scale
    assert rankme_axis.get_shared_y_axes().get_siblings(rankme_axis) == [rankme_axis]


def test_fine_tuning_cells_carry_per_image_results_too(small_stem_weights):
    # guards: the semi columns' verdicts need the fine-tuned classifier's per-image results (evaluate_loader)
    config = from_preset(
        CompareConfig,
        weights=[str(small_stem_weights)],
        protocols=["semi"],
        fractions=[10],
        baselines=["random-init"],
        seeds=1,
        semi={"epochs": 1, "min_steps": 2},
        data="synthetic:100",
        image_size=8,
        out=None,
    )
    result, _ = compare_and_write(config)
    column = Column("semi", 10)
    for row in (small_stem_weights.name, "random-init"):
        (hits,) = result.correct[row][column]
        assert len(hits) == result.test_size and 100.0 * hits.mean() == pytest.approx(result.values[row][column][0])
    assert result.verdict(small_stem_weights.name, column)["test"] == "McNemar"
