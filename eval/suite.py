"""``bt-hub eval all``: every classification protocol on one checkpoint and the same splits, one table."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from bt_hub.common.config import child, children, option
from bt_hub.common.presets import shown
from bt_hub.common.records import SCHEMA
from bt_hub.eval.config import EvalConfig
from bt_hub.eval.knn import KnnConfig
from bt_hub.eval.linear import LinearConfig
from bt_hub.eval.protocols import Protocol, get_protocol, list_protocols
from bt_hub.eval.report import load_results
from bt_hub.eval.runner import evaluation, run_child
from bt_hub.eval.semi_supervised import SemiSupervisedConfig


@dataclass
class SuiteConfig(EvalConfig):
    """Flags of ``bt-hub eval all``: the shared flags are passed to every protocol, and a protocol's own are its
    child's (``--knn.k``, ``--linear.preset``, ``--semi.epochs``)."""

    CACHE_UNDER_OUT: ClassVar[bool] = True
    REUSES_SPLITS: ClassVar[bool] = True
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "paper": {},
        "small": {"linear": {"preset": "small"}, "semi": {"preset": "small"}},
    }

    preset: str = option("paper", "the protocols' presets, by name; --linear.preset / --semi.preset override them")
    knn: KnnConfig = child("the kNN run (bt-hub eval knn)")
    linear: LinearConfig = child(
        "the linear probe's run (bt-hub eval linear), on cached features here, not eval linear's paper loop: every "
        "protocol of eval all reads one feature cache (--no-linear.cached: the paper's loop)",
        cached=True,
    )
    fractions: list[int] = option(
        [1, 10], "label percentages of the semi-supervised runs (empty: skip them)", nargs="*"
    )
    semi: SemiSupervisedConfig = child(
        "the semi-supervised runs (bt-hub eval semi), one per --fractions; --batch-size is the feature extraction's "
        "batch, --semi.batch-size theirs",
        sets=("fraction", "subset_file"),
        own=("batch_size",),
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
        if self.voc07_devkit is not None and not Path(self.voc07_devkit).is_dir():
            raise ValueError(
                f"--voc07-devkit {self.voc07_devkit} is not a folder; point it to a VOC devkit or leave it out"
            )
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
        """The semi-supervised runs' flags when ``--fractions`` is empty (none runs); ``--rerun`` without a folder."""
        unused = super().unused_flags()
        if self.out is None:
            unused["rerun"] = "runs again the protocols finished in --out, and this run writes no folder"
        if not self.fractions:
            why = "sets the semi-supervised runs, which an empty --fractions skips"
            unused |= dict.fromkeys(("semi", "subset_dir"), why)
        return unused


def _runs(config: SuiteConfig) -> Iterator[tuple[Protocol, Any]]:
    """Each run of ``eval all`` in its own folder ``OUT/<name>``, its protocol and config: its children (a child on a
    share of the labels once per ``--fractions``, on SimCLR's list from ``--subset-dir`` where given), then every other
    protocol of the table on its defaults and the shared flags it reads (one on a dataset of its own where a flag
    gives that dataset: VOC07's ``--voc07-devkit``)."""

    def out(name: str) -> dict[str, Any]:
        return {"out": str(Path(config.out) / name) if config.out is not None else None}

    for name in children(SuiteConfig):
        for pct in config.fractions if hasattr(getattr(config, name), "fraction") else [0]:  # a share of the labels
            listed = config.subset_dir and {"subset_file": f"{Path(config.subset_dir) / f'{pct}percent.txt'}"}
            labels = ({"fraction": None, **listed} if listed else {"fraction": pct}) if pct else {}
            folder = f"{name}_{pct}percent" if pct else name
            yield get_protocol(name), dataclasses.replace(getattr(config, name), **out(folder), **labels)
    for protocol in map(get_protocol, list_protocols()):
        data = {"voc07-svm": config.voc07_devkit}.get(protocol.name)  # the dataset of its own, where given
        if protocol.name not in children(SuiteConfig) and (data or not protocol.dataset):
            values = {"data": data} if data else {}
            yield protocol, config.passed_down(protocol.config_class, values | out(protocol.name.replace("-", "_")))


def run_suite(config: SuiteConfig) -> dict[str, Any]:
    """Run every protocol of the table on ``--data`` (and VOC07 on ``--voc07-devkit``) on ``--weights``, read and
    hashed once; return ``{"results": [record, ...], ...}``.

    A run whose folder holds a record of the same weights and settings is skipped, with a line, unless ``--rerun``.
    """
    with evaluation(config) as parent:
        records = [run_child(parent, protocol, child, rerun=config.rerun) for protocol, child in _runs(config)]
        summary = {"results": records, "wall_time_s": time.perf_counter() - parent.started}
        kept = load_results(parent.out)[0] if parent.out is not None else []  # a skipped run's record may be there
        parent.write([r for r in records if r not in kept], summary)
    return {"schema": SCHEMA, **summary}
