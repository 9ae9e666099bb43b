"""Evaluation results records: the schema, their human labels, the paper's numbers, reading and rendering.

One record per evaluation run (``bt-hub eval``), a JSON object::

    schema          "bt_hub.results/3" (3: the record says which paper row it follows, paper_task)
    protocol        linear | semi | transfer | knn | voc07-svm | detect | ...
    mode            cached | loop | features (MODES gives the words: "cached features, no augmentation", ...)
    preset          the preset the run started from (None when the protocol has none)
    paper_task      the key of PAPER_RESULTS whose setting the run follows, as its protocol says (or None)
    overrides       {field: {"value": ..., "preset": ...}}: every hyper-parameter changed from the preset
    hyperparameters the whole config (absolute paths reduced to their base name)
    labels          semi-supervised only: fraction, source (seeded / SimCLR list), file, sha256, count, seed
    dataset         name, path (relative or base name only), fingerprint, train / test splits (split name,
                    size, fingerprint), holdout (fraction, seed, sha256 of the held-out indices), overlap check
    weights         name (base name, URL or Hub id) and fingerprint (sha256 of the file)
    seed, metrics (flat, percent, the paper's names: top1, top5, mAP, ...), wall_time_s, timestamp,
    versions        bt_hub, torch, torchvision, python, git sha and dirty flag
    warnings        what the run found doubtful (a preset far from the data, ...)
    notes           protocol extras (per-class APs, backend, ...)

``eval/report.py`` writes and tabulates records and the model card (bt_hub/weights/card.py) shows
them; both use the labels and formatting here, so a result reads the same everywhere.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bt_hub.common.runs import config_dict, git_state, package_version

SCHEMA = "bt_hub.results/3"
RESULT_FILES = ("results.json", "results.jsonl", "results.md")

PROTOCOLS = {
    "linear": "linear probe",
    "transfer": "linear transfer",
    "semi": "semi-supervised fine-tuning",
    "knn": "weighted kNN",
    "voc07-svm": "VOC07 linear SVMs",
    "detect": "detection transfer",
}
MODES = {
    "cached": "cached features, no augmentation",
    "loop": "paper loop with augmentation",
    "features": "frozen features, no training",
}
METRIC_LABELS = {
    "top1": "Top-1",
    "top5": "Top-5",
    "mAP": "mAP",
    "mAP_11point": "mAP (11-point)",
    **{
        f"{task}_{m}": f"{kind} {m}"
        for task, kind in (("bbox", "box"), ("segm", "mask"))
        for m in ("AP", "AP50", "AP75")
    },
}

# The paper's Barlow Twins numbers (ResNet-50, 1000 epochs; Tables 1-4 of Zbontar et al., 2021).
PAPER_NAME = "Barlow Twins paper (ResNet-50, 1000 epochs)"
PAPER_RESULTS: dict[str, dict[str, float]] = {
    "imagenet_linear": {"top1": 73.2, "top5": 91.0},
    "semi_supervised_1pct": {"top1": 55.0, "top5": 79.2},
    "semi_supervised_10pct": {"top1": 69.7, "top5": 89.3},
    "places205_linear": {"top1": 54.1},
    "voc07_svm": {"mAP": 86.2},
    "inat18_linear": {"top1": 46.5},
    "voc07+12_faster_rcnn_c4": {"bbox_AP": 56.8, "bbox_AP50": 82.6, "bbox_AP75": 63.4},
    "coco_mask_rcnn_c4_1x": {
        "bbox_AP": 39.2,
        "bbox_AP50": 59.0,
        "bbox_AP75": 42.5,
        "segm_AP": 34.3,
        "segm_AP50": 56.0,
        "segm_AP75": 36.5,
    },
}
# (dataset, setting in the words of ``setting``) of each paper number, for its row beside ours.
PAPER_SETTINGS = {
    "imagenet_linear": ("ImageNet", "preset imagenet; paper loop with augmentation"),
    "semi_supervised_1pct": (
        "ImageNet",
        "1% labels (SimCLR list 1percent.txt); preset paper; paper loop with augmentation",
    ),
    "semi_supervised_10pct": (
        "ImageNet",
        "10% labels (SimCLR list 10percent.txt); preset paper; paper loop with augmentation",
    ),
    "places205_linear": ("Places-205", "preset places205; paper loop with augmentation"),
    "voc07_svm": ("VOC2007", "frozen features, no training"),
    "inat18_linear": ("iNat18", "preset inat18; paper loop with augmentation"),
    "voc07+12_faster_rcnn_c4": (
        "VOC07+12 (test: VOC07 test)",
        "preset voc; Faster R-CNN R50-C4, 24k iterations, 5 trials",
    ),
    "coco_mask_rcnn_c4_1x": ("COCO 2017 (test: val2017)", "preset coco; Mask R-CNN R50-C4, 1x schedule"),
}
# The folder names (lower case, letters and digits only) of each paper number's dataset, and the size of the
# test split the paper scored on: the paper's number sits beside ours only on that data (``paper_comparable``).
_IMAGENET = ("imagenet", "imagenet1k", "in1k", "ilsvrc", "ilsvrc2012", "imagenet2012")
PAPER_DATASETS: dict[str, tuple[tuple[str, ...], int]] = {
    "imagenet_linear": (_IMAGENET, 50000),
    "semi_supervised_1pct": (_IMAGENET, 50000),
    "semi_supervised_10pct": (_IMAGENET, 50000),
    "places205_linear": (("places205", "places"), 20500),
    "voc07_svm": (("voc2007", "voc07"), 4952),
    "inat18_linear": (("inat18", "inat2018", "inaturalist2018", "inaturalist"), 24426),
    "voc07+12_faster_rcnn_c4": (("voc", "vocdevkit", "voc0712", "voc2007", "voc2012"), 4952),
    "coco_mask_rcnn_c4_1x": (("coco", "coco2017", "mscoco"), 5000),
}

Record = dict[str, Any]


# ----------------------------------------------------------------------------- building a record


def display_path(value: Any) -> Any:
    """A path safe to publish: URLs, Hub ids and relative paths as given, absolute paths by base name (lists too)."""
    if isinstance(value, list):
        return [display_path(v) for v in value]
    if not isinstance(value, str) or "://" in value:
        return value
    expanded = os.path.expanduser(value)
    return Path(expanded).name if os.path.isabs(expanded) else value


def versions() -> dict[str, Any]:
    """bt_hub, torch, torchvision, numpy and Python versions, and the git state of the checkout."""
    import numpy
    import torch
    import torchvision

    return {
        "bt_hub": package_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
        **git_state(),
    }


def make_record(
    *,
    protocol: str,
    metrics: Mapping[str, float],
    config: Any,
    preset: str | None,
    mode: str | None,
    weights: Mapping[str, Any],
    dataset: Mapping[str, Any],
    seed: int,
    wall_time_s: float,
    overrides: Mapping[str, Any] | None = None,
    labels: Mapping[str, Any] | None = None,
    warnings: Sequence[str] = (),
    notes: Mapping[str, Any] | None = None,
    paper_task: str | None = None,
) -> Record:
    """A results record (see the module docstring); raises on metrics that are not flat numbers."""
    bad = {k: v for k, v in metrics.items() if not isinstance(v, (int, float)) or isinstance(v, bool)}
    if bad:
        raise ValueError(f"metrics must be a flat dict of numbers; got {bad!r}")
    if mode is not None and mode not in MODES:
        raise ValueError(f"mode {mode!r} is unknown; expected one of {sorted(MODES)}")
    if paper_task is not None and paper_task not in PAPER_RESULTS:
        raise ValueError(f"paper_task {paper_task!r} is unknown; expected one of {sorted(PAPER_RESULTS)}")
    record: Record = {
        "schema": SCHEMA,
        "protocol": protocol,
        "mode": mode,
        "mode_description": MODES.get(mode or ""),
        "preset": preset,
        "paper_task": paper_task,
        "overrides": {k: {kk: display_path(vv) for kk, vv in v.items()} for k, v in (overrides or {}).items()},
        "hyperparameters": {k: display_path(v) for k, v in config_dict(config).items()},
        "dataset": {k: display_path(v) if k == "path" else v for k, v in dataset.items()},
        "weights": {k: display_path(v) if k == "name" else v for k, v in weights.items()},
        "seed": int(seed),
        "metrics": {k: float(v) for k, v in metrics.items()},
        "wall_time_s": float(wall_time_s),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": versions(),
        "warnings": list(warnings),
    }
    if labels:
        record["labels"] = dict(labels)
    if notes:
        record["notes"] = dict(notes)
    return json.loads(json.dumps(record, default=str))


# ----------------------------------------------------------------------------- reading


def records_in(data: Any, source: str = "results") -> list[Record]:
    """The records in parsed JSON: a record, a list of records, or ``bt-hub eval all``'s ``{"results": [...]}``."""
    if isinstance(data, Mapping) and "results" in data and "metrics" not in data:
        data = data["results"]
    rows = data if isinstance(data, list) else [data]
    for row in rows:
        if not isinstance(row, Mapping) or not isinstance(row.get("metrics"), Mapping):
            raise ValueError(
                f"{source} holds an entry without a 'metrics' object; "
                "expected the results.json or results.jsonl that bt-hub eval writes"
            )
    return [dict(r) for r in rows]


