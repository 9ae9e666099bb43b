"""Evaluation results records: the schema, their human labels, reading and rendering.

A protocol writes into its record what the tables need (its ``paper`` row, its results.md ``table``, the
label ``fraction``), so this module knows no protocol, preset or file name; docs/evaluation.md lists the fields.
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

from bt_hub.common.config import config_dict
from bt_hub.common.runs import git_state, package_version

SCHEMA = "bt_hub.results/4"
RESULT_FILES = ("results.json", "results.jsonl", "results.md")

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

Record = dict[str, Any]
# a record's ``settings.<name>_from`` naming what the weights said of themselves, and those words in a sentence
FROM_WEIGHTS = {f"weights {part}": f"the weights' {part}" for part in ("metadata", "config.json", "keys")}


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
    paper: Mapping[str, Any] | None = None,
    table: Mapping[str, Any] | None = None,
) -> Record:
    """A results record (see the module docstring); raises on metrics that are not flat numbers."""
    bad = {k: v for k, v in metrics.items() if not isinstance(v, (int, float)) or isinstance(v, bool)}
    if bad:
        raise ValueError(f"metrics must be a flat dict of numbers; got {bad!r}")
    if mode is not None and mode not in MODES:
        raise ValueError(f"mode {mode!r} is unknown; expected one of {sorted(MODES)}")
    record: Record = {
        "schema": SCHEMA,
        "protocol": protocol,
        "mode": mode,
        "mode_description": MODES.get(mode or ""),
        "preset": preset,
        "paper": dict(paper) if paper else None,
        "table": dict(table) if table else None,
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
    record |= {key: dict(given) for key, given in (("labels", labels), ("notes", notes)) if given}
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


def labels_text(record: Mapping[str, Any]) -> str:
    """The record's label subset in words (``1% labels (seeded class-balanced, seed 0)``); '' without one."""
    labels = record.get("labels") or {}
    pct = labels.get("fraction")
    if pct is None:
        return ""
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
    return f"{_value(pct)}% labels" + (f" ({source})" if source else "")


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
        parts.append(f"test: held-out {_value(100 * holdout['fraction'])}% of train (seed {holdout['seed']})")
    return "; ".join(p for p in parts if p)


def data_label(record: Mapping[str, Any]) -> str:
    """The dataset's name, and the test split it was scored on when that is not obvious."""
    dataset = record.get("dataset")
    if not isinstance(dataset, Mapping):
        return Path(str(dataset or "")).name or str(dataset or "")
    name = str(dataset.get("name") or "")
    test = (dataset.get("test") or {}).get("split")
    return f"{name} ({test})" if test and test not in ("val", "test", "none") else name


def weights_label(record: Mapping[str, Any]) -> str:
    """``resnet50.pth (1f2e3d4c)``: the weights' name and the start of their fingerprint; ``pixels (baseline)`` for
    a baseline of ``eval compare``, which has no weights file."""
    weights = record.get("weights")
    if isinstance(weights, Mapping) and weights.get("baseline"):
        return f"{weights['baseline']} (baseline)"
    name = Path(str((weights.get("name") if isinstance(weights, Mapping) else weights) or "")).name
    fingerprint = record_fingerprint(record)
    return f"{name} ({fingerprint[:8]})" if fingerprint else name


def record_fingerprint(record: Mapping[str, Any]) -> str | None:
    """The fingerprint (sha256) of the weights a record scored (``weights_sha256`` in older records), or None."""
    weights = record.get("weights")
    found = weights.get("fingerprint") if isinstance(weights, Mapping) else record.get("weights_sha256")
    return str(found) if found else None


