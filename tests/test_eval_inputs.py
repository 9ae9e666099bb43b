"""An evaluation scores what it says: at the weights' image size, on verified cached features, with sane kNN flags."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_output import one_sentence
from torch import nn

from bt_hub import cli
from bt_hub.data.datasets import ArrayImageDataset, dataset_fingerprint
from bt_hub.eval.config import EvalWarning
from bt_hub.eval.feature_cache import FeatureCache, cache_problem
from bt_hub.eval.features import extract_features
from bt_hub.method.knn import hit_rates, knn_hits


def _run(argv: list[str], out: Path) -> dict:
    assert cli.main([*argv, "--out", str(out)]) == 0
    return json.loads((out / "results.json").read_text())


@pytest.fixture
def run_folder(small_stem_weights, tmp_path) -> Path:
    """A pretraining run's weights and config.json, pretrained at 8 px."""
    folder = tmp_path / "run"
    folder.mkdir()
    shutil.copy(small_stem_weights, folder / "resnet18.pth")
    config = {"architecture": "resnet18", "small_image_stem": True, "image_size": 8}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# ----------------------------------------------------------------------------- image size (weights' config.json)


def test_eval_scores_at_the_image_size_the_weights_were_pretrained_at(run_folder, tmp_path, capsys):
    """Guards: a run pretrained at 16 px was scored at 224 px without a word."""
    common = ["eval", "knn", "--weights", str(run_folder), "--data", "synthetic:40", "--k", "3"]
    result = _run(common, tmp_path / "a")
    assert result["hyperparameters"]["image_size"] == 8
    assert result["hyperparameters"]["image_size_from"] == "weights config.json"
    assert "warning" not in capsys.readouterr().err
    explicit = _run([*common, "--image-size", "12"], tmp_path / "b")
    assert explicit["hyperparameters"]["image_size"] == 12
    assert explicit["hyperparameters"]["image_size_from"] == "--image-size"
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "warning" in x]
    assert "--image-size 12 differs from the 8 px the weights" in line and "leave --image-size out" in line
    assert "pretrained at (from the weights' config.json);" in line  # the record's source, in the report's words


def test_weights_without_a_config_json_are_scored_at_the_default_size_and_say_so(run_folder, tmp_path):
    from bt_hub.eval.config import eval_image_size
    from bt_hub.weights import load_backbone

    assert eval_image_size(None, None, None, str(run_folder)) == (224, "default")
    assert eval_image_size(16, 16, "weights config.json", "w") == (16, "--image-size")
    (run_folder / "config.json").write_text(json.dumps({"architecture": "resnet18", "image_size": "big"}))
    with pytest.raises(ValueError, match="config.json of weights .*resnet18.pth has image_size 'big'; expected a posi"):
        load_backbone(run_folder)


@pytest.fixture(scope="module")
def run_at_32_px(tmp_path_factory) -> Path:
    """A tiny pretraining run at 32 px (ResNet-18, small stem) that kept steps 2 and 4."""
    run = tmp_path_factory.mktemp("pretrained") / "run"
    flags = ["--data", "synthetic:40", "--arch", "resnet18", "--small-image-stem", "--image-size", "32"]
    flags += ["--projector", "32-32", "--batch-size", "8", "--epochs", "1", "--warmup-epochs", "0"]
    assert cli.main(["pretrain", *flags, "--keep-every", "2", "--probe-max-dim", "0", "--out", str(run)]) == 0
    return run


def test_kept_and_moved_weights_are_scored_at_the_size_their_run_pretrained_at(run_at_32_px, tmp_path, capsys):
    """Guards: a kept step and a backbone.safetensors copied out of its run folder (no config.json beside either)
    were scored at 224 px, "images 224 px (default)", though their run pretrained at 32 px."""
    run_id = json.loads((run_at_32_px / "run.json").read_text())["run_id"]
    moved = tmp_path / "moved.safetensors"
    shutil.copy(run_at_32_px / "backbone.safetensors", moved)
    for weights in (run_at_32_px / "kept" / "step-000002.safetensors", moved):
        capsys.readouterr()
        settings = _run(
            ["eval", "knn", "--weights", str(weights), "--data", "synthetic:40", "--k", "3"], tmp_path / weights.stem
        )["settings"]
        assert (settings["image_size"], settings["image_size_from"]) == (32, "weights metadata")
        assert (settings["arch"], settings["arch_from"], settings["small_image_stem"]) == (
            "resnet18",
            "weights metadata",
            True,
        )
        assert (settings["normalisation_from"], settings["weights_run"]) == ("weights metadata", run_id)
        assert "images 32 px (from the weights' metadata)" in capsys.readouterr().out
    flags = ["--data", "synthetic:40", "--baselines", "pixels", "--protocols", "knn", "--seeds", "1", "--knn-k", "3"]
    cells = _run(["eval", "compare", "--weights", str(run_at_32_px), "--over-steps", *flags], tmp_path / "curve")
    assert {(r["settings"]["image_size"], r["settings"]["image_size_from"]) for r in cells["results"]} == {
        (32, "weights metadata")
    }
    assert "images 32 px (from the weights' metadata)" in (tmp_path / "curve" / "compare.md").read_text()
    explicit = _run(
        ["eval", "knn", "--weights", str(moved), "--data", "synthetic:40", "--k", "3", "--image-size", "16"],
        tmp_path / "x",
    )
    assert (explicit["settings"]["image_size"], explicit["settings"]["image_size_from"]) == (16, "--image-size")


