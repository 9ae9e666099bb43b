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

from bt_hub.common.files import file_sha256  # noqa: E402
from bt_hub.common.records import card_table  # noqa: E402
from bt_hub.common.runs import claim_run_dir  # noqa: E402
from bt_hub.eval import linear  # noqa: E402
from bt_hub.method.model import build_backbone  # noqa: E402
from bt_hub.method.transforms import eval_transforms  # noqa: E402
from bt_hub.weights import ExportConfig, export, get_weights, save_pretrained  # noqa: E402


def _record(
    protocol, metrics, *, seed=0, name="digits", split="test", size=360, preset=None, paper=None, sha="ab" * 32, **extra
):
    return {
        "protocol": protocol,
        "preset": preset,
        "paper": paper,
        "seed": seed,
        "dataset": {"name": name, "test": {"split": split, "size": size}, "holdout": extra.pop("holdout", None)},
        "weights": {"name": extra.pop("weights_name", "bt.safetensors"), "fingerprint": sha},
        "metrics": metrics,
        **extra,
    }


def _results(path, *records):
    path.write_text(json.dumps({"results": list(records)}))
    return str(path)


def _index(folder) -> list[dict]:
    """The card's model-index entries as written (huggingface_hub's ModelCardData would merge them on re-writing)."""
    (entry,) = huggingface_hub.metadata_load(folder / "README.md")["model-index"]
    parsed = huggingface_hub.ModelCard.load(folder / "README.md").data.eval_results
    assert [(r.task_name, r.dataset_name, r.metric_type) for r in parsed] == [
        (e["task"]["name"], e["dataset"]["name"], m["type"]) for e in entry["results"] for m in e["metrics"]
    ]
    return entry["results"]


def test_model_index_has_one_entry_per_protocol_and_dataset_with_the_hubs_schema(tmp_path, resnet18_weights):
    """Guards against one entry named after kNN that held the linear probe's metrics too (same task and data)."""
    sha = file_sha256(resnet18_weights)
    records = [
        _record("knn", {"top1": 80.0, "top5": 95.0}, sha=sha),
        _record("linear", {"top1": 90.0, "top5": 99.0}, sha=sha),
        _record("linear", {"top1": 70.0}, name="cifar10", split="val", size=10000, sha=sha),
    ]
    results = _index(save_pretrained(resnet18_weights, tmp_path / "hf", results=records, name="bt/r18"))
    model = "[resnet18, 7x7 stem, unknown image size]"
    assert [(r["task"]["name"], r["dataset"]["name"]) for r in results] == [
        (f"knn {model}", "digits"),
        (f"linear {model}", "digits"),
        (f"linear {model}", "cifar10"),
    ]
    for entry in results:
        assert entry["task"]["type"] == "image-classification"
        assert set(entry["dataset"]) == {"name", "type", "split"}
        assert all(set(m) == {"type", "value", "name"} for m in entry["metrics"])
    knn, linear, _ = ({m["type"]: m["value"] for m in r["metrics"]} for r in results)
    assert knn == {"top1": 80.0, "top5": 95.0} and linear == {"top1": 90.0, "top5": 99.0}
    assert results[2]["dataset"]["split"] == "val"


def test_several_seeds_give_mean_and_std_and_one_seed_says_so(tmp_path, resnet18_weights):
    sha = file_sha256(resnet18_weights)
    records = [_record("linear", {"top1": v}, seed=s, sha=sha) for s, v in enumerate((90.0, 91.0, 95.0))]
    records.append(_record("knn", {"top1": 80.0}, sha=sha))
    table = card_table(records)
    assert "| linear | — | digits | Top-1 | 92.0 ± 2.6 | 3 seeds | — |" in table
    assert "| knn | — | digits | Top-1 | 80.0 | 1 seed | — |" in table
    results = _index(save_pretrained(resnet18_weights, tmp_path / "hf", results=records, name="bt/r18"))
    model = "[resnet18, 7x7 stem, unknown image size]"
    assert [r["task"]["name"] for r in results] == [f"linear {model}", f"knn {model}"]
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
    imagenet = dict(preset="imagenet", paper=linear.PAPER_ROWS["imagenet"].block())
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
    run = claim_run_dir(tmp_path / "run", kind="pretrain")
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


def _card(folder) -> str:
    return (folder / "README.md").read_text()


def test_results_of_other_weights_are_refused_naming_both_hashes_and_nothing_is_written(tmp_path, resnet18_weights):
    """Guards against export and push publishing, as this model's, results recorded for other weights."""
    from bt_hub.weights import push_to_hub

    ours, theirs = file_sha256(resnet18_weights), "cd" * 32
    results = _results(
        tmp_path / "results.json", _record("knn", {"top1": 80.0}, sha=ours), _record("knn", {"top1": 99.0}, sha=theirs)
    )
    out = tmp_path / "hf"
    with pytest.raises(ValueError) as err:
        export(ExportConfig(weights=str(resnet18_weights), format="hf", out=str(out), results=[results]))
    assert f"results file {results}, record 2 (knn on digits)" in str(err.value)
    assert f"weights sha256 {theirs}, not of the exported weights' sha256 {ours}" in str(err.value)
    assert "--other-results" in str(err.value) and not out.exists()
    with pytest.raises(ValueError, match=f"sha256 {theirs}, not of the exported weights' sha256 {ours}"):
        push_to_hub(str(resnet18_weights), "bt/r18", results=[results], endpoint="http://127.0.0.1:9")