def paper_comparable(record: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The record's ``paper`` row where it applies to the record (:func:`paper_mismatch` finds no difference), else
    None: results.md and the model card show the paper's numbers only beside such a record."""
    paper = record.get("paper")
    return paper if isinstance(paper, Mapping) and paper_mismatch(record) is None else None


def paper_mismatch(record: Mapping[str, Any]) -> str | None:
    """Why the record's ``paper`` row (its protocol's, chosen when it ran) does not apply to the record, in words:
    the data is not the paper's (folder name, test split size, a held-out part of the training split), or the
    labelled subset is not the paper's list (``paper.labels``, matched by the sha256 the record's ``labels`` carry);
    None where it applies or the record follows no paper row."""
    paper, dataset = record.get("paper"), record.get("dataset")
    if not isinstance(paper, Mapping):
        return None
    if not isinstance(dataset, Mapping) or dataset.get("holdout"):
        return f"the run was not scored on {paper.get('data')}'s test split"
    name, size = str(dataset.get("name") or ""), (dataset.get("test") or {}).get("size")
    if re.sub(r"[^a-z0-9]", "", name.lower()) not in paper.get("folders", ()):
        return f"the data is {name or 'unnamed'}, not {paper.get('data')}"
    if size is not None and size != paper.get("test_size"):
        return f"the test split has {size} images, not {paper.get('data')}'s {paper.get('test_size')}"
    wanted, labels = paper.get("labels"), record.get("labels") or {}
    if wanted and labels.get("published") != wanted:
        subset = "a seeded subset" if labels.get("source") == "seeded" else f"the list {labels.get('file', 'given')}"
        return f"the labels are {subset}, not the paper's {wanted}"
    return None


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


def one_value(group: Sequence[Mapping[str, Any]], values: Sequence[Any]) -> str | None:
    """Why several seeds gave one value, in words (``deterministic``: a score the seed does not touch, as its
    record's ``notes.deterministic`` says; else ``alike``), or None when they differ or there is only one."""
    if len(values) < 2 or len({fmt(v) for v in values}) > 1:
        return None
    deterministic = all((r.get("notes") or {}).get("deterministic") is True for r in group)
    return "deterministic: one value" if deterministic else "alike: one value"


def seeds_text(count: int) -> str:
    """``1 seed``, ``3 seeds``."""
    return f"{count} seed" + ("" if count == 1 else "s")


def group_by_seed(
    records: Sequence[Mapping[str, Any]], key: Callable[[Mapping[str, Any]], Hashable]
) -> list[list[Mapping[str, Any]]]:
    """Records that differ only in their seed, grouped by ``key``; a seed met again starts a new group."""
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


def settings_text(settings: Mapping[str, Any]) -> str:
    """An evaluation's resolved settings (a record's ``settings``) in words, each with where it came from."""

    def source(key: str) -> str:
        found = settings.get(f"{key}_from")
        if not found or found == "default":
            return f" ({found})" if found else ""
        return f" (from {FROM_WEIGHTS.get(found, found)})"

    stem = "small-image stem (3x3, no max-pool)" if settings.get("small_image_stem") else "standard stem"
    parts = [
        f"{settings.get('arch')}{source('arch')}, {stem}{source('small_image_stem')}",
        f"images {settings.get('image_size')} px{source('image_size')}",
    ]
    if settings.get("normalisation"):
        parts.append(f"{settings['normalisation']}{source('normalisation')}")
    parts.append(f"precision {settings.get('precision')} on {settings.get('device')}{source('precision')}")
    if settings.get("weights_run"):
        parts.append(f"weights of pretraining run {settings['weights_run']}")
    return "; ".join(parts)


def summary_text(records: Sequence[Mapping[str, Any]], written: Sequence[str | os.PathLike] = ()) -> str:
    """The short table ``bt-hub eval`` prints at the end: one row per run, the settings the runs resolved (each with
    its source), then the files written."""
    rows = [("protocol", "setting", "data", "metrics")]
    for r in records:
        metrics = "  ".join(f"{metric_label(k)} {fmt(v)}" for k, v in (r.get("metrics") or {}).items())
        rows.append((str(r.get("protocol", "")), setting(r) or "—", data_label(r) or "—", metrics))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3] for row in rows]
    resolved = dict.fromkeys(settings_text(r["settings"]) for r in records if isinstance(r.get("settings"), Mapping))
    lines += [f"settings: {text}" for text in resolved]
    lines += [f"wrote {path}" for path in written]
    return "\n".join(line.rstrip() for line in lines)


def card_table(records: Sequence[Mapping[str, Any]]) -> str:
    """The model card's markdown table: one row per run and metric (seeds averaged) with the paper's value."""
    lines = ["| protocol | setting | data | metric | ours | seeds | paper |", "|---|---|---|---|---|---|---|"]
    for group in group_by_seed(records, seed_group_key):
        first = group[0]
        paper = (paper_comparable(first) or {}).get("metrics") or {}
        for metric in dict.fromkeys(m for r in group for m in r.get("metrics") or {}):
            values = [r["metrics"][metric] for r in group if metric in (r.get("metrics") or {})]
            cells = [
                str(first.get("protocol", "")),
                seed_free_setting(first) or "—",
                data_label(first) or "—",
                metric_label(metric),
                fmt_mean_std(values[:1] if one_value(group, values) else values),
                seeds_text(len(values)) + (f", {one_value(group, values)}" if one_value(group, values) else ""),
                fmt(paper.get(metric)),
            ]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    if len(lines) == 2:
        lines.append("| (none given) | | | | | | |")
    return "\n".join(lines)
