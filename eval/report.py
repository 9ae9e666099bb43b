"""Evaluation results on disk: ``results.json`` (this run), ``results.jsonl`` (every run), ``results.md``.

Every run's records (bt_hub.common.records: what was run, in which mode, from which preset and
with which changes, on which weights and splits, the metrics) are written by the runner
(``bt_hub.eval.runner.write_records``): ``<out>/results.json``, then ``append_results`` appends them to
``<out>/results.jsonl`` and rewrites ``<out>/results.md`` from that history: one table per
protocol family (``FAMILIES``: linear, semi-supervised, transfer, detection, kNN; add an entry
for a new family), each run's setting in words, metrics rounded to 0.1, and the paper's row
beside ours only where the run follows the paper's protocol for that number.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bt_hub.common.files import WriteError, atomic_write_text, write_failure
from bt_hub.common.records import (
    PAPER_NAME,
    PAPER_RESULTS,
    PAPER_SETTINGS,
    Record,
    data_label,
    fmt,
    fmt_mean_std,
    group_by_seed,
    mean_std,
    metric_label,
    paper_task,
    seed_free_setting,
    seed_group_key,
    seeds_text,
    setting,
    weights_label,
)
from bt_hub.eval.config import EvalWarning


@dataclass(frozen=True)
class Family:
    """One table of results.md: a title, the metrics it shows first (others a run has follow) and any it leaves out."""

    title: str
    metrics: tuple[str, ...]
    hidden: tuple[str, ...] = ()


_DETECTION_METRICS = tuple(f"{task}_{m}" for task in ("bbox", "segm") for m in ("AP", "AP50", "AP75"))

FAMILIES: dict[str, Family] = {
    "linear": Family("Linear evaluation (paper Table 1)", ("top1", "top5")),
    "semi": Family("Semi-supervised fine-tuning (paper Table 2)", ("top1", "top5")),
    "transfer": Family("Transfer to other classification tasks (paper Table 3)", ("top1", "mAP", "mAP_11point")),
    "detect_voc": Family("Detection transfer: VOC07+12 Faster R-CNN R50-C4 (paper Table 4)", _DETECTION_METRICS[:3]),
    "detect_coco": Family("Detection transfer: COCO Mask R-CNN R50-C4 1x (paper Table 4)", _DETECTION_METRICS),
    "detect": Family(
        "Detection on other data (e.g. the generated shapes of the installation check; no paper row)",
        _DETECTION_METRICS,
    ),
    # top1 / top5 repeat the first k's columns
    "knn": Family(
        "Weighted kNN (community protocol, not in the paper)",
        ("top1_k20", "top5_k20", "top1_k200", "top5_k200"),
        ("top1", "top5"),
    ),
}


def family_of(result: Mapping[str, Any]) -> str:
    """The table a result belongs to.

    One of ``linear``, ``semi``, ``transfer``, ``detect_voc`` / ``detect_coco`` / ``detect``, ``knn`` or its protocol.
    """
    protocol = str(result.get("protocol", ""))
    if protocol == "linear" and result.get("preset") in ("places205", "inat18"):
        return "transfer"
    if protocol in ("transfer", "voc07-svm"):
        return "transfer"
    if protocol in ("semi", "semi_supervised", "semi-supervised"):
        return "semi"
    if protocol == "detect":
        return {"voc": "detect_voc", "coco": "detect_coco"}.get(str(result.get("preset")), "detect")
    return protocol


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def _table(name: str, rows: list[Mapping[str, Any]]) -> str:
    family = FAMILIES.get(name, Family(name, ()))
    shown = [m for m in family.metrics if any(m in (r.get("metrics") or {}) for r in rows)]
    shown += [m for r in rows for m in (r.get("metrics") or {}) if m not in family.metrics and m not in family.hidden]
    shown = list(dict.fromkeys(shown))
    header = ["Run", "Setting", "Weights", "Data", "Seeds"] + [metric_label(m) for m in shown] + ["Wall time (s)"]
    lines = [f"### {family.title}", "", _row(header), "|" + "---|" * len(header)]
    tasks = list(dict.fromkeys(paper_task(r) for r in rows))  # our rows grouped by the paper number they match
    for task in tasks:
        if task in PAPER_RESULTS:
            data, words = PAPER_SETTINGS[task]
            lines.append(
                _row(
                    [PAPER_NAME, words, "paper's", data, "not stated"]
                    + [fmt(PAPER_RESULTS[task].get(m)) for m in shown]
                    + ["—"]
                )
            )
        for runs in group_by_seed([r for r in rows if paper_task(r) == task], seed_group_key):
            first = runs[0]
            words = seed_free_setting(first) if len(runs) > 1 else setting(first)
            cells = [f"ours: {first.get('protocol')}", words or "—", weights_label(first)]
            cells += [data_label(first) or "—", seeds_text(len(runs))]
            cells += [fmt_mean_std([(r.get("metrics") or {}).get(m) for r in runs]) for m in shown]
            times = [r.get("wall_time_s") for r in runs]
            wall = mean_std(times)[0] if all(fmt(t) != "—" for t in times) else None
            lines.append(_row(cells + [fmt(wall)]))
    return "\n".join(lines)


def render_table(results: list[Mapping[str, Any]]) -> str:
    """Markdown tables, one per protocol family; the paper's row above our runs of the same protocol."""
    by_family: dict[str, list[Mapping[str, Any]]] = {}
    for result in results:
        by_family.setdefault(family_of(result), []).append(result)
    order = [f for f in FAMILIES if f in by_family] + sorted(f for f in by_family if f not in FAMILIES)
    return "\n\n".join(_table(name, by_family[name]) for name in order) + "\n"