def read_records(sources: Iterable[str | os.PathLike | Mapping[str, Any]]) -> list[Record]:
    """Records from ``results.json`` (one run, or ``eval all``'s summary), ``results.jsonl`` files or dicts."""
    records: list[Record] = []
    for source in sources:
        if isinstance(source, Mapping):
            records += records_in(source)
            continue
        path = Path(source)
        try:
            text = path.read_text(encoding="utf-8")
            if path.suffix == ".jsonl":
                data: Any = [json.loads(line) for line in text.splitlines() if line.strip()]
            else:
                data = json.loads(text)
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"results file {path} is not readable JSON ({err})") from err
        records += records_in(data, f"results file {path}")
    return records


# ----------------------------------------------------------------------------- labels


def fmt(value: Any) -> str:
    """A metric as the paper prints it: one decimal; '—' for a missing or non-finite value."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return f"{value:.1f}"
    return "—"


def metric_label(name: str) -> str:
    """``top1`` -> ``Top-1``, ``top1_k20`` -> ``k=20 Top-1``, other names unchanged."""
    base, _, k = name.partition("_k")
    if k.isdigit() and base in METRIC_LABELS:
        return f"k={k} {METRIC_LABELS[base]}"
    return METRIC_LABELS.get(name, name)


def label_fraction(record: Mapping[str, Any]) -> float | None:
    """The label percentage of a semi-supervised record (1, 10, ...), None for other protocols."""
    labels = record.get("labels") or {}
    if labels.get("fraction") is not None:
        return labels["fraction"]
    hyper = record.get("hyperparameters") or {}
    if hyper.get("fraction") is not None:
        return hyper["fraction"]
    name = Path(str(hyper.get("subset_file") or "")).name
    return next((pct for pct in (10, 1) if name.startswith(f"{pct}percent")), None)


def labels_text(record: Mapping[str, Any]) -> str:
    """``1% labels (seeded class-balanced, seed 0)``, ``10% labels (SimCLR list 10percent.txt)``; '' when not semi."""
    pct = label_fraction(record)
    if pct is None:
        return ""
    labels = record.get("labels") or {}
    source = labels.get("source")
    if source == "list":
        published = labels.get("published")
        source = (
            f"SimCLR list {published}"
            if published
            else f"list {labels.get('file')}, sha256 {str(labels.get('sha256'))[:8]}"
        )
    elif source == "seeded":
        source = f"seeded class-balanced, seed {labels.get('seed')}"
    return f"{_number(pct)}% labels" + (f" ({source})" if source else "")


def overrides_text(record: Mapping[str, Any]) -> str:
    """``epochs 5 (preset 100), lr 0.1 (preset 0.3)``: the hyper-parameters changed from the preset (or defaults)."""
    items = (record.get("overrides") or {}).items()
    source = "preset" if record.get("preset") else "default"
    return ", ".join(f"{name} {_value(o.get('value'))} ({source} {_value(o.get('preset'))})" for name, o in items)


def setting(record: Mapping[str, Any]) -> str:
    """What was run, in words: labels, preset, mode, a grid search, changed hyper-parameters, a held-out test split."""
    parts = [labels_text(record)]
    if record.get("preset"):
        parts.append(f"preset {record['preset']}")
    parts.append(MODES.get(str(record.get("mode")), ""))
    notes = record.get("notes") or {}
    if notes.get("search") == "grid" or "chosen" in notes:  # the probe chose its LR and decay on validation data
        parts.append("grid of heads chosen on a validation split")
    parts.append(overrides_text(record))
    holdout = (record.get("dataset") or {}).get("holdout") if isinstance(record.get("dataset"), Mapping) else None
    if holdout:
        parts.append(f"test: held-out {_number(100 * holdout['fraction'])}% of train (seed {holdout['seed']})")
    return "; ".join(p for p in parts if p)


def data_label(record: Mapping[str, Any]) -> str:
    """The dataset's name, and the test split it was scored on when that is not obvious."""
    dataset = record.get("dataset")
    if not isinstance(dataset, Mapping):
        return Path(str(dataset or "")).name or str(dataset or "")
    name = str(dataset.get("name") or "")
    test = (dataset.get("test") or {}).get("split")
    return f"{name} ({test})" if test and test not in ("val", "test") else name


