"""``bt-hub eval compare``: are these weights better than no pretraining, on this data, by more than the noise?

Rows are the ``--weights`` (any source the resolver takes) and the ``--baselines``:

- ``pixels``: the test-transformed images, flattened, through the same classifiers;
- ``random-init``: the same architecture and stem at torchvision's default initialisation
  (residual BNs at 1, not the zero-initialised branches pretraining starts from), a new
  network per seed;
- ``supervised``: the same network trained from scratch on the labelled images (all training
  labels for kNN and linear, the subset for ``semi``) with ``SUPERVISED`` for
  ``--supervised-epochs``; its own test top-1 fills each column.

Columns are the ``--protocols``: ``knn`` (weighted kNN, bt_hub.eval.knn), ``linear`` (the grid probe
of bt_hub.eval.linear, chosen on a validation split of the training data) and ``semi``
(fine-tuning on ``--fractions`` percent of the labels with the ``--semi-preset`` recipe; pixels
get the grid probe on the subset). Every cell is the mean ± sample standard deviation over
``--seeds`` seeds (``--seed``, ``--seed`` + 1, ...); ``SEED_VARIES`` says what a seed changes
in each. Features are extracted once per network (and cached under ``--cache-dir``) and reused
by every protocol and seed. ``better`` compares each weights row with the best baseline of a
column seed by seed (``verdict``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, Subset
from torchvision.models.resnet import BasicBlock, Bottleneck

from bt_hub.common.distributed import process_group
from bt_hub.common.files import atomic_write_json, atomic_write_text
from bt_hub.common.presets import baseline
from bt_hub.common.records import SCHEMA, fmt_mean_std, make_record, mean_std, seeds_text
from bt_hub.common.runs import claim_run_dir
from bt_hub.eval.config import EvalConfig
from bt_hub.eval.features import (
    TransformedDataset,
    eval_image_size,
    features_for,
    module_fingerprint,
    train_transform,
)
from bt_hub.eval.knn import knn_classify
from bt_hub.eval.label_subsets import balanced_subset_indices
from bt_hub.eval.linear import GRID_LRS, GRID_WEIGHT_DECAYS, check_probe_settings, grid_probe
from bt_hub.eval.report import append_results
from bt_hub.eval.semi_supervised import SemiSupervisedConfig, finetune
from bt_hub.eval.splits import Splits, splits_for
from bt_hub.method.model import build_backbone
from bt_hub.method.transforms import eval_transforms

BASELINES = ("pixels", "random-init", "supervised")
PROTOCOLS = ("knn", "linear", "semi")
# The from-scratch recipe of the supervised baseline (the digits demo's): SGD for every layer, cosine.
SUPERVISED = {"lr_backbone": 0.1, "lr_classifier": 0.1, "weight_decay": 5e-4, "momentum": 0.9, "schedule": "cosine"}
SEED_VARIES = {
    "knn": "nothing for a fixed network (the vote is deterministic); the network itself for random-init",
    "linear": "the validation split carved from the training data, the heads' initialisation and the data order",
    "semi": "the labelled subset (seeded, class-balanced), the classifier's initialisation and the data order",
    "supervised": "the network's initialisation, the labelled subset (semi columns) and the data order",
}
RULE = (
    "a weights row is *better* in a column when, pairing runs by seed, it beats the column's best baseline (highest "
    "mean) in every seed and the mean of the paired differences exceeds their standard deviation; one seed gives "
    "no verdict"
)


# ----------------------------------------------------------------------------- rows, cells, verdicts


@dataclass
class Source:
    """One row: a name, how to get its network for a seed, and whether it is a baseline.

    ``network(seed)`` returns the feature extractor (``nn.Flatten()`` for pixels); ``per_seed``
    says it differs by seed (random-init), else it is built once. ``fingerprint`` names fixed
    weights in the records. ``trainable`` networks are fine-tuned by ``semi``; others get the
    grid probe on the labelled subset's features.
    """

    name: str
    network: Callable[[int], nn.Module]
    baseline: bool = False
    per_seed: bool = False
    fingerprint: str = "baseline"
    trainable: bool = True


@dataclass
class Comparison:
    """Per-seed top-1 of every row and column, and what was compared."""

    seeds: list[int]
    columns: list[str]
    values: dict[str, dict[str, list[float]]]  # row -> column -> per-seed top-1
    baselines: list[str]
    test_size: int
    records: list[dict[str, Any]] = field(default_factory=list)

    def cell(self, row: str, column: str) -> str:
        """``mean ± std`` of a cell ('—' when the row has no value there)."""
        return fmt_mean_std(self.values[row].get(column, []))

    def verdict(self, row: str, column: str) -> dict[str, Any] | None:
        """The paired comparison of a weights row with the column's best baseline (``RULE``); None without one."""
        scored = [b for b in self.baselines if self.values[b].get(column)]
        if not scored or not self.values[row].get(column):
            return None
        best = max(scored, key=lambda b: mean_std(self.values[b][column])[0])
        diffs = [w - b for w, b in zip(self.values[row][column], self.values[best][column])]
        mean, std = mean_std(diffs)
        better = None if len(diffs) < 2 else all(d > 0 for d in diffs) and mean > std
        return {"baseline": best, "differences": diffs, "mean": mean, "std": std, "better": better}


