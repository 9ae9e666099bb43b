"""What ``bt-hub eval compare`` found (filled by bt_hub.eval.comparison): cells, verdicts, compare.md, the plot."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from bt_hub.common.files import atomic_write_text, read_json
from bt_hub.common.records import fmt_mean_std, mean_std, seeds_text, settings_text
from bt_hub.eval.compare_config import Column, frozen
from bt_hub.eval.paired_test import LEVEL, RESAMPLES, paired_test
from bt_hub.eval.protocols import get_protocol
from bt_hub.eval.runner import EvalRun
from bt_hub.method.rankme import MAX_IMAGES

# What a seed varies in a column's cells (another protocol's: the data order), and in the supervised baseline's.
SEED_VARIES = {
    "knn": "nothing for a fixed network (the vote is deterministic); the network itself for random-init",
    "linear": "the validation split carved from the training data, the heads' initialisation and the data order",
    "semi": "the labelled subset (seeded, class-balanced), the classifier's initialisation and the data order",
    "supervised": "the network's initialisation, the labelled subset (semi columns) and the data order",
    "rankme": "the images scored where the training split holds more than --max-images; nothing else",
    "label budget": "the labelled subset (seeded, class-balanced, the same for every row), besides what a seed varies "
    "on all the labels",
}
RULE = (
    "a weights row is *better* (yes) than a column's best baseline (highest mean) when a paired test of the two rows' "
    f"per-image results on the same test images says so at level {LEVEL:g}, *not* (no) when it says the baseline is "
    "better, and gets no verdict where the test set cannot tell; the test is McNemar's exact test on the images one "
    "row gets right and the other wrong where these are the same at every seed (one seed, a deterministic vote), "
    f"else a paired bootstrap of the mean difference ({RESAMPLES:,} seeded resamples of the test images and the seeds)"
)


@dataclass(frozen=True)
class CellSummary:
    """One cell of the table, summarised once (:attr:`Comparison.cells`) before anything renders it: its per-seed
    values (one a seed), their mean and std, the text the table shows, and for a weights row in a column of accuracies
    its paired verdict against each baseline of its column (``verdict``: against the best, what the table's verdict
    column says)."""

    values: list[float]
    mean: float
    std: float
    text: str
    verdicts: dict[str, dict[str, Any]] = field(default_factory=dict)
    best: str | None = None  # the column's best baseline (highest mean)

    @property
    def verdict(self) -> dict[str, Any] | None:
        """The paired comparison with the column's best baseline (``RULE``); None for a baseline or without one."""
        return self.verdicts.get(self.best) if self.best else None


