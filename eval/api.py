"""The Python API at the level of the CLI: ``evaluate``, ``compare`` and ``embed`` (re-exported by bt_hub.eval).

Each builds the same config its ``bt-hub`` command builds (presets and flags as keyword arguments,
spelled as the dataclass fields) and runs it through the same runner (bt_hub.eval.runner); nothing is
written unless ``out=`` is given. Every argument is checked against its field's type before anything runs:
a wrong one is a TypeError (a ValueError for a value outside its choices) naming it, and nothing is written.
The result holds the records and the table as a list of rows (``.to_pandas()`` where pandas is installed)::

    from bt_hub.eval import compare, embed, evaluate

    knn = evaluate("runs/pretrain", "digits", "knn", k=[20])
    knn.rows[0]["top1"]
    table = compare("runs/pretrain", "digits", baselines=["pixels", "random-init"], seeds=3).to_pandas()
    features, index = embed("runs/pretrain", "digits", splits=["test"]).arrays["test"]
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bt_hub.common.config import from_preset
from bt_hub.common.optional import require
from bt_hub.common.records import Record, setting
from bt_hub.eval.compare_config import CompareConfig
from bt_hub.eval.comparison import compare_and_write
from bt_hub.eval.comparison_report import table_rows
from bt_hub.eval.embedding import EmbedConfig, run_embed
from bt_hub.eval.protocols import PROTOCOLS, get_protocol
from bt_hub.eval.report import render_table
from bt_hub.eval.runner import run_protocol
from bt_hub.eval.suite import SuiteConfig, run_suite


@dataclass
class Results:
    """What the API returns: the records, the table as rows (one dict each), the text the CLI prints, the folder."""

    records: list[Record]
    rows: list[dict[str, Any]]
    text: str = ""
    out: Path | None = None
    arrays: dict[str, Any] = field(default_factory=dict)

    def to_pandas(self) -> Any:
        """The rows as a pandas DataFrame (``pip install pandas``)."""
        return require("pandas", "Results.to_pandas").DataFrame(self.rows)

    def __str__(self) -> str:
        return self.text


def record_row(record: Mapping[str, Any]) -> dict[str, Any]:
    """One table row of a record: protocol, setting in words, network, image size, weights, data, seed, metrics."""
    settings = record.get("settings") or {}
    return {
        "protocol": record.get("protocol"),
        "setting": setting(record),
        "arch": settings.get("arch"),
        "small_image_stem": settings.get("small_image_stem"),
        "image_size": settings.get("image_size"),
        "weights": (record.get("weights") or {}).get("name"),
        "weights_sha256": (record.get("weights") or {}).get("fingerprint"),
        "data": (record.get("dataset") or {}).get("name"),
        "seed": record.get("seed"),
        **record.get("metrics", {}),
    }


def evaluate(
    weights: str | Path,
    data: str | Path = "digits",
    protocol: str = "knn",
    *,
    out: str | Path | None = None,
    preset: str | None = None,
    **settings: Any,
) -> Results:
    """Score ``weights`` on ``data`` with one protocol of the table (bt_hub.eval.protocols: knn, linear, transfer,
    semi, voc07-svm, rankme), or ``all`` of them (``bt-hub eval all``).

    ``settings`` are the protocol's flags as field names (``k=[20]``, ``epochs=10``, ``image_size=32``,
    ``device="cuda"``); ``preset`` names one of its presets. A folder is written only when ``out`` is given.
    """
    if protocol == "all":
        config = from_preset(SuiteConfig, preset, weights=weights, data=data, out=out, **settings)
        records = run_suite(config)["results"]
    else:
        if not isinstance(protocol, str) or protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join([*PROTOCOLS, 'all'])}, got {protocol!r}")
        entry = get_protocol(protocol)
        config = from_preset(entry.config_class, preset, weights=weights, data=data, out=out, **settings)
        records = [run_protocol(entry, config)]
    return Results(records, [record_row(r) for r in records], render_table(records), Path(out) if out else None)


def compare(
    weights: str | Path | Sequence[str | Path],
    data: str | Path = "digits",
    *,
    baselines: Sequence[str] = ("pixels", "random-init"),
    protocols: Sequence[str] | None = None,
    seeds: int = 3,
    out: str | Path | None = None,
    **settings: Any,
) -> Results:
    """Weights against baselines, every cell mean ± std over ``seeds`` (``bt-hub eval compare``).

    ``protocols`` are the columns (default: those of ``bt-hub eval compare``, the protocols on frozen features).
    ``rows`` has one row per representation: its mean, std and per-seed values in each column and,
    for weights, the verdict against the best baseline; ``records`` holds every per-seed record.
    """
    config = from_preset(
        CompareConfig,
        None,
        weights=[weights] if isinstance(weights, (str, os.PathLike)) else weights,
        data=data,
        baselines=baselines,
        seeds=seeds,
        out=out,
        **({"protocols": protocols} if protocols is not None else {}),
        **settings,
    )
    result, text = compare_and_write(config)
    return Results(result.records, table_rows(result), text, Path(out) if out else None)


def embed(
    weights: str | Path,
    data: str | Path = "digits",
    *,
    splits: Sequence[str] = ("train", "test"),
    out: str | Path | None = None,
    **settings: Any,
) -> Results:
    """Features of ``weights`` on each split of ``data``, with the file (or row), label and class of every row.

    ``arrays[split]`` is ``(features [N, D] float32, index rows)``; with ``out`` the features go to
    ``<split>.npy`` and the index to ``index.csv`` (``format="parquet"``: one ``embeddings.parquet``).
    """
    config = from_preset(EmbedConfig, None, weights=weights, data=data, splits=splits, out=out, **settings)
    found = run_embed(config)
    rows = [row for _, index in found.values() for row in index]
    return Results([], rows, f"{len(rows)} rows embedded", Path(out) if out else None, arrays=found)
