"""``bt-hub eval compare``: are these weights better than no pretraining, on this data, by more than the noise?

Rows (weights, baselines), columns (protocols), seeds, curves and the verdict rule: docs/evaluation.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from bt_hub.common.config import children
from bt_hub.common.progress import note, progress
from bt_hub.eval.compare_config import (
    SUPERVISED,
    Column,
    CompareConfig,
    WeightsRow,
    frozen,
    per_fraction,
    weights_rows,
)
from bt_hub.eval.comparison_report import Comparison, describe_settings, render_markdown, seed_varies, write_comparison
from bt_hub.eval.features import module_fingerprint
from bt_hub.eval.label_subsets import balanced_subset_indices
from bt_hub.eval.protocols import Protocol, get_protocol
from bt_hub.eval.runner import EvalRun, Scored, evaluation
from bt_hub.eval.splits import stratified_holdout
from bt_hub.method.model import default_init_backbone
from bt_hub.weights.sources import live_run

# ----------------------------------------------------------------------------- rows and their cells


@dataclass
class Source:
    """One row: its name, ``network(seed)`` (``per_seed``: a new one per seed, else built once), whether it is a
    baseline, the sha256 of its weights, and whether a protocol that trains the network (semi) may train it (else:
    the linear probe on the same labels); ``supervised``: every cell trains it from scratch (:data:`SUPERVISED`)."""

    name: str
    network: Callable[[int], nn.Module]
    baseline: bool = False
    per_seed: bool = False
    fingerprint: str | None = None
    trainable: bool = True
    seed_fingerprints: dict[int, str] = field(default_factory=dict)  # --as-seeds: the run each seed scores
    position: dict[str, float] = field(default_factory=dict)  # --over-steps: pretraining step and seconds
    curve: str = ""  # --over-steps: the curve the row is a point of ('' for one run)
    supervised: bool = False

    def fingerprint_for(self, seed: int) -> str | None:
        """The sha256 of the weights this row scores at ``seed`` (None: a baseline)."""
        return self.seed_fingerprints.get(seed, self.fingerprint)


@dataclass
class RowCell:
    """One row's network on the run's splits, read by a protocol's ``score_cell`` as it reads an EvalRun: the
    features are extracted once per network (``extracted``) and shared by its columns and seeds; ``labelled``
    keeps the training features of a label subset (a frozen row in a column of a protocol that trains the network)."""

    run: EvalRun
    network: nn.Module
    extracted: Callable[[], tuple[Any, Any, Any, Any]]
    labelled: Sequence[int] | None = None
    progress: ClassVar[bool] = False  # compare's own line says which cell runs

    @property
    def splits(self) -> Any:
        """The run's splits."""
        return self.run.splits

    @property
    def device(self) -> torch.device:
        """The run's device."""
        return self.run.device

    @property
    def settings(self) -> Any:
        """The run's settings (image size, precision)."""
        return self.run.settings

    def features(self, split: str) -> tuple[Any, Any]:
        """Features and labels of ``split`` (``train``: of the labelled subset, where there is one)."""
        train_x, train_y, test_x, test_y = self.extracted()
        if split == "test":
            return test_x, test_y
        rows = self.labelled
        return (train_x, train_y) if rows is None else (train_x[rows], train_y[rows])


def cell_protocol(settings: CompareConfig, source: Source, column: Column) -> tuple[Protocol, Any]:
    """The protocol a cell runs and its config: the column's (compare's child of its name, or the protocol's defaults
    on compare's shared flags), the linear probe where it would train a frozen row (pixels), semi with
    :data:`SUPERVISED` for the supervised row; on the row's weights, the column's share of the labels (all of them
    in a column without a fraction)."""
    name = "semi" if source.supervised else column.protocol
    name = "linear" if get_protocol(name).trains_network and not source.trainable else name
    values: dict[str, Any] = {"weights": source.name, "out": None}
    if per_fraction(name):
        values["fraction"] = column.fraction or 100
    if source.supervised:
        values |= SUPERVISED | {"epochs": settings.supervised_epochs}
    protocol = get_protocol(name)
    if name in children(CompareConfig):  # the child built when compare was, each cell its values replaced
        return protocol, replace(getattr(settings, name), **values)
    return protocol, settings.passed_down(protocol.config_class, values)


