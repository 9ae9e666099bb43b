"""``bt-hub eval compare``: are these weights better than no pretraining, on this data, by more than the noise?

Rows (weights, baselines), columns (protocols), seeds, curves and the verdict rule: docs/evaluation.md.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from bt_hub.common.presets import baseline
from bt_hub.common.progress import note, progress
from bt_hub.eval import knn, linear, semi_supervised
from bt_hub.eval.compare_config import CompareConfig
from bt_hub.eval.comparison_report import SEED_VARIES, Comparison, describe_settings, render_markdown, write_comparison
from bt_hub.eval.features import TransformedDataset, module_fingerprint, train_transform
from bt_hub.eval.heads import grid_probe
from bt_hub.eval.knn import knn_classify
from bt_hub.eval.label_subsets import balanced_subset_indices
from bt_hub.eval.runner import EvalRun, Scored, evaluation
from bt_hub.eval.semi_supervised import SemiSupervisedConfig, finetune
from bt_hub.method.model import default_init_backbone
from bt_hub.method.transforms import eval_transforms
from bt_hub.train.kept import WeightsRow, curve_rows, live_run

# The from-scratch recipe of the supervised baseline (the digits demo's): SGD for every layer, cosine.
SUPERVISED = {"lr_backbone": 0.1, "lr_classifier": 0.1, "weight_decay": 5e-4, "momentum": 0.9, "schedule": "cosine"}

# ----------------------------------------------------------------------------- rows and their scores


@dataclass
class Source:
    """One row: its name, ``network(seed)`` (``per_seed``: a new one per seed, else built once), whether it is a
    baseline, the sha256 of its weights, and whether ``semi`` fine-tunes it (else: the grid probe on the subset)."""

    name: str
    network: Callable[[int], nn.Module]
    baseline: bool = False
    per_seed: bool = False
    fingerprint: str | None = None
    trainable: bool = True
    seed_fingerprints: dict[int, str] = field(default_factory=dict)  # --as-seeds: the run each seed scores
    position: dict[str, float] = field(default_factory=dict)  # --over-steps: pretraining step and seconds

    def fingerprint_for(self, seed: int) -> str | None:
        """The sha256 of the weights this row scores at ``seed`` (None: a baseline)."""
        return self.seed_fingerprints.get(seed, self.fingerprint)


def _labels_column(column: str) -> int | None:
    return int(column.removeprefix("semi ").removesuffix("%")) if column.startswith("semi ") else None


def compare(
    sources: Sequence[Source],
    run: EvalRun,
    *,
    columns: Sequence[str],
    seeds: Sequence[int],
    features: Callable[[Source, nn.Module, int], tuple[Any, Any, Any, Any]],
    supervised: Callable[[int], nn.Module] | None = None,
    settings: CompareConfig | None = None,
) -> Comparison:
    """Score every source in every column (``kNN``, ``linear``, ``semi P%``) for every seed: the per-seed values
    and their records. ``features(source, network, seed)`` gives (train_x, train_y, test_x, test_y)
    (``feature_source``); ``supervised(seed)``, a network at its default initialisation, adds that baseline."""
    settings = settings or run.config
    splits = run.splits
    num_classes = len(splits.classes)
    names = [s.name for s in sources] + (["supervised"] if supervised else [])
    values: dict[str, dict[str, list[float]]] = {name: {c: [] for c in columns} for name in names}
    result = Comparison(list(seeds), list(columns), values, [s.name for s in sources if s.baseline], len(splits.test))
    result.positions = {s.name: s.position for s in sources if s.position}
    result.varying = {s.name for s in sources if s.per_seed} | ({"supervised"} if supervised else set())
    if supervised:
        result.baselines.append("supervised")
    targets = np.asarray(splits.train.targets)
    say = progress(None, "compare", total=len(seeds) * len(sources) * len(columns), unit="cell")
    for seed in seeds:
        subsets = {p: balanced_subset_indices(targets, p, seed) for c in columns if (p := _labels_column(c))}
        for p in (p for p, rows in subsets.items() if len(set(targets[rows])) == len(rows) and "pixels" in names):
            raise ValueError(
                f"--fractions {p} labels one image a class, too few for the pixels' grid probe to validate on; "
                "raise --fractions or leave pixels out of --baselines"
            )
        for source in sources:
            net = source.network(seed)
            train_x, train_y, test_x, test_y = features(source, net, seed)
            network_id = {"network_fingerprint": module_fingerprint(net)} if source.per_seed and source.baseline else {}
            network_id |= {"curve": source.position} if source.position else {}
            fixed = not source.per_seed  # a kNN vote of one network for every seed is the same vote
            for column in columns:
                tick = time.perf_counter()
                pct = _labels_column(column)
                note(say, f"next: {_cell_work(column, source, settings)} of {source.name}, seed {seed}")
                say.set_postfix(row=source.name, column=column, seed=seed)
                if column == "kNN":
                    k = min(settings.knn_k, len(train_y))
                    score = knn_classify(
                        train_x, train_y, test_x, test_y, k=k, num_classes=num_classes, device=run.device
                    )
                    notes: dict[str, Any] = {"k": k, "temperature": 0.07, "deterministic": fixed}
                    score = {**score, f"top1_k{k}": score["top1"], f"top5_k{k}": score["top5"]}
                elif column == "linear" or not source.trainable:
                    rows = subsets[pct] if pct else None
                    found = grid_probe(
                        train_x[rows] if rows else train_x,
                        train_y[rows] if rows else train_y,
                        test_x,
                        test_y,
                        num_classes,
                        **_grid(settings, seed, run.device),
                    )
                    score, notes = found.pop("metrics"), found
                else:
                    score = _finetune(copy.deepcopy(net), run, subsets[pct], settings, seed, _semi_recipe(settings))
                    notes = {"recipe": f"semi preset {settings.semi_preset}", "epochs": score.pop("epochs")}
                values[source.name][column].append(score["top1"])
                cell = (source.name, source.fingerprint_for(seed), column, seed)
                result.records.append(
                    _record(run, settings, cell, score, subsets.get(pct or 0), tick, {**notes, **network_id})
                )
                say.update(1)
        if supervised:
            _supervised_row(result, supervised, run, subsets, settings, seed)
    say.close()
    return result


def _cell_work(column: str, source: Any, settings: CompareConfig) -> str:
    """What scoring a cell does, in words (the progress line said before it starts: a grid can take minutes)."""
    if column == "kNN":
        return f"the kNN vote (k = {settings.knn_k})"
    if column == "linear" or not source.trainable:
        heads = len(settings.lr_grid) * len(settings.weight_decay_grid)
        return f"{column}: the linear grid probe ({heads} heads x {settings.linear_epochs} epochs)"
    return f"{column}: fine-tuning (semi preset {settings.semi_preset})"


def _grid(settings: CompareConfig, seed: int, device: torch.device | str) -> dict[str, Any]:
    return {
        "lrs": settings.lr_grid,
        "weight_decays": settings.weight_decay_grid,
        "val_fraction": settings.val_fraction,
        "epochs": settings.linear_epochs,
        "batch_size": settings.batch_size,
        "seed": seed,
        "device": device,
        "progress": False,
    }


def _semi_recipe(settings: CompareConfig) -> dict[str, Any]:
    recipe = baseline(SemiSupervisedConfig, settings.semi_preset)
    keys = ("lr_backbone", "lr_classifier", "weight_decay", "momentum", "schedule", "milestones", "gamma")
    return {k: recipe[k] for k in keys} | {
        "crop_scale_min": recipe["crop_scale_min"],
        "flip": recipe["flip"],
        "batch_size": settings.finetune_batch_size,
    }


def _finetune(
    net: nn.Module,
    run: EvalRun,
    indices: Sequence[int],
    settings: CompareConfig,
    seed: int,
    recipe: dict[str, Any],
) -> dict[str, float]:
    """Fine-tune ``net`` and a new classifier on the labelled ``indices``; test top-1 / top-5 and the epochs run.

    The epochs rise until they make ``--finetune-steps`` SGD steps at the recipe's batch size.
    """
    recipe = dict(recipe)
    size, splits = run.settings.image_size, run.splits
    steps_per_epoch = math.ceil(len(indices) / recipe["batch_size"])
    epochs = max(recipe.pop("epochs", settings.semi_epochs), math.ceil(settings.finetune_steps / steps_per_epoch))
    augment = train_transform(size, crop_scale_min=recipe.pop("crop_scale_min"), flip=recipe.pop("flip"))
    train: Dataset = Subset(TransformedDataset(splits.train, augment), list(indices))
    score = finetune(
        net,
        len(splits.classes),
        train,
        TransformedDataset(splits.test, eval_transforms(size)),
        epochs=epochs,
        seed=seed,
        num_workers=settings.num_workers,
        device=run.device,
        desc=f"fine-tune ({len(indices)} labels)",
        precision=run.settings.precision,
        **recipe,
    )
    return {**score, "epochs": epochs}


def _supervised_row(
    result: Comparison,
    network: Callable[[int], nn.Module],
    run: EvalRun,
    subsets: dict[int, list[int]],
    settings: CompareConfig,
    seed: int,
) -> None:
    """Train the network from scratch on each column's labelled images (all of them for kNN and linear)."""
    recipe = _semi_recipe(settings) | SUPERVISED | {"milestones": [], "gamma": 1.0}
    recipe["epochs"] = settings.supervised_epochs
    everything = list(range(len(run.splits.train)))
    done: dict[int, dict[str, float]] = {}
    for column in result.columns:
        pct = _labels_column(column) or 100
        tick = time.perf_counter()
        if pct not in done:
            done[pct] = _finetune(network(seed), run, subsets.get(pct, everything), settings, seed, recipe)
        result.values["supervised"][column].append(done[pct]["top1"])
        notes = {"recipe": SUPERVISED, "epochs": done[pct]["epochs"], "labelled": len(subsets.get(pct, everything))}
        cell = ("supervised", None, column, seed)
        result.records.append(_record(run, settings, cell, done[pct], subsets.get(pct), tick, notes))


