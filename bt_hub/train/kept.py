"""Weights a pretraining run keeps for its learning curve (``--keep-every``), and the curve's rows over runs."""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bt_hub.common.runs import lock_holder

KEPT_DIR = "kept"


def kept_path(run_dir: Path, step: int) -> Path:
    """Where a run keeps the backbone of ``step``."""
    return run_dir / KEPT_DIR / f"step-{step:06d}.safetensors"


def kept_weights(run_dir: Path) -> list[tuple[int, float, Path]]:
    """The weights ``--keep-every`` kept in a run: (step, training seconds until then, path), by step."""
    from safetensors import safe_open

    kept = []
    for path in sorted((run_dir / KEPT_DIR).glob("step-*.safetensors")):
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        step = int(meta.get("step", path.stem.removeprefix("step-")))
        kept.append((step, float(meta.get("train_seconds", "nan")), path))
    return kept


def live_run(run_dir: Path) -> str | None:
    """How far a pretraining run still going has got, for a curve of its kept weights so far (None when no live
    process holds its lock): ``still live (pid 4242 on host node7, started ...): 40 steps so far, 3 kept``."""
    holder = lock_holder(run_dir)
    if holder is None:
        return None
    steps = 0
    with contextlib.suppress(OSError):  # a line the run is appending may be cut short: it is left out
        for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8", errors="replace").splitlines():
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                steps = max(steps, int(json.loads(line).get("step", 0)))
    who = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {holder.get('started', '?')}"
    return f"still live ({who}): {steps} steps so far, {len(kept_weights(run_dir))} kept"


def resumed_seconds(state: dict[str, Any] | None, run_dir: Path) -> float:
    """The training seconds a run resumed from checkpoint ``state`` counts on from (0 for a fresh run).

    The checkpoint's own ``train_seconds``, so a kept step after a resume reads what it would have uninterrupted;
    a checkpoint of an earlier bt_hub has none, and the seconds of the last weights kept up to its step stand in
    (they leave out the steps between that kept step and the checkpoint).
    """
    if state is None:
        return 0.0
    if "train_seconds" in state:
        return float(state["train_seconds"])
    step = int(state["step"])
    return max([s for k, s, _ in kept_weights(run_dir) if k <= step and math.isfinite(s)], default=0.0)


@dataclass
class WeightsRow:
    """The weights of one row: a label (None: the file's name), one file per pretraining run, a curve position."""

    label: str | None
    paths: list[str]
    position: dict[str, float] = field(default_factory=dict)


def curve_rows(runs: list[str], as_seeds: bool) -> list[WeightsRow]:
    """One row per kept step of each run; with ``as_seeds``, one per step of all runs together (same steps)."""
    kept = {}
    for run in runs:
        kept[run] = {step: (seconds, str(path)) for step, seconds, path in kept_weights(Path(run))}
        if not kept[run]:
            raise ValueError(
                f"--over-steps scores the weights a pretraining run kept, and --weights {run} holds none in kept/; "
                "pretrain with --keep-every N (or 'log')"
            )
    if not as_seeds:
        prefix = {run: f"{Path(run).name} " if len(runs) > 1 else "" for run in runs}
        return [
            WeightsRow(f"{prefix[run]}step {step}", [path], {"step": step, "seconds": seconds})
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