@dataclass
class Comparison:
    """Per-seed top-1 of every row and column, and what was compared."""

    seeds: list[int]
    columns: list[Column]
    values: dict[str, dict[Column, list[float]]]  # row -> column -> per-seed top-1 (RankMe in its column)
    baselines: list[str]
    test_size: int
    records: list[dict[str, Any]] = field(default_factory=list)
    positions: dict[str, dict[str, float]] = field(default_factory=dict)  # curve rows: pretraining step, seconds
    curve_names: dict[str, str] = field(default_factory=dict)  # curve rows: the curve ('' for one run)
    varying: set[str] = field(default_factory=set)  # rows whose network differs by seed (random init, --as-seeds)
    partial: dict[str, str] = field(default_factory=dict)  # a pretraining run still live -> how far it had got
    correct: dict[str, dict[Column, list[Any]]] = field(default_factory=dict)  # row -> column -> per seed: per image

    @property
    def accuracy_columns(self) -> list[Column]:
        """The columns of test accuracies, which have verdicts (not RankMe's: a label-free value is no accuracy)."""
        return [c for c in self.columns if not get_protocol(c.protocol).label_free]

    def _alike(self, rows: Sequence[str], column: Column, n: int) -> str:
        """Why equal values have no spread: a deterministic protocol (the kNN vote) on fixed networks and all the
        labels; others are alike."""
        fixed = get_protocol(column.protocol).deterministic and not column.drawn
        fixed = fixed and not any(r in self.varying for r in rows)
        return "1 seed" if n == 1 else "deterministic" if fixed else f"{n} seeds alike"

    @cached_property
    def cells(self) -> dict[str, dict[Column, CellSummary]]:
        """Every scored cell, summarised once, the first time a report reads it (the comparison is filled by then):
        row -> column -> :class:`CellSummary`. Every table, line and plot of the report reads these."""
        cells: dict[str, dict[Column, CellSummary]] = {}
        for row in [*self.baselines, *(r for r in self.values if r not in self.baselines)]:  # baselines first
            for column, values in self.values[row].items():
                if not values:
                    continue
                mean, std = mean_std(values)
                text = fmt_mean_std(values)
                if len(values) == 1 or len(set(values)) == 1:  # no spread: say why instead of "± 0.0"
                    text = f"{fmt_mean_std(values[:1])} ({self._alike([row], column, len(values))})"
                verdicts, best = {}, None
                scored = [b for b in self.baselines if column in cells.get(b, {})]
                if row not in self.baselines and scored and column in self.accuracy_columns:
                    best = max(scored, key=lambda b: cells[b][column].mean)
                    behind = {b: cells[b][column].mean - mean for b in scored}
                    loses_to = {b: gap for b, gap in sorted(behind.items(), key=lambda kv: -kv[1]) if gap > 0}
                    verdicts = {b: {**self._paired(row, b, column), "loses_to": loses_to} for b in scored}
                cells.setdefault(row, {})[column] = CellSummary(list(values), mean, std, text, verdicts, best)
        return {row: cells.get(row, {}) for row in self.values}

    def _paired(self, row: str, baseline: str, column: Column) -> dict[str, Any]:
        """The paired comparison of a weights row with one baseline of its column (``RULE``): the one place that
        decides whether the row is better (``better``: True), not (False), or that the test set cannot tell (None;
        also where a cell has no per-image results: ``test`` None). Seeded by the comparison's first seed."""
        diffs = [w - b for w, b in zip(self.values[row][column], self.values[baseline][column])]
        mean, std = mean_std(diffs)
        found = {
            "baseline": baseline,
            "alike": self._alike([row, baseline], column, len(diffs)),
            "differences": diffs,
            "mean": mean,
            "std": std,
        }
        hits = [self.correct.get(r, {}).get(column, []) for r in (row, baseline)]
        if any(len(h) != len(diffs) or any(x is None for x in h) for h in hits):
            return found | {"test": None, "better": None}
        return found | paired_test(*hits, seed=self.seeds[0])

    def curves(self) -> dict[str, list[str]]:
        """The learning curves: curve name ('' for one run) -> its rows, by pretraining step."""
        curves: dict[str, list[str]] = {}
        for row in sorted(self.positions, key=lambda r: self.positions[r]["step"]):
            curves.setdefault(self.curve_names.get(row, ""), []).append(row)
        return curves

    def crossings(self) -> list[str]:
        """Per curve, column and baseline, one line read from the cells' verdicts against that baseline (against
        the best baseline, the table's verdict column): the step from which every step is better, the steps that
        are if the last is not, or that none is; with the curve's best point."""
        lines = []
        for name, rows in self.curves().items():
            for column in self.accuracy_columns:
                for b in (b for b in self.baselines if column in self.cells[b]):
                    points = [(r, self.cells[r][column]) for r in rows if column in self.cells[r]]
                    better = [cell.verdicts[b]["better"] for _, cell in points]
                    steps = [f"{self.positions[r]['step']:g}" for r, _ in points]
                    start = next((i for i in range(len(points)) if all(v is True for v in better[i:])), None)
                    yes = [s for s, v in zip(steps, better) if v is True]
                    if start is not None:
                        seconds = self.positions[points[start][0]]["seconds"]
                        said = f"better from step {steps[start]} ({seconds:.0f} s of pretraining) on"
                    elif yes:
                        said = f"better at step {', '.join(yes)} but not at the last step ({steps[-1]})"
                    elif all(v is None for v in better):
                        said = "no verdict at any step"
                    else:
                        said = "better at no step"
                    top = max(range(len(points)), key=lambda i: points[i][1].mean)
                    said += f"; best {points[top][1].mean:.1f} at step {steps[top]}" * (start is None)
                    lines.append(
                        f"{column}{f' ({name})' if name else ''} vs {b} ({self.cells[b][column].text}): {said}"
                    )
        return lines

    def cell(self, row: str, column: Column) -> str:
        """``mean ± std`` of a cell; ``x (1 seed)``, ``x (deterministic)`` or ``x (3 seeds alike)`` where there is no
        spread; '—' if empty."""
        cell = self.cells[row].get(column)
        return cell.text if cell else "—"

    def verdict(self, row: str, column: Column) -> dict[str, Any] | None:
        """The paired comparison of a weights row with the column's best baseline (``RULE``); None without one."""
        cell = self.cells[row].get(column)
        return cell.verdict if cell else None