def test_other_results_are_labelled_as_other_weights_and_never_in_the_model_index(tmp_path, resnet18_weights):
    ours = file_sha256(resnet18_weights)
    own = _results(tmp_path / "own.json", _record("knn", {"top1": 80.0}, sha=ours, weights_name="resnet18.pth"))
    other = _results(tmp_path / "other.json", _record("knn", {"top1": 99.0}, sha="cd" * 32, weights_name="them.pth"))
    config = ExportConfig(
        weights=str(resnet18_weights), format="hf", out=str(tmp_path / "hf"), results=[own], other_results=[other]
    )
    folder = export(config)
    assert [m["value"] for entry in _index(folder) for m in entry["metrics"]] == [80.0]
    mine, theirs = _card(folder).split("### Other weights' results, for comparison (not these weights)")
    assert "| 80.0 |" in mine and "99.0" not in mine
    assert "them.pth (cdcdcdcd):" in theirs and "| metric | theirs | seeds |" in theirs and "| 99.0 |" in theirs


def test_baseline_rows_are_labelled_baselines_and_never_in_the_model_index(tmp_path, resnet18_weights):
    """Guards against eval compare's pixels and random-init rows (kNN 96.4, 92.9) published as the model's own."""
    ours = file_sha256(resnet18_weights)
    compare = _results(
        tmp_path / "results.json",
        _record("knn", {"top1": 85.3}, sha=ours, weights_name="resnet18.pth"),
        _record("knn", {"top1": 96.4}, sha="baseline", weights_name="pixels"),
        _record("knn", {"top1": 92.9}, sha="baseline", weights_name="random-init"),
        _record("semi", {"top1": 90.1}, sha="baseline", weights_name="supervised"),
    )
    folder = export(
        ExportConfig(weights=str(resnet18_weights), format="hf", out=str(tmp_path / "hf"), results=[compare])
    )
    assert [m["value"] for entry in _index(folder) for m in entry["metrics"]] == [85.3]
    mine, baselines = _card(folder).split("### Baselines, for comparison (not these weights, not pretrained)")
    assert "| 85.3 |" in mine and not any(v in mine for v in ("96.4", "92.9", "90.1"))
    for name, value in (("pixels", "96.4"), ("random-init", "92.9"), ("supervised", "90.1")):
        table = baselines.split(f"{name} (baseline):\n\n")[1].split("\n\n")[0]
        assert "| metric | baseline | seeds |" in table and f"| {value} |" in table