def _record(
    run: EvalRun,
    settings: CompareConfig,
    cell: tuple[str, str | None, str, int],
    score: dict[str, float],
    subset: Sequence[int] | None,
    started: float,
    notes: dict[str, Any],
) -> dict[str, Any]:
    """One per-seed record of a cell (protocol knn / linear / semi; the row in ``notes.compare``).

    A baseline row's weights have no file: its ``weights.baseline`` names it, and ``fingerprint`` is None.
    """
    name, fingerprint, column, seed = cell
    protocol = "knn" if column == "kNN" else "linear" if column == "linear" else "semi"
    pct = _labels_column(column)
    weights: dict[str, Any] = {"name": name, "fingerprint": fingerprint}
    if fingerprint is None:
        weights["baseline"] = name
    scored = Scored(
        protocol,
        {k: v for k, v in score.items() if k.startswith(("top1", "top5"))},
        mode={"knn": "features", "linear": "cached"}.get(protocol, "loop"),
        table={"knn": knn.TABLE, "linear": linear.LINEAR_TABLE}.get(protocol, semi_supervised.TABLE),
        labels={"fraction": pct, "source": "seeded", "seed": seed, "count": len(subset or [])} if pct else None,
        notes={"compare": {"row": name, "column": column, "seed_varies": SEED_VARIES[protocol]}, **notes},
    )
    return run.record(scored, weights=weights, seed=seed, config=settings, wall_time_s=time.perf_counter() - started)


