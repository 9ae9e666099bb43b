"""The plots of a pretraining run (``bt-hub report RUN_DIR``), shared with ``bt-hub demo``: ``loss.png``,
``cross_correlation.png`` (start and end) and ``knn.png`` (with ``--monitor-knn``); matplotlib headless.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bt_hub.common.config import OVERWRITE_HELP, REQUIRED, option
from bt_hub.common.files import pyplot, read_json, save_png
from bt_hub.common.runs import claimed_run_dir, read_jsonl, run_kind
from bt_hub.method.loss import LAMBD


@dataclass
class ReportConfig:
    """``bt-hub report``: draw a pretraining run's curves and matrices as PNG files."""

    run_dir: str = option(
        REQUIRED,
        "a bt-hub pretrain run directory (metrics.jsonl, run.json, cross_correlation_*.npy)",
        positional=True,
        nargs=None,
    )
    out: str | None = option(None, "where the PNG files go (default: RUN_DIR/report)")
    overwrite: bool = option(False, OVERWRITE_HELP)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of a run's ``metrics.jsonl`` (FileNotFoundError without one, ValueError naming a bad line)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; expected the run directory of bt-hub pretrain")
    rows = read_jsonl(path)  # names the line that is not JSON
    text = path.read_text(encoding="utf-8", errors="replace")
    for n, row in zip((n for n, line in enumerate(text.splitlines(), 1) if line.strip()), rows):
        keys = ("step", "loss", "invariance", "redundancy") if isinstance(row, dict) and "loss" in row else ("step",)
        if not isinstance(row, dict) or not all(isinstance(row.get(k), (int, float)) for k in keys):
            raise ValueError(
                f"{path} line {n} is not a metrics row of bt-hub pretrain (expected numbers under {', '.join(keys)})"
            )
    return rows


def read_cross_correlation(path: Path) -> np.ndarray:
    """A saved cross-correlation matrix (a square float array; pickles refused), else ValueError naming the file."""
    try:
        c = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as err:
        raise ValueError(f"{path} is not a readable .npy array ({str(err).rstrip('.')}); delete it or rerun") from None
    if c.ndim != 2 or c.shape[0] != c.shape[1] or not np.issubdtype(c.dtype, np.floating):
        raise ValueError(f"{path} holds a {c.dtype} array of shape {c.shape}; expected a square float matrix")
    return c


def plot_losses(rows: Sequence[dict[str, Any]], lambd: float) -> Any:
    """The loss, its on-diagonal part Σ(1 − C_ii)² and its off-diagonal part λ Σ C_ij², per logged step (log scale)."""
    plt = pyplot()
    rows = [r for r in rows if "loss" in r]
    steps = [r["step"] for r in rows]
    point = {"marker": "o"} if len(rows) == 1 else {}  # one logged step (a run shorter than --log-every): no line
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(steps, [r["loss"] for r in rows], label="loss", color="black", **point)
    ax.plot(steps, [r["invariance"] for r in rows], label="on-diagonal: Σ (1 − C_ii)²", **point)
    ax.plot(steps, [lambd * r["redundancy"] for r in rows], label=f"off-diagonal: λ Σ C_ij² (λ = {lambd})", **point)
    ax.set(xlabel="step", ylabel="loss", title="Barlow Twins loss during pretraining", yscale="log")
    ax.legend()
    return fig


def off_diagonal_mean(c: np.ndarray) -> float:
    """Mean |C_ij| over i ≠ j."""
    return float(np.abs(c - np.diag(np.diag(c))).sum() / (c.size - len(c)))


def plot_cross_correlations(matrices: dict[str, np.ndarray]) -> Any:
    """Cross-correlation matrices side by side (-1 blue .. 1 red), titled with their diagonal and off-diagonal means."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(matrices), figsize=(4.2 * len(matrices), 3.8), squeeze=False)
    for ax, (when, c) in zip(axes[0], matrices.items()):
        im = ax.imshow(c, cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest")
        ax.set_title(
            f"C at the {when}: mean diag {np.diag(c).mean():.2f}, mean |off| {off_diagonal_mean(c):.3f}", fontsize=8
        )
        ax.set_xticks([]), ax.set_yticks([])
    fig.colorbar(im, ax=list(axes[0]), shrink=0.8)
    return fig


def plot_knn(rows: Sequence[dict[str, Any]]) -> Any:
    """The online kNN monitor's top-1 per step, beside the same vote on raw pixels and a random-init network."""
    plt = pyplot()
    points = [(r["step"], r["knn_top1"]) for r in rows if "knn_top1" in r]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([s for s, _ in points], [v for _, v in points], marker="o", color="tab:green", label="backbone")
    first = next((r for r in rows if "knn_pixels" in r), {})
    lines = (("knn_pixels", "raw pixels", "tab:orange"), ("knn_random_init", "random init", "tab:blue"))
    for key, name, color in lines:
        if key in first:
            ax.axhline(first[key], color=color, lw=1, ls="--", label=f"{name} (same vote)")
    ax.legend(fontsize=8, loc="lower right")
    ax.set(xlabel="step", ylabel="top-1 (%)", ylim=(0, 100), title="online kNN monitor (k = 20, T = 0.07)")
    return fig


def _recorded_lambd(run_dir: Path) -> float:
    """λ of the run's recorded config (the paper's when the run has no run.json)."""
    path = run_dir / "run.json"
    if not path.is_file():
        return LAMBD
    record = read_json(path)
    lambd = record.get("config", {}).get("lambd") if isinstance(record, dict) else None
    if not isinstance(lambd, (int, float)):
        raise ValueError(f"{path} records no config.lambd; expected the run.json of bt-hub pretrain")
    return float(lambd)


def run_plots(
    run_dir: str | Path, out: str | Path, lambd: float | None = None, claim: Callable[[], object] | None = None
) -> list[Path]:
    """Draw loss.png, cross_correlation.png and knn.png into ``out``, every input checked before ``claim()``."""
    run_dir, out = Path(run_dir), Path(out)
    rows = read_metrics(run_dir)
    if lambd is None:
        lambd = _recorded_lambd(run_dir)
    matrices = {
        t: read_cross_correlation(run_dir / f"cross_correlation_{t}.npy")
        for t in ("start", "end")
        if (run_dir / f"cross_correlation_{t}.npy").exists()
    }
    if claim is not None:
        claim()
    written = []
    if any("loss" in r for r in rows):
        written.append(save_png(plot_losses(rows, lambd), out / "loss.png"))
    if matrices:
        written.append(save_png(plot_cross_correlations(matrices), out / "cross_correlation.png"))
    if any("knn_top1" in r for r in rows):
        written.append(save_png(plot_knn(rows), out / "knn.png"))
    return written


def report(config: ReportConfig) -> list[Path]:
    """``bt-hub report``: the plots of ``config.run_dir`` into ``config.out`` (default RUN_DIR/report); the files."""
    run_dir = Path(config.run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    kind = run_kind(run_dir)
    if kind != "pretrain":
        what = f"a bt-hub {kind} folder" if kind else "not a folder bt-hub pretrain wrote"
        raise ValueError(
            f"{run_dir} is not a pretraining run ({what}); bt-hub report draws the curves of a bt-hub pretrain --out"
        )
    out = Path(config.out) if config.out else run_dir / "report"
    with contextlib.ExitStack() as held:  # claimed and locked once every input is read, until the last PNG
        claim = lambda: held.enter_context(claimed_run_dir(out, overwrite=config.overwrite, kind="report"))  # noqa: E731
        return run_plots(run_dir, out, claim=claim)