def default_init_backbone(arch: str, small_image_stem: bool, seed: int) -> nn.Module:
    """The backbone at torchvision's default initialisation (residual BN weights 1, Kaiming-normal small stem)."""
    torch.manual_seed(seed)
    net = build_backbone(arch, small_image_stem=small_image_stem)
    if small_image_stem:  # torchvision's initialisation of every convolution, which the 3x3 stem replaced
        nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
    for module in net.modules():
        if isinstance(module, Bottleneck):
            nn.init.ones_(module.bn3.weight)
        elif isinstance(module, BasicBlock):
            nn.init.ones_(module.bn2.weight)
    return net


def _labels_column(column: str) -> int | None:
    return int(column.removeprefix("semi ").removesuffix("%")) if column.startswith("semi ") else None


def compare(
    sources: Sequence[Source],
    splits: Splits,
    *,
    columns: Sequence[str],
    seeds: Sequence[int],
    features: Callable[[Source, nn.Module, int], tuple[Any, Any, Any, Any]],
    settings: CompareConfig,
    supervised: Callable[[int], nn.Module] | None = None,
    device: torch.device | str = "cpu",
) -> Comparison:
    """Score every source in every column for every seed; return the per-seed values and their records.

    Args:
        sources: the rows (weights first, then baselines).
        splits: the train / test splits (the test split is only ever scored).
        columns: ``kNN``, ``linear`` and ``semi P%`` columns.
        seeds: one run of every cell per seed.
        features: ``(source, network, seed) -> (train_x, train_y, test_x, test_y)``, extracted once per network.
        settings: the protocols' settings (``CompareConfig``).
        supervised: ``seed -> network`` at its default initialisation, to add the supervised baseline.
        device: where classifiers train.
    """
    num_classes = len(splits.classes)
    names = [s.name for s in sources] + (["supervised"] if supervised else [])
    values: dict[str, dict[str, list[float]]] = {name: {c: [] for c in columns} for name in names}
    result = Comparison(list(seeds), list(columns), values, [s.name for s in sources if s.baseline], len(splits.test))
    if supervised:
        result.baselines.append("supervised")
    targets = np.asarray(splits.train.targets)
    for seed in seeds:
        subsets = {p: balanced_subset_indices(targets, p, seed) for c in columns if (p := _labels_column(c))}
        for source in sources:
            net = source.network(seed)
            train_x, train_y, test_x, test_y = features(source, net, seed)
            network_id = {"network_fingerprint": module_fingerprint(net)} if source.per_seed else {}
            for column in columns:
                tick = time.perf_counter()
                pct = _labels_column(column)
                if column == "kNN":
                    k = min(settings.knn_k, len(train_y))
                    score = knn_classify(train_x, train_y, test_x, test_y, k=k, num_classes=num_classes, device=device)
                    notes: dict[str, Any] = {"k": k, "temperature": 0.07}
                    score = {**score, f"top1_k{k}": score["top1"], f"top5_k{k}": score["top5"]}
                elif column == "linear" or not source.trainable:
                    rows = subsets[pct] if pct else None
                    found = grid_probe(
                        train_x[rows] if rows else train_x,
                        train_y[rows] if rows else train_y,
                        test_x,
                        test_y,
                        num_classes,
                        **_grid(settings, seed, device),
                    )
                    score, notes = found.pop("metrics"), found
                else:
                    score = _finetune(
                        copy.deepcopy(net), splits, subsets[pct], settings, seed, device, _semi_recipe(settings)
                    )
                    notes = {"recipe": f"semi preset {settings.semi_preset}", "epochs": settings.semi_epochs}
                values[source.name][column].append(score["top1"])
                result.records.append(
                    _record(
                        settings,
                        source.name,
                        source.fingerprint,
                        column,
                        score,
                        seed,
                        splits,
                        subsets.get(pct or 0),
                        time.perf_counter() - tick,
                        {**notes, **network_id},
                    )
                )
        if supervised:
            _supervised_row(result, supervised, splits, subsets, settings, seed, device)
    return result


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
    keys = ("lr_backbone", "lr_classifier", "weight_decay", "momentum", "schedule", "milestones", "gamma", "batch_size")
    return {k: recipe[k] for k in keys} | {"crop_scale_min": recipe["crop_scale_min"], "flip": recipe["flip"]}


