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
        small_stem_weights,
        baselines=["pixels"],
        protocols=["knn"],
        seeds=2,
        knn={"k": [5]},
        out=tmp_path / "cmp",
        **SMALL,
    )
    rows = {row["representation"]: row for row in result.rows}
    assert set(rows) == {small_stem_weights.name, "pixels"} and rows["pixels"]["baseline"] is True
    verdict = rows[small_stem_weights.name]["kNN better"]
    assert len(rows["pixels"]["kNN per seed"]) == 2 and verdict in (True, False, None)  # None: no verdict
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
    by_metric: dict[str, list[float]] = {}  # kNN's and RankMe's records (compare scores RankMe beside kNN)
    for record in ours:
        for metric, value in record["metrics"].items():
            by_metric.setdefault(metric, []).append(value)
    means = {round(float(np.mean(values)), 1) for values in by_metric.values()}
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
    assert cli.main(["embed", *args, "--out", str(tmp_path / "emb")]) == 2  # Guards: it said "to score ..."
    assert "pass --splits train to embed the training images alone" in capsys.readouterr().err
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


OUT = "out"  # every bad call below is given out=OUT inside an empty folder: nothing may appear there
BAD_CALLS = [  # (function, positional arguments, keyword arguments, exception, what the message must say)
    ("evaluate", (None,), {}, TypeError, "weights must be a string, got None"),
    ("evaluate", (3,), {}, TypeError, "weights must be a string, got 3"),
    ("evaluate", ("W",), {"data": None}, TypeError, "data must be a string, got None"),
    ("evaluate", ("W",), {"protocol": ["knn"]}, ValueError, "protocol must be one of knn, linear"),
    ("evaluate", ("W",), {"image_size": "16"}, TypeError, "image_size must be an integer, got '16' (str)"),
    ("evaluate", ("W",), {"image_size": 8.5}, TypeError, "image_size must be an integer, got 8.5"),
    ("evaluate", ("W",), {"k": 20}, TypeError, "k must be a list of integers, got 20"),
    ("evaluate", ("W",), {"k": ["20"]}, TypeError, "each item of k must be an integer, got '20'"),
    ("evaluate", ("W",), {"k": [0] * 200_000}, ValueError, "got [0, 0, 0, 0, 0, 0, ...] (list of 200000 items)"),
    ("evaluate", ("W",), {"temprature": 0.1}, TypeError, "temprature is not a setting of KnnConfig; did you mean"),
    ("evaluate", ("W",), {"out": 5}, TypeError, "out must be a string, got 5"),
    ("evaluate", ("W",), {"preset": 3}, TypeError, "preset must be the name of a preset (a string), got 3"),
    ("evaluate", ("W",), {"device": 0}, TypeError, "device must be a string, got 0"),
    ("evaluate", ("W",), {"seed": "1"}, TypeError, "seed must be an integer, got '1'"),
    ("evaluate", ("W",), {"num_workers": "2"}, TypeError, "num_workers must be an integer, got '2'"),
    ("evaluate", ("W",), {"batch_size": None}, TypeError, "batch_size must be an integer, got None"),
    ("evaluate", ("W",), {"holdout": "0.2"}, TypeError, "holdout must be a number, got '0.2'"),
    ("evaluate", ("W",), {"allow_non_finite": "yes"}, TypeError, "allow_non_finite must be True or False"),
    ("evaluate", ("W",), {"precision": "fp64"}, ValueError, "precision must be one of 'auto', 'fp32'"),
    ("evaluate", ("W",), {"arch": "resnet9"}, ValueError, "arch must be one of 'resnet18'"),
    ("evaluate", ("W",), {"cache_dir": 3}, TypeError, "cache_dir must be a string, got 3"),
    ("evaluate", ("W",), {"protocol": "linear", "epochs": "2"}, TypeError, "epochs must be an integer, got '2'"),
    ("compare", (None,), {}, TypeError, "weights must be a list of strings, got None"),
    ("compare", ([None],), {}, TypeError, "each item of weights must be a string, got None"),
    ("compare", ("W",), {"baselines": "pixels"}, TypeError, "baselines must be a list of strings, got the string"),
    ("compare", ("W",), {"protocols": "knn"}, TypeError, "protocols must be a list of strings, got the string 'knn'"),
    ("compare", ("W",), {"seeds": "3"}, TypeError, "seeds must be an integer, got '3'"),
    ("compare", ("W",), {"seeds": 2.5}, TypeError, "seeds must be an integer, got 2.5"),
    ("compare", ("W",), {"knn": {"k": 5}}, TypeError, "knn.k must be a list of integers, got 5"),
    ("embed", ("W",), {"splits": "train"}, TypeError, "splits must be a list of strings, got the string 'train'"),
    ("embed", ("W",), {"splits": None}, TypeError, "splits must be a list of strings, got None"),
    ("embed", (None,), {}, TypeError, "weights must be a string, got None"),
    ("embed", ("W",), {"format": 3}, TypeError, "format must be a string, got 3"),
    ("embed", ("W",), {"format": "hdf5"}, ValueError, "--format must be npy or parquet, got 'hdf5'"),
    (
        "embed",
        ("W",),
        {"decode": "gpu"},
        ValueError,
        "one of 'auto', 'device', 'nvimgcodec', 'pil', 'workers', got 'gpu'",
    ),
]


@pytest.mark.parametrize(("function", "args", "kwargs", "error", "said"), BAD_CALLS, ids=lambda v: repr(v)[:30])
def test_a_bad_api_argument_is_one_sentence_naming_it_and_nothing_is_written(
    function, args, kwargs, error, said, small_stem_weights, tmp_path, monkeypatch
):
    """Guards: evaluate(None) read the weights 'None', compare(None) raised "'NoneType' object is not iterable",
    image_size='16' "'<=' not supported", splits='train' "got t r a i n", and out=5 made a folder "5"."""
    monkeypatch.chdir(tmp_path)
    args = tuple(str(small_stem_weights) if a == "W" else a for a in args)
    with pytest.raises(error) as err:
        getattr(bt_hub.eval, function)(*args, **{"data": "synthetic:40", "out": OUT, **kwargs})
    message = str(err.value)
    assert said in message and "\n" not in message, message
    assert list(tmp_path.iterdir()) == []


def test_paths_tuples_and_numpy_numbers_are_taken_where_strings_lists_and_numbers_are_expected(
    small_stem_weights, tmp_path
):
    settings = {**SMALL, "image_size": np.int64(8), "temperature": np.float32(0.07)}
    result = bt_hub.eval.evaluate(small_stem_weights, protocol="knn", k=(5,), cache_dir=tmp_path / "cache", **settings)
    hyper = result.records[0]["hyperparameters"]
    assert (hyper["k"], hyper["image_size"]) == ([5], 8) and (tmp_path / "cache").is_dir()
