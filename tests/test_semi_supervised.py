"""Semi-supervised fine-tuning: the paper's presets, subsets by fraction or list, BN trains, the CLI end to end."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import TensorDataset

from bt_hub import cli
from bt_hub.common.config import from_preset
from bt_hub.eval.semi_supervised import SemiSupervisedConfig, finetune
from bt_hub.method.model import build_backbone


def test_paper_preset_is_the_papers_recipe():
    # docs/protocols.md §2: 20 epochs; lr backbone 0.002, classifier 0.5;
    # x0.2 after epochs 12 and 16; SGD momentum 0.9; no weight decay; batch 256; crops 8-100% + flip.
    c = SemiSupervisedConfig(weights="w")
    assert (c.epochs, c.lr_backbone, c.lr_classifier, c.schedule, c.milestones, c.gamma) == (
        20,
        0.002,
        0.5,
        "step",
        [12, 16],
        0.2,
    )
    assert (c.momentum, c.weight_decay, c.batch_size, c.fraction, c.crop_scale_min, c.flip) == (
        0.9,
        0.0,
        256,
        1,
        0.08,
        True,
    )


def test_reference_preset_uses_0_005_and_a_cosine_schedule():
    c = from_preset(SemiSupervisedConfig, "reference", weights="w", fraction=10)
    assert (c.lr_backbone, c.lr_classifier, c.schedule, c.epochs, c.weight_decay, c.fraction) == (
        0.005,
        0.5,
        "cosine",
        20,
        0.0,
        10,
    )


def test_small_preset_is_eval_compares_fine_tuning_recipe():
    # eval compare fine-tunes through the `small` preset itself, so the preset is the recipe its semi columns measure.
    from bt_hub.eval.comparison import CompareConfig

    preset = CompareConfig(weights=["w"], out=None).semi.preset
    c = from_preset(SemiSupervisedConfig, preset, weights="w")
    assert preset == "small"
    assert (c.lr_backbone, c.lr_classifier, c.schedule, c.batch_size) == (0.002, 0.05, "cosine", 32)
    assert (c.crop_scale_min, c.flip) == (0.4, False)


def test_fraction_and_subset_file_exclude_each_other():
    with pytest.raises(ValueError, match="--fraction and --subset-file"):
        SemiSupervisedConfig(weights="w", fraction=1, subset_file="1percent.txt")
    with pytest.raises(ValueError, match="--fraction must be"):
        SemiSupervisedConfig(weights="w", fraction=0)


def test_finetuning_trains_the_backbone_and_its_batchnorm_statistics():
    torch.manual_seed(0)
    backbone = build_backbone("resnet18")
    before = {k: v.clone() for k, v in backbone.state_dict().items()}
    x = torch.randn(16, 3, 32, 32) * 2 + 1
    y = torch.arange(16) % 2
    finetune(
        backbone,
        2,
        TensorDataset(x, y),
        TensorDataset(x, y),
        lr_backbone=0.01,
        lr_classifier=0.5,
        epochs=2,
        batch_size=8,
    )
    after = backbone.state_dict()
    assert not torch.equal(before["conv1.weight"], after["conv1.weight"])
    assert not torch.equal(before["bn1.running_mean"], after["bn1.running_mean"])
    assert int(after["bn1.num_batches_tracked"]) == 4


def test_a_last_batch_of_one_small_image_is_skipped_not_a_batchnorm_error():
    """Guards: 17 labels in batches of 8 at 8 px (a 1x1 res5 map) stopped fine-tuning on its last batch with
    "Expected more than 1 value per channel when training"."""
    torch.manual_seed(0)
    backbone = build_backbone("resnet18", small_image_stem=True)
    x, y = torch.randn(17, 3, 8, 8), torch.arange(17) % 2
    finetune(
        backbone,
        2,
        TensorDataset(x, y),
        TensorDataset(x, y),
        lr_backbone=0.01,
        lr_classifier=0.5,
        epochs=1,
        batch_size=8,
    )
    assert int(backbone.state_dict()["bn1.num_batches_tracked"]) == 2  # the two full batches


def test_cli_semi_with_a_balanced_fraction_writes_results(resnet18_weights, tmp_path):
    out = tmp_path / "semi"
    assert (
        cli.main(
            [
                "eval",
                "semi",
                "--weights",
                str(resnet18_weights),
                "--data",
                "synthetic:100",
                "--image-size",
                "32",
                "--fraction",
                "10",
                "--epochs",
                "2",
                "--batch-size",
                "16",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    record = json.loads((out / "results.json").read_text())
    assert (record["protocol"], record["preset"], record["hyperparameters"]["fraction"]) == ("semi", "paper", 10)
    assert record["labels"] == {
        "fraction": 10,
        "source": "seeded",
        "seed": 0,
        "count": 10,
    }  # 10% of the 80 training images
    assert 0 <= record["metrics"]["top1"] <= record["metrics"]["top5"] <= 100
    assert {"weights", "dataset", "seed", "wall_time_s", "versions"} <= set(record)
    assert "10% labels (seeded class-balanced, seed 0)" in (out / "results.md").read_text()


def _imagenet_like(image_folder, root, per_class=3):
    """An ImageNet-named tree (PNG bytes under <wnid>_<i>.JPEG names); returns the training files' names."""
    image_folder(root, classes=("n01440764", "n01443537"), per_class=per_class, size=20, suffix=".JPEG")
    return [path.name for path in sorted((root / "train").glob("*/*.JPEG"))]


