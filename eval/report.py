"""Evaluation results: ``results.json`` per run and a ``results.md`` laid out like the paper's tables.

Every protocol ends with ``write_results``. It writes ``<out>/results.json`` (what was
run, on which weights and data, with which hyper-parameters, and the metrics), appends
the same record as one line to ``<out>/results.jsonl`` and rewrites ``<out>/results.md``
from that history: one table per protocol family (linear, semi-supervised, transfer,
detection, kNN), with the paper's Barlow Twins row (PROTOCOLS.md §4) above ours for reference.

``metrics`` is a flat dict of floats named as in the paper, in percent: ``top1``,
``top5``, ``mAP``, ``mAP_11point``, ``bbox_AP50``, ``segm_AP``, ... (the model card of bt_hub.hub reads them).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from bt_hub.runs import atomic_write_json, atomic_write_text, config_dict, git_state, package_version

PAPER_METHOD = "Barlow Twins (paper: ResNet-50, 1000 epochs)"


def _fraction(result: Mapping[str, Any]) -> Optional[int]:
    """The label percentage of a semi-supervised run (config ``fraction`` or the subset file's name)."""
    config = result.get("hyperparameters") or {}
    if config.get("fraction") is not None:
        return int(config["fraction"])
    name = Path(str(config.get("subset_file") or "")).name
    for pct in (10, 1):
        if name.startswith(f"{pct}percent"):
            return pct
    return None


def _preset(result: Mapping[str, Any]) -> str:
    return str(result.get("preset") or "")


@dataclass(frozen=True)
class Column:
    """A metric column: its header, the metric key it shows, and which runs fill it."""

    header: str
    metric: str
    applies: Callable[[Mapping[str, Any]], bool] = lambda result: True


@dataclass(frozen=True)
class Family:
    """One table: a title, its metric columns and the paper's values by column header."""

    title: str
    columns: tuple[Column, ...]
    paper: Mapping[str, float]


def _detection_columns(*kinds: str) -> tuple[Column, ...]:
    """AP / AP50 / AP75 columns of ``bt-hub detect`` for ``box`` (metrics ``bbox_*``) and ``mask`` (``segm_*``)."""
    prefix = {"box": "bbox", "mask": "segm"}
    return tuple(Column(f"{kind} {m}", f"{prefix[kind]}_{m}") for kind in kinds for m in ("AP", "AP50", "AP75"))


FAMILIES: dict[str, Family] = {
    "linear": Family(
        "Linear evaluation (ImageNet protocol; paper Table 1)",
        (Column("Top-1", "top1"), Column("Top-5", "top5")),
        {"Top-1": 73.2, "Top-5": 91.0},
    ),
    "semi": Family(
        "Semi-supervised fine-tuning (paper Table 2)",
        tuple(
            Column(f"{pct}% {name}", metric, lambda r, pct=pct: _fraction(r) == pct)
            for pct in (1, 10)
            for name, metric in (("Top-1", "top1"), ("Top-5", "top5"))
        ),
        {"1% Top-1": 55.0, "1% Top-5": 79.2, "10% Top-1": 69.7, "10% Top-5": 89.3},
    ),
    "transfer": Family(
        "Transfer to other classification tasks (paper Table 3)",
        (
            Column("Places-205 Top-1", "top1", lambda r: _preset(r) == "places205"),
            Column("VOC07 SVM mAP", "mAP", lambda r: r.get("protocol") == "voc07-svm"),
            Column("VOC07 SVM mAP (11-point)", "mAP_11point", lambda r: r.get("protocol") == "voc07-svm"),
            Column("iNat18 Top-1", "top1", lambda r: _preset(r) == "inat18"),
        ),
        {"Places-205 Top-1": 54.1, "VOC07 SVM mAP": 86.2, "iNat18 Top-1": 46.5},
    ),
    "detect_voc": Family(
        "Detection transfer: VOC07+12 Faster R-CNN R50-C4 (paper Table 4)",
        _detection_columns("box"),
        {"box AP": 56.8, "box AP50": 82.6, "box AP75": 63.4},
    ),
    "detect_coco": Family(
        "Detection transfer: COCO Mask R-CNN R50-C4 1x (paper Table 4)",
        _detection_columns("box", "mask"),
        {"box AP": 39.2, "box AP50": 59.0, "box AP75": 42.5, "mask AP": 34.3, "mask AP50": 56.0, "mask AP75": 36.5},
    ),
    "detect": Family("Detection on other data (e.g. the generated-shapes installation check; no paper row)", _detection_columns("box", "mask"), {}),
    "knn": Family(
        "Weighted kNN (community protocol, not in the paper)",
        tuple(Column(f"k={k} {name}", f"{metric}_k{k}") for k in (20, 200) for name, metric in (("Top-1", "top1"), ("Top-5", "top5"))),
        {},
    ),
}


def family_of(result: Mapping[str, Any]) -> str:
    """The table a result belongs to (``linear``, ``semi``, ``transfer``, ``detect_voc`` / ``detect_coco`` / ``detect``, ``knn`` or its protocol)."""
    protocol = str(result.get("protocol", ""))
    if protocol == "linear" and _preset(result) in ("places205", "inat18"):
        return "transfer"
    if protocol in ("transfer", "voc07-svm"):
        return "transfer"
    if protocol in ("semi", "semi_supervised", "semi-supervised"):
        return "semi"
    if protocol == "detect":
        return {"voc": "detect_voc", "coco": "detect_coco"}.get(_preset(result), "detect")
    return protocol


def _fmt(value: Any) -> str:
    if isinstance(value, (int, float)) and math.isfinite(value):
        return f"{value:.1f}"
    return "—"


def render_table(results: list[Mapping[str, Any]]) -> str:
    """Markdown tables, one per protocol family, the paper's row first, then one row per result."""
    by_family: dict[str, list[Mapping[str, Any]]] = {}
    for result in results:
        by_family.setdefault(family_of(result), []).append(result)
    order = [f for f in FAMILIES if f in by_family] + sorted(f for f in by_family if f not in FAMILIES)
    sections = []
    for name in order:
        rows = by_family[name]
        family = FAMILIES.get(name, Family(f"{name}", (), {}))
        columns = list(family.columns)
        for r in rows:  # metrics of a run that fits no fixed column get columns of their own
            if not any(c.applies(r) and c.metric in r.get("metrics", {}) for c in columns):
                columns += [Column(m, m, lambda x, m=m: True) for m in r.get("metrics", {}) if all(c.header != m for c in columns)]
        header = ["Method", "Weights", "Data", "Preset"] + [c.header for c in columns] + ["Wall time (s)"]
        lines = [f"### {family.title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        if family.paper:
            lines.append("| " + " | ".join([PAPER_METHOD, "paper", "ImageNet", "paper"] + [_fmt(family.paper.get(c.header)) for c in columns] + ["—"]) + " |")
        for r in rows:
            weights = f"{Path(str(r.get('weights', ''))).name} ({str(r.get('weights_sha256') or '')[:8]})"
            cells = [f"ours: {r.get('protocol')}", weights, str(r.get("dataset", "")), _preset(r) or "—"]
            cells += [_fmt(r.get("metrics", {}).get(c.metric)) if c.applies(r) else "—" for c in columns]
            cells.append(_fmt(r.get("wall_time_s")))
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        sections.append("\n".join(lines))
    return "\n\n".join(sections) + "\n"


def load_results(out_dir: str | Path) -> list[dict[str, Any]]:
    """Every record appended to ``<out_dir>/results.jsonl``, oldest first."""
    path = Path(out_dir) / "results.jsonl"
    if not path.exists():
        return []
    records = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} line {n} is not valid JSON ({err.msg}); expected one results record per line") from None
    return records


def write_results(
    out_dir: str | Path,
    *,
    protocol: str,
    preset: Optional[str],
    config: Any,
    metrics: Mapping[str, float],
    weights: str,
    weights_sha256: str,
    dataset: str,
    dataset_fingerprint: str,
    seed: int,
    wall_time_s: float,
    notes: Optional[Mapping[str, Any]] = None,
) -> dict[str, Any]:
    """Write ``results.json``, append to ``results.jsonl`` and rewrite ``results.md``; return the record.

    Args:
        out_dir: the run's output directory (created).
        protocol: the subcommand name (``linear``, ``semi``, ``knn``, ``voc07-svm``, ``transfer``).
        preset: the preset or mode the run used (None when there is none).
        config: the protocol's config dataclass (or a mapping): every hyper-parameter.
        metrics: flat ``{name: float}`` in percent, named as in the paper (``top1``, ``mAP``, ...).
        weights: the ``--weights`` value; ``weights_sha256`` its fingerprint.
        dataset: the ``--data`` value; ``dataset_fingerprint`` its fingerprint.
        seed: the run's seed.
        wall_time_s: seconds the run took.
        notes: optional extra facts about the run (e.g. ``{"mode": "cached"}``).
    """
    bad = {k: v for k, v in metrics.items() if not isinstance(v, (int, float)) or isinstance(v, bool)}
    if bad:
        raise ValueError(f"metrics must be a flat dict of numbers; got {bad!r}")
    git = git_state()
    record: dict[str, Any] = {
        "protocol": protocol,
        "preset": preset,
        "hyperparameters": config_dict(config),
        "weights": str(weights),
        "weights_sha256": weights_sha256,
        "dataset": str(dataset),
        "dataset_fingerprint": dataset_fingerprint,
        "seed": int(seed),
        "metrics": {k: float(v) for k, v in metrics.items()},
        "wall_time_s": float(wall_time_s),
        "bt_hub_version": package_version(),
        "git_sha": git["git_sha"],
        "git_dirty": git["git_dirty"],
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if notes:
        record["notes"] = dict(notes)
    out = Path(out_dir)
    atomic_write_json(out / "results.json", record)
    history = load_results(out) + [json.loads(json.dumps(record, default=str))]
    atomic_write_text(out / "results.jsonl", "".join(json.dumps(r, sort_keys=True, default=str) + "\n" for r in history))
    atomic_write_text(out / "results.md", "# Evaluation results\n\n" + render_table(history))
    return record