def seed_varies(row_or_protocol: str) -> str:
    """What a seed varies in the cells of a protocol's column (or of the supervised row), as compare.md says."""
    return SEED_VARIES.get(row_or_protocol, "the data order")


def describe_settings(run: EvalRun, partial: Mapping[str, str] | None = None) -> list[str]:
    """What every cell of a comparison shares, in words: network, image size, precision, pretraining, k, grid.

    ``partial``: the ``--over-steps`` runs still pretraining (:attr:`Comparison.partial`), whose curves are partial.
    """
    from bt_hub.weights.card import training_length

    config = run.config
    lines = [f"- network: {settings_text(run.settings.as_dict())}"]
    if config.over_steps:
        for w in config.weights:
            length = training_length(read_json(Path(w) / "config.json") or {}) or "unknown (no bt_hub run config)"
            scores = "the curve scores the weights it kept"
            if w in (partial or {}):
                length, scores = partial[w], "the curve is partial: it scores the weights kept so far"
            lines.append(f"- {Path(w).name}: pretraining {length}; {scores}")
    else:
        for w in run.all_weights:
            length = training_length(w.info.get("config") or {}) or "unknown (no bt_hub run config)"
            lines.append(f"- {w.label} (sha256 {w.sha256[:12]}): pretraining {length}")
    if config.as_seeds:
        lines.append(
            f"- pretraining runs as seeds: run i of {len(config.weights)} is scored with evaluation seed --seed + i,"
            " so a weights row's spread, and the verdict's pairing, is over pretraining runs"
        )
    unused, knn, linear, semi = config.unused_flags(), config.knn, config.linear, config.semi
    if "knn" not in unused:
        k, train = min(knn.k[0], len(run.splits.train)), len(run.splits.train)
        fewer = f" ({config.flag('knn.k')} {knn.k[0]} is more than the {train} training images)" if k < knn.k[0] else ""
        lines.append(f"- kNN: k = {k}{fewer}, T = {knn.temperature:g}, cosine similarity")
    if "linear" not in unused:
        lines.append(
            f"- linear: grid of lr {', '.join(f'{v:g}' for v in linear.lr_grid)} x weight decay "
            f"{', '.join(f'{v:g}' for v in linear.weight_decay_grid)}, {linear.epochs} epochs, chosen on a "
            f"seeded {linear.val_fraction:g} of the training split"
        )
    if config.label_fractions != [100] and "label_fractions" not in unused:
        lines.append(
            f"- label budgets of the frozen columns: {', '.join(f'{f}%' for f in config.label_fractions)} of the "
            "training labels, semi's seeded class-balanced subsets (the same for every row at a seed); kNN's k at most "
            "the labelled images, the linear grid chosen on a validation split of the budget's own labels"
        )
    if any(get_protocol(c.protocol).label_free for c in config.columns()):
        lines.append(
            f"- RankMe: of every row's training features (all of them up to {MAX_IMAGES:,}; no label read), without a "
            "verdict: a label-free value is no accuracy to beat"
        )
    if "semi" not in unused:
        lines.append(
            f"- semi: preset {semi.preset}, batch {semi.batch_size}, {semi.epochs} epochs; supervised baseline: "
            f"{config.supervised_epochs} epochs from scratch; each at least {semi.min_steps} SGD steps (the "
            "epochs a cell ran are in its record)"
        )
    return lines


