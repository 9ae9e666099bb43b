"""``bt-hub eval all``: every classification protocol on one checkpoint, one combined table.

Runs kNN, the linear probe (cached by default, ``--full-linear`` for the paper's loop),
semi-supervised fine-tuning on each ``--fractions`` percent of the labels (from the
SimCLR lists in ``--subset-dir`` when given), and the VOC07 SVMs when ``--voc07-devkit``
is given. kNN and the cached linear probe share one feature cache (``--cache-dir``,
default ``OUT/feature_cache``), so the backbone runs over the data once. Each protocol
writes its own ``OUT/<protocol>/results.json``; ``OUT/results.json`` lists them all and
``OUT/results.md`` holds the tables laid out like the paper's.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from bt_hub.runs import atomic_write_json, atomic_write_text, claim_run_dir
from eval.config import EvalConfig
from eval.report import render_table


@dataclass
class SuiteConfig(EvalConfig):
    """Flags of ``bt-hub eval all``; the shared flags are passed to every protocol."""

    full_linear: bool = field(default=False, metadata={"help": "run the paper's linear loop (augmentation, a backbone pass per epoch) instead of the cached probe"})
    linear_epochs: Optional[int] = field(default=None, metadata={"help": "linear-probe epochs (default: the paper's 100)"})
    knn_k: list[int] = field(default_factory=lambda: [20, 200], metadata={"help": "numbers of neighbours of the kNN protocol"})
    fractions: list[int] = field(default_factory=lambda: [1, 10], metadata={"help": "label percentages of the semi-supervised runs (empty: skip them)", "nargs": "*"})
    semi_epochs: Optional[int] = field(default=None, metadata={"help": "fine-tuning epochs (default: the paper's 20)"})
    subset_dir: Optional[str] = field(default=None, metadata={"help": "directory with SimCLR's 1percent.txt / 10percent.txt (ImageNet); without it subsets are seeded and class-balanced"})
    voc07_devkit: Optional[str] = field(default=None, metadata={"help": "VOC devkit path: also run the VOC07 SVM protocol"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if any(f <= 0 or f > 100 for f in self.fractions):
            raise ValueError(f"--fractions must be percentages in (0, 100], got {self.fractions}")
        if self.subset_dir is not None:
            for pct in self.fractions:
                if not (Path(self.subset_dir) / f"{pct}percent.txt").is_file():
                    raise ValueError(f"--subset-dir {self.subset_dir} has no {pct}percent.txt; expected SimCLR's published lists there")


def _shared(config: SuiteConfig, out: Path, **overrides: Any) -> dict[str, Any]:
    """The EvalConfig fields of the suite, with the protocol's own output directory."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(EvalConfig)}
    values.update(out=str(out), **overrides)
    return values


def run(config: SuiteConfig) -> dict[str, Any]:
    """Run every protocol on ``--weights``; return ``{"results": [record, ...], "wall_time_s": ...}``."""
    from eval import knn, linear, semi_supervised

    tick = time.perf_counter()
    out = claim_run_dir(config.out, overwrite=config.overwrite)
    cache_dir = config.cache_dir or str(out / "feature_cache")
    records = [knn.run(knn.KnnConfig(**_shared(config, out / "knn", cache_dir=cache_dir), k=list(config.knn_k)))]
    linear_extra = {"epochs": config.linear_epochs} if config.linear_epochs else {}
    records.append(linear.run(linear.LinearConfig(**_shared(config, out / "linear", cache_dir=cache_dir), cached=not config.full_linear, **linear_extra)))
    for pct in config.fractions:
        subset = {"subset_file": str(Path(config.subset_dir) / f"{pct}percent.txt")} if config.subset_dir else {"fraction": pct}
        semi_extra = {"epochs": config.semi_epochs} if config.semi_epochs else {}
        semi = semi_supervised.SemiSupervisedConfig(**_shared(config, out / f"semi_{pct}percent"), **subset, **semi_extra)
        records.append(semi_supervised.run(semi))
    if config.voc07_devkit:
        from eval import voc07_svm

        records.append(voc07_svm.run(voc07_svm.Voc07SvmConfig(**_shared(config, out / "voc07_svm", data=config.voc07_devkit))))
    summary = {"results": records, "wall_time_s": time.perf_counter() - tick}
    atomic_write_json(out / "results.json", summary)
    atomic_write_text(out / "results.md", "# Evaluation results\n\n" + render_table(records))
    return summary
