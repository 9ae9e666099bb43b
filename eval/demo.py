"""``bt-hub demo``: when does Barlow Twins pretraining pay? A learning curve on scikit-learn's digits, on a laptop CPU.

1. Pretrain a small-stem ResNet-18 with the `digits` preset of ``bt-hub pretrain`` on the 1,437
   training digits, ``--pretrain-seeds`` times (seeds ``--seed``, ``--seed`` + 1, ...), keeping the
   backbone at ``--curve-points`` log-spaced steps (``--keep-every``).
2. Score every kept step as ``bt-hub eval compare --over-steps --as-seeds`` does: weighted kNN and
   the linear grid probe on the 360 held-out digits at each ``--label-fractions`` budget (10% and 100%
   of the training labels), and RankMe, against the raw pixels and the same network at
   torchvision's default initialisation (not the zero-initialised residual branches pretraining
   starts from). Run i is scored with evaluation seed ``--seed`` + i, so every spread is over
   pretraining runs. Fine-tuning columns are left to ``bt-hub eval compare --protocols semi``: at a
   budget where training from scratch is far above chance they take longer than the demo's minutes.
3. Write ``report.md``, led by the answer at each budget (the last step's verdict against that budget's
   best baseline), then the curve and the step where it crosses each baseline, the last step's table
   with its paired verdicts, the settings and timings; the comparison itself
   (``compare/``: compare.md, curve.png, every per-seed record) and the first run's loss and
   cross-correlation plots.

Everything is seeded by ``--seed``. The demo writes only into a new or empty ``--out`` (or one
passed with ``--overwrite``, where it starts over) and deletes nothing; run again into its own folder (after
Ctrl-C) with the same settings, it continues: each pretraining run from its checkpoint, then the scoring.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from bt_hub.common.config import RunConfig, child, config_dict, from_preset, option, out_field
from bt_hub.common.files import atomic_write_json, atomic_write_text, read_json
from bt_hub.common.presets import first_few, preset_values
from bt_hub.common.progress import announce
from bt_hub.common.records import SCHEMA
from bt_hub.common.reuse import changed_input
from bt_hub.common.runs import LOCK_NAME, MARKER_NAME, RunDir, check_run_dir, claimed_run_dir, package_version
from bt_hub.data.datasets import build_dataset
from bt_hub.data.precision import STEP_IMAGES, STEP_SIDE, precision_choice
from bt_hub.eval.comparison import CompareConfig, check_grid_labels, compare_and_write
from bt_hub.eval.comparison_report import RULE, Comparison, answers, comparison_summary, render_markdown
from bt_hub.eval.knn import KnnConfig
from bt_hub.eval.label_subsets import balanced_subset_indices
from bt_hub.eval.linear import LinearConfig
from bt_hub.eval.runner import NOT_SETTINGS
from bt_hub.train.pretrain import PretrainConfig, pretrain
from bt_hub.train.report import run_plots

# The pretraining recipe is the `digits` preset of bt-hub pretrain; the biases' LR keeps its ratio to the weights'.
DIGITS = preset_values(PretrainConfig, "digits")
# Scoring the curve takes about 6% of the pretraining's time (the default 2 runs on a 2-core AVX-512 EPYC, bf16: 14 s
# after 262 s).
SCORING_SHARE = 0.06
# what the demo's kNN and linear columns take from their children: the settings compare passes on, not its own
_SET_BY_COMPARE = tuple(f.name for f in fields(CompareConfig))


@dataclass
class DemoConfig(RunConfig):
    """Flags of ``bt-hub demo``; the defaults are sized to finish in minutes on two idle CPU cores (5 to 17 on the
    EPYCs README.md names; the demo says at its start how long here)."""

    out: str = out_field("demo_out", "output directory: report.md, PNG plots, results.json, compare/, pretrain*/")
    # the demo's timings are stated for two threads
    threads: int = field(
        default=2, kw_only=True, metadata={"help": "CPU threads of torch in this process (0: torch's default)"}
    )
    pretrain: PretrainConfig = child(
        "the pretraining runs: bt-hub pretrain --preset digits on the 1,437 training digits, their biases' LR "
        "scaled with --lr-weights",
        sets=("data", "keep_every", "lr_biases", "resume"),
        preset="digits",
        checkpoint_every=0,
    )
    pretrain_seeds: int = option(
        2,
        "pretraining runs (seeds --seed, --seed + 1, ...); run i is scored with evaluation seed "
        "--seed + i, so every cell is mean ± std over pretraining runs",
    )
    curve_points: int = option(5, "kept steps of the learning curve, log-spaced from the first epoch's end")
    label_fractions: list[int] = option(
        [10, 100],
        "label budgets of the kNN and linear columns, percent of the training labels (bt-hub eval compare "
        "--label-fractions): one verdict each; 1 labels one digit a class, too few for the grid's validation split",
    )
    knn: KnnConfig = child(
        "the kNN column of bt-hub eval compare; k is 20, as there: a column is one number, the first k's top-1",
        sets=_SET_BY_COMPARE,
        k=[20],
    )
    linear: LinearConfig = child(
        "the linear column of bt-hub eval compare: the grid probe on cached features",
        sets=(*_SET_BY_COMPARE, "search"),
        search="grid",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_positive("pretrain_seeds", "curve_points")
        self.build_children()

    def shared_settings(self) -> dict[str, Any]:
        """The shared flags given; the columns' configs are checked on the first pretraining run's weights."""
        return super().shared_settings() | {"weights": str(Path(self.out) / "pretrain")}


@contextlib.contextmanager
def _claimed_out(config: DemoConfig) -> Iterator[tuple[Path, bool]]:
    """``--out`` under every command's ownership rule, claimed and locked (:func:`claimed_run_dir`) for the block,
    its settings recorded in ``run.json``; and whether the demo continues its own run there.

    Without ``--overwrite`` the demo writes only into a new or empty folder (bt_hub's marker aside), or continues
    the demo run that folder holds (:func:`_continues`), so no earlier demo of other settings, pretraining run,
    evaluation or file of the user's is replaced; anything else is refused before any work. It never deletes
    anything.
    """
    out = check_run_dir(config.out, kind="demo", overwrite=config.overwrite)
    held = sorted(p.name for p in out.iterdir() if p.name not in (MARKER_NAME, LOCK_NAME)) if out.is_dir() else []
    continues = bool(held) and not config.overwrite and _continues(config, out)
    if held and not (config.overwrite or continues):
        shown = first_few(held, 4)
        raise ValueError(
            f"--out {out} already holds {shown} and the demo writes only into a new or empty folder (or continues "
            "its own run there); choose a new --out, or pass --overwrite to replace the demo's files there (run.json, "
            "report.md, results.json, the plots, compare/, pretrain*/)"
        )
    with claimed_run_dir(out, kind="demo", overwrite=config.overwrite) as claimed:
        RunDir(claimed, kind="demo", claimed=True).start(config, fresh=not continues)
        try:
            yield claimed, continues
        except Exception:  # a failed start that wrote nothing but its record leaves no run to continue
            if not continues and {p.name for p in claimed.iterdir()} <= {MARKER_NAME, LOCK_NAME, "run.json"}:
                (claimed / "run.json").unlink()
            raise


def _continues(config: DemoConfig, out: Path) -> bool:
    """Whether ``out`` holds a demo run of bt_hub's (its ``run.json`` of kind demo records the demo's settings) for
    this command to continue: the one reuse rule (:func:`~bt_hub.common.reuse.changed_input`) asks whether it was
    made from this command's inputs, and a run of other settings is refused, naming the first that changed."""
    record = read_json(out / "run.json")
    if not (isinstance(record, dict) and record.get("kind") == "demo" and isinstance(record.get("config"), dict)):
        return False
    changed = changed_input("checkpoint", _inputs(record["config"]), _inputs(config_dict(config)))
    if changed:
        raise ValueError(
            f"--out {out} holds a demo run of other settings: {changed}; the demo continues only a run of its own "
            "settings, so choose a new --out, or pass --overwrite to start that demo over"
        )
    return True


