"""Evaluation results on disk: ``results.json`` (this run), ``results.jsonl`` (every run), ``results.md``: one
table per ``Table`` the records name, the paper's row above the runs that follow it.
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
    Record,
    data_label,
    fmt,
    fmt_mean_std,
    group_by_seed,
    mean_std,
    metric_label,
    paper_comparable,
    paper_mismatch,
    seed_free_setting,
    seed_group_key,
    seeds_text,
    setting,
    weights_label,
)
from bt_hub.eval.config import EvalWarning
from bt_hub.weights.paper import PAPER_RESULTS

PAPER_NAME = "Barlow Twins paper (ResNet-50, 1000 epochs)"
# the folder names (lower case, letters and digits only) under which ImageNet is the paper's data
IMAGENET_FOLDERS = ("imagenet", "imagenet1k", "in1k", "ilsvrc", "ilsvrc2012", "imagenet2012")
DETECTION_METRICS = tuple(f"{task}_{m}" for task in ("bbox", "segm") for m in ("AP", "AP50", "AP75"))


@dataclass(frozen=True)
class Table:
    """A table of results.md a protocol's records go in: its title, the metrics it shows first (others a run
    has follow), any it leaves out, and the Hugging Face task type of its results."""

    title: str
    metrics: tuple[str, ...]
    hidden: tuple[str, ...] = ()
    task: str = "image-classification"

    def block(self) -> dict[str, Any]:
        """The record's ``table``."""
        return {"title": self.title, "metrics": list(self.metrics), "hidden": list(self.hidden), "task": self.task}


@dataclass(frozen=True)
class PaperRow:
    """One of the paper's numbers a protocol's run follows: its ``PAPER_RESULTS`` key, its dataset and setting in
    words, and the data it was measured on (dataset folder names, test split size) for the card's paper column."""

    task: str
    data: str
    setting: str
    folders: tuple[str, ...]
    test_size: int
    labels: str | None = None  # the published label subset the paper's row fine-tuned on (by its file name)

    def block(self) -> dict[str, Any]:
        """The record's ``paper``: everything results.md and the card show of this row, and check it against."""
        block = {
            "task": self.task,
            "name": PAPER_NAME,
            "metrics": PAPER_RESULTS[self.task],
            "data": self.data,
            "setting": self.setting,
            "folders": list(self.folders),
            "test_size": self.test_size,
        }
        return block | ({"labels": self.labels} if self.labels else {})


def table_of(record: Mapping[str, Any]) -> Table:
    """The table a record belongs to; a record that names none gets a table of its protocol's name."""
    block = record.get("table")
    if not isinstance(block, Mapping):
        return Table(str(record.get("protocol", "")), ())
    return Table(block["title"], tuple(block.get("metrics", ())), tuple(block.get("hidden", ())))


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def _paper_key(record: Mapping[str, Any]) -> str | None:
    paper = paper_comparable(record)
    return paper.get("task") if paper else None


def _table(rows: list[Mapping[str, Any]]) -> str:
    """One ``Table`` of results.md: the paper's row above the runs it applies to (:func:`paper_comparable`), a
    warning a run's records carry marked beside its numbers and said under the table, and why a paper row a run
    follows is left out."""
    tables = [table_of(r) for r in rows]
    shown = [m for t in tables for m in t.metrics if any(m in (r.get("metrics") or {}) for r in rows)]
    hidden = {m for t in tables for m in t.hidden}
    shown += [m for r in rows for m in (r.get("metrics") or {}) if m not in hidden]
    shown = list(dict.fromkeys(shown))
    header = ["Run", "Setting", "Weights", "Data", "Seeds"] + [metric_label(m) for m in shown] + ["Wall time (s)"]
    lines = [f"### {tables[0].title}", "", _row(header), "|" + "---|" * len(header)]
    notes: dict[str, int] = {}  # a warning -> its mark
    papers = {_paper_key(r): paper_comparable(r) for r in rows}  # our rows grouped by the paper number they follow
    for key, paper in papers.items():
        if paper:
            cells = [paper["name"], paper["setting"], "paper's", paper["data"], "not stated"]
            lines.append(_row(cells + [fmt(paper["metrics"].get(m)) for m in shown] + ["—"]))
        for runs in group_by_seed([r for r in rows if _paper_key(r) == key], seed_group_key):
            first = runs[0]
            said = dict.fromkeys(w for r in runs for w in r.get("warnings") or [])
            mark = "".join(f" [{notes.setdefault(w, len(notes) + 1)}]" for w in said)
            words = seed_free_setting(first) if len(runs) > 1 else setting(first)
            cells = [f"ours: {first.get('protocol')}", words or "—", weights_label(first)]
            cells += [data_label(first) or "—", seeds_text(len(runs))]
            values = [fmt_mean_std([(r.get("metrics") or {}).get(m) for r in runs]) for m in shown]
            cells += [v + mark if v != "—" else v for v in values]
            times = [r.get("wall_time_s") for r in runs]
            wall = mean_std(times)[0] if all(fmt(t) != "—" for t in times) else None
            lines.append(_row(cells + [fmt(wall)]))
    left_out = {
        (r["paper"].get("data"), r["paper"].get("setting")): why for r in rows if (why := paper_mismatch(r)) is not None
    }
    under = [f"- [{n}] {warning}" for warning, n in notes.items()]
    under += [f"- The paper's {data} row ({words}) is left out: {why}." for (data, words), why in left_out.items()]
    return "\n".join(lines + ([""] + under if under else []))


def render_table(results: list[Mapping[str, Any]]) -> str:
    """Markdown tables, one per ``Table`` in order of first appearance, the paper's row above the runs following it."""
    by_table: dict[str, list[Mapping[str, Any]]] = {}
    for result in results:
        by_table.setdefault(table_of(result).title, []).append(result)
    return "\n\n".join(_table(rows) for rows in by_table.values()) + "\n"


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
    """Every record of ``<out_dir>/results.jsonl``, oldest first, and the numbers of damaged lines."""
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

    One ``O_APPEND | O_NOFOLLOW`` write, locked until ``results.md`` is rewritten, so concurrent appenders keep
    every record; WriteError for a symbolic link or a failed write (the file is left as it was).
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