def render_markdown(results: list[Mapping[str, Any]]) -> str:
    """The whole results.md: title, tables and how to read them."""
    return (
        "# Evaluation results\n\n"
        + render_table(results)
        + "\nMetrics in percent, rounded to 0.1. *Setting* names the preset, the mode and every hyper-parameter "
        "changed from the preset; runs that differ only in their seed share a row: mean ± sample standard deviation "
        "(n - 1) over the *Seeds* column's count, one value when there is 1 seed; the full records (per-seed values, "
        "splits, fingerprints, versions) are in results.jsonl.\n"
    )


def load_results(out_dir: str | Path) -> tuple[list[dict[str, Any]], list[int]]:
    """Every record appended to ``<out_dir>/results.jsonl``, oldest first, and the numbers of damaged lines.

    A line cut short by a crash or edited by hand is no record: it is left in the file (bt_hub deletes
    nothing of it) and out of ``results.md``; :func:`check_history` says which before a run's work.
    """
    path = Path(out_dir) / "results.jsonl"
    if not path.exists():
        return [], []
    records, damaged = [], []
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if isinstance(record, dict) and isinstance(record.get("metrics"), dict):
                records.append(record)
            else:
                damaged.append(n)
    return records, damaged


def check_history(out_dir: str | Path) -> None:
    """One ``EvalWarning`` before any work when ``results.jsonl`` holds damaged lines (named by number)."""
    _, damaged = load_results(out_dir)
    if damaged:
        warnings.warn(
            f"{Path(out_dir) / 'results.jsonl'} line {', '.join(map(str, damaged))} is not a results record (cut "
            "short or edited); it stays in the file, out of results.md, and this run's records are appended after it",
            EvalWarning,
            stacklevel=2,
        )


def append_results(out_dir: str | Path, records: Sequence[Record]) -> list[Record]:
    """Append records to ``results.jsonl`` and rewrite ``results.md`` from the whole history; return it.

    The records go in with one ``write`` on a descriptor opened ``O_APPEND | O_NOFOLLOW`` and
    locked (``flock``) until ``results.md`` is rewritten, so processes appending to one folder
    at once keep every record, each on a line of its own, and ``results.md`` shows them all.

    Raises:
        WriteError: ``results.jsonl`` is a symbolic link, or could not be written (it is left as it was).
    """
    out = Path(out_dir)
    path = out / "results.jsonl"
    data = "".join(json.dumps(r, sort_keys=True, default=str) + "\n" for r in records).encode("utf-8")
    out.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise WriteError(
                f"{path} is a symbolic link; bt_hub appends results only to a regular file: remove the link or "
                "choose another --out"
            ) from None
        raise write_failure(path, err) from err
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data  # a line cut short stays a line of its own; the new records stay whole
        try:
            if os.write(fd, data) != len(data):
                raise OSError(errno.EIO, "the records were written only in part")
        except OSError as err:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise write_failure(path, err) from err
        history = load_results(out)[0]
        atomic_write_text(out / "results.md", render_markdown(history))
    finally:
        os.close(fd)  # releases the lock
    return history