def compare(
    sources: Sequence[Source],
    run: EvalRun,
    *,
    columns: Sequence[Column],
    seeds: Sequence[int],
    features: Callable[[Source, nn.Module, int], tuple[Any, Any, Any, Any]],
    settings: CompareConfig | None = None,
) -> Comparison:
    """Score every source in every column for every seed, each cell a protocol run (:func:`cell_protocol`): the
    per-seed values, their per-image results and their records. ``features(source, network, seed)`` gives (train_x,
    train_y, test_x, test_y) (``feature_source``). RankMe's column has no cell of the supervised row (no
    representation of its own)."""
    settings = settings or run.config
    cells = {
        (s.name, c): cell_protocol(settings, s, c)
        for s in sources
        for c in columns
        if not (s.supervised and get_protocol(c.protocol).label_free)
    }  # seeds: an argument
    splits = run.splits
    names = [s.name for s in sources]
    values: dict[str, dict[Column, list[float]]] = {name: {c: [] for c in columns} for name in names}
    result = Comparison(list(seeds), list(columns), values, [s.name for s in sources if s.baseline], len(splits.test))
    result.positions = {s.name: s.position for s in sources if s.position}
    result.curve_names = {s.name: s.curve for s in sources if s.position}
    result.varying = {s.name for s in sources if s.per_seed}
    result.correct = {name: {c: [] for c in columns} for name in names}
    targets = np.asarray(splits.train.targets)
    subsets_of = {seed: _label_subsets(cells, columns, targets, seed) for seed in seeds}  # checked before any cell
    say = progress(None, "compare", total=len(seeds) * len(cells), unit="cell")
    for seed in seeds:
        subsets = subsets_of[seed]
        nets = {s.name: s.network(seed) for s in sources}
        rows_of = {
            s.name: RowCell(run, n, lambda s=s, n=n, k=seed: features(s, n, k)) for s, n in zip(sources, nets.values())
        }
        together: dict[tuple[str, Column], dict[str, tuple[Scored, float]]] = {}  # a column's cells scored at once
        for source in sources:
            net, cell = nets[source.name], rows_of[source.name]
            network_id = {"network_fingerprint": module_fingerprint(net)} if source.per_seed and source.baseline else {}
            network_id |= {"curve": source.position} if source.position else {}
            done: dict[tuple[str, int | None], Scored] = {}  # the supervised row trains once per share of labels
            for column in (c for c in columns if (source.name, c) in cells):
                tick = time.perf_counter()
                protocol, config = cells[source.name, column]
                note(say, f"next: {column} of {source.name}, seed {seed}: {protocol.name}, {protocol.help}")
                say.set_postfix(row=source.name, column=str(column), seed=seed)
                key = (protocol.name, getattr(config, "fraction", column.fraction))
                # a protocol that draws no labelled subset itself (kNN, linear, the linear probe of a frozen row in a
                # semi column) gets the column's
                rows = subsets.get(column.fraction) if not per_fraction(protocol.name) else None
                if hasattr(protocol.load(), "score_cells") and not source.supervised:
                    if (protocol.name, column) not in together:
                        peers = [s.name for s in sources if cells[s.name, column][0] == protocol and not s.supervised]
                        cells_of = [replace(rows_of[name], labelled=rows) for name in peers]
                        together[protocol.name, column] = _score_together(protocol, cells_of, peers, config, seed)
                    scored, seconds = together[protocol.name, column][source.name]
                    done[key] = replace(scored, protocol=protocol.name)
                    tick = time.perf_counter() - seconds  # the record's wall time: its share of the column's
                elif key not in done:
                    scored = protocol.load().score_cell(replace(cell, labelled=rows), config, seed)
                    done[key] = replace(scored, protocol=protocol.name)
                scored = done[key]
                values[source.name][column].append(scored.metrics[_headline(protocol)])
                result.correct[source.name][column].append(scored.correct)
                result.records.append(
                    _record(run, settings, source, column, seed, scored, subsets.get(column.fraction), tick, network_id)
                )
                say.update(1)
    say.close()
    return result