def _finetune(
    net: nn.Module,
    splits: Splits,
    indices: Sequence[int],
    settings: CompareConfig,
    seed: int,
    device: torch.device | str,
    recipe: dict[str, Any],
) -> dict[str, float]:
    """Fine-tune ``net`` and a new classifier on the labelled ``indices``; test top-1 / top-5."""
    recipe = dict(recipe)
    augment = train_transform(settings.image_size, crop_scale_min=recipe.pop("crop_scale_min"), flip=recipe.pop("flip"))
    train: Dataset = Subset(TransformedDataset(splits.train, augment), list(indices))
    return finetune(
        net,
        len(splits.classes),
        train,
        TransformedDataset(splits.test, eval_transforms(settings.image_size)),
        epochs=recipe.pop("epochs", settings.semi_epochs),
        seed=seed,
        device=device,
        desc=f"fine-tune ({len(indices)} labels)",
        **recipe,
    )


def _supervised_row(
    result: Comparison,
    network: Callable[[int], nn.Module],
    splits: Splits,
    subsets: dict[int, list[int]],
    settings: CompareConfig,
    seed: int,
    device: torch.device | str,
) -> None:
    """Train the network from scratch on each column's labelled images (all of them for kNN and linear)."""
    recipe = _semi_recipe(settings) | SUPERVISED | {"milestones": [], "gamma": 1.0}
    recipe["epochs"] = settings.supervised_epochs
    everything = list(range(len(splits.train)))
    done: dict[int, dict[str, float]] = {}
    for column in result.columns:
        pct = _labels_column(column) or 100
        tick = time.perf_counter()
        if pct not in done:
            done[pct] = _finetune(network(seed), splits, subsets.get(pct, everything), settings, seed, device, recipe)
        result.values["supervised"][column].append(done[pct]["top1"])
        notes = {
            "recipe": SUPERVISED,
            "epochs": settings.supervised_epochs,
            "labelled": len(subsets.get(pct, everything)),
        }
        result.records.append(
            _record(
                settings,
                "supervised",
                "baseline",
                column,
                done[pct],
                seed,
                splits,
                subsets.get(pct),
                time.perf_counter() - tick,
                notes,
            )
        )


