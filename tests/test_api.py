"""The Python API (bt_hub.eval.evaluate / compare / embed) and bt-hub embed: results as objects, files with out=."""

from __future__ import annotations

import csv
import json
import os

import numpy as np
import pytest
import yaml

import bt_hub.eval
from bt_hub import cli
from bt_hub.weights.export import ExportConfig, export

SMALL = {"data": "synthetic:40", "image_size": 8, "batch_size": 16}


def test_evaluate_returns_records_and_rows_and_writes_nothing_without_out(small_stem_weights, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = bt_hub.eval.evaluate(small_stem_weights, protocol="knn", k=[5], **SMALL)
    assert list(tmp_path.iterdir()) == [] and result.out is None
    (row,) = result.rows
    assert (row["protocol"], row["arch"], row["small_image_stem"], row["image_size"]) == ("knn", "resnet18", True, 8)
    assert row["top1"] == result.records[0]["metrics"]["top1"] and "Top-1" in str(result)
    pandas = pytest.importorskip("pandas")
    assert isinstance(result.to_pandas(), pandas.DataFrame)


def test_evaluate_with_out_writes_the_same_record_as_the_cli(small_stem_weights, tmp_path):
    api = bt_hub.eval.evaluate(small_stem_weights, protocol="knn", k=[5], out=tmp_path / "api", **SMALL)
    args = ["eval", "knn", "--weights", str(small_stem_weights), "--k", "5", "--data", "synthetic:40"]
    assert cli.main([*args, "--image-size", "8", "--batch-size", "16", "--out", str(tmp_path / "cli")]) == 0
    written = json.loads((tmp_path / "cli" / "results.json").read_text())
    assert written["metrics"] == api.records[0]["metrics"] and written["settings"] == api.records[0]["settings"]


def test_compare_rows_have_mean_std_per_column_and_the_card_never_takes_a_baseline(small_stem_weights, tmp_path):
    # guards: export --results <compare>/results.json published the pixel and random-init rows as the model's own
    result = bt_hub.eval.compare(
        small_stem_weights, baselines=["pixels"], protocols=["knn"], seeds=2, knn_k=5, out=tmp_path / "cmp", **SMALL
    )
    rows = {row["representation"]: row for row in result.rows}
    assert set(rows) == {small_stem_weights.name, "pixels"} and rows["pixels"]["baseline"] is True
    assert len(rows["pixels"]["kNN per seed"]) == 2 and rows[small_stem_weights.name]["kNN better"] in (True, False)
    card = export(
        ExportConfig(
            weights=str(small_stem_weights),
            format="hf",
            out=str(tmp_path / "hf"),
            results=[str(tmp_path / "cmp" / "results.json")],
        )
    )
    readme = (card / "README.md").read_text()
    index = yaml.safe_load(readme.split("---")[1])["model-index"]
    published = {m["value"] for entry in index for result in entry["results"] for m in result["metrics"]}
    ours = [r for r in result.records if r["weights"]["name"] != "pixels"]
    means = {round(float(np.mean([r["metrics"][k] for r in ours])), 1) for k in ours[0]["metrics"]}
    assert published and published <= means and "Baselines, for comparison" in readme


def test_bt_hub_eval_compare_is_the_function_and_the_module_is_comparison():
    from bt_hub.eval import comparison

    assert callable(bt_hub.eval.compare) and bt_hub.eval.compare.__module__ == "bt_hub.eval.api"
    assert comparison.run.__module__ == "bt_hub.eval.comparison"


def test_embed_writes_features_and_an_index_of_files_in_dataset_order(small_stem_weights, image_folder, tmp_path):
    root = image_folder(tmp_path / "data", classes=("cat", "dog"), per_class=3, size=16)
    out = tmp_path / "emb"
    args = ["embed", "--weights", str(small_stem_weights), "--data", str(root), "--image-size", "16"]
    assert cli.main([*args, "--out", str(out)]) == 0
    train = np.load(out / "train.npy")
    with open(out / "index.csv", newline="") as f:
        index = list(csv.DictReader(f))
    assert train.shape == (6, 512) and len(index) == 12
    first = index[0]
    assert first["split"] == "train" and os.path.basename(first["path"]) == "cat_0.png" and first["class"] == "cat"
    api = bt_hub.eval.embed(small_stem_weights, root, image_size=16, splits=["train"])
    np.testing.assert_allclose(api.arrays["train"][0], train, rtol=1e-5, atol=1e-5)
    record = json.loads((out / "embed.json").read_text())
    assert record["settings"]["image_size"] == 16 and record["notes"]["rows"] == {"train": 6, "test": 6}


def test_embed_takes_a_flat_folder_of_one_class_with_splits_train(small_stem_weights, image_folder, tmp_path, capsys):
    """Guards: embed ("any data") refused one class (no accuracy to mean anything) and a folder without val/."""
    root = image_folder(tmp_path / "photos", classes=("all",), per_class=3, size=16, splits=())
    args = ["--weights", str(small_stem_weights), "--data", str(root), "--image-size", "16"]
    assert cli.main(["embed", *args, "--splits", "train", "--out", str(tmp_path / "emb")]) == 0
    assert np.load(tmp_path / "emb" / "train.npy").shape == (3, 512)
    assert cli.main(["eval", "knn", *args, "--holdout", "0.4", "--out", str(tmp_path / "knn")]) == 2
    assert "every training image is of one class (all)" in capsys.readouterr().err  # scoring still refuses it


def test_embed_reuses_the_features_of_a_split_done_before_an_interruption(small_stem_weights, tmp_path):
    out = tmp_path / "emb"
    args = ["embed", "--weights", str(small_stem_weights), "--data", "synthetic:40", "--image-size", "8"]
    assert cli.main([*args, "--splits", "train", "--out", str(out)]) == 0
    assert cli.main([*args, "--out", str(out)]) == 0
    used = json.loads((out / "embed.json").read_text())["hyperparameters"]["features"]
    assert used["train"].startswith("cached") and used["test"] == "computed"


def test_embed_parquet_holds_the_index_and_the_features(small_stem_weights, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    out = tmp_path / "emb"
    args = ["embed", "--weights", str(small_stem_weights), "--data", "synthetic:40", "--image-size", "8"]
    assert cli.main([*args, "--format", "parquet", "--out", str(out)]) == 0
    table = pq.read_table(out / "embeddings.parquet")
    assert table.column_names == ["split", "row", "path", "label", "class", "features"]
    features = np.stack(table.column("features").to_numpy(zero_copy_only=False))
    assert features.shape[1] == 512 and table.num_rows == features.shape[0]