def _inputs(settings: Mapping[str, Any]) -> dict[str, Any]:
    """What a demo's runs and scores are made from, as a checkpoint's inputs: its data (always the digits) and, as
    its recipe, every setting flat (``pretrain.epochs``) but those of where and how it runs (:data:`NOT_SETTINGS`;
    and ``device``: a pretraining run resumes on another)."""
    skip = (*NOT_SETTINGS, "device")
    recipe = {k: v for k, v in settings.items() if not isinstance(v, Mapping) and k not in skip}
    for name, values in ((k, v) for k, v in settings.items() if isinstance(v, Mapping)):
        recipe |= {f"{name}.{k}": v for k, v in values.items() if k not in skip}
    return {"data": "digits", "recipe": recipe}


def curve_steps(config: DemoConfig) -> list[int]:
    """The steps the curve keeps: ``--curve-points`` log-spaced from the end of the first epoch to the last step."""
    pre = config.pretrain
    per_epoch = len(build_dataset("digits", "train", image_size=pre.image_size)) // pre.batch_size
    last = pre.max_steps or pre.epochs * per_epoch
    first = min(per_epoch, last)
    return sorted({int(round(s)) for s in np.geomspace(first, last, config.curve_points)})


def expected_seconds(config: DemoConfig, step_s: float) -> float:
    """How long the demo takes where ``--precision auto``'s ResNet-18 step took ``step_s``: each pretraining step of
    each run costs that step times the ratio of the pixels the residual blocks see, 2 views of ``--batch-size``
    images at ``--image-size`` (whole through the 3x3 stem, a quarter of the side through the 7x7/2 stem and
    max-pool) against the micro-benchmark's 16 images of 64 px through the latter; scoring adds ``SCORING_SHARE``."""
    pre = config.pretrain
    side = pre.image_size if pre.small_image_stem else pre.image_size / 4
    per_step = step_s * 2 * pre.batch_size * side**2 / (STEP_IMAGES * (STEP_SIDE / 4) ** 2)
    return per_step * curve_steps(config)[-1] * config.pretrain_seeds * (1 + SCORING_SHARE)