def _registered_default(torch_home, monkeypatch) -> str:
    """barlowtwins-in1k in the download cache of an offline TORCH_HOME (a seeded ResNet-50 stands in for it)."""

    def no_network(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr("urllib.request.urlopen", no_network)
    path = get_weights("barlowtwins-in1k").cache_path()
    path.parent.mkdir(parents=True)
    torch.manual_seed(0)
    torch.save(build_backbone("resnet50").state_dict(), path)
    return "barlowtwins-in1k"


@pytest.mark.parametrize("source", ["run", "registered"])
def test_a_bt_hub_run_or_registered_weights_are_said_pretrained_with_barlow_twins(
    source, tmp_path, torch_home, monkeypatch
):
    if source == "run":
        weights, provenance = _run_folder(tmp_path, build_backbone("resnet18")), "a bt_hub Barlow Twins pretraining run"
    else:
        weights, provenance = _registered_default(torch_home, monkeypatch), "registered Barlow Twins weights"
    folder = export(ExportConfig(weights=weights, format="hf", out=str(tmp_path / "hf")))
    again = export(
        ExportConfig(weights=str(folder), format="hf", out=str(tmp_path / "again"))
    )  # the Hub folder says it
    for card in (_card(folder), _card(again)):
        assert "backbone with torchvision's 7x7 stem, pretrained with Barlow Twins (Zbontar" in card
        assert f"provenance: {provenance}" in card and "- barlow-twins" in card and "unknown provenance" not in card


def test_weights_of_no_bt_hub_run_nor_registry_are_of_unknown_provenance(tmp_path, resnet18_weights):
    """Guards against a randomly initialised torchvision ResNet described as "pretrained with Barlow Twins"."""
    folder = export(ExportConfig(weights=str(resnet18_weights), format="hf", out=str(tmp_path / "hf")))
    again = export(ExportConfig(weights=str(folder), format="hf", out=str(tmp_path / "again")))
    in_memory = save_pretrained(build_backbone("resnet18"), tmp_path / "memory")
    for card in (_card(folder), _card(again), _card(in_memory)):
        assert "torchvision's 7x7 stem, of unknown provenance: these weights come from neither" in card
        assert "Barlow Twins (" not in card and "- barlow-twins" not in card and "# resnet18 backbone" in card
    assert json.loads((folder / "config.json").read_text())["provenance"] is None


def test_runs_differing_only_in_image_size_are_two_entries_naming_size_architecture_and_stem(
    tmp_path, small_stem_weights
):
    """Guards against kNN at 8 px and 16 px (85.3 vs 92.8) merged into one entry or shown as two alike.

    The records carry ``arch`` and ``small_image_stem`` null (derived from the weights at evaluation time).
    """
    ours, unset = file_sha256(small_stem_weights), {"arch": None, "small_image_stem": None}
    records = [
        _record("knn", {"top1": v}, seed=seed, sha=ours, hyperparameters={**unset, "image_size": size})
        for seed, size, v in ((0, 8, 85.3), (1, 16, 92.8))
    ]
    records.append(_record("knn", {"top1": 96.4}, sha="baseline", weights_name="pixels", hyperparameters=unset))
    folder = save_pretrained(small_stem_weights, tmp_path / "hf", results=records)
    model = "resnet18, 3x3 small-image stem"
    assert [e["task"]["name"] for e in _index(folder)] == [f"knn [{model}, 8 px]", f"knn [{model}, 16 px]"]
    card = _card(folder)
    assert f"| knn [{model}, 8 px] | — | digits | Top-1 | 85.3 | 1 seed | — |" in card
    assert f"| knn [{model}, 16 px] | — | digits | Top-1 | 92.8 | 1 seed | — |" in card
    assert "| knn [raw pixels, no network, unknown image size] | — | digits | Top-1 | 96.4 |" in card


def test_a_protocols_declared_paper_row_reaches_its_record_and_the_card(tmp_path, small_stem_weights):
    from bt_hub import cli

    out = tmp_path / "probe"
    args = ["eval", "linear", "--weights", str(small_stem_weights), "--data", "synthetic:40", "--image-size", "8"]
    args += ["--preset", "imagenet", "--search", "fixed", "--cached", "--epochs", "1", "--out", str(out)]
    assert cli.main(args) == 0
    record = json.loads((out / "results.json").read_text())
    assert record["paper"] == linear.PAPER_ROWS["imagenet"].block() and record["table"] == linear.LINEAR_TABLE.block()
    assert "73.2" not in card_table([record])  # synthetic data is not the paper's: no paper number beside it
    record["dataset"] |= {"name": "imagenet", "test": {"split": "val", "size": 50000}}  # as if run on ImageNet val
    results = _results(tmp_path / "imagenet.json", record)
    export(ExportConfig(weights=str(small_stem_weights), format="hf", out=str(tmp_path / "hf"), results=[results]))
    assert "| Top-1 |" in (card := _card(tmp_path / "hf")) and "| 73.2 |" in card and "| 91.0 |" in card


def test_a_compare_card_names_the_pixels_baseline_keeps_task_names_short_and_says_a_vote_is_deterministic(
    tmp_path, small_stem_weights
):
    """Guards: the pixels baseline was labelled `knn [resnet18, 3x3 small-image stem, 8 px]` under `pixels ():`,
    model-index task names carried compare's whole flags ("baselines [pixels] ..."), and a kNN vote that no seed
    changes was published as "mean ± 0.0 std over 2 seeds"."""
    from bt_hub import cli

    compare = tmp_path / "cmp"
    flags = ["--baselines", "pixels", "--protocols", "knn", "--seeds", "2", "--knn-k", "5"]
    flags += ["--data", "synthetic:40", "--image-size", "8", "--batch-size", "16"]
    assert cli.main(["eval", "compare", "--weights", str(small_stem_weights), *flags, "--out", str(compare)]) == 0
    folder = tmp_path / "hf"
    results = str(compare / "results.jsonl")
    assert (
        cli.main(
            ["export", "--weights", str(small_stem_weights), "--format", "hf", "--out", str(folder)]
            + ["--results", results]
        )
        == 0
    )
    entry, rankme = _index(folder)  # compare scores RankMe beside every frozen column
    assert entry["task"]["name"] == "knn [resnet18, 3x3 small-image stem, 8 px] (frozen features, no training)"
    # guards: a RankMe result (scored on the training split) was published as a result on the test split ("val")
    assert rankme["metrics"][0]["type"] == "rankme" and rankme["dataset"]["split"] == "train"
    assert entry["metrics"][0]["name"] == "Top-1 (deterministic: one value over 2 seeds)"
    card = _card(folder)
    assert "pixels ()" not in card and "pixels (baseline):" in card
    baseline = card.split("pixels (baseline):")[1]
    assert "| knn [raw pixels, no network, 8 px] |" in baseline and "2 seeds, deterministic: one value" in baseline
    assert "± 0.0" not in card
