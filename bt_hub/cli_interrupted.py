"""What a ``bt-hub`` command cut short by Ctrl-C or SIGTERM kept, and the command that continues it: the end of the
one sentence ``bt_hub.cli`` prints (exit 130 / 143). Imports nothing heavy at the top: the signal may have landed
inside ``import torch``."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any


def interrupted(path: list[str], rest: list[str], config: Any, started: float = 0.0) -> str:
    """What an interrupted command kept and the command that continues it (Ctrl-C), as the end of one sentence.

    A command with a ``resume`` field continues from its checkpoint (``--resume auto``, or ``--resume`` for a
    flag); any other command is run again (without ``--overwrite`` once ``--out`` is bt_hub's: the demo continues
    its own run, and with it would start over): files are written whole, so what it finished is kept, and
    features it cached (whole splits written since ``started``, parts of one in progress) are reused.
    """
    again = ["bt-hub", *path, *rest]
    if config is None:  # perhaps cut inside ``import torch``: import nothing that imports it
        return f"nothing was written; run the command again: {shlex.join(again)}"
    from bt_hub.common.runs import owned_by_bt_hub
    from bt_hub.train.resume import CHECKPOINT_NAME

    out = Path(config.out) if getattr(config, "out", None) else None
    if out is None:
        kept = "no file is left half-written"
    elif out.is_file() or (out.is_dir() and any(out.iterdir())):
        kept = f"what was written to {out} is kept"
        if getattr(config, "force", None) is False:  # bt-hub export replaces what it wrote only with --force
            again.append("--force")
    else:
        kept = f"nothing was written to {out}"
    cache = getattr(config, "cache_dir", None)
    if not cache and out is not None and getattr(config, "CACHE_UNDER_OUT", False):  # compare, eval all, embed
        cache = out / "feature_cache"
    if cache:
        from bt_hub.eval.feature_cache import PART_ROWS, PART_SECONDS, kept_features

        whole, partial = kept_features(cache, started)
        if not (whole or partial):
            return (
                f"{kept}, and no features were kept in {cache} yet (an extraction keeps a part every {PART_ROWS} "
                f"rows or {PART_SECONDS:g} s), so running it again starts the extraction over: {shlex.join(again)}"
            )
        kept += f", and {_features_kept(whole, partial)} in {cache} (checked before reuse)"
    if not hasattr(config, "resume"):
        if cache or not hasattr(config, "cache_dir"):
            if getattr(config, "overwrite", False) and out is not None and owned_by_bt_hub(out):
                again = _without_flag(again, "--overwrite", takes_value=False)
                return f"{kept}; run the command again without --overwrite to continue: {shlex.join(again)}"
            return f"{kept}; run the same command again to continue: {shlex.join(again)}"
        starts_over = "without --cache-dir nothing of the features is kept, so running it again starts over"
        return f"{kept}; {starts_over}: {shlex.join(again)}"
    checkpoint = (out or Path()) / CHECKPOINT_NAME
    if isinstance(config.resume, bool):
        again = [*_without_flag(again, "--resume", takes_value=False), "--resume"]
    elif checkpoint.is_file() or config.resume in (None, "auto"):
        again = [*_without_flag(again, "--resume", takes_value=True), "--resume", "auto"]
    if checkpoint.is_file():
        kept = f"the last checkpoint {checkpoint} ({_checkpoint_step(checkpoint)}) is kept"
    return f"{kept}; continue with: {shlex.join(again)}"


def _features_kept(whole: list[int], partial: list[int]) -> str:
    """``the features of 1 whole split (1797 rows) and 4096 rows of another are kept``."""
    splits = f"the features of {len(whole)} whole split{'s' * (len(whole) > 1)} ({sum(whole)} rows)"
    if not partial:
        return f"{splits} are kept"
    rows = f"{sum(partial)} rows of {'another' if whole else 'features'}"
    return f"{splits} and {rows} are kept" if whole else f"{rows} are kept"


def _without_flag(argv: list[str], flag: str, *, takes_value: bool) -> list[str]:
    """``argv`` without ``flag`` (``--flag V``, ``--flag=V`` or, for a switch, ``--flag`` / ``--no-flag``)."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = takes_value
        elif not (arg.startswith(flag + "=") or arg == "--no-" + flag[2:]):
            kept.append(arg)
    return kept


def _checkpoint_step(path: Path) -> str:
    """``step N`` of a pretraining checkpoint (its tensors are mapped, not read), or why it could not be read."""
    import torch

    try:
        return f"step {int(torch.load(path, map_location='cpu', weights_only=True, mmap=True)['step'])}"
    except Exception:  # the sentence is still written: the file is kept whatever it holds
        return "its step could not be read back"