def _record(
    settings: CompareConfig,
    name: str,
    fingerprint: str,
    column: str,
    score: dict[str, float],
    seed: int,
    splits: Splits,
    subset: Sequence[int] | None,
    seconds: float,
    notes: dict[str, Any],
) -> dict[str, Any]:
    """One per-seed record of a cell (protocol knn / linear / semi; the row in ``notes.compare``)."""
    protocol = "knn" if column == "kNN" else "linear" if column == "linear" else "semi"
    pct = _labels_column(column)
    hyper = {k: v for k, v in vars(settings).items() if k not in ("weights", "out", "cache_dir")}
    return make_record(
        protocol=protocol,
        metrics={k: v for k, v in score.items() if k.startswith(("top1", "top5"))},
        config=hyper,
        preset=None,
        mode={"knn": "features", "linear": "cached"}.get(protocol, "loop"),
        weights={"name": name, "fingerprint": fingerprint},
        dataset=splits.info,
        seed=seed,
        wall_time_s=seconds,
        labels={"fraction": pct, "source": "seeded", "seed": seed, "count": len(subset or [])} if pct else None,
        notes={"compare": {"row": name, "column": column, "seed_varies": SEED_VARIES[protocol]}, **notes},
    )


# ----------------------------------------------------------------------------- rendering


def render_markdown(result: Comparison, title: str = "Did pretraining help?") -> str:
    """``compare.md``: the mean ± std table with the verdict column, the paired comparisons, the rule and the seeds."""
    weights_rows = [r for r in result.values if r not in result.baselines]
    header = ["representation", *result.columns, "better than the best baseline?"]
    lines = [f"# {title}", "", "| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for row in result.values:
        verdicts = [] if row in result.baselines else [(c, result.verdict(row, c)) for c in result.columns]
        said = "; ".join(f"{c}: {_verdict_word(v)}" for c, v in verdicts if v) or "—"
        label = f"{row} (baseline)" if row in result.baselines else row
        lines.append("| " + " | ".join([label, *(result.cell(row, c) for c in result.columns), said]) + " |")
    lines += ["", "## Paired by seed", "", "| weights | column | best baseline | difference per seed | mean ± std |"]
    lines.append("|---|---|---|---|---|")
    for row in weights_rows:
        for column in result.columns:
            v = result.verdict(row, column)
            if v:
                diffs = ", ".join(f"{d:+.1f}" for d in v["differences"])
                lines.append(f"| {row} | {column} | {v['baseline']} | {diffs} | {v['mean']:+.1f} ± {v['std']:.1f} |")
    one = 100.0 / max(result.test_size, 1)
    lines += [
        "",
        f"Test top-1 in percent, mean ± sample standard deviation (n - 1) over {seeds_text(len(result.seeds))} "
        f"({', '.join(map(str, result.seeds))}); per-seed values are in results.jsonl. Rule: {RULE}.",
        f"The test split has {result.test_size} images (one image = {one:.2f} points); its sampling error is "
        "not in the spread.",
        "",
        "What a seed varies:",
        "",
        *[f"- **{name}**: {text}" for name, text in SEED_VARIES.items()],
        "",
    ]
    return "\n".join(lines)


def _verdict_word(v: dict[str, Any]) -> str:
    word = {True: "yes", False: "no", None: "no verdict (1 seed)"}[v["better"]]
    return f"{word} ({v['mean']:+.1f} ± {v['std']:.1f} vs {v['baseline']})"


def plot(result: Comparison, path: Path) -> Path:
    """Grouped bars with error bars (± one standard deviation over the seeds), written atomically as PNG."""
    import matplotlib

    from bt_hub.train.plots import save_png

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(result.values)
    for i, (row, cells) in enumerate(result.values.items()):
        xs = [j + i * width for j, c in enumerate(result.columns) if cells.get(c)]
        stats = [mean_std(cells[c]) for c in result.columns if cells.get(c)]
        ax.bar(xs, [m for m, _ in stats], width, yerr=[s for _, s in stats], capsize=3, label=row)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(result.columns))], result.columns)
    ax.set(ylabel="test top-1 (%)", ylim=(0, 100), title=f"mean ± std over {seeds_text(len(result.seeds))}")
    ax.legend(fontsize=8, loc="lower right")
    return save_png(fig, path)


