"""``bt-hub demo``: the report and plots, and pretraining that beats the random-init network."""

from __future__ import annotations

import json

import pytest

from bt_hub import cli

# 44 pretraining steps and 30 fine-tuning steps on 1% of the labels: about 75 s on 2 cores
SHORT = ["--epochs", "2", "--semi-epochs", "3", "--linear-epochs", "10"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def short_demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "demo_out"
    assert cli.main(["demo", "--out", str(out), *SHORT]) == 0
    return out


def test_shortened_demo_writes_the_report_and_the_plots(short_demo):
    report = (short_demo / "report.md").read_text()
    for name in ("loss.png", "cross_correlation.png", "accuracy.png"):
        data = (short_demo / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5_000
        assert f"![{name}]({name})" in report
    for row in ("Barlow Twins (pretrained)", "random init (same network)", "raw pixels", "supervised from scratch"):
        assert f"| {row} |" in report
    results = json.loads((short_demo / "results.json").read_text())
    assert results["labelled"] == {"1": 10, "10": 142}
    assert set(results["table"]["raw pixels"]) == {"kNN", "linear", "1% labels", "10% labels"}


def test_the_cli_reproduces_the_demos_knn_linear_and_fine_tuning_numbers(short_demo, tmp_path):
    table = json.loads((short_demo / "results.json").read_text())["table"]["Barlow Twins (pretrained)"]
    common = [
        "--weights",
        str(short_demo / "pretrain"),
        "--data",
        "digits",
        "--image-size",
        "8",
        "--test-split",
        "test",
    ]
    commands = {
        "kNN": ["eval", "knn", "--k", "20", *common],
        "linear": ["eval", "linear", "--cached", "--epochs", "10", *common],
        "10% labels": [
            "eval",
            "semi",
            "--preset",
            "small",
            "--fraction",
            "10",
            "--epochs",
            "3",
            *common,
        ],  # the demo's --semi-epochs
    }
    for column, argv in commands.items():
        assert cli.main([*argv, "--out", str(tmp_path / column)]) == 0
        assert json.loads((tmp_path / column / "results.json").read_text())["metrics"]["top1"] == table[column], column


def test_barlow_twins_beats_the_random_init_network_on_knn_and_on_1_percent_labels(short_demo):
    table = json.loads((short_demo / "results.json").read_text())["table"]
    bt, random_init = table["Barlow Twins (pretrained)"], table["random init (same network)"]
    # seed 0, 44 steps: kNN 86.4 vs 15.6, 1% labels 48.9 vs 11.4
    assert bt["kNN"] > random_init["kNN"] + 40.0
    assert bt["1% labels"] > random_init["1% labels"] + 20.0


@pytest.mark.slow
def test_full_length_demo_beats_the_random_init_network_and_the_pixels_on_1_percent_labels(tmp_path):
    assert cli.main(["demo", "--out", str(tmp_path / "demo_out")]) == 0
    table = json.loads((tmp_path / "demo_out" / "results.json").read_text())["table"]
    bt, random_init, pixels = (
        table["Barlow Twins (pretrained)"],
        table["random init (same network)"],
        table["raw pixels"],
    )
    # seed 0, 88 steps: kNN 86.4 vs 11.9; 1% labels 64.4 vs 21.7 (pixels 45.8)
    assert bt["kNN"] > random_init["kNN"] + 40.0
    assert bt["1% labels"] > random_init["1% labels"] + 20.0
    assert bt["1% labels"] > pixels["1% labels"]


def test_demo_rejects_a_directory_it_did_not_write(tmp_path, capsys):
    (tmp_path / "pretrain").mkdir(parents=True)
    (tmp_path / "pretrain" / "notes.txt").write_text("mine")
    assert cli.main(["demo", "--out", str(tmp_path), *SHORT]) == 2
    # the ownership rule of every command: a folder bt_hub did not create needs --overwrite
    assert "is not empty and was not created by bt-hub" in capsys.readouterr().err
    assert (tmp_path / "pretrain" / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_demo_is_deterministic_for_a_seed(tmp_path):
    tiny = ["--epochs", "1", "--max-steps", "2", "--semi-epochs", "1", "--linear-epochs", "2"]
    tables = []
    for run in ("a", "b"):
        assert cli.main(["demo", "--out", str(tmp_path / run), *tiny]) == 0
        tables.append(json.loads((tmp_path / run / "results.json").read_text())["table"])
    assert tables[0] == tables[1]


def test_the_demo_pretrains_with_the_digits_preset_of_bt_hub_pretrain(tmp_path, monkeypatch):
    # Guards: the demo and `bt-hub pretrain --preset digits` carried two different digits recipes.
    from bt_hub.eval import demo
    from bt_hub.train.pretrain import PretrainConfig

    seen = {}

    def capture(config):
        seen["config"] = config
        return tmp_path

    monkeypatch.setattr(demo, "pretrain", capture)
    demo._pretrain(demo.DemoConfig(out=str(tmp_path / "d")), tmp_path / "d" / "pretrain")
    for key, value in PretrainConfig.PRESETS["digits"].items():
        assert getattr(seen["config"], key) == value, key