def test_cli_semi_with_a_subset_file_uses_the_listed_images(resnet18_weights, image_folder, tmp_path):
    names = _imagenet_like(image_folder, tmp_path / "imagenet")
    listing = tmp_path / "mine.txt"
    listing.write_text("\n".join([names[0], names[4]]) + "\n")
    out = tmp_path / "out"
    assert (
        cli.main(
            [
                "eval",
                "semi",
                "--weights",
                str(resnet18_weights),
                "--data",
                str(tmp_path / "imagenet"),
                "--subset-file",
                str(listing),
                "--image-size",
                "32",
                "--epochs",
                "1",
                "--batch-size",
                "4",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    record = json.loads((out / "results.json").read_text())
    assert (record["labels"]["count"], record["labels"]["source"], record["labels"]["file"]) == (2, "list", "mine.txt")
    assert record["labels"]["published"] is None and len(record["labels"]["sha256"]) == 64
    assert (
        f"| ours: semi | 33.33% labels (list mine.txt, sha256 {record['labels']['sha256'][:8]}); preset paper;"
        in (out / "results.md").read_text()
    )


def test_cli_semi_rejects_a_list_naming_absent_files(resnet18_weights, image_folder, tmp_path, capsys):
    names = _imagenet_like(image_folder, tmp_path / "imagenet")
    listing = tmp_path / "mine.txt"
    listing.write_text("\n".join([names[0], "n01440764_999.JPEG", "n09999999_1.JPEG"]) + "\n")
    assert (
        cli.main(
            [
                "eval",
                "semi",
                "--weights",
                str(resnet18_weights),
                "--data",
                str(tmp_path / "imagenet"),
                "--subset-file",
                str(listing),
                "--image-size",
                "32",
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "names 2 of its 3 files that are not in the dataset" in err and "n09999999_1.JPEG" in err
    assert not (tmp_path / "out" / "results.json").exists()


def test_a_preset_far_from_the_data_is_one_warning_naming_what_differs():
    from bt_hub.eval.config import preset_warnings

    paper = from_preset(SemiSupervisedConfig, "paper", weights="w", image_size=32)
    (message,) = preset_warnings(paper, num_classes=10, train_images=14, image_side=8)
    assert message.startswith(
        "preset 'paper' assumes 1000 classes (the data has 10), images of about 224 px (the data's are 8 px), "
        "at least 4 batches per epoch (14 training images in batches of 256 make 1)"
    )
    small = from_preset(SemiSupervisedConfig, "small", weights="w", image_size=32)
    assert preset_warnings(small, num_classes=10, train_images=144, image_side=32) == []
    assert (
        preset_warnings(SemiSupervisedConfig(weights="w"), num_classes=1000, train_images=12_811, image_side=375) == []
    )  # ImageNet 1%


def test_milestones_that_never_fire_are_a_warning():
    from bt_hub.eval.config import schedule_warnings

    assert schedule_warnings(SemiSupervisedConfig(weights="w", epochs=5)) == [
        "--milestones 12 16 never fire in 5 epochs, so the LR never drops there: "
        "lower --milestones or use --schedule cosine"
    ]
    assert schedule_warnings(SemiSupervisedConfig(weights="w", epochs=14)) == [
        "--milestones 16 never fire in 14 epochs, so the LR never drops there: "
        "lower --milestones or use --schedule cosine"
    ]
    assert schedule_warnings(SemiSupervisedConfig(weights="w")) == []
    assert schedule_warnings(from_preset(SemiSupervisedConfig, "small", weights="w", epochs=5)) == []  # cosine


def test_the_record_says_the_precision_the_fine_tuning_ran_in(small_stem_weights):
    # guards: under --precision auto on a bf16 CPU the record said bf16 (the extraction's) while the loop ran fp32
    from bt_hub.eval import evaluate

    result = evaluate(small_stem_weights, "synthetic:40", "semi", preset="small", fraction=50, epochs=1, image_size=8)
    assert result.records[0]["notes"]["loop_precision"] == "fp32"  # on the CPU, whatever --precision resolved to
