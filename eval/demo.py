"""``bt-hub demo``: Barlow Twins end to end on scikit-learn's digits, in minutes on a laptop CPU.

1. Pretrain a small-stem ResNet-18 with the Barlow Twins loss on the 1,437 training digits
   (bt_hub.train.pretrain, batched BYOL views, LARS with warm-up + cosine).
2. Compare it on the 360 held-out digits with the baselines of ``bt-hub eval compare``
   (bt_hub.eval.comparison, whose per-seed loop this is): the raw pixels, the same network at
   torchvision's default initialisation (not the zero-initialised residual branches pretraining
   starts from, which hide all but one corner pixel of an 8-px digit) and, with 1% / 10% of the
   labels, the same network trained from scratch. Columns: weighted kNN, the linear grid probe on
   cached features, and fine-tuning on 1% / 10% of the training labels (pixels get the grid probe
   on the labelled digits). Every cell is mean ± std over ``--seeds`` evaluation seeds; features
   are extracted once per network and reused by every protocol and seed.
3. Write ``report.md`` (the table, the paired verdicts, settings, timings) with PNG plots: the
   loss and its two terms, the cross-correlation matrix at the start and end of pretraining,
   and the accuracies with error bars; ``results.json`` holds every per-seed record.

Everything is seeded by ``--seed``: two runs with the same flags give the same report. The demo
writes only into a new or empty ``--out`` (or one passed with ``--overwrite``) and deletes nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bt_hub.common.config import RunConfig, out_field
from bt_hub.common.files import atomic_write_json, atomic_write_text
from bt_hub.common.presets import from_preset, preset_values
from bt_hub.common.records import seeds_text
from bt_hub.common.runs import LOCK_NAME, MARKER_NAME, check_run_dir, claim_run_dir, package_version
from bt_hub.data.plots import run_plots
from bt_hub.eval.comparison import SUPERVISED, CompareConfig, compare, feature_source, sources_of
from bt_hub.eval.comparison_report import Comparison, render_markdown
from bt_hub.eval.comparison_report import plot as plot_comparison
from bt_hub.eval.runner import evaluation
from bt_hub.method.model import ARCHITECTURES
from bt_hub.train.pretrain import PretrainConfig, pretrain

FRACTIONS = [1, 10]
# The pretraining recipe is the `digits` preset of bt-hub pretrain; the demo's flags default to it.
DIGITS = preset_values(PretrainConfig, "digits")
PRETRAINED = "Barlow Twins (pretrained)"
RANDOM_INIT = "random init (torchvision default init)"
PIXELS = "raw pixels"
# The fine-tuning recipe is the `small` preset of bt-hub eval semi (which was measured here).
SEMI_PRESET = "small"


@dataclass
class DemoConfig(RunConfig):
    """Flags of ``bt-hub demo``; the defaults are sized to finish in under three minutes on two idle CPU cores."""

    out: str = out_field("demo_out", "output directory: report.md, PNG plots, results.json, pretrain/")
    # the demo's timings are stated for two threads
    threads: int = field(
        default=2, kw_only=True, metadata={"help": "CPU threads of torch in this process (0: torch's default)"}
    )
    epochs: int = field(default=DIGITS["epochs"], metadata={"help": "pretraining epochs"})
    max_steps: int = field(
        default=0,
        metadata={"help": "stop pretraining after this many steps (0: all epochs); the schedule is unchanged"},
    )
    batch_size: int = field(
        default=DIGITS["batch_size"], metadata={"help": "pretraining batch size (small: more steps in a short run)"}
    )
    lr_weights: float = field(
        default=DIGITS["lr_weights"],
        metadata={"help": "LARS base LR of the weights, × batch/256 (paper: 0.2, far too slow for 88 steps)"},
    )
    crop_scale_min: float = field(
        default=DIGITS["crop_scale_min"],
        metadata={
            "help": "smallest area fraction of the random crops in pretraining (paper: 0.08, which can erase an 8-px "
            "digit; fine-tuning crops at the `small` preset's 0.4)"
        },
    )
    image_size: int = field(
        default=DIGITS["image_size"],
        metadata={"help": "side of the digit images and views in pixels (the originals are 8x8)"},
    )
    backbone: str = field(
        default=DIGITS["backbone"],
        metadata={
            "help": "torchvision ResNet",
            "flag": "arch",
            "aliases": ("backbone",),
            "choices": tuple(ARCHITECTURES),
        },
    )
    small_image_stem: bool = field(
        default=DIGITS["small_image_stem"],
        metadata={
            "help": "3x3 stem without max-pool (the standard 7x7/2 stem + max-pool keeps too little of a 16-px digit)"
        },
    )
    projector: str = field(
        default=DIGITS["projector"],
        metadata={
            "help": "projector widths joined by '-' (a 32-d output: a batch of 64 can estimate a 32 x 32 "
            "cross-correlation of full rank)"
        },
    )
    lambd: float = field(default=DIGITS["lambd"], metadata={"help": "weight of the redundancy-reduction term"})
    warmup_epochs: int = field(default=DIGITS["warmup_epochs"], metadata={"help": "LARS warm-up epochs"})
    seeds: int = field(
        default=3, metadata={"help": "evaluation seeds per cell (--seed, --seed + 1, ...): the table is mean ± std"}
    )
    knn_k: int = field(default=20, metadata={"help": "neighbours of the weighted kNN (T = 0.07)"})
    linear_epochs: int = field(
        default=100, metadata={"help": "epochs of the linear grid probe on cached features (bt-hub eval compare's)"}
    )
    semi_epochs: int = field(
        default=5,
        metadata={
            "help": "epochs of fine-tuning on 10% of the labels (the `small` preset of bt-hub eval semi); 1% gets 10x "
            "as many, so both see as many images; the supervised baseline trains as long"
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.crop_scale_min <= 1:
            raise ValueError(f"--crop-scale-min must be in (0, 1], got {self.crop_scale_min}")
        self.require_positive("epochs", "batch_size", "lr_weights", "image_size", "knn_k", "linear_epochs")
        self.require_positive("semi_epochs", "seeds")
        self.require_positive("max_steps", "warmup_epochs", or_zero=True)


# ----------------------------------------------------------------------------- pretraining


def _claim_out(config: DemoConfig) -> Path:
    """``--out`` under every command's ownership rule, refused (before any work) if it holds anything already.

    The demo writes report.md, results.json, its plots and a pretraining run in pretrain/: without
    ``--overwrite`` it writes only into a new or empty folder (bt_hub's marker aside), so no earlier
    demo, pretraining run, evaluation or file of the user's is replaced. It never deletes anything.
    """
    out = check_run_dir(config.out, kind="demo", overwrite=config.overwrite)
    held = sorted(p.name for p in out.iterdir() if p.name not in (MARKER_NAME, LOCK_NAME)) if out.is_dir() else []
    if held and not config.overwrite:
        shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
        raise ValueError(
            f"--out {out} already holds {shown} and the demo writes only into a new or empty folder; choose a "
            "new --out, or pass --overwrite to replace the demo's files there (report.md, results.json, the plots, "
            "pretrain/)"
        )
    return claim_run_dir(out, kind="demo", overwrite=config.overwrite)


def _pretrain(config: DemoConfig, directory: Path) -> Path:
    """Barlow Twins on the digits' training split into ``directory`` (with ``--overwrite``, into the run there)."""
    return pretrain(
        from_preset(
            PretrainConfig,
            "digits",
            out=str(directory),
            overwrite=config.overwrite,
            backbone=config.backbone,
            projector=config.projector,
            lambd=config.lambd,
            small_image_stem=config.small_image_stem,
            image_size=config.image_size,
            crop_scale_min=config.crop_scale_min,
            lr_weights=config.lr_weights,
            lr_biases=config.lr_weights * DIGITS["lr_biases"] / DIGITS["lr_weights"],
            epochs=config.epochs,
            batch_size=config.batch_size,
            warmup_epochs=min(config.warmup_epochs, config.epochs),
            seed=config.seed,
            device=config.device,
            max_steps=config.max_steps,
            log_every=1,
            checkpoint_every=0,
        )
    )


# ----------------------------------------------------------------------------- scoring


def compare_settings(config: DemoConfig, pretrain_dir: Path) -> CompareConfig:
    """The ``bt-hub eval compare`` settings the demo scores with (its seeds, columns and recipes)."""
    return CompareConfig(
        weights=[str(pretrain_dir)],
        baselines=["pixels", "random-init", "supervised"],
        protocols=["knn", "linear", "semi"],
        seeds=config.seeds,
        fractions=FRACTIONS,
        knn_k=config.knn_k,
        linear_epochs=config.linear_epochs,
        semi_preset=SEMI_PRESET,
        semi_epochs=semi_epochs(config, max(FRACTIONS)),
        supervised_epochs=semi_epochs(config, max(FRACTIONS)),
        data="digits",
        test_split="test",
        image_size=config.image_size,
        arch=config.backbone,
        small_image_stem=config.small_image_stem,
        out=str(pretrain_dir.parent / "compare"),  # checked, never written: the demo writes its own files
        seed=config.seed,
        device=config.device,
    )


def _score(config: DemoConfig, pretrain_dir: Path) -> Comparison:
    """Every row in every column over the seeds, through ``bt-hub eval compare``'s run, rows and loop.

    The supervised baseline is trained from scratch on the labelled subsets only (in the kNN and
    linear columns, with every training label, it would be an upper bound rather than a baseline
    for frozen features); fine-tuning on 1% gets ten times the epochs of 10%, so both see as many
    images. Features are extracted once per network and reused by every column and seed.
    """
    settings = compare_settings(config, pretrain_dir)
    with evaluation(replace(settings, out=None)) as run:
        names = {"pixels": PIXELS, "random-init": RANDOM_INIT}
        rows = sources_of(run, ["random-init", "pixels"])
        sources = [replace(s, name=names.get(s.name, PRETRAINED)) for s in (rows[0], rows[2], rows[1])]
        features = feature_source(run)
        seeds = [config.seed + i for i in range(config.seeds)]
        result = compare(sources, run, columns=["kNN", "linear"], seeds=seeds, features=features)
        result.baselines.append("supervised")
        result.values["supervised"] = {}
        for pct in FRACTIONS:
            epochs = semi_epochs(config, pct)
            # the grid probe chooses on a validation split: one labelled image per class leaves none for the pixels
            enough = len(run.splits.train) * pct / 100 >= 2 * len(run.splits.classes)
            part = compare(
                [s for s in sources if s.trainable or enough],
                run,
                columns=[f"semi {pct}%"],
                seeds=seeds,
                features=features,
                settings=replace(settings, fractions=[pct], semi_epochs=epochs, supervised_epochs=epochs),
                supervised=sources[1].network,
            )
            result.columns += part.columns
            for row, cells in part.values.items():
                result.values[row].update(cells)
            result.records += part.records
    return result


def semi_epochs(config: DemoConfig, pct: int) -> int:
    """Fine-tuning epochs on ``pct`` percent of the labels: ``--semi-epochs`` at 10%, as many images at 1%."""
    return config.semi_epochs * max(FRACTIONS) // pct


# ----------------------------------------------------------------------------- report


def _report(
    config: DemoConfig, result: Comparison, timings: dict[str, float], plots: list[str], pretrain_dir: Path
) -> str:
    stem = " (3x3 stem)" if config.small_image_stem else ""
    stopped = f" (stopped at step {config.max_steps})" if config.max_steps else ""
    table = render_markdown(result, title="Barlow Twins demo on the digits")
    head, rest = table.split("\n\n", 1)
    lines = [
        head,
        "",
        f"bt_hub {package_version()}, seed {config.seed}. A {config.backbone}{stem} pretrained with the Barlow Twins "
        f"loss for {config.epochs} epochs{stopped} on the 1,437 training digits at {config.image_size} px, "
        f"projector {config.projector}, λ = {config.lambd}, batch {config.batch_size}, LARS base LR "
        f"{config.lr_weights}, crops of ≥ {config.crop_scale_min:.0%} of the area, no flip, no blur (one "
        f"pretraining run); scored on the 360 held-out digits (top-1 %) as `bt-hub eval compare` scores, "
        f"each cell over {seeds_text(config.seeds)} of the evaluation.",
        "",
        rest.rstrip("\n"),
        "",
        "## Rows and columns",
        "",
        f"- **{RANDOM_INIT}**: the same network at torchvision's default initialisation (residual BN weights 1), "
        "not the zero-initialised residual branches pretraining starts from; a new network per seed.",
        f"- **{PIXELS}**: the flattened {config.image_size}x{config.image_size} images through the same classifiers.",
        f"- **supervised**: the same network trained from scratch on the labelled digits only (SGD lr "
        f"{SUPERVISED['lr_backbone']} for all layers, momentum {SUPERVISED['momentum']}, cosine, wd "
        f"{SUPERVISED['weight_decay']}, the fine-tuning's epochs, crops and batch).",
        f"- **kNN**: weighted vote of the {config.knn_k} nearest training digits, cosine similarity, T = 0.07.",
        f"- **linear**: the grid probe of `bt-hub eval linear` (learning rate × weight decay, {config.linear_epochs} "
        "epochs on cached frozen features, chosen on a validation split of the training digits).",
        f"- **semi 1% / 10%**: fine-tuning on the seeded, class-balanced 1% / 10% of the training labels with the "
        f"`{SEMI_PRESET}` preset of `bt-hub eval semi` for {semi_epochs(config, 1)} / {semi_epochs(config, 10)} "
        "epochs (as many images); pixels get the grid probe on the labelled digits where it can choose on a "
        "validation split (not at 1%: one labelled digit per class).",
        "",
        "## Timings (s)",
        "",
        "| stage | seconds |",
        "|---|---|",
    ]
    lines += [f"| {stage} | {seconds:.1f} |" for stage, seconds in timings.items()]
    lines += ["", "## Plots", ""] + [f"![{name}]({name})" for name in plots]
    lines += ["", f"Pretraining run (weights, metrics.jsonl, cross-correlation matrices): `{pretrain_dir}`.", ""]
    return "\n".join(lines)


def run_demo(config: DemoConfig) -> dict[str, Any]:
    """Pretrain on digits, compare with random init, pixels and supervised training, write the report; the numbers."""
    out = _claim_out(config)
    timings: dict[str, float] = {}
    tick = start = time.perf_counter()
    pretrain_dir = _pretrain(config, out / "pretrain")
    timings["pretraining"] = time.perf_counter() - tick
    tick = time.perf_counter()
    result = _score(config, pretrain_dir)
    timings[f"evaluation ({seeds_text(config.seeds)})"] = time.perf_counter() - tick
    timings["total"] = time.perf_counter() - start

    written = run_plots(pretrain_dir, out, lambd=config.lambd) + [plot_comparison(result, out / "accuracy.png")]
    plots = [path.name for path in written]
    atomic_write_text(out / "report.md", _report(config, result, timings, plots, pretrain_dir))
    results = {
        "table": {
            row: {c: {"per_seed": v, "mean_std": result.cell(row, c)} for c, v in cells.items() if v}
            for row, cells in result.values.items()
        },
        "verdicts": {
            row: {c: result.verdict(row, c) for c in result.columns} for row in result.values if row == PRETRAINED
        },
        "seeds": result.seeds,
        "records": result.records,
        "timings_s": timings,
        "config": vars(config).copy(),
    }
    atomic_write_json(out / "results.json", results)
    return results