def _pretrain(config: DemoConfig, directory: Path, seed: int, keep: list[int], resume: bool = False) -> Path:
    """Barlow Twins on the digits' training split into ``directory`` (with ``--overwrite``, into the run there);
    ``resume``: continued from its checkpoint as ``bt-hub pretrain --resume auto`` does, a finished run reused."""
    pre = config.pretrain
    return pretrain(
        replace(
            pre,
            out=str(directory),
            seed=seed,
            keep_every=",".join(map(str, keep)),
            warmup_epochs=min(pre.warmup_epochs, pre.epochs),
            lr_biases=pre.lr_weights * DIGITS["lr_biases"] / DIGITS["lr_weights"],
            resume="auto" if resume else None,
        )
    )


def compare_settings(config: DemoConfig, runs: list[Path], out: Path) -> CompareConfig:
    """The ``bt-hub eval compare`` settings the demo scores with: the curve of its runs, as seeds."""
    pre = config.pretrain
    return from_preset(
        CompareConfig,
        weights=[str(run) for run in runs],
        as_seeds=len(runs) > 1,
        over_steps=True,
        baselines=["pixels", "random-init"],
        seeds=len(runs),
        overwrite=config.overwrite,
        device=config.device,
        seed=config.seed,
        image_size=pre.image_size,
        small_image_stem=pre.small_image_stem,
        knn=config.knn,
        linear=config.linear,
        label_fractions=config.label_fractions,
        data="digits",
        test_split="test",
        arch=pre.backbone,
        out=str(out),
    )


def _report(config: DemoConfig, result: Comparison, last: str, timings: dict[str, float], plots: list[str]) -> str:
    pre = config.pretrain
    stem = " (3x3 stem)" if pre.small_image_stem else ""
    steps = ", ".join(f"{p['step']:g}" for p in sorted(result.positions.values(), key=lambda p: p["step"]))
    n = config.pretrain_seeds
    runs = f"{n} pretraining runs, seeds {config.seed} to {config.seed + n - 1}"
    runs = f"pretraining seed {config.seed}" if n == 1 else runs
    spread = (
        "one pretraining run, one evaluation seed: no spread over pretraining runs"
        if n == 1
        else "pretraining run i with evaluation seed i (`--as-seeds`), so every spread is over pretraining runs"
    )
    budgets = ", ".join(f"{f}%" for f in config.label_fractions)
    rest = render_markdown(result, title=None, rows=[last, *result.baselines])
    lines = [
        "# When does pretraining pay? Barlow Twins on the digits",
        "",
        f"bt_hub {package_version()}. A {pre.backbone}{stem} pretrained with the Barlow Twins loss on the 1,437 "
        f"training digits at {pre.image_size} px ({runs}), {pre.epochs} epochs of batch {pre.batch_size}, "
        f"projector {pre.projector}, λ = {pre.lambd}, LARS base LR {pre.lr_weights}, crops of ≥ "
        f"{pre.crop_scale_min:.0%} of the area, no flip, no blur; its backbone kept at steps {steps} and scored "
        f"on the 360 held-out digits (top-1 %) with {budgets} of the training labels as `bt-hub eval compare "
        f"--over-steps` scores: {spread}.",
        "",
        f"## The answer at each label budget ({last})",
        "",
        *(f"- {line}" for line in answers(result, last)),
        "",
        f"Rule: {RULE}.",
        "",
        "## The learning curve",
        "",
        "![curve](compare/curve.png)",
        "",
        *(f"- {line}" for line in result.crossings()),
        "",
        f"## At the last step ({last})",
        "",
        rest.rstrip("\n"),
        "",
        "## Rows and columns",
        "",
        "- **random-init**: the same network at torchvision's default initialisation (residual BN weights 1), not "
        "the zero-initialised residual branches pretraining starts from; a new network per seed.",
        f"- **pixels**: the flattened {pre.image_size}x{pre.image_size} images through the same classifiers.",
        f"- **kNN**: weighted vote of the {config.knn.k[0]} nearest labelled training digits (at most the labelled "
        f"ones), cosine similarity, T = {config.knn.temperature:g}.",
        f"- **linear**: the grid probe of `bt-hub eval linear` (learning rate × weight decay, {config.linear.epochs} "
        "epochs on cached frozen features, chosen on a validation split of the budget's labelled digits).",
        "- **a label budget** (`kNN 10%`: 10% of the labels): a seeded, class-balanced subset of the training labels, "
        "another at each seed, the same for every row; each baseline gets the same budget.",
        "- **RankMe**: the effective rank of each row's features of the 1,437 training digits, read without a "
        "label; no verdict.",
        "- Fine-tuning on 1% / 10% of the labels, against the same network trained from scratch, is "
        "`bt-hub eval compare --protocols semi --baselines supervised` (docs/evaluation.md).",
        "",
        "Every step, seed and cell: `compare/compare.md` and `compare/results.jsonl`.",
        "",
        "## Timings (s)",
        "",
        "| stage | seconds |",
        "|---|---|",
    ]
    lines += [f"| {stage} | {seconds:.1f} |" for stage, seconds in timings.items()]
    lines += ["", "## Plots (the first pretraining run)", ""] + [f"![{name}]({name})" for name in plots]
    return "\n".join(lines) + "\n"


