"""Linear probe and transfer: schedules, classifier, frozen backbone, cached mode, the CLI end to end."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from bt_hub import cli
from bt_hub.common.config import from_preset
from bt_hub.eval.classifier import lr_factor, make_classifier, make_loader, topk_hits, train_classifier
from bt_hub.eval.heads import (
    GRID_LRS,
    GRID_WEIGHT_DECAYS,
    NonFiniteLoss,
    grid_probe,
    score_heads,
    train_head_sets,
    train_heads,
)
from bt_hub.eval.linear import FrozenBackboneClassifier, LinearConfig, TransferConfig, equally_spaced_milestones
from bt_hub.eval.runner import EvalRun
from bt_hub.method.model import build_backbone

RESULT_FIELDS = {
    "schema",
    "protocol",
    "mode",
    "preset",
    "overrides",
    "hyperparameters",
    "weights",
    "dataset",
    "seed",
    "metrics",
    "wall_time_s",
    "versions",
    "warnings",
}


def test_presets_carry_the_protocol_numbers():
    # docs/protocols.md §2: the paper's probe and PIRL's transfer settings
    imagenet = LinearConfig(weights="w")
    assert (
        imagenet.lr,
        imagenet.weight_decay,
        imagenet.momentum,
        imagenet.epochs,
        imagenet.batch_size,
        imagenet.schedule,
    ) == (0.3, 1e-6, 0.9, 100, 256, "cosine")
    assert (imagenet.crop_scale_min, imagenet.flip, imagenet.preset) == (0.08, True, "imagenet")
    places = from_preset(TransferConfig, weights="w")
    assert (places.preset, places.lr, places.weight_decay, places.epochs, places.schedule, places.gamma) == (
        "places205",
        0.01,
        5e-4,
        14,
        "step",
        0.1,
    )
    assert places.milestones == [5, 9]
    inat = from_preset(TransferConfig, "inat18", weights="w")
    assert (inat.epochs, inat.milestones) == (84, [28, 56])
    vissl = from_preset(TransferConfig, weights="w", milestones=[4, 8, 12], lr=0.02)
    assert (vissl.milestones, vissl.lr, vissl.epochs) == ([4, 8, 12], 0.02, 14)
    small = from_preset(LinearConfig, "small", weights="w")
    assert (small.crop_scale_min, small.flip, small.lr, small.epochs) == (0.4, False, 0.3, 100)


def test_cosine_schedule_per_epoch_without_warmup_and_step_drops():
    assert lr_factor(0, 100, "cosine") == 1.0
    assert lr_factor(50, 100, "cosine") == pytest.approx(0.5)
    assert lr_factor(99, 100, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.99)))
    assert [lr_factor(e, 20, "step", [12, 16], 0.2) for e in (11, 12, 15, 16, 19)] == pytest.approx(
        [1, 0.2, 0.2, 0.04, 0.04]
    )
    assert equally_spaced_milestones(14) == [5, 9] and equally_spaced_milestones(84) == [28, 56]


def test_classifier_init_is_normal_0_01_with_zero_bias():
    torch.manual_seed(0)
    fc = make_classifier(2048, 1000)
    assert fc.weight.std().item() == pytest.approx(0.01, rel=0.01)
    assert abs(fc.weight.mean().item()) < 1e-4
    assert torch.count_nonzero(fc.bias) == 0


def test_topk_counts_targets_among_the_best_logits():
    logits = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.1, 0.05], [0.2, 0.3, 0.5]])
    assert topk_hits(logits, torch.tensor([1, 1, 0]), ks=(1, 2)).sum(0).tolist() == [1, 2]
    assert topk_hits(logits, torch.tensor([1, 1, 0]), ks=(1, 5)).sum(0).tolist() == [1, 3]


def _separable(n_per_class: int, num_classes: int, dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(num_classes, dim, generator=g) * 3
    labels = torch.arange(num_classes).repeat_interleave(n_per_class)
    return centres[labels] + torch.randn(len(labels), dim, generator=g), labels


def test_probe_on_features_that_separate_the_classes_reaches_100_percent():
    train_x, train_y = _separable(40, 10, 64, seed=0)
    test_x, test_y = _separable(20, 10, 64, seed=0)
    test_x = test_x + 0.1 * torch.randn_like(test_x)
    hyper = {"lrs": [0.3], "weight_decays": [1e-6], "epochs": 30, "batch_size": 64, "progress": False}
    fc = train_heads(train_x, train_y, 10, **hyper)
    assert score_heads(fc, test_x, test_y)[0]["top1"] == 100.0
    shuffled = train_heads(train_x, train_y[torch.randperm(len(train_y))], 10, **hyper)
    assert score_heads(shuffled, test_x, test_y)[0]["top1"] < 40.0


def test_memmapped_features_train_the_same_classifiers_as_a_tensor_to_the_bit(tmp_path):
    x, y = _separable(20, 5, 16, seed=1)
    path = tmp_path / "f.npy"
    np.save(path, x.numpy())
    hyper = {"lrs": [0.3, 3.0], "weight_decays": [1e-6, 0.0], "epochs": 20, "batch_size": 32, "seed": 2}
    a = train_heads(x, y, 5, **hyper, progress=False)
    b = train_heads(np.load(path, mmap_mode="r"), y, 5, **hyper, progress=False)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)  # cached (CLI) and in memory (API) agree
    assert score_heads(b, np.load(path, mmap_mode="r"), y) == score_heads(a, x, y)


def test_cached_probe_trains_the_same_classifier_as_the_loop_over_the_same_inputs():
    images, labels = _separable(13, 4, 3 * 4 * 4, seed=3)
    backbone = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
    ).eval()
    data = torch.utils.data.TensorDataset(images.view(-1, 3, 4, 4), labels)
    hyper = {"momentum": 0.9, "schedule": "cosine", "milestones": [], "gamma": 1.0}
    torch.manual_seed(5)
    fc = make_classifier(8, 4)
    loader = make_loader(data, 16, shuffle=True, seed=5, num_workers=0, device=torch.device("cpu"))
    train_classifier(
        FrozenBackboneClassifier(backbone, fc),
        [{"params": list(fc.parameters()), "lr": 0.3}],
        loader,
        epochs=3,
        device=torch.device("cpu"),
        desc="loop",
        weight_decay=1e-4,
        **hyper,
    )
    with torch.no_grad():
        features = backbone(data.tensors[0])
    cached = train_heads(
        features, labels, 4, lrs=[0.3], weight_decays=[1e-4], epochs=3, batch_size=16, seed=5, progress=False, **hyper
    )
    torch.testing.assert_close(cached.weight[0], fc.weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cached.bias[0], fc.bias, rtol=1e-5, atol=1e-6)


def test_frozen_backbone_keeps_weights_and_bn_statistics_while_the_classifier_learns():
    torch.manual_seed(0)
    backbone = build_backbone("resnet18")
    before = {k: v.clone() for k, v in backbone.state_dict().items()}
    model = FrozenBackboneClassifier(backbone, make_classifier(backbone.feature_dim, 3))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model.train()
    assert not backbone.training and model.fc.training
    w0 = model.fc.weight.clone()
    loss = torch.nn.functional.cross_entropy(
        model(torch.randn(8, 3, 32, 32) * 3 + 1), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    )
    loss.backward()
    optimizer.step()
    assert not torch.equal(model.fc.weight, w0)
    assert all(torch.equal(before[k], v) for k, v in backbone.state_dict().items())


def _read(out):
    record = json.loads((out / "results.json").read_text())
    assert RESULT_FIELDS <= set(record)
    return record


def test_cli_linear_full_and_cached_write_results(resnet18_weights, tmp_path):
    common = [
        "--weights",
        str(resnet18_weights),
        "--data",
        "synthetic:60",
        "--image-size",
        "32",
        "--batch-size",
        "32",
        "--seed",
        "1",
    ]
    assert (
        cli.main(["eval", "linear", *common, "--search", "fixed", "--epochs", "1", "--out", str(tmp_path / "full")])
        == 0
    )
    full = _read(tmp_path / "full")
    assert (full["protocol"], full["preset"], full["hyperparameters"]["lr"], full["hyperparameters"]["epochs"]) == (
        "linear",
        "imagenet",
        0.3,
        1,
    )
    assert (full["mode"], full["mode_description"]) == ("loop", "paper loop with augmentation")
    assert full["overrides"]["epochs"] == {"value": 1, "preset": 100, "from": "--epochs"}  # the flag that set it
    assert 0 <= full["metrics"]["top1"] <= full["metrics"]["top5"] <= 100
    cache = tmp_path / "cache"
    assert (
        cli.main(
            [
                "eval",
                "linear",
                *common,
                "--epochs",
                "5",
                "--cached",
                "--search",
                "fixed",
                "--cache-dir",
                str(cache),
                "--out",
                str(tmp_path / "cached"),
            ]
        )
        == 0
    )
    cached = _read(tmp_path / "cached")
    assert (
        cached["mode_description"] == "cached features, no augmentation" and cached["hyperparameters"]["cached"] is True
    )
    assert cached["weights"] == full["weights"] and cached["dataset"]["fingerprint"] == full["dataset"]["fingerprint"]
    assert len(list(cache.glob("*.features.npy"))) == 2
    assert "Linear evaluation" in (tmp_path / "cached" / "results.md").read_text()


def test_cli_transfer_takes_an_imagefolder_by_path_with_the_pirl_preset(resnet18_weights, image_folder, tmp_path):
    image_folder(tmp_path / "data", classes=("a", "b"), per_class=4, size=20)
    out = tmp_path / "out"
    assert (
        cli.main(
            [
                "eval",
                "transfer",
                "--preset",
                "inat18",
                "--search",
                "fixed",
                "--weights",
                str(resnet18_weights),
                "--data",
                str(tmp_path / "data"),
                "--image-size",
                "32",
                "--epochs",
                "1",
                "--batch-size",
                "8",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    record = _read(out)
    assert (
        record["protocol"],
        record["preset"],
        record["hyperparameters"]["lr"],
        record["hyperparameters"]["milestones"],
    ) == ("transfer", "inat18", 0.01, [28, 56])
    assert "iNat18" in (out / "results.md").read_text()


def test_cli_rejects_bad_milestones_in_one_line(resnet18_weights, capsys):
    argv = ["eval", "linear", "--weights", str(resnet18_weights), "--schedule", "step", "--milestones", "9", "3"]
    assert cli.main(argv) == 2
    assert "--milestones must be increasing" in capsys.readouterr().err


def test_cli_eval_all_runs_every_protocol_sharing_one_feature_cache(resnet18_weights, tmp_path):
    out = tmp_path / "all"
    assert (
        cli.main(
            [
                "eval",
                "all",
                "--weights",
                str(resnet18_weights),
                "--data",
                "synthetic:60",
                "--image-size",
                "32",
                "--batch-size",
                "16",
                "--linear-epochs",
                "3",
                "--semi-epochs",
                "1",
                "--knn-k",
                "5",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    summary = json.loads((out / "results.json").read_text())
    assert [(r["protocol"], r["hyperparameters"].get("fraction")) for r in summary["results"]] == [
        ("knn", None),
        ("linear", None),
        ("semi", 1),
        ("semi", 10),
        ("rankme", None),
    ]
    assert summary["results"][1]["mode"] == "cached"
    assert (
        len(list((out / "feature_cache").glob("*.features.npy"))) == 2
    )  # train and test, computed once for kNN, linear and RankMe
    table = (out / "results.md").read_text()
    assert all(title in table for title in ("Linear evaluation", "Semi-supervised", "Weighted kNN"))
    assert all((out / sub / "results.json").exists() for sub in ("knn", "linear", "semi_1percent", "semi_10percent"))
    from bt_hub.common.records import read_records

    assert [r["protocol"] for r in read_records([out / "results.json"])] == [
        "knn",
        "linear",
        "semi",
        "semi",
        "rankme",
    ]  # what push --results reads


# ----------------------------------------------------------------------------- the grid of heads


def test_every_head_of_a_grid_equals_that_head_trained_alone():
    x, y = _separable(30, 4, 16, seed=5)
    lrs, wds = [0.01, 0.3, 3.0], [0.0, 1e-2, 1e-3]
    together = train_heads(x, y, 4, lrs=lrs, weight_decays=wds, epochs=3, batch_size=16, seed=1, progress=False)
    for k, (lr, wd) in enumerate(zip(lrs, wds)):
        alone = train_heads(x, y, 4, lrs=[lr], weight_decays=[wd], epochs=3, batch_size=16, seed=1, progress=False)
        torch.testing.assert_close(together.weight[k], alone.weight[0], rtol=1e-5, atol=1e-6)
    assert not torch.equal(together.weight[0], together.weight[2])


def test_heads_trained_on_several_feature_sets_at_once_equal_those_trained_on_each_set_alone():
    # A learning curve trains its rows' grids together (one batched product a step for all of them): each set's
    # heads, divergence included (the third set overflows at LR 3), must be what it trains alone: the same divergence
    # and weights within 4 float32 ulps of the largest weight (a batched product is not bit-exact on every x86-64
    # CPU: on an AVX2-only EPYC it differs from each set's own product by 1e-7 of weights near 44).
    sets = [_separable(30, 4, 16, seed=s)[0] for s in (5, 6)]
    sets.append(sets[0] * 1e19)
    y = _separable(30, 4, 16, seed=5)[1]
    hyper = {"lrs": [1e-30, 0.3, 3.0], "weight_decays": [0.0, 1e-3, 0.0], "epochs": 3, "batch_size": 16, "seed": 1}
    together = train_head_sets([*sets, np.asarray(sets[1])], y, 4, **hyper, rows=range(10, 120), progress=False)
    for x, heads in zip([*sets, sets[1]], together):
        alone = train_heads(x, y, 4, **hyper, rows=range(10, 120), progress=False)
        for trained, expected in ((heads.weight, alone.weight), (heads.bias, alone.bias)):
            finite = torch.isfinite(expected)
            assert torch.equal(finite, torch.isfinite(trained)) and torch.equal(trained[~finite], expected[~finite])
            atol = 4 * torch.finfo(torch.float32).eps * float(expected[finite].abs().max())
            torch.testing.assert_close(trained[finite], expected[finite], rtol=0, atol=atol)
        assert heads.diverged == alone.diverged
    assert together[2].diverged[0] is None and together[2].diverged[2] is not None
    assert together[0].diverged == [None] * 3


def test_a_diverged_head_keeps_its_weights_from_the_start_of_that_epoch_and_spares_the_others():
    x, y = _separable(20, 3, 8, seed=8)
    x = x * 1e19  # the LR-100 head overflows in its second step (epoch 0), the LR-1e-30 head never
    hyper = {"epochs": 3, "batch_size": 16, "seed": 0, "progress": False}
    heads = train_heads(x, y, 3, lrs=[1e-30, 100.0], weight_decays=[0.0, 0.0], **hyper)
    alone = train_heads(x, y, 3, lrs=[1e-30], weight_decays=[0.0], **hyper)
    torch.manual_seed(0)
    init = make_classifier(8, 3)
    assert heads.diverged == [None, 0]
    assert torch.equal(heads.weight[1], init.weight.detach()) and torch.equal(heads.bias[1], init.bias.detach())
    assert torch.equal(heads.weight[0], alone.weight[0]) and torch.equal(heads.bias[0], alone.bias[0])


def test_grid_chooses_on_a_seeded_validation_split_of_the_training_data_never_the_test_split():
    train_x, train_y = _separable(40, 5, 16, seed=6)
    test_x, test_y = _separable(20, 5, 16, seed=7)
    hyper = {"epochs": 5, "batch_size": 32, "progress": False}
    found = grid_probe(train_x, train_y, test_x, test_y, 5, seed=2, **hyper)
    # the test labels take no part in the choice: scrambling them changes the test score only
    scrambled = grid_probe(train_x, train_y, test_x, test_y[torch.randperm(len(test_y))], 5, seed=2, **hyper)
    assert scrambled["chosen"] == found["chosen"] and scrambled["grid"] == found["grid"]
    assert len(found["grid"]) == 12 and {(h["lr"], h["weight_decay"]) for h in found["grid"]} == {
        (lr, wd) for lr in GRID_LRS for wd in GRID_WEIGHT_DECAYS
    }
    best = max(h["val_top1"] for h in found["grid"])
    assert found["chosen"]["val_top1"] == best
    validation = found["validation"]
    assert (validation["train_size"], validation["val_size"], validation["seed"]) == (160, 40, 2)
    again = grid_probe(train_x, train_y, test_x, test_y, 5, seed=2, **hyper)["validation"]
    other = grid_probe(train_x, train_y, test_x, test_y, 5, seed=3, **hyper)["validation"]
    assert again == validation and other["val_indices_sha256"] != validation["val_indices_sha256"]


def test_a_diverging_head_is_reported_and_never_chosen_and_a_diverged_grid_is_refused():
    x, y = _separable(20, 3, 8, seed=8)
    x = x * 1e19  # float32 logits overflow after one step of LR 100, not of LR 1e-30
    found = grid_probe(x, y, x, y, 3, lrs=[1e-30, 100.0], weight_decays=[0.0], epochs=3, batch_size=16, progress=False)
    diverged = [h for h in found["grid"] if h["lr"] == 100.0][0]
    assert diverged["val_top1"] is None and diverged["diverged_epoch"] is not None
    assert found["chosen"]["lr"] == 1e-30
    with pytest.raises(NonFiniteLoss, match="every head of the linear grid diverged"):
        grid_probe(x, y, x, y, 3, lrs=[100.0], weight_decays=[0.0], epochs=3, batch_size=16, progress=False)


def test_the_grid_is_the_default_except_on_the_data_a_paper_preset_was_set_for():
    config = LinearConfig(weights="w")
    assert not config.uses_grid(1000) and config.uses_grid(10)
    assert from_preset(TransferConfig, weights="w").uses_grid(10)
    assert not from_preset(TransferConfig, weights="w").uses_grid(205)
    assert LinearConfig(weights="w", search="grid").uses_grid(1000)
    assert not LinearConfig(weights="w", search="fixed").uses_grid(10)


def test_cli_linear_on_digits_like_data_runs_the_grid_and_records_it(resnet18_weights, tmp_path):
    out = tmp_path / "grid"
    common = ["--weights", str(resnet18_weights), "--data", "synthetic:60", "--image-size", "32"]
    assert cli.main(["eval", "linear", *common, "--epochs", "3", "--batch-size", "16", "--out", str(out)]) == 0
    record = _read(out)
    notes = record["notes"]
    assert notes["search"] == "grid" and len(notes["grid"]) == 12 and record["mode"] == "cached"
    assert notes["chosen"]["lr"] in GRID_LRS and notes["validation"]["source_split"] == "train"
    assert record["paper"] is None  # the grid is not the paper's recipe: no paper row beside it


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lr", "1e30"], "--lr must be in (0, 100]"),
        (["--lr", "nan"], "--lr must be in (0, 100]"),
        (["--lr", "0"], "--lr must be in (0, 100]"),
        (["--lr-grid", "0.1", "inf"], "--lr-grid must be in (0, 100]"),
        (["--weight-decay", "-1"], "--weight-decay must be in [0, 1)"),
        (["--weight-decay-grid", "2"], "--weight-decay-grid must be in [0, 1)"),
        (["--momentum", "1.5"], "--momentum must be in [0, 1)"),
        (["--epochs", "0"], "--epochs must be an integer in [1, 100000]"),
        (["--batch-size", "0"], "--batch-size must be positive"),
        (["--val-fraction", "0.9"], "--val-fraction must be in (0, 0.5]"),
        (["--gamma", "0", "--schedule", "step"], "--gamma must be in (0, 1]"),
    ],
)
def test_cli_rejects_probe_settings_out_of_range_in_one_line(resnet18_weights, tmp_path, capsys, flags, message):
    # guards `--cached --lr 1e30`, which trained silently to 15.4% top-1
    out = tmp_path / "out"
    assert cli.main(["eval", "linear", "--weights", str(resnet18_weights), "--cached", *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()


def test_cli_fixed_probe_stops_in_one_sentence_when_its_loss_becomes_non_finite(
    resnet18_weights, tmp_path, capsys, monkeypatch
):
    real = EvalRun.features
    monkeypatch.setattr(EvalRun, "features", lambda *a, **k: (lambda f: (f[0] * 1e30, f[1]))(real(*a, **k)))
    args = ["eval", "linear", "--weights", str(resnet18_weights), "--data", "synthetic:40", "--image-size", "32"]
    args += ["--cached", "--search", "fixed", "--lr", "50", "--epochs", "2", "--out", str(tmp_path / "out")]
    assert cli.main(args) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line or "Traceback" in line]
    assert len(errors) == 1 and re.search(r"training loss became non-finite in epoch \d+ with --lr 50", errors[0])
    assert not (tmp_path / "out" / "results.json").exists()


def test_grid_without_a_validation_split_is_refused_in_one_sentence():
    # Guards: one image per class left no validation rows and grid_probe raised ZeroDivisionError.

    x, y = torch.randn(3, 4), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="at most one per class, so the grid has no validation split"):
        grid_probe(x, y, x, y, 3, epochs=1, progress=False)


def test_the_image_loops_autocast_in_the_runs_precision_on_cuda_and_never_on_the_cpu():
    from bt_hub.eval.classifier import loop_autocast

    assert loop_autocast(torch.device("cuda"), "bf16") is torch.bfloat16
    assert loop_autocast(torch.device("cuda"), "fp16") is torch.float16
    assert loop_autocast(torch.device("cuda"), "fp32") is None
    assert loop_autocast(torch.device("cpu"), "bf16") is None


def test_two_runs_into_one_folder_log_rows_that_say_which_run_wrote_them(small_stem_weights, tmp_path):
    # guards: eval linear runs sharing an --out interleaved their metrics.jsonl rows with no run id, and run.json
    # recorded the second as a "resume"
    out = tmp_path / "lin"
    args = ["eval", "linear", "--weights", str(small_stem_weights), "--data", "synthetic:40", "--image-size", "8"]
    args += ["--search", "fixed", "--epochs", "2", "--batch-size", "16", "--out", str(out)]
    assert cli.main(args) == 0 and cli.main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    run = json.loads((out / "run.json").read_text())
    ids = [run["run_id"], run["runs"][0]["run_id"]]
    assert "resumes" not in run and ids[0] != ids[1]
    assert [r["run_id"] for r in rows] == [ids[0]] * 2 + [ids[1]] * 2