def render_markdown(
    result: Comparison,
    title: str | None = "Did pretraining help?",
    settings: Sequence[str] = (),
    paired: bool = True,
    rows: Sequence[str] | None = None,
) -> str:
    """``compare.md``: the mean ± std table with the verdict column, the paired comparisons, the rule and the seeds
    (``paired=False``: up to the table, what the CLI prints; ``title=None``: no heading, for a report of its own;
    ``rows``: only these rows' table, without the curve's lines)."""
    shown = [r for r in result.values if rows is None or r in rows]
    weights_rows = [r for r in shown if r not in result.baselines]
    header = ["representation", *map(str, result.columns), "better than the best baseline?"]
    lines = [*([f"# {title}", ""] if title else []), *([*settings, ""] if settings else [])]
    if result.positions and rows is None:
        lines += ["## Learning curve", "", "![curve](curve.png)", "", *(f"- {c}" for c in result.crossings()), ""]
    lines += ["| " + " | ".join(header) + " |"]
    lines.append("|---" * len(header) + "|")
    for row in shown:
        verdicts = [] if row in result.baselines else [(c, result.verdict(row, c)) for c in result.columns]
        said = "; ".join(f"{c}: {_verdict_word(v)}" for c, v in verdicts if v) or "—"
        label = f"{row} (baseline)" if row in result.baselines else row
        lines.append("| " + " | ".join([label, *(result.cell(row, c) for c in result.columns), said]) + " |")
    if not paired:
        return "\n".join(lines)
    lines += ["", "## Paired by seed and test image", ""]
    lines += ["| weights | column | best baseline | difference per seed | mean ± std | paired test |", "|---" * 6 + "|"]
    for row in weights_rows:
        for column in result.columns:
            v = result.verdict(row, column)
            if v:
                diffs = ", ".join(f"{d:+.1f}" for d in v["differences"])
                lines.append(f"| {row} | {column} | {v['baseline']} | {diffs} | {_difference(v)} | {_test(v)} |")
    one = 100.0 / max(result.test_size, 1)
    lines += [
        "",
        f"Test top-1 in percent, mean ± sample standard deviation (n - 1) over {seeds_text(len(result.seeds))} "
        f"({', '.join(map(str, result.seeds))}); per-seed values are in results.jsonl. Rule: {RULE}.",
        f"The test split has {result.test_size} images (one image = {one:.2f} points); its sampling error is in "
        "the paired tests, not in the spread.",
        "",
        "What a seed varies:",
        "",
        *[f"- **{name}**: {seed_varies(name)}" for name in dict.fromkeys(c.protocol for c in result.columns)],
        *[f"- **{', '.join(budgets)}**: {seed_varies('label budget')}" for budgets in [_budgets(result)] if budgets],
        *[f"- **{name}**: {seed_varies(name)}" for name in result.baselines if name in SEED_VARIES],
        "",
    ]
    return "\n".join(lines)


def _budgets(result: Comparison) -> list[str]:
    """The headings of the frozen columns on a seeded share of the labels (``--label-fractions``)."""
    return [str(c) for c in result.columns if c.drawn and frozen(c.protocol)]


def _difference(v: dict[str, Any]) -> str:
    """``+1.2 ± 0.4``; ``-5.3 (deterministic)``, ``+2.0 (1 seed)`` or ``+0.0 (2 seeds alike)`` without spread."""
    diffs = v["differences"]
    if len(diffs) == 1 or len(set(diffs)) == 1:
        return f"{v['mean']:+.1f} ({v['alike']})"
    return f"{v['mean']:+.1f} ± {v['std']:.1f}"


def _test(v: dict[str, Any]) -> str:
    """The paired test of a verdict in words: its discordant images or interval, and its p-value."""
    if v["test"] == "McNemar":
        b, c = v["discordant"]
        return f"McNemar: {b} vs {c} images right in one row only, {_p(v)}"
    if v["test"] == "bootstrap":
        low, high = v["interval"]
        return f"bootstrap: {1 - v['level']:.0%} interval {low:+.1f} to {high:+.1f}, {_p(v)}"
    return "none: a cell without per-image results"


def answers(result: Comparison, row: str) -> list[str]:
    """A weights row's verdict in each accuracy column (each label budget) against that column's best baseline, one
    line each: the demo's answers."""
    return [
        f"{c}: {result.cell(row, c)} against {v['baseline']} {result.cell(v['baseline'], c)}: {_verdict_word(v)}"
        for c in result.accuracy_columns
        if (v := result.verdict(row, c))
    ]


def _p(v: dict[str, Any]) -> str:
    """``p = 0.031``; ``p < 0.001``."""
    return "p < 0.001" if v["p_value"] < 0.001 else f"p = {v['p_value']:.2g}"


def _verdict_word(v: dict[str, Any]) -> str:
    word = {True: "yes", False: "no", None: "no verdict"}[v["better"]]
    tested = f", {_p(v)} on {v['test_images']} test images" if v["test"] else "; no per-image results"
    behind = ", ".join(f"{b} by {gap:.1f}" for b, gap in v.get("loses_to", {}).items())
    return f"{word} ({_difference(v)} vs {v['baseline']}{tested})" + (f"; loses to {behind}" if behind else "")


def plot(result: Comparison, path: Path) -> Path:
    """Grouped bars of the accuracy columns with error bars (± one standard deviation over the seeds), written
    atomically as PNG."""
    from bt_hub.common.files import pyplot, save_png

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width, columns = 0.8 / len(result.values), result.accuracy_columns
    for i, (row, cells) in enumerate(result.cells.items()):
        xs = [j + i * width for j, c in enumerate(columns) if c in cells]
        shown = [cells[c] for c in columns if c in cells]
        ax.bar(xs, [c.mean for c in shown], width, yerr=[c.std for c in shown], capsize=3, label=row)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(columns))], list(map(str, columns)))
    ax.set(ylabel="test top-1 (%)", ylim=(0, 100), title=f"mean ± std over {seeds_text(len(result.seeds))}")
    ax.legend(fontsize=8, loc="lower right")
    return save_png(fig, path)