def test_exports_keep_what_the_weights_say_of_their_input(run_at_32_px, tmp_path):
    """Guards: an export of a kept step lost its image size (an hf folder's card and config.json said 224 px)."""
    from bt_hub.method.transforms import input_metadata
    from bt_hub.weights import load_backbone, save_detectron2

    kept = run_at_32_px / "kept" / "step-000004.safetensors"
    run_id = json.loads((run_at_32_px / "run.json").read_text())["run_id"]
    for fmt, out in (("safetensors", tmp_path / "w.safetensors"), ("hf", tmp_path / "hf")):
        assert cli.main(["export", "--weights", str(kept), "--format", fmt, "--out", str(out)]) == 0
        info = load_backbone(out).weights_info
        assert (info["image_size"], info["image_size_from"], info["run_id"]) == (32, "weights metadata", run_id)
        assert info["mean"] == (0.485, 0.456, 0.406) and info["small_image_stem"] is True
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["image_size"] == 32
    assert load_backbone(kept).transforms.crop_size == [32]
    standard = load_backbone(kept).state_dict()  # detectron2 builds a 7x7 stem: a standard-stem ResNet-18 stands in
    standard["conv1.weight"] = torch.zeros(64, 3, 7, 7)
    meta = input_metadata(architecture="resnet18", small_image_stem=False, image_size=48, run_id="r1")
    info = load_backbone(save_detectron2(standard, tmp_path / "d2.pkl", meta)).weights_info
    assert (info["image_size"], info["run_id"], info["architecture_from"]) == (48, "r1", "weights metadata")


# ----------------------------------------------------------------------------- the feature cache


class MeanColour(nn.Module):
    """A 'backbone' whose feature is the per-channel mean; counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x.mean(dim=(2, 3)) * self.scale


def _to_tensor(image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1)


class _Planted:
    """Unpickling this touches a file: proof that a cache file was unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _shuffle_labels(features: Path, labels: Path, tmp: Path) -> None:
    np.save(labels, np.load(labels)[::-1].copy())


def _negate_features(features: Path, labels: Path, tmp: Path) -> None:
    np.save(features, -np.load(features))


def _flip_one_byte(features: Path, labels: Path, tmp: Path) -> None:
    data = bytearray(features.read_bytes())
    data[-3] ^= 1
    features.write_bytes(bytes(data))


def _truncate(features: Path, labels: Path, tmp: Path) -> None:
    features.write_bytes(features.read_bytes()[:-40])


def _delete(features: Path, labels: Path, tmp: Path) -> None:
    features.unlink()


def _pickle_labels(features: Path, labels: Path, tmp: Path) -> None:
    np.save(labels, np.array([_Planted(tmp / "unpickled")] * 10, dtype=object), allow_pickle=True)


def _corrupt_meta(features: Path, labels: Path, tmp: Path) -> None:
    meta = features.with_name(features.name.replace(".features.npy", ".meta.json"))
    meta.write_text("{not json")


TAMPERING = {
    "shuffled labels": (_shuffle_labels, "does not match the sha256"),
    "negated features": (_negate_features, "does not match the sha256"),
    "one byte changed": (_flip_one_byte, "does not match the sha256"),
    "truncated": (_truncate, "bytes, "),
    "deleted": (_delete, "is missing"),
    "pickled labels": (_pickle_labels, ".labels.npy"),
    "meta not JSON": (_corrupt_meta, "is not readable JSON"),
}


@pytest.mark.parametrize("case", list(TAMPERING))
def test_a_tampered_cache_is_recomputed_with_one_warning_never_used(case, tmp_path):
    """Guards: shuffled cached labels took kNN from 100.0 to 2.0, and a truncated file was a numpy traceback."""
    tamper, reason = TAMPERING[case]
    rng = np.random.default_rng(0)
    data = ArrayImageDataset(rng.integers(0, 256, (10, 4, 4, 3), dtype=np.uint8), np.arange(10) % 3, list("abc"))
    net = MeanColour()
    cache = FeatureCache(tmp_path / "cache", "w", dataset_fingerprint(data))
    expected, expected_labels = extract_features(net, data, transform=_to_tensor, batch_size=4, cache=cache)
    expected = np.array(expected)
    (features_path,) = (tmp_path / "cache").glob("*.features.npy")
    labels_path = features_path.with_name(features_path.name.replace(".features", ".labels"))
    tamper(features_path, labels_path, tmp_path)
    calls = net.calls
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        features, labels = extract_features(net, data, transform=_to_tensor, batch_size=4, cache=cache)
    (warning,) = caught
    assert warning.category is EvalWarning and reason in str(warning.message) and "\n" not in str(warning.message)
    assert str(warning.message).endswith("computing the features again")
    assert net.calls > calls  # recomputed, not read
    np.testing.assert_array_equal(np.array(features), expected)
    assert labels.tolist() == expected_labels.tolist()
    assert not (tmp_path / "unpickled").exists()
    meta = next((tmp_path / "cache").glob("*.meta.json"))
    assert cache_problem(meta, json.loads(meta.read_text())["key"]) is None  # the repaired cache verifies


