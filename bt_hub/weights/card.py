"""The model card (README.md) and timm's fields of a Hugging Face folder's config.json (docs/weights.md)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import yaml

from bt_hub.common.optional import require
from bt_hub.common.records import (
    card_table,
    data_label,
    display_path,
    group_by_seed,
    mean_std,
    metric_label,
    one_value,
    read_records,
    record_fingerprint,
    seed_free_setting,
    seed_group_key,
    seeds_text,
    weights_label,
)
from bt_hub.method.transforms import IMAGENET_MEAN, IMAGENET_STD, transforms_for

TAGS = ["barlow-twins", "self-supervised-learning", "image-feature-extraction", "pytorch", "timm", "bt_hub"]
# timm builds ResNet(**model_args): this argument, unknown to timm, makes it refuse a small-stem folder by name.
SMALL_STEM_TIMM_ARG = "bt_hub_small_image_stem"
# The weights fingerprint earlier ``eval compare`` records carried for their baseline rows; newer ones name the
# baseline (pixels, random-init, supervised) in ``weights.baseline``.
BASELINE_FINGERPRINT = "baseline"


def _is_baseline(record: Mapping[str, Any]) -> bool:
    weights = record.get("weights")
    return (
        bool(isinstance(weights, Mapping) and weights.get("baseline"))
        or record_fingerprint(record) == BASELINE_FINGERPRINT
    )


def card_rows(
    results: Iterable[str | os.PathLike | Mapping[str, Any]],
    other_results: Iterable[str | os.PathLike | Mapping[str, Any]],
    sha256: str | None,
) -> dict[str, list[dict[str, Any]]]:
    """The card's records by whose they are: ``own`` (weights sha256 ``sha256``), ``baselines`` and ``others``.

    Raises:
        ValueError: a ``results`` record of other (or unknown) weights, naming the file, the record and both hashes.
    """
    rows: dict[str, list[dict[str, Any]]] = {"own": [], "baselines": [], "others": []}
    for sources, other in ((results, False), (other_results, True)):
        for source in sources:
            where = "a results record" if isinstance(source, Mapping) else f"results file {source}"
            for i, record in enumerate(read_records([source]), 1):
                theirs = record_fingerprint(record)
                if _is_baseline(record):
                    rows["baselines"].append(record)
                elif sha256 is not None and theirs == sha256:
                    rows["own"].append(record)
                elif other:
                    rows["others"].append(record)
                else:
                    ours = sha256 or "unknown (a network in memory, not a weights file: export its file or run folder)"
                    raise ValueError(
                        f"{where}, record {i} ({record.get('protocol')} on {data_label(record) or 'unknown data'}), "
                        f"is of weights sha256 {theirs or '(none recorded)'}, not of the exported weights' sha256 "
                        f"{ours}; pass it with --other-results to show it as another model's result"
                    )
    return rows


def described(record: Mapping[str, Any], weights_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The record with its network and image size in its protocol (``knn [resnet18, 7x7 stem, 32 px]``) or "unknown"."""
    hyper, known = record.get("settings") or record.get("hyperparameters") or {}, weights_config or {}
    arch = hyper.get("arch") or known.get("architecture") or "unknown architecture"
    small = known.get("small_image_stem") if hyper.get("small_image_stem") is None else hyper["small_image_stem"]
    stem = "3x3 small-image stem" if small is True else "7x7 stem" if small is False else "unknown stem"
    size = hyper.get("image_size") or known.get("image_size")
    network = "raw pixels, no network" if _baseline_name(record) == "pixels" else f"{arch}, {stem}"
    text = f"{network}, {f'{size} px' if size else 'unknown image size'}"
    return {**record, "protocol": f"{record.get('protocol', 'evaluation')} [{text}]"}


def _baseline_name(record: Mapping[str, Any]) -> str | None:
    weights = record.get("weights")
    if isinstance(weights, Mapping) and weights.get("baseline"):
        return str(weights["baseline"])
    return str(weights.get("name")) if _is_baseline(record) and isinstance(weights, Mapping) else None


def _task_name(record: Mapping[str, Any]) -> str:
    """A model-index task: the protocol with its network (``described``) and setting; a cell of ``eval compare``
    leaves out that command's own flags (baselines, protocols, seeds, ...), which say nothing of the cell."""
    of_compare = bool((record.get("notes") or {}).get("compare"))
    setting = seed_free_setting({**record, "overrides": {}} if of_compare else record)
    protocol = str(record.get("protocol", "evaluation"))
    return f"{protocol} ({setting})" if setting else protocol


