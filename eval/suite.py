"""``bt-hub eval all``: every classification protocol on one checkpoint and the same splits, one table."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from bt_hub.common.config import option
from bt_hub.common.presets import from_preset, preset_values, shown
from bt_hub.common.records import SCHEMA
from bt_hub.eval.config import EvalConfig
from bt_hub.eval.protocols import Protocol, get_protocol, list_protocols
from bt_hub.eval.report import load_results
from bt_hub.eval.runner import evaluation, run_child


@dataclass
class SuiteConfig(EvalConfig):
    """Flags of ``bt-hub eval all``; the shared flags are passed to every protocol."""

    CACHE_UNDER_OUT: ClassVar[bool] = True
    REUSES_SPLITS: ClassVar[bool] = True
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "paper": {},
        "small": {"linear_preset": "small", "semi_preset": "small"},
    }

    preset: str = option("paper", "the protocols' presets, by name; --linear-preset / --semi-preset override them")
    linear_preset: str = option("imagenet", "preset of the linear probe (bt-hub eval linear --help lists them)")
    semi_preset: str = option("paper", "preset of the semi-supervised runs (bt-hub eval semi --help lists them)")
    full_linear: bool = option(
        False, "run the paper's linear loop (augmentation, a backbone pass per epoch) instead of the cached probe"
    )
    linear_epochs: int | None = option(None, "linear-probe epochs (default: the linear preset's)")
    knn_k: list[int] = option([20, 200], "numbers of neighbours of the kNN protocol")
    fractions: list[int] = option(
        [1, 10], "label percentages of the semi-supervised runs (empty: skip them)", nargs="*"
    )
    semi_epochs: int | None = option(None, "fine-tuning epochs (default: the semi preset's)")
    semi_batch_size: int | None = option(
        None, "fine-tuning batch size (default: the semi preset's; --batch-size is the feature-extraction batch)"
    )
    subset_dir: str | None = option(
        None,
        "directory with SimCLR's 1percent.txt / 10percent.txt (ImageNet); "
        "without it subsets are seeded and class-balanced",
    )
    voc07_devkit: str | None = option(None, "VOC devkit path: also run the VOC07 SVM protocol")
    rerun: bool = option(
        False, "run again the protocols whose record in --out has the same weights and settings (default: skip them)"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.knn_k or any(k <= 0 for k in self.knn_k):
            raise ValueError(f"--knn-k must list positive integers, got {shown(self.knn_k)}")
        if self.voc07_devkit is not None and not Path(self.voc07_devkit).is_dir():
            raise ValueError(
                f"--voc07-devkit {self.voc07_devkit} is not a folder; point it to a VOC devkit or leave it out"
            )
        for protocol, _, values, _ in _runs(self):  # an unknown --linear-preset / --semi-preset fails here
            if "preset" in values:
                preset_values(protocol.config_class, values["preset"], flag=f"--{protocol.name}-preset")
        if any(f <= 0 or f > 100 for f in self.fractions):
            raise ValueError(f"--fractions must be percentages in (0, 100], got {shown(self.fractions)}")
        if self.subset_dir is not None:
            for pct in self.fractions:
                if not (Path(self.subset_dir) / f"{pct}percent.txt").is_file():
                    raise ValueError(
                        f"--subset-dir {self.subset_dir} has no {pct}percent.txt; "
                        "expected SimCLR's published lists there"
                    )

    def unused_flags(self) -> dict[str, str]:
        """The semi-supervised flags when ``--fractions`` is empty (no semi-supervised run); ``--rerun`` without a
        folder."""
        unused = super().unused_flags()
        if self.out is None:
            unused["rerun"] = "runs again the protocols finished in --out, and this run writes no folder"
        if not self.fractions:
            why = "sets the semi-supervised runs, which an empty --fractions skips"
            unused.update(dict.fromkeys(("semi_preset", "semi_epochs", "semi_batch_size", "subset_dir"), why))
        return unused


def _shared(config: SuiteConfig, name: str, skip: tuple[str, ...]) -> dict[str, Any]:
    """The EvalConfig flags of the suite (less ``skip``; its feature cache included), with the protocol's own folder
    ``OUT/name`` (or none)."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(EvalConfig) if f.init and f.name not in skip}
    return values | {"out": str(Path(config.out) / name) if config.out is not None else None}


def _runs(config: SuiteConfig) -> Iterator[tuple[Protocol, str, dict[str, Any], tuple[str, ...]]]:
    """Each run of ``eval all``: its protocol, folder, values and the shared flags it skips, in table order."""
    for protocol in map(get_protocol, list_protocols(suite=True)):
        settings = protocol.hook("suite_settings")
        for folder, values, skip in settings(config) if settings else [(protocol.name, {}, ())]:
            yield protocol, folder, values, skip


def run_suite(config: SuiteConfig) -> dict[str, Any]:
    """Run every protocol of the table that ``eval all`` runs (:func:`bt_hub.eval.protocols.list_protocols`) on
    ``--weights``, read and hashed once; return ``{"results": [record, ...], ...}``.

    A protocol's module says on which flags it runs (``suite_settings``); by default, once on the shared flags. A run
    whose folder holds a record of the same weights and settings is skipped, with a line, unless ``--rerun``.
    """
    with evaluation(config) as parent:
        records = []
        for protocol, folder, values, skip in _runs(config):
            given = {k: v for k, v in values.items() if k != "preset"}
            child = from_preset(protocol.config_class, values.get("preset"), **(_shared(config, folder, skip) | given))
            records.append(run_child(parent, child, protocol.hook("score"), rerun=config.rerun))
        summary = {"results": records, "wall_time_s": time.perf_counter() - parent.started}
        kept = load_results(parent.out)[0] if parent.out is not None else []  # a skipped run's record may be there
        parent.write([r for r in records if r not in kept], summary)
    return {"schema": SCHEMA, **summary}
