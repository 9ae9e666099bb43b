"""The flags of ``bt-hub eval compare`` (:class:`CompareConfig`): which weights, baselines, protocols, label
fractions and seeds make the table, and the configs of its columns' protocols (its children); its rows
(:class:`WeightsRow`, one per weights, or per kept step of a learning curve) and columns (:class:`Column`).
``bt_hub.eval.comparison`` scores it."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from bt_hub.common.config import REQUIRED, child, option, out_field, overrides
from bt_hub.common.files import read_json
from bt_hub.common.presets import shown
from bt_hub.eval.config import EvalConfig, EvalWarning
from bt_hub.eval.knn import KnnConfig
from bt_hub.eval.linear import LinearConfig
from bt_hub.eval.protocols import get_protocol, list_protocols
from bt_hub.eval.semi_supervised import SemiSupervisedConfig
from bt_hub.weights.card import recipe_differences
from bt_hub.weights.sources import kept_steps

BASELINES = ("pixels", "random-init", "supervised")
# The from-scratch recipe of the supervised baseline (the digits demo's): SGD for every layer, cosine; its cells are
# semi runs of this recipe on the column's labels (all of them in a column without a fraction).
SUPERVISED = {"lr_backbone": 0.1, "lr_classifier": 0.1, "weight_decay": 5e-4, "momentum": 0.9, "schedule": "cosine"}


@dataclass(frozen=True)
class Column:
    """A column of the table: a protocol of the table (bt_hub.eval.protocols), on ``fraction`` % of the training
    labels where the protocol has a column per ``--fractions`` (semi) or per ``--label-fractions`` (kNN, linear)."""

    protocol: str
    fraction: int | None = None

    def __str__(self) -> str:
        """The column's heading: ``kNN``, ``linear``, ``semi 10%``, ``kNN 10%``, ``RankMe``."""
        name = get_protocol(self.protocol).heading
        return f"{name} {self.fraction}%" if self.fraction else name

    @property
    def drawn(self) -> bool:
        """Whether its cells' labels are a seeded draw, another at each seed (a share under 100%)."""
        return (self.fraction or 100) < 100


def column_protocols() -> list[str]:
    """The protocols a ``--protocols`` column can run: those on any ``--data`` that score with labels (a verdict
    against a baseline compares accuracies; a label-free value, RankMe, is none: it comes beside the frozen
    columns, :meth:`CompareConfig.columns`)."""
    return [p for p in list_protocols(any_data=True) if not get_protocol(p).label_free]


def frozen(protocol: str) -> bool:
    """Whether ``protocol``'s columns score frozen features of every row (kNN, linear): those RankMe comes beside, and
    those ``--label-fractions`` splits into one column a budget."""
    return not (get_protocol(protocol).trains_network or per_fraction(protocol))


def _split_list(values: Sequence[str]) -> list[str]:
    return [v.strip() for value in values for v in str(value).split(",") if v.strip()]