def weights_label(record: Mapping[str, Any]) -> str:
    """``resnet50.pth (1f2e3d4c)``: the weights' name and the start of their fingerprint."""
    weights = record.get("weights")
    if isinstance(weights, Mapping):
        name, fingerprint = weights.get("name"), weights.get("fingerprint")
    else:
        name, fingerprint = weights, record.get("weights_sha256")
    return f"{Path(str(name or '')).name} ({str(fingerprint or '')[:8]})"


def paper_task(record: Mapping[str, Any]) -> str | None:
    """The key of ``PAPER_RESULTS`` of the paper's protocol this record follows (its protocol decided), else None."""
    task = record.get("paper_task")
    return task if task in PAPER_RESULTS else None


def paper_comparable(record: Mapping[str, Any]) -> str | None:
    """``paper_task`` when the data is the paper's too (``PAPER_DATASETS``: folder name, test split size), else None.

    A run on the paper's protocol but other data (a preset imagenet probe on the digits, a held-out part
    of ImageNet's train split, a 10-class ImageNet subset) gets no paper number beside it.
    """
    task = paper_task(record)
    if task is None:
        return None
    names, test_size = PAPER_DATASETS[task]
    dataset = record.get("dataset")
    info = dataset if isinstance(dataset, Mapping) else {"name": Path(str(dataset or "")).name}
    size = (info.get("test") or {}).get("size")
    if re.sub(r"[^a-z0-9]", "", str(info.get("name") or "").lower()) not in names or info.get("holdout"):
        return None
    return task if size is None or size == test_size else None


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return str(value)