def run_demo(config: DemoConfig) -> dict[str, Any]:
    """Pretrain on the digits, score the learning curve against random init and pixels, write the report."""
    with _claimed_out(config) as (out, continues):
        return _demo(config, out, continues)


def _say_how_long(config: DemoConfig, steps: int) -> None:
    """One line before any work: how long the demo takes here, from the step ``--precision auto`` timed on a CPU
    (pretraining's own choice, so it is timed once and then read from its cache)."""
    chosen = precision_choice("auto", config.device)
    step_s = chosen.get(f"precision_{chosen['precision']}_s")
    if step_s is None:  # a GPU: nothing timed
        return
    seconds, n = expected_seconds(config, step_s), config.pretrain_seeds
    took = f"{seconds / 60:.0f} minutes" if seconds >= 90 else f"{seconds:.0f} s"
    announce(
        f"bt-hub demo: about {took} on this machine ({n} pretraining run{'s' * (n > 1)} of {steps} steps, then "
        f"scoring), from --precision auto's ResNet-18 step of {step_s:.3g} s in {chosen['precision']} here"
    )


def _demo(config: DemoConfig, out: Path, continues: bool) -> dict[str, Any]:
    timings: dict[str, float] = {}
    tick = start = time.perf_counter()
    keep = curve_steps(config)
    folders = [
        out / ("pretrain" if i == 0 else f"pretrain-seed{config.seed + i}") for i in range(config.pretrain_seeds)
    ]
    scoring = compare_settings(config, folders, out / "compare")  # its flags checked before any pretraining
    targets = np.asarray(build_dataset("digits", "train", image_size=config.pretrain.image_size).targets)
    for fraction, seed in ((f, config.seed + i) for f in config.label_fractions for i in range(scoring.seeds)):
        labelled = targets[balanced_subset_indices(targets, fraction, seed)]
        check_grid_labels(labelled, config.linear.val_fraction, seed, f"--label-fractions {fraction}", "leave it out")
    if continues:
        announce(f"bt-hub demo: continuing the demo in {out}: each pretraining run from its checkpoint, then scoring")
    else:
        _say_how_long(config, keep[-1])
    runs = [_pretrain(config, run, config.seed + i, keep, resume=continues) for i, run in enumerate(folders)]
    timings[f"pretraining ({config.pretrain_seeds} runs{', continued' * continues})"] = time.perf_counter() - tick
    tick = time.perf_counter()
    result, _ = compare_and_write(scoring)
    timings[f"evaluation ({len(keep)} steps x {config.pretrain_seeds} runs)"] = time.perf_counter() - tick
    timings["total"] = time.perf_counter() - start
    plots = [path.name for path in run_plots(runs[0], out, lambd=config.pretrain.lambd)]
    last = max(result.positions, key=lambda row: result.positions[row]["step"])
    atomic_write_text(out / "report.md", _report(config, result, last, timings, plots))
    extra = {"last_step": last, "seeds": result.seeds, "timings_s": timings, "config": config_dict(config)}
    results = {"schema": SCHEMA, **comparison_summary(result, start), **extra}  # compare's results.json, and the demo's
    atomic_write_json(out / "results.json", results)
    shown = {k: v for k, v in results.items() if k != "results"}  # the CLI prints the demo's summary, not its records
    return {**shown, "summary": _summary(result, last, out)}


def _summary(result: Comparison, last: str, out: Path) -> str:
    """What the demo prints at its end: the last step's score and verdict in each column (each label budget) against
    its best baseline, and where the report is."""
    step = result.positions[last]["step"]
    report = f"wrote {out / 'report.md'} (the answer at each label budget, the learning curve, the verdicts, timings)"
    return "\n".join([f"at the last step ({step:g}):", *(f"  {line}" for line in answers(result, last)), report])