def model_index(rows: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """The card's ``model-index``, written in the Hub's schema: one entry per protocol, setting and dataset."""
    results = []
    for group in group_by_seed(rows, seed_group_key):
        first = group[0]
        dataset = first.get("dataset")
        info = dataset if isinstance(dataset, Mapping) else {"name": display_path(dataset)}
        scored = (first.get("notes") or {}).get("split")  # the one split a label-free protocol scores (RankMe)
        split = (info.get(scored if scored in ("train", "test") else "test") or {}).get("split")
        metrics = []
        for metric in dict.fromkeys(m for r in group for m in r.get("metrics") or {}):
            values = [r["metrics"][metric] for r in group if metric in (r.get("metrics") or {})]
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
                continue
            mean, std = mean_std([float(v) for v in values])
            spread = f"mean ± {std:.1f} std over {seeds_text(len(values))}" if len(values) > 1 else seeds_text(1)
            if one_value(group, values):
                spread = f"{one_value(group, values)} over {seeds_text(len(values))}"
            metrics.append({"type": metric, "value": round(mean, 1), "name": f"{metric_label(metric)} ({spread})"})
        if not metrics:
            continue
        results.append(
            {
                "task": {
                    "type": (first.get("table") or {}).get("task", "image-classification"),
                    "name": _task_name(first),
                },
                "dataset": {
                    "name": data_label(first) or "unknown",
                    "type": str(info.get("name") or "unknown"),
                    **({"split": str(split)} if split else {}),
                },
                "metrics": metrics,
            }
        )
    return [{"name": name, "results": results}] if results else []


def results_section(
    results: Sequence[Mapping[str, Any]],
    baselines: Sequence[Mapping[str, Any]] = (),
    others: Sequence[Mapping[str, Any]] = (),
) -> str:
    """The card's "Evaluation": its own results, then baselines and other weights' results, one table per name."""
    parts = [f"## Evaluation\n\nResults of these weights:\n\n{card_table(results)}"]
    for title, rows, column in (
        ("Baselines, for comparison (not these weights, not pretrained)", baselines, "baseline"),
        ("Other weights' results, for comparison (not these weights)", others, "theirs"),
    ):
        if rows:
            parts.append(f"### {title}")
        for label in dict.fromkeys(weights_label(r) for r in rows):
            table = card_table([r for r in rows if weights_label(r) == label])
            parts.append(f"{label}:\n\n" + table.replace("| ours |", f"| {column} |", 1))
    return "\n\n".join(parts) + "\n"


def preprocessing(config: Mapping[str, Any]) -> tuple[int, int]:
    """``(resize, crop)`` sides of the weights' evaluation transforms."""
    preset = transforms_for(config)
    return int(preset.resize_size[0]), int(preset.crop_size[0])


def timm_crop_pct(resize: int, crop: int) -> float:
    """The ``crop_pct`` for which timm's eval transform resizes to ``resize`` (timm takes floor(crop / crop_pct)).

    ``crop / resize`` can land a hair below ``resize`` in floating point; half a pixel more is exact.
    """
    pct = crop / resize
    return pct if math.floor(crop / pct) == resize else crop / (resize + 0.5)


def timm_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The fields timm reads from config.json, from which timm builds bt_hub's own eval transform."""
    resize, crop = preprocessing(config)
    small = bool(config.get("small_image_stem"))
    fields: dict[str, Any] = {
        "num_classes": 0,
        "num_features": config["feature_dim"],
        "pretrained_cfg": {
            "tag": "barlowtwins",
            "input_size": [3, crop, crop],
            "interpolation": "bilinear",
            "crop_pct": timm_crop_pct(resize, crop),
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


def training_length(config: Mapping[str, Any]) -> str | None:
    """``20 of 110 steps (1.82 of 10 epochs, 11 steps per epoch); stopped before the end of the schedule``."""
    epochs, steps = config.get("epochs"), config.get("steps")
    batch, samples = (config.get("recipe") or {}).get("batch_size"), config.get("num_samples")
    per_epoch = samples // batch if isinstance(samples, int) and isinstance(batch, int) and batch > 0 else 0
    if epochs is None and steps is None:
        return None
    if steps is None:
        return f"{epochs} epochs planned (the steps done are not recorded)"
    if epochs is None or per_epoch <= 0:
        planned = f" of {epochs} epochs planned" if epochs is not None else ""
        return f"{steps} steps{planned} (the steps per epoch are not recorded)"
    planned = int(epochs) * per_epoch
    done_epochs = f"{steps / per_epoch:.2f}".rstrip("0").rstrip(".")
    text = f"{steps} of {planned} steps ({done_epochs} of {epochs} epochs, {per_epoch} steps per epoch)"
    return text + ("; stopped before the end of the schedule" if steps < planned else "")


_HOW_IT_RAN = ("seed", "decode", "views", "compile", "compile_reason", "precision", "precision_reason")


def recipe_differences(configs: Sequence[Mapping[str, Any]]) -> list[str]:
    """What pretraining runs' configs (``config.json``) differ in beyond their seed and how they ran
    (``projector: 256-256, 128-128``), and ``seed: 0, 0`` where runs share a seed: runs of one recipe differ in none.
    """
    flat = [{**c, **(c.get("recipe") or {})} for c in configs]
    keys = dict.fromkeys(k for f in flat for k in f if k not in (*_HOW_IT_RAN, "recipe") and not k.endswith("_s"))
    differ = [k for k in keys if len({repr(f.get(k)) for f in flat}) > 1]
    differ += ["seed"] if len({repr(f.get("seed")) for f in flat}) < len(flat) else []
    return [f"{k}: {', '.join(str(f.get(k)) for f in flat)}" for k in differ]


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


def _provenance_text(provenance: str | None) -> str:
    if not provenance:
        return (
            "of unknown provenance: these weights come from neither a bt_hub pretraining run nor registered "
            "Barlow Twins weights, so this card cannot say how they were trained."
        )
    return (
        "pretrained with Barlow Twins (Zbontar, Jing, Misra, LeCun, Deny: *Barlow Twins: Self-Supervised Learning "
        f"via Redundancy Reduction*, ICML 2021, https://arxiv.org/abs/2103.03230); provenance: {provenance}."
    )


def model_card(
    config: Mapping[str, Any],
    rows: Mapping[str, list[dict[str, Any]]],
    *,
    name: str | None,
    license: str = "apache-2.0",
) -> str:
    """The README.md of a Hugging Face folder; only ``rows["own"]`` reaches the model-index."""
    hf = require("huggingface_hub", "writing a model card")
    dataset = config.get("dataset")
    small = bool(config.get("small_image_stem"))
    arch = config.get("architecture", "resnet50")
    provenance = config.get("provenance")
    title = name or (f"Barlow Twins {arch}" if provenance else f"{arch} backbone")
    data = hf.ModelCardData(
        library_name="bt_hub",
        license=license,
        tags=[t for t in TAGS if not (t == "timm" and small or t == "barlow-twins" and not provenance)],
        pipeline_tag="image-feature-extraction",
        datasets=[str(display_path(dataset))] if dataset else None,
        model_name=name,
    ).to_dict()
    own, baselines, others = (
        [described(r, config if k == "own" else None) for r in rows.get(k, [])] for k in ("own", "baselines", "others")
    )
    if index := model_index(own, title):
        data["model-index"] = index
    dim = config.get("feature_dim", 2048)
    resize, crop = preprocessing(config)
    stem = "bt_hub's small-image stem (3x3 stride-1 convolution, no max-pool)" if small else "torchvision's 7x7 stem"
    recipe = {k: config[k] for k in ("dataset", "projector", "lambd", "image_size") if k in config}
    if "dataset" in recipe:
        recipe["dataset"] = display_path(recipe["dataset"])
    if (length := training_length(config)) is not None:
        recipe["training length"] = length
    recipe.update(config.get("recipe") or {})
    recipe_rows = "\n".join(f"| {k} | {v} |" for k, v in recipe.items()) or "| (not recorded) | |"
    return f"""---
{yaml.safe_dump(data, sort_keys=False, allow_unicode=True).strip()}
---

# {title}

A {arch} backbone with {stem}, {_provenance_text(provenance)}
torchvision parameter names, `fc = Identity`: the output is a {dim}-d feature vector, not class scores.

Preprocessing (the weights' own evaluation transforms, `backbone.transforms`): resize to {resize} (bilinear),
centre crop {crop}, ImageNet mean {list(IMAGENET_MEAN)}, std {list(IMAGENET_STD)}.

## Usage

{_usage(config, name or "<org>/<name>")}

## Training

| setting | value |
|---|---|
{recipe_rows}

{results_section(own, baselines, others)}"""