# ----------------------------------------------------------------------------- seeds


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1 in the denominator; 0 for one value) of per-seed values."""
    if not values:
        raise ValueError("mean_std needs at least one value")
    n = len(values)
    mean = sum(values) / n
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0


def fmt_mean_std(values: Sequence[Any]) -> str:
    """``71.2 ± 0.4`` over several seeds, ``71.2`` for one; '—' when a value is missing or not finite."""
    if not values or any(fmt(v) == "—" for v in values):
        return "—"
    if len(values) == 1:
        return fmt(values[0])
    mean, std = mean_std([float(v) for v in values])
    return f"{mean:.1f} ± {std:.1f}"


def seeds_text(count: int) -> str:
    """``1 seed``, ``3 seeds``."""
    return f"{count} seed" + ("" if count == 1 else "s")


def group_by_seed(
    records: Sequence[Mapping[str, Any]], key: Callable[[Mapping[str, Any]], Hashable]
) -> list[list[Mapping[str, Any]]]:
    """Records that differ only in their seed, grouped by ``key``, in order of first appearance.

    A group holds each seed once: a seed met again under the same key starts a new group, so
    running seeds 0, 1, 2 twice gives two groups of three and no record is dropped or counted twice.
    """
    groups: list[list[Mapping[str, Any]]] = []
    latest: dict[Hashable, list[Mapping[str, Any]]] = {}
    for record in records:
        k = key(record)
        group = latest.get(k)
        if group is None or any(r.get("seed") == record.get("seed") for r in group):
            group = latest[k] = []
            groups.append(group)
        group.append(record)
    return groups


def seed_free_setting(record: Mapping[str, Any]) -> str:
    """``setting`` without what the run's seed chose: a seeded label subset or held-out split drawn with that seed."""
    seed = record.get("seed")
    labels = dict(record.get("labels") or {})
    if labels.get("source") == "seeded" and labels.get("seed") == seed:
        labels["source"] = "seeded class-balanced, one subset per seed"
    dataset = record.get("dataset")
    holdout = dataset.get("holdout") if isinstance(dataset, Mapping) else None
    if isinstance(holdout, Mapping) and seed is not None and holdout.get("seed") == seed:
        dataset = {**dataset, "holdout": {**holdout, "seed": "of each run"}}
    return setting({**record, "labels": labels, "dataset": dataset})


