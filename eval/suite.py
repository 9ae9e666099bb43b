"""``bt-hub eval all``: every classification protocol on one checkpoint, one combined table.

Runs kNN, the linear probe (cached by default, ``--full-linear`` for the paper's loop),
semi-supervised fine-tuning on each ``--fractions`` percent of the labels (from the
SimCLR lists in ``--subset-dir`` when given), and the VOC07 SVMs when ``--voc07-devkit``
is given, all on the same splits (``--test-split`` / ``--holdout``). ``--preset`` picks the
protocols' presets: ``paper`` (linear ``imagenet``, semi ``paper``) or ``small`` (both
``small``). kNN and the cached linear probe share one feature cache (``--cache-dir``,
default ``OUT/feature_cache``), so the backbone runs over the data once. Each protocol
writes its own ``OUT/<protocol>/results.json``; ``OUT/results.json`` lists this run's
records, ``OUT/results.jsonl`` gains them and ``OUT/results.md`` holds the tables.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from bt_hub.common.presets import from_preset, preset_values
from bt_hub.common.runs import claim_run_dir, releases_claim
from bt_hub.eval import knn, linear, semi_supervised
from bt_hub.eval.config import EvalConfig
from bt_hub.eval.report import write_summary

# EvalConfig fields that only the image-folder protocols take (the VOC07 devkit has its own lists).
_SPLIT_FIELDS = ("test_split", "holdout")


@dataclass
class SuiteConfig(EvalConfig):
    """Flags of ``bt-hub eval all``; the shared flags are passed to every protocol."""

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "paper": {},
        "small": {"linear_preset": "small", "semi_preset": "small"},
    }

    preset: str = field(
        default="paper",
        metadata={"help": "the protocols' presets, by name; --linear-preset / --semi-preset override them"},
    )
    linear_preset: str = field(
        default="imagenet", metadata={"help": "preset of the linear probe (bt-hub eval linear --help lists them)"}
    )
    semi_preset: str = field(
        default="paper", metadata={"help": "preset of the semi-supervised runs (bt-hub eval semi --help lists them)"}
    )
    full_linear: bool = field(
        default=False,
        metadata={
            "help": "run the paper's linear loop (augmentation, a backbone pass per epoch) instead of the cached probe"
        },
    )
    linear_epochs: int | None = field(
        default=None, metadata={"help": "linear-probe epochs (default: the linear preset's)"}
    )
    knn_k: list[int] = field(
        default_factory=lambda: [20, 200], metadata={"help": "numbers of neighbours of the kNN protocol"}
    )
    fractions: list[int] = field(
        default_factory=lambda: [1, 10],
        metadata={"help": "label percentages of the semi-supervised runs (empty: skip them)", "nargs": "*"},
    )
    semi_epochs: int | None = field(default=None, metadata={"help": "fine-tuning epochs (default: the semi preset's)"})
    semi_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "fine-tuning batch size (default: the semi preset's; --batch-size is the feature-extraction batch)"
        },
    )
    subset_dir: str | None = field(
        default=None,
        metadata={
            "help": "directory with SimCLR's 1percent.txt / 10percent.txt (ImageNet); "
            "without it subsets are seeded and class-balanced"
        },
    )
    voc07_devkit: str | None = field(
        default=None, metadata={"help": "VOC devkit path: also run the VOC07 SVM protocol"}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.knn_k or any(k <= 0 for k in self.knn_k):
            raise ValueError(f"--knn-k must list positive integers, got {self.knn_k}")
        if self.voc07_devkit is not None and not Path(self.voc07_devkit).is_dir():
            raise ValueError(
                f"--voc07-devkit {self.voc07_devkit} is not a folder; point it to a VOC devkit or leave it out"
            )
        preset_values(linear.LinearConfig, self.linear_preset)
        preset_values(semi_supervised.SemiSupervisedConfig, self.semi_preset)
        if any(f <= 0 or f > 100 for f in self.fractions):
            raise ValueError(f"--fractions must be percentages in (0, 100], got {self.fractions}")
        if self.subset_dir is not None:
            for pct in self.fractions:
                if not (Path(self.subset_dir) / f"{pct}percent.txt").is_file():
                    raise ValueError(
                        f"--subset-dir {self.subset_dir} has no {pct}percent.txt; "
                        "expected SimCLR's published lists there"
                    )


def _shared(config: SuiteConfig, out: Path, skip: tuple[str, ...] = (), **overrides: Any) -> dict[str, Any]:
    """The EvalConfig flags of the suite (less ``skip``), with the protocol's own output directory."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(EvalConfig) if f.init and f.name not in skip}
    values.update(out=str(out), **overrides)
    return values


def _given(**values: Any) -> dict[str, Any]:
    """The values that were set (None: keep the preset's)."""
    return {k: v for k, v in values.items() if v is not None}


@releases_claim
def run(config: SuiteConfig) -> dict[str, Any]:
    """Run every protocol on ``--weights``; return ``{"results": [record, ...], "wall_time_s": ...}``."""
    tick = time.perf_counter()
    out = claim_run_dir(config.out, overwrite=config.overwrite)
    cache_dir = config.cache_dir or str(out / "feature_cache")
    records = [knn.run(knn.KnnConfig(**_shared(config, out / "knn", cache_dir=cache_dir), k=list(config.knn_k)))]
    records.append(
        linear.run(
            from_preset(
                linear.LinearConfig,
                config.linear_preset,
                **_shared(config, out / "linear", cache_dir=cache_dir),
                cached=not config.full_linear,
                **_given(epochs=config.linear_epochs),
            )
        )
    )
    for pct in config.fractions:
        subset = (
            {"subset_file": str(Path(config.subset_dir) / f"{pct}percent.txt")}
            if config.subset_dir
            else {"fraction": pct}
        )
        records.append(
            semi_supervised.run(
                from_preset(
                    semi_supervised.SemiSupervisedConfig,
                    config.semi_preset,
                    **_shared(config, out / f"semi_{pct}percent", skip=("batch_size",)),
                    **subset,
                    **_given(epochs=config.semi_epochs, batch_size=config.semi_batch_size),
                )
            )
        )
    if config.voc07_devkit:
        from bt_hub.eval import voc07_svm

        records.append(
            voc07_svm.run(
                voc07_svm.Voc07SvmConfig(
                    **_shared(config, out / "voc07_svm", skip=_SPLIT_FIELDS, data=config.voc07_devkit)
                )
            )
        )
    return write_summary(out, records, time.perf_counter() - tick)