def _headline(protocol: Protocol) -> str:
    """The metric a cell of ``protocol`` shows: test top-1, or RankMe for a label-free protocol."""
    return "rankme" if protocol.label_free else "top1"


def _label_subsets(
    cells: Mapping[tuple[str, Column], tuple[Protocol, Any]], columns: Sequence[Column], targets: np.ndarray, seed: int
) -> dict[int, list[int]]:
    """The labelled training rows of each share of the labels at ``seed`` (semi's seeded class-balanced subsets),
    each checked for the linear grid probes of the comparison that read it (:func:`check_grid_labels`)."""
    subsets = {c.fraction: balanced_subset_indices(targets, c.fraction, seed) for c in columns if c.fraction}
    for (row, column), (protocol, config) in cells.items():
        rows, grid = subsets.get(column.fraction), getattr(config, "uses_grid", None)
        if rows is not None and not per_fraction(protocol.name) and grid and grid(len(set(targets.tolist()))):
            flag = "--fractions" if per_fraction(column.protocol) else "--label-fractions"
            which = "pixels out of --baselines" if row == "pixels" else f"{protocol.name} out of --protocols"
            check_grid_labels(targets[rows], config.val_fraction, seed, f"{flag} {column.fraction}", f"leave {which}")
    return subsets


def check_grid_labels(labels: np.ndarray, val_fraction: float, seed: int, given: str, instead: str) -> None:
    """Refuse a share of the labels (``given``: its flag and value) that leaves the linear grid probe no validation
    split to choose on (at most one image a class), in one sentence that says to raise it, or ``instead``."""
    if not stratified_holdout(labels, val_fraction, seed)[1]:
        raise ValueError(
            f"{given} labels {len(labels)} training images, at most one a class, too few for the linear grid probe to "
            f"choose on a validation split; raise {given.split()[0]} or {instead}"
        )


def _score_together(
    protocol: Protocol, cells: list[RowCell], names: list[str], config: Any, seed: int
) -> dict[str, tuple[Scored, float]]:
    """The cells of one column that ``protocol`` scores at once (its ``score_cells``: a curve's linear grids in one
    set of heads), each with its row's name and its share of the seconds."""
    tick = time.perf_counter()
    found = protocol.load().score_cells(cells, config, seed)
    share = (time.perf_counter() - tick) / len(cells)
    return {name: (scored, share) for name, scored in zip(names, found)}


def _record(
    run: EvalRun,
    settings: CompareConfig,
    source: Source,
    column: Column,
    seed: int,
    scored: Scored,
    subset: Sequence[int] | None,
    started: float,
    network_id: dict[str, Any],
) -> dict[str, Any]:
    """One per-seed record of a cell: the protocol's own, with the row and column in ``notes.compare``.

    A baseline row's weights have no file: its ``weights.baseline`` names it, and ``fingerprint`` is None.
    """
    fingerprint = source.fingerprint_for(seed)
    weights: dict[str, Any] = {"name": source.name, "fingerprint": fingerprint}
    if fingerprint is None:
        weights["baseline"] = source.name
    labels = scored.labels
    if labels is None and column.fraction:  # a frozen row probed on the column's labels
        labels = {"fraction": column.fraction, "source": "seeded", "seed": seed, "count": len(subset or [])}
    budget = column.drawn and frozen(column.protocol)
    varies = seed_varies("supervised" if source.supervised else "label budget" if budget else column.protocol)
    compared = {"row": source.name, "column": str(column), "seed_varies": varies, "protocol": scored.protocol}
    notes = {"compare": compared, **(scored.notes or {}), **network_id}
    if get_protocol(scored.protocol).deterministic:  # one network for every seed: the same vote (the card says so)
        notes["deterministic"] = not source.per_seed and not column.drawn
    cell = replace(scored, labels=labels, notes=notes)
    return run.record(cell, weights=weights, seed=seed, config=settings, wall_time_s=time.perf_counter() - started)


# ----------------------------------------------------------------------------- bt-hub eval compare


