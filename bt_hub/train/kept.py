"""Weights a pretraining run keeps for its learning curve (``--keep-every``): where they go and what they say."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

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
