"""``bt-hub embed``: the features of any weights on any data, with the file each row came from."""

from __future__ import annotations

import csv
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
from torch.utils.data import Dataset

from bt_hub.common.config import option, out_field
from bt_hub.common.distributed import is_main_process
from bt_hub.common.files import atomic_write, atomic_write_json, atomic_write_text
from bt_hub.common.optional import require
from bt_hub.common.presets import shown
from bt_hub.eval.config import EvalConfig
from bt_hub.eval.features import as_float32
from bt_hub.eval.runner import EvalRun, Scored, build_record, evaluation

INDEX_COLUMNS = ("split", "row", "path", "label", "class")
CHUNK_ROWS = 65_536  # rows copied at a time from the (memory-mapped) cache into <split>.npy


@dataclass
class EmbedConfig(EvalConfig):
    """Flags of ``bt-hub embed``: which weights, data and splits, and the output format."""

    RUN_FIELDS: ClassVar[tuple[str, ...]] = EvalConfig.RUN_FIELDS + ("format",)
    CACHE_UNDER_OUT: ClassVar[bool] = True
    SCORED: ClassVar[bool] = False  # features only: one class, or no held-out split (--splits train), will do

    splits: list[str] = option(
        ["train", "test"], "splits to embed: train and/or test (--test-split names the held-out folder)"
    )
    format: Literal["npy", "parquet"] = option(
        "npy", "npy: <split>.npy + index.csv; parquet: one embeddings.parquet (pip install pyarrow)"
    )
    out: str | None = out_field(
        "runs/embed", "output directory: <split>.npy and index.csv (or embeddings.parquet), embed.json"
    )

    def __post_init__(self) -> None:
        self.splits = [s.strip() for value in self.splits for s in str(value).split(",") if s.strip()]
        bad = [s for s in self.splits if s not in ("train", "test")]
        if bad or not self.splits:
            raise ValueError(f"--splits must list train and/or test, got {shown(self.splits)}")
        if self.format not in ("npy", "parquet"):
            raise ValueError(f"--format must be npy or parquet, got {self.format!r}")
        if self.format == "parquet":
            require("pyarrow", "bt-hub embed --format parquet")
        super().__post_init__()

    def unused_flags(self) -> dict[str, str]:
        """``--test-split`` when the held-out split is not embedded."""
        unused = super().unused_flags()
        if "test" not in self.splits:
            unused["test_split"] = "names the held-out folder, which --splits without test does not embed"
        return unused


def index_rows(dataset: Dataset, split: str, data: str) -> list[dict[str, Any]]:
    """``split, row, path, label, class`` of every row of a split, in dataset order."""
    samples = getattr(dataset, "samples", None)
    labels = [int(t) for t in getattr(dataset, "targets", [])] or [int(dataset[i][1]) for i in range(len(dataset))]
    classes = list(getattr(dataset, "classes", []))
    name = Path(data).name or data
    paths = [os.path.abspath(str(s[0])) for s in samples] if samples is not None else None
    return [
        {
            "split": split,
            "row": i,
            "path": paths[i] if paths else f"{name}[{i}]",
            "label": label,
            "class": classes[label] if label < len(classes) else str(label),
        }
        for i, label in enumerate(labels)
    ]


def run_embed(config: EmbedConfig) -> dict[str, tuple[np.ndarray, list[dict[str, Any]]]]:
    """Embed each split; write the files when ``config.out`` is set. ``{split: (features, index rows)}``."""
    found: dict[str, tuple[np.ndarray, list[dict[str, Any]]]] = {}
    with evaluation(config) as run:
        for split in config.splits:
            features, _ = run.features(split)
            found[split] = (features, index_rows(getattr(run.splits, split), split, config.data))
        if run.out is not None and is_main_process():
            _write(run, found)
    return {split: (as_float32(x).numpy(), rows) for split, (x, rows) in found.items()}


def _write(run: EvalRun, found: dict[str, tuple[Any, list[dict[str, Any]]]]) -> None:
    out, config = run.out, run.config
    files = []
    if config.format == "parquet":
        files.append(_write_parquet(out / "embeddings.parquet", found).name)
    else:
        for split, (features, _) in found.items():
            files.append(_write_npy(out / f"{split}.npy", features).name)
        table = io.StringIO()
        writer = csv.DictWriter(table, fieldnames=INDEX_COLUMNS)
        writer.writeheader()
        writer.writerows(row for _, rows in found.values() for row in rows)
        files.append(atomic_write_text(out / "index.csv", table.getvalue()).name)
    record = build_record(
        Scored(
            {},
            mode="features",
            notes={"files": files, "rows": {s: len(r) for s, (_, r) in found.items()}},
            protocol="embed",
        ),
        hyperparameters={**vars(config), **run.settings.as_dict(), "features": dict(run.features_used)},
        weights=run.weights,
        dataset=run.splits.info,
        seed=config.seed,
        wall_time_s=0.0,
        settings=run.settings,
    )
    atomic_write_json(out / "embed.json", record)


def _write_npy(path: Path, features: Any) -> Path:
    n, dim = features.shape

    def write(f: io.BufferedWriter) -> None:
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (n, dim)})
        f.write(header.getvalue())
        for start in range(0, n, CHUNK_ROWS):
            f.write(as_float32(features, start, start + CHUNK_ROWS).numpy().tobytes())

    return atomic_write(path, write)


def _write_parquet(path: Path, found: dict[str, tuple[Any, list[dict[str, Any]]]]) -> Path:
    pa = require("pyarrow", "bt-hub embed --format parquet")
    pq = require("pyarrow.parquet", "bt-hub embed --format parquet")
    rows = [row for _, index in found.values() for row in index]
    columns = {name: [row[name] for row in rows] for name in INDEX_COLUMNS}
    stacked = np.concatenate([as_float32(x).numpy() for x, _ in found.values()])
    flat = pa.array(stacked.reshape(-1), type=pa.float32())
    table = pa.table({**columns, "features": pa.FixedSizeListArray.from_arrays(flat, stacked.shape[1])})
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return atomic_write(path, lambda f: f.write(buffer.getvalue()))


def run(config: EmbedConfig) -> str:
    """``bt-hub embed``: embed the splits and write the files; what was written, for the CLI to print."""
    found = run_embed(config)
    shapes = ", ".join(f"{split} {x.shape[0]} x {x.shape[1]}" for split, (x, _) in found.items())
    return f"embedded {shapes}" + (f"; wrote {config.out}" if config.out else "")