def plot_curve(result: Comparison, path: Path) -> Path:
    """Accuracy (RankMe on its own axis) against pretraining steps (top) and seconds (bottom) per column, each
    baseline a band (mean ± std)."""
    from bt_hub.common.files import pyplot, save_png

    plt = pyplot()
    cols = len(result.columns)
    fig, axes = plt.subplots(2, cols, figsize=(4.2 * cols, 6.4), squeeze=False)
    for j, column in enumerate(result.columns):
        for i, axis in enumerate(("step", "seconds")):
            ax = axes[i][j]
            for k, b in enumerate(b for b in result.baselines if column in result.cells[b]):
                mean, std = result.cells[b][column].mean, result.cells[b][column].std
                ax.axhspan(mean - std, mean + std, color=f"C{k + 1}", alpha=0.2)
                ax.axhline(mean, color=f"C{k + 1}", lw=1, label=f"{b} (mean ± std)")
            for name, rows in result.curves().items():
                xs = [result.positions[r][axis] for r in rows]
                stats = [result.cells[r][column] for r in rows]
                ax.errorbar(
                    xs, [c.mean for c in stats], [c.std for c in stats], marker="o", ms=3, label=name or "weights"
                )
                if max(xs) >= 20 * max(min(xs), 1e-9):
                    ax.set_xscale("log")
            label = "of the training features" if column not in result.accuracy_columns else "test top-1 (%)"
            ax.set(xlabel=f"pretraining {axis}", ylabel=f"{column} {label}")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"learning curve: mean ± std over {seeds_text(len(result.seeds))}")
    return save_png(fig, path)


def table_rows(result: Comparison) -> list[dict[str, Any]]:
    """One row per representation: per column its mean, std and per-seed values; for weights, the verdicts."""
    rows = []
    for name, cells in result.cells.items():
        row: dict[str, Any] = {"representation": name, "baseline": name in result.baselines}
        for column in result.columns:
            cell = cells.get(column) or CellSummary([], float("nan"), float("nan"), "—")
            row |= {str(column): cell.mean, f"{column} std": cell.std, f"{column} per seed": list(cell.values)}
            if cell.verdict:
                row |= {f"{column} better": cell.verdict["better"], f"{column} p": cell.verdict.get("p_value")}
        rows.append(row)
    return rows


def comparison_summary(result: Comparison, started: float) -> dict[str, Any]:
    """What a comparison's results.json holds (``eval compare``'s, and the demo's): the per-seed records, the table,
    the verdicts, the curve and the seconds since ``started``; a partial curve is said in every record too."""
    summary = {
        "results": result.records,
        "table": {
            row: {str(c): {"per_seed": v, "mean_std": result.cell(row, c)} for c, v in cols.items()}
            for row, cols in result.values.items()
        },
        "verdicts": {
            row: {str(c): result.verdict(row, c) for c in result.accuracy_columns}
            for row in result.values
            if row not in result.baselines
        },
        "wall_time_s": time.perf_counter() - started,
    }
    if result.positions:
        summary["curve"] = {"positions": result.positions, "crossings": result.crossings()}
    if result.partial:  # every record says so, as the table does
        summary.setdefault("curve", {})["partial"] = dict(result.partial)
        for record in result.records:
            record["warnings"] = [
                *record.get("warnings", []),
                *(f"partial curve: {w} was {how}" for w, how in result.partial.items()),
            ]
    return summary


def write_comparison(run: EvalRun, result: Comparison) -> str:
    """compare.md, compare.png and the records (results.json / .jsonl / .md) in the run's folder; the table."""
    settings = describe_settings(run, result.partial)
    out = run.out
    written = [
        atomic_write_text(out / "compare.md", render_markdown(result, settings=settings)),
        plot(result, out / "compare.png"),
    ]
    written += [plot_curve(result, out / "curve.png")] if result.positions else []
    run.write(result.records, comparison_summary(result, run.started))
    written += [out / name for name in ("results.json", "results.jsonl", "results.md")]
    table = render_markdown(result, settings=settings, paired=False)
    return table + "\n\n" + "\n".join(f"wrote {p}" for p in written)