# ----------------------------------------------------------------------------- bt-hub eval compare


def _split_list(values: Sequence[str]) -> list[str]:
    return [v.strip() for value in values for v in str(value).split(",") if v.strip()]


@dataclass
class CompareConfig(EvalConfig):
    """Flags of ``bt-hub eval compare``: weights against baselines, every cell mean ± std over seeds."""

    RUN_FIELDS: ClassVar[tuple[str, ...]] = EvalConfig.RUN_FIELDS + ("seeds",)

    weights: list[str] = field(
        metadata={
            "help": "weights to compare (one or more, any source bt-hub eval takes: file, run folder, URL, hub id)"
        }
    )
    baselines: list[str] = field(
        default_factory=lambda: ["pixels", "random-init"],
        metadata={"help": f"rows to beat, comma- or space-separated: {', '.join(BASELINES)}"},
    )
    protocols: list[str] = field(
        default_factory=lambda: ["knn", "linear"],
        metadata={"help": f"columns, comma- or space-separated: {', '.join(PROTOCOLS)} (semi: one per --fractions)"},
    )
    seeds: int = field(default=3, metadata={"help": "seeds per cell (--seed, --seed + 1, ...)"})
    fractions: list[int] = field(default_factory=lambda: [1, 10], metadata={"help": "label percentages of semi"})
    knn_k: int = field(default=20, metadata={"help": "neighbours of the kNN vote (T = 0.07)"})
    linear_epochs: int = field(default=100, metadata={"help": "epochs of the linear grid probe"})
    lr_grid: list[float] = field(default_factory=lambda: list(GRID_LRS), metadata={"help": "LRs of the grid"})
    weight_decay_grid: list[float] = field(
        default_factory=lambda: list(GRID_WEIGHT_DECAYS), metadata={"help": "weight decays of the grid"}
    )
    val_fraction: float = field(default=0.2, metadata={"help": "share of the training split the grid chooses on"})
    semi_preset: str = field(default="small", metadata={"help": "fine-tuning recipe of semi (bt-hub eval semi)"})
    semi_epochs: int = field(default=20, metadata={"help": "fine-tuning epochs of semi"})
    supervised_epochs: int = field(default=30, metadata={"help": "epochs of the supervised baseline"})
    out: str = field(
        default="runs/compare",
        kw_only=True,
        metadata={"help": "output directory: compare.md, compare.png, results.json, results.jsonl, results.md"},
    )

    def __post_init__(self) -> None:
        self.weights = [str(w) for w in self.weights]
        if not self.weights or not all(w.strip() for w in self.weights):
            raise ValueError(f"--weights must name one or more checkpoints, got {self.weights}")
        self.baselines, self.protocols = _split_list(self.baselines), _split_list(self.protocols)
        for flag, given, known in (
            ("--baselines", self.baselines, BASELINES),
            ("--protocols", self.protocols, PROTOCOLS),
        ):
            unknown = [v for v in given if v not in known]
            if unknown or not given:
                raise ValueError(f"{flag} must list some of {', '.join(known)}, got {' '.join(given) or 'none'}")
        super().__post_init__()
        if not 1 <= self.seeds <= 100:
            raise ValueError(f"--seeds must be an integer in [1, 100], got {self.seeds}")
        if not self.fractions or any(not 0 < f <= 100 for f in self.fractions):
            raise ValueError(f"--fractions must be percentages in (0, 100], got {self.fractions}")
        for flag, value in (("--knn-k", self.knn_k), ("--semi-epochs", self.semi_epochs)):
            if value <= 0:
                raise ValueError(f"{flag} must be positive, got {value}")
        if self.supervised_epochs <= 0:
            raise ValueError(f"--supervised-epochs must be positive, got {self.supervised_epochs}")
        baseline(SemiSupervisedConfig, self.semi_preset)  # an unknown preset fails here, naming the valid ones
        check_probe_settings(
            epochs=self.linear_epochs,
            lrs={"--lr-grid": self.lr_grid},
            weight_decays={"--weight-decay-grid": self.weight_decay_grid},
            val_fraction=self.val_fraction,
            epochs_flag="--linear-epochs",
        )

    def columns(self) -> list[str]:
        """The table's columns, in protocol order."""
        names = {"knn": ["kNN"], "linear": ["linear"], "semi": [f"semi {f}%" for f in self.fractions]}
        return [c for p in self.protocols for c in names[p]]


