"""Results records: the schema, the results.jsonl history, results.md and the model card say what each run was."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, is_dataclass
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from bt_hub.common.config import from_preset
from bt_hub.common.config import overrides as changed_from_preset
from bt_hub.common.records import SCHEMA, card_table, make_record, read_records, setting, summary_text
from bt_hub.eval import knn, linear, semi_supervised, voc07_svm
from bt_hub.eval.detection import detect
from bt_hub.eval.label_subsets import PUBLISHED_SUBSETS
from bt_hub.eval.report import render_table
from bt_hub.eval.runner import write_records
from bt_hub.weights.registry import PAPER_RESULTS

FIELDS = {
    "schema",
    "protocol",
    "mode",
    "mode_description",
    "preset",
    "overrides",
    "hyperparameters",
    "weights",
    "dataset",
    "seed",
    "metrics",
    "wall_time_s",
    "timestamp",
    "versions",
    "warnings",
    "paper",
    "table",
}


@dataclass
class FakeConfig:
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {"imagenet": {}, "short": {"epochs": 10}}
    RUN_FIELDS: ClassVar[tuple[str, ...]] = ("weights",)

    weights: str = "/home/me/secret/w.safetensors"
    preset: str = "imagenet"
    epochs: int = 100
    lr: float = 0.3
    milestones: list[int] = field(default_factory=list)


SPLITS = {
    "name": "digits",
    "path": "digits",
    "fingerprint": "f" * 64,
    "holdout": None,
    "train": {"split": "train", "size": 1437, "fingerprint": "a" * 64},
    "test": {"split": "val", "size": 360, "fingerprint": "b" * 64},
    "overlap_check": {"shared_files": 0, "sampled": 64, "identical": 0},
}


# the paper's data: ImageNet's validation split, by folder name and size
IMAGENET = {
    **SPLITS,
    "name": "imagenet",
    "path": "imagenet",
    "test": {"split": "val", "size": 50000, "fingerprint": "c"},
}


def _write(out, config=None, **overrides):
    kwargs = dict(
        protocol="linear",
        config=config or FakeConfig(),
        preset="imagenet",
        mode="loop",
        metrics={"top1": 71.25, "top5": 90.04},
        weights="/home/me/secret/w.safetensors",
        weights_sha256="abcdef0123456789",
        dataset=SPLITS,
        seed=3,
        wall_time_s=12.5,
    )
    kwargs.update(overrides)
    row = _paper_row(kwargs["protocol"], kwargs["preset"], kwargs.get("labels"))
    kwargs.setdefault("paper", row and row.block())
    kwargs.setdefault("table", _TABLES.get(kwargs["protocol"], linear.LINEAR_TABLE).block())
    config = kwargs.pop("config")
    weights = {"name": kwargs.pop("weights"), "fingerprint": kwargs.pop("weights_sha256")}
    changed = changed_from_preset(config, ignore=getattr(config, "RUN_FIELDS", ())) if is_dataclass(config) else {}
    record = make_record(config=config, weights=weights, overrides=changed, **kwargs)
    write_records(out, [record])
    return record


_TABLES = {"semi": semi_supervised.TABLE, "knn": knn.TABLE, "transfer": linear.TRANSFER_TABLE}


def _paper_row(protocol, preset, labels=None):
    """The paper row the protocol module itself declares for a run from ``preset`` (as the protocol passes it)."""
    if protocol in ("linear", "transfer"):
        return linear.PAPER_ROWS.get(preset or "")
    if protocol == "semi":
        return semi_supervised.paper_row(SimpleNamespace(preset=preset), labels or {})
    if protocol == "detect":
        return detect.PAPER_ROWS.get(preset or "")
    return None


def test_each_protocol_declares_the_paper_rows_it_follows_with_the_papers_numbers():
    assert {k: r.task for k, r in linear.PAPER_ROWS.items()} == {
        "imagenet": "imagenet_linear",
        "places205": "places205_linear",
        "inat18": "inat18_linear",
    }
    assert _paper_row("semi", "paper", {"fraction": 10}).task == "semi_supervised_10pct"
    assert (
        _paper_row("semi", "paper", {"fraction": 50}) is None and _paper_row("semi", "small", {"fraction": 1}) is None
    )
    assert _paper_row("detect", "coco").task == "coco_mask_rcnn_c4_1x" and _paper_row("detect", "shapes-voc") is None
    rows = [*linear.PAPER_ROWS.values(), *semi_supervised.PAPER_ROWS.values(), *detect.PAPER_ROWS.values()]
    rows.append(voc07_svm.PAPER_ROW)
    assert sorted(r.task for r in rows) == sorted(PAPER_RESULTS)  # every paper number has its protocol's row
    assert linear.PAPER_ROWS["imagenet"].block()["metrics"] == {"top1": 73.2, "top5": 91.0}


def test_results_json_has_every_documented_field_and_no_absolute_path(tmp_path):
    record = _write(tmp_path)
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert set(on_disk) == FIELDS and on_disk == record and on_disk["schema"] == SCHEMA
    assert on_disk["weights"] == {"name": "w.safetensors", "fingerprint": "abcdef0123456789"}
    assert on_disk["hyperparameters"]["weights"] == "w.safetensors"
    assert "/home/me" not in (tmp_path / "results.json").read_text()
    assert on_disk["dataset"]["test"] == {"split": "val", "size": 360, "fingerprint": "b" * 64}
    assert set(on_disk["versions"]) >= {"bt_hub", "torch", "torchvision", "python", "git_sha", "git_dirty"}
    assert on_disk["mode_description"] == "paper loop with augmentation" and on_disk["overrides"] == {}


def test_two_runs_into_one_out_leave_two_records_and_results_json_is_the_latest(tmp_path):
    _write(tmp_path, metrics={"top1": 10.0})
    _write(tmp_path, metrics={"top1": 20.0})
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert [json.loads(line)["metrics"]["top1"] for line in lines] == [10.0, 20.0]
    assert json.loads((tmp_path / "results.json").read_text())["metrics"]["top1"] == 20.0
    assert (tmp_path / "results.md").read_text().count("| ours: linear |") == 2


def test_runs_that_differ_only_in_their_seed_share_a_row_with_mean_std_and_the_seed_count(tmp_path):
    for seed, top1 in ((0, 70.0), (1, 72.0), (2, 77.0)):
        _write(tmp_path, seed=seed, metrics={"top1": top1, "top5": 90.0})
    _write(tmp_path, seed=0, mode="cached", metrics={"top1": 50.0, "top5": 80.0})
    md = (tmp_path / "results.md").read_text()
    # mean 73.0, sample standard deviation sqrt(((-3)^2 + (-1)^2 + 4^2) / 2) = sqrt(13) = 3.6
    assert "| 3 seeds | 73.0 ± 3.6 | 90.0 ± 0.0 | 12.5 |" in md
    assert "| 1 seed | 50.0 | 80.0 | 12.5 |" in md and md.count("| ours: linear |") == 2
    _write(tmp_path, seed=1, metrics={"top1": 10.0, "top5": 20.0})  # seed 1 again: a new row, nothing dropped
    md = (tmp_path / "results.md").read_text()
    assert "| 3 seeds | 73.0 ± 3.6 |" in md and "| 1 seed | 10.0 | 20.0 |" in md


def test_semi_runs_that_draw_their_label_subset_from_their_own_seed_share_a_row(tmp_path):
    for seed, top1 in ((0, 40.0), (1, 50.0)):
        labels = {"fraction": 1, "source": "seeded", "seed": seed, "count": 10}
        _write(tmp_path, protocol="semi", preset="small", seed=seed, labels=labels, metrics={"top1": top1})
    md = (tmp_path / "results.md").read_text()
    assert "1% labels (seeded class-balanced, one subset per seed)" in md and "| 2 seeds | 45.0 ± 7.1 |" in md


def _append_many(out, worker, count):
    from bt_hub.eval.report import append_results

    for i in range(count):
        record = {"protocol": "knn", "seed": i, "metrics": {"top1": float(i)}, "weights": {"name": f"w{worker}"}}
        append_results(out, [record])


def test_concurrent_appenders_keep_every_record_on_a_line_of_its_own(tmp_path):
    # guards the read-change-rewrite of results.jsonl that lost 31 to 60 of 90 records under 6 writers
    import multiprocessing

    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_append_many, args=(tmp_path, w, 15)) for w in range(6)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert [worker.exitcode for worker in workers] == [0] * 6
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert sorted((r["weights"]["name"], r["seed"]) for r in records) == sorted(
        (f"w{w}", i) for w in range(6) for i in range(15)
    )
    assert (tmp_path / "results.md").read_text().count("| 15 seeds |") == 6  # the last rewrite saw all 90


def test_results_jsonl_that_is_a_symlink_is_refused_and_its_target_left_alone(tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("mine\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.jsonl").symlink_to(target)
    with pytest.raises(OSError, match="results.jsonl is a symbolic link"):
        _write(out)
    assert target.read_text() == "mine\n"


def test_cached_and_loop_runs_render_differently(tmp_path):
    _write(tmp_path, mode="loop")
    _write(tmp_path, mode="cached")
    md = (tmp_path / "results.md").read_text()
    assert "| ours: linear | preset imagenet; paper loop with augmentation |" in md
    assert "| ours: linear | preset imagenet; cached features, no augmentation |" in md


def test_a_value_changed_from_the_preset_is_named_in_results_md_and_the_card(tmp_path):
    config = from_preset(FakeConfig, "short", epochs=5, lr=0.1)
    record = _write(tmp_path, config=config, preset="short")
    assert record["overrides"] == {"epochs": {"value": 5, "preset": 10}, "lr": {"value": 0.1, "preset": 0.3}}
    words = "preset short; paper loop with augmentation; epochs 5 (preset 10), lr 0.1 (preset 0.3)"
    assert setting(record) == words
    assert f"| {words} |" in (tmp_path / "results.md").read_text()
    assert f"| {words} |" in card_table([record])


def test_tables_round_to_one_decimal_and_show_the_paper_row_only_for_its_own_protocol(tmp_path):
    _write(tmp_path, dataset=IMAGENET)  # the paper's ImageNet probe
    _write(
        tmp_path, config=from_preset(FakeConfig, "short"), preset="small"
    )  # not the paper's protocol: no paper row of its own
    md = (tmp_path / "results.md").read_text()
    assert md.count("| Barlow Twins paper (ResNet-50, 1000 epochs) |") == 1
    assert (
        "| Barlow Twins paper (ResNet-50, 1000 epochs) | preset imagenet; paper loop with augmentation "
        "| paper's | ImageNet | not stated | 73.2 | 91.0 | — |" in md
    )
    assert "| 71.2 | 90.0 | 12.5 |" in md and "71.25" not in md
    card = card_table([json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()])
    assert card.count("| Top-1 | 71.2 | 1 seed | 73.2 |") == 1 and card.count("| Top-1 | 71.2 | 1 seed | — |") == 1


def test_semi_rows_say_which_label_fraction_and_get_that_fractions_paper_row(tmp_path):
    for pct in (1, 10):
        listing = f"{pct}percent.txt"
        labels = {"fraction": pct, "source": "list", "file": listing, "published": listing, "count": pct * 10}
        labels["sha256"] = PUBLISHED_SUBSETS[listing]
        metrics = {"top1": 40.0 + pct, "top5": 70.0}
        _write(tmp_path, protocol="semi", preset="paper", labels=labels, metrics=metrics, dataset=IMAGENET)
    md = (tmp_path / "results.md").read_text()
    assert (
        "1% labels (SimCLR list 1percent.txt); preset paper; paper loop with augmentation "
        "| paper's | ImageNet | not stated | 55.0 | 79.2 |" in md
    )
    assert (
        "10% labels (SimCLR list 10percent.txt); preset paper; paper loop with augmentation "
        "| paper's | ImageNet | not stated | 69.7 | 89.3 |" in md
    )
    assert "| ours: semi | 1% labels (SimCLR list 1percent.txt); preset paper; paper loop with augmentation |" in md
    assert "| ours: semi | 10% labels (SimCLR list 10percent.txt); preset paper; paper loop with augmentation |" in md
    records = read_records([tmp_path / "results.jsonl"])
    assert ["1% labels" in setting(r) for r in records] == [True, False]
    assert "left out" not in md


def test_a_paper_row_stands_only_beside_runs_on_its_data_and_label_subsets_and_a_warning_beside_its_number(tmp_path):
    # guards: eval all's semi on a 3-class folder (33.3 at chance under the paper preset's 20 steps) was printed under
    # the paper's ImageNet rows (55.0 / 69.7), and its "may not fit" warning reached stderr and results.json but not
    # results.md (issue 46, case 11)
    warned = "preset 'paper' assumes 1000 classes (the data has 3); its hyper-parameters may not fit"
    three = {**SPLITS, "name": "d", "test": {"split": "val", "size": 60, "fingerprint": "d"}}
    for pct, top1 in ((1, 46.7), (10, 33.3)):
        labels = {"fraction": pct, "source": "seeded", "seed": 0, "count": 3}
        metrics = {"top1": top1, "top5": 100.0}
        _write(
            tmp_path, protocol="semi", preset="paper", labels=labels, metrics=metrics, dataset=three, warnings=[warned]
        )
    seeded = {"fraction": 10, "source": "seeded", "seed": 0, "count": 12811}
    _write(tmp_path, protocol="semi", preset="paper", labels=seeded, metrics={"top1": 60.0}, dataset=IMAGENET)
    md = (tmp_path / "results.md").read_text()
    records = read_records([tmp_path / "results.jsonl"])
    assert all(r["paper"]["task"].startswith("semi_supervised_") for r in records)  # each follows a paper row...
    assert "| Barlow Twins paper" not in md  # ...that applies to none of them
    assert "| d | 1 seed | 46.7 [1] | 100.0 [1] |" in md and "| d | 1 seed | 33.3 [1] | 100.0 [1] |" in md
    assert f"\n- [1] {warned}\n" in md and "| imagenet | 1 seed | 60.0 |" in md
    assert "- The paper's ImageNet row (1% labels (SimCLR list 1percent.txt); " in md and "the data is d, not" in md
    assert "the labels are a seeded subset, not the paper's 10percent.txt." in md
    assert "| 55.0 |" not in card_table(records) and "| 69.7 |" not in card_table(records)  # the card agrees


def test_transfer_presets_land_in_the_transfer_table_with_their_paper_row():
    base = {
        "weights": {"name": "w", "fingerprint": ""},
        "dataset": {"name": "inat18"},
        "wall_time_s": 1.0,
        "mode": "loop",
        "seed": 0,
    }
    record = {
        **base,
        "protocol": "transfer",
        "preset": "inat18",
        "paper": _paper_row("transfer", "inat18").block(),
        "table": linear.TRANSFER_TABLE.block(),
        "metrics": {"top1": 30.0},
    }
    md = render_table([record])
    lines = md.splitlines()
    assert lines[0] == "### Transfer to other classification tasks (paper Table 3)"
    assert lines[2] == "| Run | Setting | Weights | Data | Seeds | Top-1 | Wall time (s) |"
    assert lines[4].endswith("| iNat18 | not stated | 46.5 | — |")
    assert lines[5].endswith("| inat18 | 1 seed | 30.0 | 1.0 |")


def test_unknown_protocols_get_a_table_of_their_own_metrics():
    md = render_table([{"protocol": "retrieval", "metrics": {"recall_at_1": 12.0}, "wall_time_s": 2.0}])
    assert md.splitlines()[0] == "### retrieval"
    assert md.splitlines()[2] == "| Run | Setting | Weights | Data | Seeds | recall_at_1 | Wall time (s) |"
    assert md.splitlines()[-1].endswith("| 1 seed | 12.0 | 2.0 |")


def test_non_numeric_metrics_are_rejected_naming_them(tmp_path):
    with pytest.raises(ValueError, match="flat dict of numbers"):
        _write(tmp_path, metrics={"top1": {"k20": 1.0}})
    assert not (tmp_path / "results.json").exists()


def test_eval_all_summary_is_read_as_its_records_by_push_and_the_card(tmp_path):
    records = [
        _write(tmp_path / "a"),
        _write(tmp_path / "b", protocol="knn", preset=None, mode="features", metrics={"top1": 50.0}),
    ]
    write_records(tmp_path / "all", records, {"results": records, "wall_time_s": 30.0})
    read = read_records([tmp_path / "all" / "results.json"])
    assert [r["protocol"] for r in read] == ["linear", "knn"]
    assert len(read_records([tmp_path / "all" / "results.jsonl"])) == 2
    with pytest.raises(ValueError, match="without a 'metrics' object"):
        (tmp_path / "bad.json").write_text('{"protocol": "linear"}')
        read_records([tmp_path / "bad.json"])


def test_push_and_save_pretrained_accept_eval_all_results(tmp_path):
    pytest.importorskip("huggingface_hub")
    import torch

    from bt_hub.method.model import BarlowTwins
    from bt_hub.weights import save_pretrained

    records = [
        _write(tmp_path / "a"),
        _write(
            tmp_path / "b",
            protocol="semi",
            preset="paper",
            labels={"fraction": 1, "source": "seeded", "seed": 0, "count": 5},
        ),
    ]
    write_records(tmp_path / "all", records, {"results": records, "wall_time_s": 30.0})
    torch.manual_seed(0)
    folder = save_pretrained(
        BarlowTwins("resnet18", "16-16"),
        tmp_path / "card",
        other_results=[tmp_path / "all" / "results.json"],
        name="bt/card",
    )
    card = (folder / "README.md").read_text()
    unknown = "[unknown architecture, unknown stem, unknown image size]"
    assert (
        f"| semi {unknown} | 1% labels (seeded class-balanced, seed 0); preset paper; paper loop with augmentation "
        "| digits | Top-1 | 71.2 | 1 seed | — |" in card
    )
    assert (
        f"| linear {unknown} | preset imagenet; paper loop with augmentation | digits | Top-1 | 71.2 | 1 seed | — |"
        in card
    )


def test_summary_names_each_run_its_metrics_and_the_files(tmp_path):
    record = _write(tmp_path)
    text = summary_text([record], [tmp_path / "results.json"])
    assert text.splitlines()[0].split() == ["protocol", "setting", "data", "metrics"]
    assert "Top-1 71.2  Top-5 90.0" in text.splitlines()[1] and text.splitlines()[1].startswith("linear ")
    assert text.splitlines()[-1] == f"wrote {tmp_path / 'results.json'}"


def test_seed_free_setting_of_a_record_without_seed_or_holdout():
    # Guards: a record with neither a seed nor a held-out split raised KeyError: 'holdout' (None == None).
    from bt_hub.common.records import seed_free_setting, setting

    record = {"protocol": "knn", "dataset": {"name": "digits", "train_split": "train"}, "labels": {}}
    assert seed_free_setting(record) == setting(record)


def test_a_damaged_history_is_named_before_the_work_and_the_new_record_is_never_lost(
    small_stem_weights, tmp_path, capsys
):
    # guards: a cut-short or edited results.jsonl line made every later eval in the folder do all its work, then
    # fail with rc 2; with a cut-short last line the new record was appended onto it and lost too
    from bt_hub import cli

    out = tmp_path / "knn"
    args = ["eval", "knn", "--weights", str(small_stem_weights), "--data", "synthetic:40", "--image-size", "8"]
    assert cli.main([*args, "--k", "5", "--out", str(out)]) == 0
    history = out / "results.jsonl"
    good = history.read_text()
    history.write_text(good + "not json at all\n" + good[: len(good) // 2])  # line 2 edited, line 3 cut short
    capsys.readouterr()
    assert cli.main([*args, "--k", "5", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if "results.jsonl line 2, 3 is not a results record" in line]
    assert len(warned) == 1 and err.index(warned[0]) < err.index("features train")  # named before the work
    lines = history.read_text().splitlines()
    assert lines[:2] == [good.strip(), "not json at all"] and lines[2] == good[: len(good) // 2]
    assert json.loads(lines[3])["metrics"] == json.loads(good)["metrics"]  # the new record, whole, on its own line
    assert (out / "results.md").read_text().count("| ours: knn |") == 2  # both whole records, not the damaged lines


def test_a_grid_probe_says_so_in_its_setting():
    # guards: a linear result chosen over a grid on validation data read "cached features, no augmentation",
    # like the preset's one recipe
    grid = {"protocol": "linear", "mode": "cached", "preset": "imagenet", "notes": {"search": "grid"}, "metrics": {}}
    fixed = {**grid, "notes": {"search": "fixed"}}
    assert "grid of heads chosen on a validation split" in setting(grid)
    assert "grid" not in setting(fixed)