# ----------------------------------------------------------------------------- bt-hub eval compare


def weights_rows(config: CompareConfig) -> list[WeightsRow]:
    """``--weights`` as rows: one each; all in one with ``--as-seeds``; one per kept step with ``--over-steps``."""
    if config.over_steps:
        return curve_rows(config.weights, config.as_seeds)
    if config.as_seeds:
        return [WeightsRow(f"{', '.join(Path(w).name or w for w in config.weights)} (as seeds)", config.weights)]
    return [WeightsRow(None, [w]) for w in config.weights]


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
        )
        if len(ws) == 1
        else Source(
            label,
            lambda s, nets=[w.network for w in ws]: nets[seeds.index(s)],
            per_seed=True,
            seed_fingerprints={seed: w.sha256 for seed, w in zip(seeds, ws)},
            position=row.position,
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
    if config.out is not None and config.cache_dir is None:
        config = replace(config, cache_dir=str(Path(config.out) / "feature_cache"))
    rows = weights_rows(config)
    live = {w: how for w in config.weights if (how := live_run(Path(w)))} if config.over_steps else {}
    with evaluation(config, weights=[path for row in rows for path in row.paths]) as ev:
        supervised = None
        if "supervised" in config.baselines:
            arch, stem = ev.settings.arch, ev.settings.small_image_stem
            supervised = lambda s: default_init_backbone(arch, stem, s)  # noqa: E731
        result = compare(
            sources_of(ev, config.baselines, rows),
            ev,
            columns=config.columns(),
            seeds=[config.seed + i for i in range(config.seeds)],
            features=feature_source(ev),
            supervised=supervised,
        )
        result.partial = live
        if ev.out is None:
            return result, render_markdown(result, settings=describe_settings(ev, result.partial))
        return result, write_comparison(ev, result)