@dataclass
class CompareConfig(EvalConfig):
    """Flags of ``bt-hub eval compare``: weights against baselines, every cell mean ± std over seeds; each column's
    protocol config is a child (``--knn.k``, ``--linear.epochs``, ``--semi.preset``)."""

    RUN_FIELDS: ClassVar[tuple[str, ...]] = EvalConfig.RUN_FIELDS + ("seeds",)
    CACHE_UNDER_OUT: ClassVar[bool] = True
    REUSES_SPLITS: ClassVar[bool] = True

    weights: list[str] = option(
        REQUIRED, "weights to compare (one or more, any source bt-hub eval takes: file, run folder, URL, hub id)"
    )
    baselines: list[str] = option(
        ["pixels", "random-init"], f"rows to beat, comma- or space-separated: {', '.join(BASELINES)}"
    )
    protocols: list[str] = option(
        [p for p in column_protocols() if not get_protocol(p).trains_network],  # on frozen features
        "columns, comma- or space-separated: "
        f"{', '.join(column_protocols())} (a protocol on a share of the labels, semi: one per --fractions; those on "
        "frozen features: one per --label-fractions, and RankMe of every row beside them, without a verdict)",
    )
    seeds: int = option(3, "seeds per cell (--seed, --seed + 1, ...); with --as-seeds, one per run")
    as_seeds: bool = option(
        False,
        "the --weights are pretraining runs of one recipe that differ in their seed: one row, run i "
        "scored with evaluation seed --seed + i, so the spread is over pretraining runs",
    )
    over_steps: bool = option(
        False,
        "a learning curve: one row per step whose weights each --weights run kept (bt-hub pretrain "
        "--keep-every), drawn against the baselines' bands in curve.png",
    )
    fractions: list[int] = option([1, 10], "label percentages of semi")
    label_fractions: list[int] = option(
        [100],
        "label percentages of the frozen columns (kNN, linear): one column each, on the seeded, class-balanced "
        "subsets semi draws (the same for every row at a seed), each with its own verdict; 100: all the labels",
    )
    knn: KnnConfig = child(
        "the kNN column (bt-hub eval knn); k is 20 here, not eval knn's 20 200: a column is one number, the first "
        "k's top-1",
        k=[20],
    )
    linear: LinearConfig = child(
        "the linear column, and the probe of a row that has no network to train (pixels) in a column that trains "
        "one: the grid probe (bt-hub eval linear --search grid)",
        sets=("search",),
        search="grid",
    )
    semi: SemiSupervisedConfig = child(
        "the semi columns (bt-hub eval semi), one per --fractions, and the recipe of the supervised row; preset small "
        "and at least 800 steps here, not eval semi's paper and 0: the paper's 20 epochs on a small folder are a few "
        "steps, at which training from scratch is at chance",
        sets=("fraction", "subset_file"),
        preset="small",
        min_steps=800,
    )
    supervised_epochs: int = option(30, "epochs of the supervised baseline")
    out: str | None = out_field(
        "runs/compare", "output directory: compare.md, compare.png, results.json, results.jsonl, results.md"
    )

    def __post_init__(self) -> None:
        self.weights = [str(w) for w in self.weights]
        if not self.weights or not all(w.strip() for w in self.weights):
            raise ValueError(f"--weights must name one or more checkpoints, got {shown(self.weights)}")
        self.baselines, self.protocols = _split_list(self.baselines), _split_list(self.protocols)
        for flag, given, known in (
            ("--baselines", self.baselines, BASELINES),
            ("--protocols", self.protocols, column_protocols()),
        ):
            unknown = [v for v in given if v not in known]
            if unknown or not given:
                why = "; RankMe comes beside the frozen columns unasked" if "rankme" in unknown else ""
                raise ValueError(f"{flag} must list some of {', '.join(known)}, got {shown(given)}{why}")
        super().__post_init__()
        if self.as_seeds:
            if len(self.weights) < 2:
                raise ValueError(f"--as-seeds needs two or more pretraining runs in --weights, got {self.weights}")
            if "seeds" not in overrides(self):
                self.seeds = len(self.weights)
            elif self.seeds != len(self.weights):
                raise ValueError(
                    f"--as-seeds scores run i with seed --seed + i: --seeds must be {len(self.weights)} (the number "
                    f"of --weights), got {self.seeds}"
                )
        if not 1 <= self.seeds <= 100:
            raise ValueError(f"--seeds must be an integer in [1, 100], got {self.seeds}")
        for flag, given in (("--fractions", self.fractions), ("--label-fractions", self.label_fractions)):
            if not given or any(not 0 < f <= 100 for f in given) or len(set(given)) < len(given):
                raise ValueError(f"{flag} must be distinct percentages in (0, 100], got {shown(given)}")
        self.require_positive("supervised_epochs")

    def shared_settings(self) -> dict[str, Any]:
        """The shared flags given; a cell's weights are its row's (the children are checked with the first)."""
        return super().shared_settings() | {"weights": self.weights[0]}

    def unused_flags(self) -> dict[str, str]:
        """A column's child when no cell runs it: not in ``--protocols``, nor the probe of the pixels row in a column
        that trains the network (linear), nor the supervised row's recipe (semi, less its epochs and optimiser:
        ``--supervised-epochs`` and :data:`SUPERVISED`)."""
        unused = super().unused_flags()
        column = "sets the {} column{}, which this run does not score"
        trains = any(get_protocol(p).trains_network for p in self.protocols)
        if "knn" not in self.protocols:
            unused["knn"] = column.format("kNN", "")
        if "linear" not in self.protocols and not (trains and "pixels" in self.baselines):
            unused["linear"] = column.format("linear", " (and the pixels row of a column that trains the network)")
        if "semi" not in self.protocols and "supervised" in self.baselines:
            unused |= dict.fromkeys([f"semi.{k}" for k in ("epochs", *SUPERVISED)], column.format("semi", ""))
        elif "semi" not in self.protocols:
            unused["semi"] = column.format("semi", " (and --baselines supervised)")
        if "supervised" not in self.baselines:
            unused["supervised_epochs"] = "sets --baselines supervised, which is not asked for"
        if not any(per_fraction(p) for p in self.protocols):
            unused["fractions"] = "sets the columns on a share of the labels, which --protocols leaves out"
        if not any(frozen(p) for p in self.protocols):
            unused["label_fractions"] = "sets the frozen columns (knn, linear), which --protocols leaves out"
        return unused

    def columns(self) -> list[Column]:
        """The table's columns, in ``--protocols`` order: one per ``--fractions`` for a protocol scored on a share
        of the labels (semi), one per ``--label-fractions`` for one on frozen features (without a fraction where
        that is all the labels alone: the table of before budgets), else one; then RankMe where a column is frozen."""
        budgets = [None] if self.label_fractions == [100] else self.label_fractions
        columns = [
            Column(p, f)
            for p in self.protocols
            for f in (self.fractions if per_fraction(p) else budgets if frozen(p) else [None])
        ]
        return columns + [Column("rankme")] * any(frozen(p) for p in self.protocols)