def seed_group_key(record: Mapping[str, Any]) -> tuple[str, str, str, str]:
    """``group_by_seed``'s key for runs that differ only in their seed: (weights, protocol, dataset, setting)."""
    return weights_label(record), str(record.get("protocol", "")), data_label(record), seed_free_setting(record)


# ----------------------------------------------------------------------------- rendering


def summary_text(records: Sequence[Mapping[str, Any]], written: Sequence[str | os.PathLike] = ()) -> str:
    """The short table ``bt-hub eval`` prints at the end: one row per run, then the files written."""
    rows = [("protocol", "setting", "data", "metrics")]
    for r in records:
        metrics = "  ".join(f"{metric_label(k)} {fmt(v)}" for k, v in (r.get("metrics") or {}).items())
        rows.append((str(r.get("protocol", "")), setting(r) or "—", data_label(r) or "—", metrics))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3] for row in rows]
    lines += [f"wrote {path}" for path in written]
    return "\n".join(line.rstrip() for line in lines)


def card_table(records: Sequence[Mapping[str, Any]]) -> str:
    """A markdown table for the model card: one row per run and metric, with the paper's value where it applies.

    Runs that differ only in their seed (``seed_group_key``) share a row: ours is the mean ± sample standard
    deviation over them, beside the number of seeds ("1 seed" for one run). The paper column is filled only
    where protocol and data are the paper's (``paper_comparable``).
    """
    lines = ["| protocol | setting | data | metric | ours | seeds | paper |", "|---|---|---|---|---|---|---|"]
    for group in group_by_seed(records, seed_group_key):
        first = group[0]
        paper = PAPER_RESULTS.get(paper_comparable(first) or "", {})
        for metric in dict.fromkeys(m for r in group for m in r.get("metrics") or {}):
            values = [r["metrics"][metric] for r in group if metric in (r.get("metrics") or {})]
            cells = [
                str(first.get("protocol", "")),
                seed_free_setting(first) or "—",
                data_label(first) or "—",
                metric_label(metric),
                fmt_mean_std(values),
                seeds_text(len(values)),
                fmt(paper.get(metric)),
            ]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    if len(lines) == 2:
        lines.append("| (none given) | | | | | | |")
    return "\n".join(lines)
