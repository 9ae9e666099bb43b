"""The evaluation runner: one weights read per run, settings resolved and recorded, the user's config untouched."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest

import bt_hub.weights as bt_weights
from bt_hub import cli
from bt_hub.common.config import from_preset
from bt_hub.eval import comparison, knn, runner, suite
from bt_hub.eval.config import load_weights
from bt_hub.eval.embedding import EmbedConfig
from bt_hub.eval.linear import LinearConfig, TransferConfig
from bt_hub.eval.protocols import get_protocol
from bt_hub.eval.semi_supervised import SemiSupervisedConfig
from bt_hub.eval.suite import SuiteConfig
from bt_hub.eval.voc07_svm import Voc07SvmConfig

SMALL = ["--data", "synthetic:40", "--image-size", "8", "--batch-size", "16"]


def test_the_runner_never_writes_into_the_users_config_and_records_what_it_resolved(small_stem_weights, tmp_path):
    # guards: load_eval_backbone wrote the image size and precision back into the config, and the record
    # snapshotted the mutated config (so a config reused for a second run silently carried the first one's values)
    config = knn.KnnConfig(weights=str(small_stem_weights), data="synthetic:40", batch_size=16, out=str(tmp_path / "k"))
    before = dataclasses.asdict(config)
    record = runner.run_protocol(get_protocol("knn"), config)
    assert dataclasses.asdict(config) == before and config.image_size is None and config.precision == "auto"
    settings = record["settings"]
    assert settings["arch"] == "resnet18" and settings["small_image_stem"] is True
    assert settings["image_size"] == 224 and settings["image_size_from"] == "default"
    assert settings["precision"] in ("fp32", "bf16") and record["hyperparameters"]["precision"] == settings["precision"]
    assert settings["precision_from"].startswith("auto: a ResNet-18 step took")  # measured, both times said
    assert record["weights"]["fingerprint"] == load_weights(str(small_stem_weights)).sha256


def test_eval_all_reads_and_hashes_the_weights_once_for_every_protocol(small_stem_weights, tmp_path, monkeypatch):
    # guards: every protocol of eval all loaded the weights again and hashed the file a second time (8+ reads)
    reads = []
    real = bt_weights.load_backbone
    monkeypatch.setattr(bt_weights, "load_backbone", lambda *a, **k: reads.append(a[0]) or real(*a, **k))
    config = from_preset(
        SuiteConfig,
        weights=str(small_stem_weights),
        data="synthetic:40",
        image_size=8,
        batch_size=16,
        fractions=[10],
        linear={"epochs": 2},
        semi={"epochs": 1},
        out=str(tmp_path / "all"),
    )
    summary = suite.run_suite(config)
    assert len(reads) == 1
    records = summary["results"]
    assert [r["protocol"] for r in records] == ["knn", "linear", "semi", "rankme"]
    assert len({r["weights"]["fingerprint"] for r in records}) == 1
    assert all(r["settings"]["image_size"] == 8 for r in records)


def test_eval_all_passes_its_protocols_only_the_shared_flags_they_read(small_stem_weights, tmp_path):
    # guards: a shared flag that fine-tuning refuses (cache, decode, CPU bf16) must never break eval all
    config = from_preset(
        SuiteConfig,
        weights=str(small_stem_weights),
        data="synthetic:40",
        image_size=8,
        batch_size=16,
        fractions=[10],
        linear={"epochs": 1},
        semi={"epochs": 1},
        cache_dtype="float16",
        decode="workers",
        precision="bf16",
        out=str(tmp_path / "all"),
    )
    records = suite.run_suite(config)["results"]
    assert [r["settings"]["decode"] for r in records] == ["workers", "workers", "workers", "workers"]
    assert records[0]["hyperparameters"]["cache_dtype"] == "float16"


def test_eval_all_fine_tunes_on_simclrs_published_lists_from_subset_dir(small_stem_weights, image_folder, tmp_path):
    # Guards eval all's semi runs from --subset-dir, which the suite configures itself (suite._runs): one run per
    # --fractions, each on its N percent.txt, recorded as that list.
    root = image_folder(tmp_path / "data", classes=("a", "b"), per_class=6, size=8)
    lists = tmp_path / "lists"
    lists.mkdir()
    (lists / "10percent.txt").write_text("a_0.png\nb_1.png\n")
    config = from_preset(
        SuiteConfig,
        weights=str(small_stem_weights),
        data=str(root),
        image_size=8,
        batch_size=4,
        fractions=[10],
        subset_dir=str(lists),
        linear={"epochs": 1},
        semi={"epochs": 1},
        precision="fp32",
        out=str(tmp_path / "all"),
    )
    records = suite.run_suite(config)["results"]
    semi = records[2]
    assert [r["protocol"] for r in records] == ["knn", "linear", "semi", "rankme"]
    assert (semi["labels"]["source"], semi["labels"]["file"], semi["labels"]["count"]) == ("list", "10percent.txt", 2)
    assert (tmp_path / "all" / "semi_10percent" / "results.json").is_file()


def test_eval_all_run_again_skips_the_protocols_finished_with_the_same_settings(
    small_stem_weights, tmp_path, monkeypatch, capsys
):
    # guards: after a SIGTERM that stopped eval all after its kNN run, each rerun scored kNN again and appended
    # another record (1, 2, then 3); same settings are the record's (weights sha256, settings, hyper-parameters)
    from bt_hub.common.signals import Terminated
    from bt_hub.data import measured, precision
    from bt_hub.eval import linear
    from bt_hub.eval.report import load_results

    monkeypatch.setattr(measured, "cache_file", lambda name: tmp_path / "precision.json")  # measured now, then cached
    monkeypatch.setattr(precision, "measure_cpu", lambda: {"fp32": 1.0, "bf16": 2.0})
    out = tmp_path / "all"
    argv = ["eval", "all", "--weights", str(small_stem_weights), *SMALL, "--fractions", "--linear-epochs", "1"]
    argv += ["--knn-k", "5", "--out", str(out)]
    score = linear.score
    monkeypatch.setattr(linear, "score", lambda run: (_ for _ in ()).throw(Terminated()))
    assert cli.main(argv) == 143
    monkeypatch.setattr(linear, "score", score)

    def counts() -> list[int]:
        return [len(load_results(folder)[0]) for folder in (out / "knn", out / "linear", out)]

    skipped = "finished before from the same inputs (weights, data, settings); skipped (--rerun runs it again)"
    assert cli.main(argv) == 0 and counts() == [1, 1, 3]  # kNN kept; linear and RankMe scored
    assert f"bt-hub eval all: knn in {out / 'knn'} {skipped}" in capsys.readouterr().err.splitlines()
    assert cli.main(argv) == 0 and counts() == [1, 1, 3]
    assert [line.split(" in ")[0] for line in capsys.readouterr().err.splitlines() if skipped in line] == [
        "bt-hub eval all: knn",
        "bt-hub eval all: linear",
        "bt-hub eval all: rankme",
    ]
    assert len(json.loads((out / "results.json").read_text())["results"]) == 3
    assert cli.main([*argv, "--knn-k", "7"]) == 0 and counts() == [2, 1, 4]  # a changed setting runs again
    said = f"bt-hub eval all: knn in {out / 'knn'} was scored with other settings (hyper-parameters changed (k))"
    assert f"{said}; running it again" in capsys.readouterr().err.splitlines()
    assert cli.main([*argv, "--rerun"]) == 0 and counts() == [3, 2, 7]


@pytest.mark.parametrize("change", ["replaced in place", "a class added", "a class removed"])
def test_eval_all_scores_a_folder_changed_in_place_again_saying_which_split_changed(
    small_stem_weights, tmp_path, image_folder, capsys, change
):
    # guards: eval all compared the data by its path alone, so a folder whose images were replaced under the same
    # names (or that gained or lost a class) printed the old top-1 as "finished before" with exit 0 (43.0 vs 3.0)
    data = image_folder(tmp_path / "data", classes=("a", "b", "c"), per_class=4, seed=0)
    out = tmp_path / "all"
    argv = ["eval", "all", "--weights", str(small_stem_weights), "--data", str(data), "--image-size", "8"]
    argv += ["--batch-size", "16", "--fractions", "--linear.epochs", "1", "--knn.k", "3", "--out", str(out)]
    assert cli.main(argv) == 0
    capsys.readouterr()
    if change == "replaced in place":  # other pixels under the same names, sizes and mtimes
        fresh = image_folder(tmp_path / "other", classes=("a", "b", "c"), per_class=4, seed=1)
        for path in sorted((data / "train").rglob("*.png")):
            stat = path.stat()
            shutil.copyfile(fresh / path.relative_to(data), path)
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    elif change == "a class added":
        image_folder(data, classes=("d",), per_class=4, splits=("train",), seed=2)
    else:
        shutil.rmtree(data / "train" / "c")
        shutil.rmtree(data / "val" / "c")
    fresh_out = tmp_path / "fresh"
    assert cli.main([*argv[:-1], str(fresh_out)]) == 0
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    for name in ("knn", "linear"):
        said = f"bt-hub eval all: {name} in {out / name} was scored on other data (train split changed); running it"
        assert said in err
        latest, expected = (json.loads((o / name / "results.json").read_text()) for o in (out, fresh_out))
        assert latest["metrics"] == expected["metrics"] and latest["dataset"]["train"] == expected["dataset"]["train"]


@pytest.mark.parametrize(
    ("cls", "flags", "flag"),
    [
        (knn.KnnConfig, {"cache_dtype": "float16"}, "--cache-dtype"),
        (knn.KnnConfig, {"holdout": 0.2, "test_split": "test"}, "--test-split"),
        (LinearConfig, {"schedule": "cosine", "milestones": [3]}, "--milestones"),
        (TransferConfig, {"schedule": "cosine", "gamma": 0.5}, "--gamma"),
        (LinearConfig, {"search": "fixed", "cache_dir": "c"}, "--cache-dir"),
        (LinearConfig, {"lr": 0.1, "precision": "bf16"}, "--precision"),
        (SemiSupervisedConfig, {"cache_dir": "c"}, "--cache-dir"),
        (SemiSupervisedConfig, {"cache_dtype": "float16"}, "--cache-dtype"),
        (SemiSupervisedConfig, {"decode": "device"}, "--decode"),
        (SemiSupervisedConfig, {"precision": "bf16"}, "--precision"),
        (SemiSupervisedConfig, {"preset": "reference", "milestones": [3]}, "--milestones"),
        (Voc07SvmConfig, {"data": "voc", "decode": "device"}, "--decode"),
        (Voc07SvmConfig, {"data": "voc", "holdout": 0.2}, "--holdout"),
        (SuiteConfig, {"fractions": [], "semi": {"epochs": 2}}, "--semi.epochs"),
        (SuiteConfig, {"fractions": [], "semi": {"preset": "small"}}, "--semi.preset"),
        (SuiteConfig, {"out": None, "cache_dtype": "float16"}, "--cache-dtype"),
        (SuiteConfig, {"out": None, "rerun": True}, "--rerun"),
        (comparison.CompareConfig, {"protocols": ["knn"], "fractions": [5]}, "--fractions"),
        (comparison.CompareConfig, {"protocols": ["knn"], "semi": {"epochs": 2}}, "--semi.epochs"),
        (comparison.CompareConfig, {"protocols": ["knn"], "linear": {"lr_grid": [0.1]}}, "--linear.lr-grid"),
        (
            comparison.CompareConfig,
            {"protocols": ["semi"], "baselines": ["random-init"], "linear": {"val_fraction": 0.3}},
            "--linear.val",
        ),
        (comparison.CompareConfig, {"protocols": ["linear"], "knn": {"k": [5]}}, "--knn.k"),
        (comparison.CompareConfig, {"semi": {"preset": "paper"}}, "--semi.preset"),
        (comparison.CompareConfig, {"supervised_epochs": 2}, "--supervised-epochs"),
        (comparison.CompareConfig, {"semi": {"min_steps": 9}}, "--semi.min-steps"),
        (EmbedConfig, {"splits": ["train"], "test_split": "test"}, "--test-split"),
        (EmbedConfig, {"out": None, "cache_dtype": "float16"}, "--cache-dtype"),
    ],
)
def test_a_flag_the_run_would_not_read_is_refused_naming_it(cls, flags, flag, tmp_path):
    # guards: these flags were accepted, ignored by the run, and recorded as if they had applied
    flags = {"out": str(tmp_path / "o"), **flags}
    weights = ["w"] if cls is comparison.CompareConfig else "w"
    with pytest.raises(ValueError, match=f"^{flag}.*; leave it out$"):
        from_preset(cls, flags.pop("preset", None), weights=weights, **flags)


@pytest.mark.parametrize(
    ("cls", "flags"),
    [
        (knn.KnnConfig, {"cache_dtype": "float16", "cache_dir": "c"}),
        (LinearConfig, {"search": "fixed", "cached": True, "cache_dir": "c", "precision": "bf16"}),
        (TransferConfig, {"cache_dir": "c"}),
        (SemiSupervisedConfig, {"schedule": "cosine", "precision": "fp32"}),
        (SuiteConfig, {"fractions": [], "preset": "small", "cache_dtype": "float16"}),
        (comparison.CompareConfig, {"protocols": ["semi"], "baselines": ["pixels"], "linear": {"lr_grid": [0.1]}}),
        (comparison.CompareConfig, {"baselines": ["supervised"], "semi": {"preset": "paper"}, "supervised_epochs": 2}),
        (EmbedConfig, {"splits": ["test"], "test_split": "test", "cache_dtype": "float16"}),
    ],
)
def test_a_flag_the_run_reads_is_accepted(cls, flags, tmp_path):
    flags = {"out": str(tmp_path / "o"), **flags}
    weights = ["w"] if cls is comparison.CompareConfig else "w"
    from_preset(cls, flags.pop("preset", None), weights=weights, **flags)


def test_a_failed_evaluation_leaves_no_folder_behind(tmp_path):
    out = tmp_path / "out"
    assert cli.main(["eval", "knn", "--weights", str(tmp_path / "nope.pth"), "--out", str(out)]) == 2
    assert not out.exists()


def test_two_weights_that_share_a_base_name_are_two_rows_with_their_own_scores(seeded_weights, tmp_path):
    # guards: eval compare keyed rows by base name, so the second 'backbone.pth' was never evaluated and its
    # record carried the first one's score beside its own sha256
    a, b = tmp_path / "a" / "w.pth", tmp_path / "b" / "w.pth"
    a.parent.mkdir(), b.parent.mkdir()
    shutil.copy(seeded_weights("resnet18", seed=1, small_image_stem=True), a)
    shutil.copy(seeded_weights("resnet18", seed=2, small_image_stem=True), b)
    out = tmp_path / "cmp"
    args = ["eval", "compare", "--weights", str(a), str(b), "--baselines", "pixels", "--protocols", "knn"]
    assert cli.main([*args, "--seeds", "1", "--knn-k", "5", *SMALL, "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    rows = {r["notes"]["compare"]["row"]: r for r in records if r["protocol"] == "knn"}  # not RankMe's beside it
    weights_rows = [name for name in rows if name != "pixels"]
    assert len(weights_rows) == 2 and weights_rows[0] != weights_rows[1]
    assert {rows[n]["weights"]["fingerprint"] for n in weights_rows} == {load_weights(str(p)).sha256 for p in (a, b)}
    for path in (a, b):
        alone = runner.run_protocol(
            get_protocol("knn"),
            knn.KnnConfig(
                weights=str(path), data="synthetic:40", image_size=8, batch_size=16, k=[5], out=None, threads=0
            ),
        )
        row = next(n for n in weights_rows if rows[n]["weights"]["fingerprint"] == alone["weights"]["fingerprint"])
        assert rows[row]["metrics"]["top1"] == pytest.approx(alone["metrics"]["top1"])


def test_the_same_weights_twice_are_refused_in_one_sentence(small_stem_weights, tmp_path):
    copy = tmp_path / "copy.pth"
    shutil.copy(small_stem_weights, copy)
    config = comparison.CompareConfig(
        weights=[str(small_stem_weights), str(copy)], data="synthetic:40", image_size=8, out=None, seeds=1
    )
    with pytest.raises(ValueError, match="are the same weights"):
        comparison.compare_and_write(config)


@pytest.mark.parametrize(
    ("flags", "search"),
    [({"lr": 0.1}, "fixed"), ({"lr_grid": [0.1, 1.0]}, "grid"), ({"flip": False}, "fixed"), ({}, "auto")],
)
def test_a_flag_of_one_search_switches_auto_to_it(flags, search, tmp_path):
    # guards: eval linear --lr X under the default grid search trained with the grid's LRs and recorded "lr X"
    assert LinearConfig(weights="w", out=str(tmp_path / "o"), **flags).search == search


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"search": "grid", "lr": 0.1}, "--lr apply to the fixed recipe"),
        ({"search": "fixed", "val_fraction": 0.3}, "--val-fraction apply to --search grid only"),
        ({"lr": 0.1, "lr_grid": [1.0]}, "pass --search fixed or --search grid"),
        ({"search": "fixed", "cached": True, "crop_scale_min": 0.5}, "which --cached skips"),
    ],
)
def test_a_flag_the_chosen_search_would_ignore_is_refused(flags, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        LinearConfig(weights="w", out=str(tmp_path / "o"), **flags)


def test_compare_cells_without_spread_say_so(small_stem_weights, tmp_path, capsys):
    out = tmp_path / "cmp"
    args = ["eval", "compare", "--weights", str(small_stem_weights), "--baselines", "pixels", "--protocols", "knn"]
    assert cli.main([*args, "--seeds", "2", "--knn-k", "5", *SMALL, "--out", str(out)]) == 0
    # guards: compare was silent while it trained its heads; its cells now report progress
    err = capsys.readouterr().err
    assert "compare: 8/8 cell (100%)" in err  # 2 rows x 2 seeds x (kNN, RankMe)
    # guards: after the features' last line nothing was said for the minutes a cell took; each cell is announced
    assert "compare: next: kNN of pixels, seed 0: knn, weighted kNN on L2-normalised features" in err
    table = (out / "compare.md").read_text()
    assert "± 0.0" not in table and "(deterministic)" in table
    assert (
        "- network: resnet18 (from the weights' keys), small-image stem (3x3, no max-pool) (from the weights' keys); "
        "images 8 px (from --image-size); ImageNet mean/std (default)"
    ) in table
    assert "kNN: k = 5, T = 0.07" in table and "pretraining unknown" in table
    assert np.isfinite(json.loads((out / "results.json").read_text())["results"][0]["metrics"]["top1"])