def sources_of(run: EvalRun, baselines: Sequence[str], rows: Sequence[WeightsRow] | None = None) -> list[Source]:
    """The weights rows (keyed by sha256, labelled apart when their names collide) and the chosen baselines.

    ``rows`` groups ``run.all_weights`` in order (``weights_rows``); by default each weights is a row.
    """
    seen: dict[str, str] = {}
    for w in run.all_weights:
        if w.sha256 in seen:
            raise ValueError(
                f"--weights {seen[w.sha256]} and {w.source} are the same weights (sha256 {w.sha256[:12]}); "
                "name each checkpoint once"
            )
        seen[w.sha256] = w.source
    rows = rows or [WeightsRow(None, [w.source]) for w in run.all_weights]
    loaded = iter(run.all_weights)
    groups = [(row, [next(loaded) for _ in row.paths]) for row in rows]
    labels = [row.label or ws[0].label for row, ws in groups]
    seeds = [run.config.seed + i for i in range(len(rows[0].paths))]
    sources = [
        Source(
            label if labels.count(label) == 1 else f"{label} ({ws[0].sha256[:8]})",
            lambda s, n=ws[0].network: n,
            fingerprint=ws[0].sha256,
            position=row.position,
            curve=row.curve,
        )
        if len(ws) == 1
        else Source(
            label,
            lambda s, nets=[w.network for w in ws]: nets[seeds.index(s)],
            per_seed=True,
            seed_fingerprints={seed: w.sha256 for seed, w in zip(seeds, ws)},
            position=row.position,
            curve=row.curve,
        )
        for label, (row, ws) in zip(labels, groups)
    ]
    arch, stem = run.settings.arch, run.settings.small_image_stem
    if "pixels" in baselines:
        sources.append(Source("pixels", lambda s: nn.Flatten(), baseline=True, trainable=False))
    if "random-init" in baselines:
        sources.append(
            Source("random-init", lambda s: default_init_backbone(arch, stem, s), baseline=True, per_seed=True)
        )
    if "supervised" in baselines:
        scratch = Source("supervised", lambda s: default_init_backbone(arch, stem, s), baseline=True, per_seed=True)
        sources.append(replace(scratch, supervised=True))
    return sources


def feature_source(run: EvalRun) -> Callable[[Source, nn.Module, int], tuple[Any, Any, Any, Any]]:
    """``compare``'s ``features`` argument: each network's train and test features, extracted once per run."""
    extracted: dict[tuple[str, int | None], tuple[Any, Any, Any, Any]] = {}

    def features(source: Source, net: nn.Module, seed: int) -> tuple[Any, Any, Any, Any]:
        key = (source.fingerprint_for(seed) or source.name, seed if source.baseline and source.per_seed else None)
        if key not in extracted:
            weights_id = source.fingerprint_for(seed) or module_fingerprint(net)
            pairs = [
                run.features(name, network=net, weights_id=weights_id, label=f"{name} ({source.name})")
                for name in ("train", "test")
            ]
            extracted[key] = (*pairs[0], *pairs[1])
        return extracted[key]

    return features


def run(config: CompareConfig) -> str:
    """``bt-hub eval compare``: score weights and baselines, write compare.md, compare.png and the records.

    Returns:
        The table (compare.md) and the files written, for the CLI to print.
    """
    return compare_and_write(config)[1]


def compare_and_write(config: CompareConfig) -> tuple[Comparison, str]:
    """Score every row and column; with ``config.out``, write the files of :func:`write_comparison`.

    Features are cached in ``--cache-dir`` (default ``OUT/feature_cache``). Returns the comparison and
    the table (with the files written, when there is a folder).
    """
    rows, columns = weights_rows(config), config.columns()
    live = {w: how for w in config.weights if (how := live_run(Path(w)))} if config.over_steps else {}
    with evaluation(config, weights=[path for row in rows for path in row.paths]) as ev:
        result = compare(
            sources_of(ev, config.baselines, rows),
            ev,
            columns=columns,
            seeds=[config.seed + i for i in range(config.seeds)],
            features=feature_source(ev),
        )
        result.partial = live
        if ev.out is None:
            return result, render_markdown(result, settings=describe_settings(ev, result.partial))
        return result, write_comparison(ev, result)