def test_the_record_says_whether_features_were_cached_or_computed(run_folder, tmp_path):
    """Guards: results did not say that cached features were used."""
    common = ["eval", "knn", "--weights", str(run_folder), "--data", "synthetic:40", "--k", "3"]
    common += ["--cache-dir", str(tmp_path / "cache")]
    first = _run(common, tmp_path / "a")
    assert first["hyperparameters"]["features"] == {"train": "computed", "test": "computed"}
    second = _run(common, tmp_path / "b")
    keys = {p.name.split(".")[0] for p in (tmp_path / "cache").glob("*.meta.json")}
    assert {v.split()[0] for v in second["hyperparameters"]["features"].values()} == {"cached"}
    assert {v.split()[1] for v in second["hyperparameters"]["features"].values()} == keys
    assert second["metrics"] == first["metrics"]


# ----------------------------------------------------------------------------- kNN flags and degenerate data


def test_a_tiny_temperature_is_the_nearest_neighbours_vote_not_overflow():
    """Guards: --temperature 1e-30 took kNN top-1 from 92.3 to 46.2 (exp overflowed to inf)."""
    g = torch.Generator().manual_seed(0)
    sims = torch.rand(50, 10, generator=g).sort(dim=1, descending=True).values
    idx = torch.randint(0, 40, (50, 10), generator=g)
    train_y, test_y = torch.randint(0, 4, (40,), generator=g), torch.randint(0, 4, (50,), generator=g)
    nearest = hit_rates(knn_hits(sims, idx, train_y, test_y, 1, 0.07, 4))
    assert hit_rates(knn_hits(sims, idx, train_y, test_y, 10, 1e-30, 4))["top1"] == nearest["top1"]
    votes = torch.nn.functional.one_hot(train_y[idx], 4).sum(1).double() + torch.arange(4) * -1e-3  # ties: low class
    majority = 100.0 * (votes.argmax(1) == test_y).double().mean().item()
    assert hit_rates(knn_hits(sims, idx, train_y, test_y, 10, 1e30, 4))["top1"] == pytest.approx(majority)


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan"])
def test_a_temperature_that_is_not_positive_and_finite_is_refused_in_one_line(value, tmp_path, capsys):
    assert cli.main(["eval", "knn", "--weights", "x.pth", "--temperature", value, "--out", str(tmp_path / "o")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--temperature must be a positive finite number" in line


def test_k_above_the_training_set_is_scored_and_named_with_the_k_used(run_folder, tmp_path, capsys):
    """Guards: --k 100000 was reported as top1_k100000 but computed with 51 neighbours."""
    result = _run(
        ["eval", "knn", "--weights", str(run_folder), "--data", "synthetic:40", "--k", "3", "100000"], tmp_path / "a"
    )
    train_size = result["dataset"]["train"]["size"]
    assert set(result["metrics"]) == {
        "top1",
        "top5",
        "top1_k3",
        "top5_k3",
        f"top1_k{train_size}",
        f"top5_k{train_size}",
    }
    assert result["notes"]["neighbours_used"] == {"3": 3, "100000": train_size}
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "warning" in x]
    assert f"--k 100000 exceeds the {train_size} training images: scored with k={train_size}" in line
    assert result["warnings"] == [line.split("warning: ", 1)[1]]


def test_a_one_class_dataset_is_refused_in_one_sentence(run_folder, image_folder, tmp_path, capsys):
    """Guards: a dataset of one class scored 100% top-1."""
    data = image_folder(tmp_path / "data", classes=("cats",), per_class=4)
    argv = ["eval", "knn", "--weights", str(run_folder), "--data", str(data), "--k", "1"]
    assert cli.main([*argv, "--out", str(tmp_path / "o")]) == 2
    line = one_sentence(capsys.readouterr().err)  # after the settings: --precision auto may be timed first
    assert "every training image is of one class (cats)" in line and "accuracy means nothing" in line


def test_a_dataset_too_small_to_split_names_the_data_flag(run_folder, tmp_path, capsys):
    """Guards: synthetic:1 failed with 'cannot extract features from an empty dataset'."""
    argv = ["eval", "knn", "--weights", str(run_folder), "--data", "synthetic:1", "--out", str(tmp_path / "o")]
    assert cli.main(argv) == 2
    line = one_sentence(capsys.readouterr().err)
    assert "--data synthetic:1 gives 1 training and 0 val images" in line and "give a larger N" in line