def per_fraction(protocol: str) -> bool:
    """Whether ``protocol``'s columns are one per ``--fractions``: its config takes a share of the labels."""
    return any(f.name == "fraction" for f in dataclasses.fields(get_protocol(protocol).config_class))


def weights_rows(config: CompareConfig) -> list[WeightsRow]:
    """``--weights`` as rows: one each; all in one with ``--as-seeds``; one per kept step with ``--over-steps``.

    ``--as-seeds`` warns when the runs' ``config.json`` differ in more than their seed (``recipe_differences``).
    """
    runs = [Path(w) / "config.json" for w in config.weights]
    if (
        config.as_seeds
        and all(r.is_file() for r in runs)
        and (differ := recipe_differences(list(map(read_json, runs))))
    ):
        warnings.warn(
            f"--as-seeds takes the --weights for pretraining runs of one recipe with different seeds, but they differ "
            f"in {'; '.join(differ)} (their config.json): a row's spread is not over seeds alone",
            EvalWarning,
            stacklevel=2,
        )
    if config.over_steps:
        return curve_rows(config.weights, config.as_seeds)
    if config.as_seeds:
        return [WeightsRow(f"{', '.join(Path(w).name or w for w in config.weights)} (as seeds)", config.weights)]
    return [WeightsRow(None, [w]) for w in config.weights]


@dataclass
class WeightsRow:
    """The weights of one row: a label (None: the file's name), one file per pretraining run, a curve position."""

    label: str | None
    paths: list[str]
    position: dict[str, float] = field(default_factory=dict)
    curve: str = ""  # the learning curve the row is a point of: its run's name where several runs make curves


def curve_rows(runs: list[str], as_seeds: bool) -> list[WeightsRow]:
    """One row per kept step of each run; with ``as_seeds``, one per step of all runs together (same steps)."""
    kept = {}
    for run in runs:
        kept[run] = {step: (seconds, str(path)) for step, seconds, path in kept_steps(run)}
        if not kept[run]:
            raise ValueError(
                f"--over-steps scores the weights a pretraining run kept, and --weights {run} holds none in kept/; "
                "pretrain with --keep-every N (or 'log')"
            )
    if not as_seeds:
        prefix = {run: f"{Path(run).name} " if len(runs) > 1 else "" for run in runs}
        return [
            WeightsRow(f"{prefix[run]}step {step}", [path], {"step": step, "seconds": seconds}, prefix[run].strip())
            for run in runs
            for step, (seconds, path) in sorted(kept[run].items())
        ]
    steps = sorted(kept[runs[0]])
    for run in runs[1:]:
        if sorted(kept[run]) != steps:
            raise ValueError(
                f"--as-seeds --over-steps pairs the runs step by step, and --weights {run} kept steps "
                f"{sorted(kept[run])} where {runs[0]} kept {steps}; keep the same steps in every run"
            )
    return [
        WeightsRow(
            f"step {step}",
            [kept[run][step][1] for run in runs],
            {"step": step, "seconds": sum(kept[run][step][0] for run in runs) / len(runs)},
        )
        for step in steps
    ]
