"""The model card (README.md) and the timm fields of a Hugging Face folder's config.json.

The card's preprocessing is read from the weights' own evaluation transforms (image size
from the run's config), and a small-image-stem backbone, which timm's ResNet cannot build,
is said to be a bt_hub-only layout with the bt_hub line that loads it. The evaluation
table is rendered by ``results_section`` alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torchvision import transforms as T

from bt_hub.common.optional import require
from bt_hub.common.records import card_table, data_label, task_label
from bt_hub.method.transforms import IMAGENET_MEAN, IMAGENET_STD, transforms_for

TAGS = ["barlow-twins", "self-supervised-learning", "image-feature-extraction", "pytorch", "timm", "bt_hub"]
# timm builds ResNet(**model_args): this argument, unknown to timm, makes it refuse a small-stem folder by name.
SMALL_STEM_TIMM_ARG = "bt_hub_small_image_stem"
# Protocol name (as eval/ writes it) -> Hugging Face task type.
_TASKS = {
    "detect": "object-detection",
    "detection": "object-detection",
    "voc07+12": "object-detection",
    "coco": "object-detection",
}


def _eval_results(rows: list[dict[str, Any]]) -> list[Any]:
    """The card's model-index entries: one per run and metric, named by what the run was (bt_hub.common.records)."""
    hf = require("huggingface_hub", "writing a model card")
    out = []
    for row in rows:
        protocol = str(row.get("protocol", "evaluation"))
        dataset_name = data_label(row) or "unknown"
        task_type = _TASKS.get(protocol.split("-")[0], "image-classification")
        for metric, value in (row.get("metrics") or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out.append(
                    hf.EvalResult(
                        task_type=task_type,
                        task_name=task_label(row),
                        dataset_type=dataset_name,
                        dataset_name=dataset_name,
                        metric_type=metric,
                        metric_name=metric,
                        metric_value=round(float(value), 1),
                    )
                )
    return out


def results_section(results: list[dict[str, Any]]) -> str:
    """The card's "Evaluation" table: one row per run and metric, with the paper's number for the same protocol."""
    return f"## Evaluation\n\n{card_table(results)}\n"


def preprocessing(config: Mapping[str, Any]) -> tuple[int, int]:
    """``(resize, crop)`` sides of the weights' evaluation transforms."""
    steps = transforms_for(config).transforms
    resize = next(t.size for t in steps if isinstance(t, T.Resize))
    crop = next(t.size for t in steps if isinstance(t, T.CenterCrop))
    return int(resize if isinstance(resize, int) else resize[0]), int(crop[0])


def timm_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The fields timm reads from config.json (its ResNets use torchvision's parameter names)."""
    resize, crop = preprocessing(config)
    small = bool(config.get("small_image_stem"))
    fields: dict[str, Any] = {
        "num_classes": 0,
        "num_features": config["feature_dim"],
        "pretrained_cfg": {
            "tag": "barlowtwins",
            "input_size": [3, crop, crop],
            "interpolation": "bilinear",
            "crop_pct": round(crop / resize, 4),
            "crop_mode": "center",
            "mean": list(IMAGENET_MEAN),
            "std": list(IMAGENET_STD),
            "num_classes": 0,
            "pool_size": [math.ceil(crop / (8 if small else 32))] * 2,
            "first_conv": "conv1",
            "classifier": "fc",
        },
    }
    if small:
        fields["model_args"] = {SMALL_STEM_TIMM_ARG: True}
    return fields


def _usage(config: Mapping[str, Any], repo: str) -> str:
    dim = config.get("feature_dim", 2048)
    lines = [
        "```python",
        "from bt_hub.weights import from_pretrained",
        f'backbone = from_pretrained("{repo}").eval()          # strict load; works offline from the cache',
        f"features = backbone(backbone.transforms(image)[None])     # (1, {dim})",
    ]
    if config.get("projector"):
        lines += [
            "",
            "from bt_hub.weights import barlow_twins              # backbone + projector + λ, to train further",
            f'model = barlow_twins(weights="{repo}")',
        ]
    lines.append("```")
    if config.get("small_image_stem"):
        lines += [
            "",
            "This backbone has bt_hub's small-image stem (a 3x3 stride-1 first convolution, no max-pool), which "
            "timm's ResNet cannot build: it is a bt_hub-only layout. `timm.create_model` refuses it with "
            f"\"unexpected keyword argument '{SMALL_STEM_TIMM_ARG}'\"; load it with the bt_hub lines above.",
        ]
    else:
        lines += [
            "",
            "```python",
            "import timm                                           # the same weights as a timm feature extractor",
            f'model = timm.create_model("hf-hub:{repo}", pretrained=True, num_classes=0)',
            "```",
        ]
    return "\n".join(lines)


def model_card(
    config: Mapping[str, Any], results: list[dict[str, Any]], *, name: str | None, license: str = "apache-2.0"
) -> str:
    """The README.md of a Hugging Face folder: YAML metadata, usage, preprocessing, recipe and results."""
    hf = require("huggingface_hub", "writing a model card")
    dataset = config.get("dataset")
    small = bool(config.get("small_image_stem"))
    data = hf.ModelCardData(
        library_name="bt_hub",
        license=license,
        tags=[t for t in TAGS if t != "timm" or not small],
        pipeline_tag="image-feature-extraction",
        datasets=[str(dataset)] if dataset else None,
        model_name=name,
        eval_results=_eval_results(results) or None,
    )
    arch = config.get("architecture", "resnet50")
    dim = config.get("feature_dim", 2048)
    resize, crop = preprocessing(config)
    stem = "bt_hub's small-image stem (3x3 stride-1 convolution, no max-pool)" if small else "torchvision's 7x7 stem"
    recipe = {k: config[k] for k in ("dataset", "epochs", "projector", "lambd", "image_size") if k in config}
    recipe.update(config.get("recipe") or {})
    recipe_rows = "\n".join(f"| {k} | {v} |" for k, v in recipe.items()) or "| (not recorded) | |"
    return f"""---
{data.to_yaml()}
---

# {name or f"Barlow Twins {arch}"}

A {arch} backbone with {stem}, pretrained with Barlow Twins (Zbontar, Jing, Misra, LeCun, Deny: *Barlow Twins:
Self-Supervised Learning via Redundancy Reduction*, ICML 2021, https://arxiv.org/abs/2103.03230).
torchvision parameter names, `fc = Identity`: the output is a {dim}-d feature vector, not class scores.

Preprocessing (the weights' own evaluation transforms, `backbone.transforms`): resize to {resize} (bilinear),
centre crop {crop}, ImageNet mean {list(IMAGENET_MEAN)}, std {list(IMAGENET_STD)}.

## Usage

{_usage(config, name or "<org>/<name>")}

## Training

| setting | value |
|---|---|
{recipe_rows}

{results_section(results)}"""