def run(config: CompareConfig) -> str:
    """``bt-hub eval compare``: score weights and baselines, write compare.md, compare.png and the records.

    Returns:
        The table (compare.md) and the files written, for the CLI to print.
    """
    from bt_hub.weights import load_backbone

    out = claim_run_dir(config.out, overwrite=config.overwrite)
    tick = time.perf_counter()
    with process_group(config.device) as device:
        networks = {
            w: load_backbone(w, arch=config.arch, small_image_stem=config.small_image_stem) for w in config.weights
        }
        info = getattr(next(iter(networks.values())), "weights_info", None) or {}
        config.image_size, config.image_size_from = eval_image_size(
            config.image_size, info.get("config"), config.weights[0]
        )
        arch, stem = info.get("architecture", "resnet50"), bool(info.get("small_image_stem"))
        settings = replace(config, cache_dir=config.cache_dir or str(out / "feature_cache"), overwrite=True)
        splits = splits_for(settings)
        sources = [
            Source(Path(w).name or w, lambda s, n=net: n, fingerprint=net.weights_info["sha256"])
            for w, net in networks.items()
        ]
        if "pixels" in config.baselines:
            sources.append(Source("pixels", lambda s: nn.Flatten(), baseline=True, trainable=False))
        if "random-init" in config.baselines:
            sources.append(
                Source("random-init", lambda s: default_init_backbone(arch, stem, s), baseline=True, per_seed=True)
            )
        extracted: dict[str, tuple[Any, Any, Any, Any]] = {}

        def features(source: Source, net: nn.Module, seed: int) -> tuple[Any, Any, Any, Any]:
            key = f"{source.name}:{seed}" if source.per_seed else source.name
            if key not in extracted:
                weights_id = module_fingerprint(net) if source.per_seed else source.fingerprint
                pairs = [
                    features_for(
                        settings,
                        net,
                        getattr(splits, name),
                        weights_id=weights_id,
                        dataset_id=splits.info[name]["fingerprint"],
                        split=f"{name} ({source.name})",
                    )
                    for name in ("train", "test")
                ]
                extracted[key] = (*pairs[0], *pairs[1])
            return extracted[key]

        supervised = (lambda s: default_init_backbone(arch, stem, s)) if "supervised" in config.baselines else None
        result = compare(
            sources,
            splits,
            columns=config.columns(),
            seeds=[config.seed + i for i in range(config.seeds)],
            features=features,
            settings=settings,
            supervised=supervised,
            device=device,
        )
    text = render_markdown(result)
    written = [atomic_write_text(out / "compare.md", text), plot(result, out / "compare.png")]
    append_results(out, result.records)
    summary = {
        "schema": SCHEMA,
        "results": result.records,
        "table": {
            row: {c: {"per_seed": v, "mean_std": result.cell(row, c)} for c, v in cols.items()}
            for row, cols in result.values.items()
        },
        "verdicts": {
            row: {c: result.verdict(row, c) for c in result.columns}
            for row in result.values
            if row not in result.baselines
        },
        "wall_time_s": time.perf_counter() - tick,
    }
    written.append(atomic_write_json(out / "results.json", summary))
    written += [out / "results.jsonl", out / "results.md"]
    return text.split("\n\n## Paired by seed")[0] + "\n\n" + "\n".join(f"wrote {p}" for p in written)
