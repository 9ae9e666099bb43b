"""A pretraining run's folder: the weights it writes (the final ones, ``config.json``, and those ``--keep-every``
keeps for the learning curve), and whether a new start continues, replaces or refuses what a folder holds
(docs/pretraining.md, "The run directory"). The training loop that fills it is :mod:`bt_hub.train.pretrain`.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

from bt_hub.common.files import atomic_write_json, read_json, write_safetensors
from bt_hub.common.reuse import changed_input
from bt_hub.method.model import BarlowTwins
from bt_hub.method.transforms import input_metadata
from bt_hub.train.config import RESUME_INVARIANTS, PretrainConfig
from bt_hub.train.resume import CHECKPOINT_NAME, load_checkpoint

WEIGHTS_NAME = "backbone.safetensors"
# What a run writes beside its checkpoint (a fresh run with --overwrite removes an earlier run's copies first).
RUN_OUTPUTS = (WEIGHTS_NAME, "config.json", "cross_correlation_start.npy", "cross_correlation_end.npy")
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


def _finished_run(out: Path, config: PretrainConfig) -> str | None:
    """The final weights a finished run left in ``out`` (named with their step when config.json says it), or None."""
    for name in (WEIGHTS_NAME, "config.json", f"{config.backbone}.pth"):
        if (out / name).exists():
            record = read_json(out / "config.json")
            steps = record.get("steps") if isinstance(record, dict) else None
            return f"{name} of step {steps}" if isinstance(steps, int) else name
    return None


def resume_state(config: PretrainConfig, out: Path, data: str) -> dict[str, Any] | None:
    """The checkpoint to continue from, or None for a fresh run (refusing to replace a run without ``--overwrite``).

    A checkpoint is resumed only where its inputs are this run's (``changed_input("checkpoint", ...)`` of
    :mod:`bt_hub.common.reuse`): its recipe (``RESUME_INVARIANTS``) and its training data, ``data`` being the
    fingerprint of ``--data`` now (``dataset_fingerprint``: its files' stat rows and labels), so a folder changed in
    place is refused. A checkpoint of an older bt_hub, which recorded no fingerprint, is resumed with a warning."""
    own = out / CHECKPOINT_NAME
    if config.resume is None or (config.resume == "auto" and not own.exists()):
        if config.overwrite:
            return None
        if config.resume is None and own.exists():
            raise ValueError(
                f"--out {out} already holds {CHECKPOINT_NAME}; pass --resume auto to continue it, --overwrite to "
                "replace that run with a new one, or choose another --out"
            )
        finished = _finished_run(out, config)
        if finished:
            raise ValueError(
                f"--out {out} holds a finished run ({finished}) and no {CHECKPOINT_NAME} to continue; pass --overwrite "
                "to replace that run with a new one, or choose a new --out"
            )
        return None
    path = own if config.resume == "auto" else Path(config.resume)
    state = load_checkpoint(path)
    recipe = {key: state["config"].get(key) for key in RESUME_INVARIANTS}
    if "data_fingerprint" not in state:
        warnings.warn(
            f"checkpoint {path} records no fingerprint of its training data (an older bt_hub wrote it), so resuming "
            f"it cannot check that --data {config.data} still holds the images it was trained on; its next checkpoint "
            "records them",
            stacklevel=2,
        )
    recorded = {"recipe": recipe, "data": state.get("data_fingerprint", data)}
    why = changed_input("checkpoint", recorded, {"recipe": {key: getattr(config, key) for key in recipe}, "data": data})
    if why is not None and why.startswith("recipe"):
        key = next(key for key, saved in recipe.items() if saved != getattr(config, key))
        raise ValueError(
            f"--{key.replace('_', '-')} is {getattr(config, key)!r} but checkpoint {path} was trained with "
            f"{recipe[key]!r}"
        )
    if why is not None:
        raise ValueError(
            f"--data {config.data} is not what checkpoint {path} was trained on ({why}: an image was added, removed, "
            "relabelled or written since); put back the images it was trained on to resume it, or start a new run "
            "on this data (--overwrite without --resume, or another --out)"
        )
    return state


def clear_replaced_run(out: Path, config: PretrainConfig) -> None:
    """Before a fresh run with ``--overwrite`` in a bt_hub run folder: remove what the earlier run wrote (its
    checkpoint would be resumed, its weights would sit beside the new record); an adopted folder keeps them."""
    record = read_json(out / "run.json")
    if not (isinstance(record, dict) and "bt_hub_version" in record):
        return
    for name in (CHECKPOINT_NAME, *RUN_OUTPUTS, f"{config.backbone}.pth"):  # <arch>.pth: written by earlier versions
        (out / name).unlink(missing_ok=True)
    for _, _, path in kept_weights(out):
        path.unlink()


def write_backbone(
    out: Path, model: BarlowTwins, config: PretrainConfig, step: int, num_samples: int, decided: dict[str, Any]
) -> None:
    """The final weights, once: ``backbone.safetensors`` (torchvision keys, no fc) and ``config.json``.

    ``decided`` is what the run chose for itself: :class:`AutoCompile`'s record (the path the steps took,
    ``compile: on|off``, and why) and ``precision_choice``'s (the precision, why, and on a CPU the times of both).
    """
    write_weights(out / WEIGHTS_NAME, model, config, step=step)
    atomic_write_json(
        out / "config.json",
        {
            "architecture": config.backbone,
            "feature_dim": model.backbone.feature_dim,
            **_flags(config, "small_image_stem projector lambd image_size"),
            "dataset": config.data,
            "num_samples": num_samples,
            "epochs": config.epochs,
            "steps": step,
            "recipe": {
                "optimizer": "LARS",
                **_flags(
                    config,
                    "batch_size lr_weights lr_biases weight_decay warmup_epochs loss_method precision views decode",
                ),
                **decided,
                **_flags(config, "seed reference_grad_scale crop_scale_min flip blur"),
            },
            "format": "torchvision",
        },
    )


def _flags(config: PretrainConfig, names: str) -> dict[str, Any]:
    """The values of the flags ``names`` (space-separated), in that order, as config.json records them."""
    return {name: getattr(config, name) for name in names.split()}


def write_weights(path: Path, model: BarlowTwins, config: PretrainConfig, **meta: Any) -> None:
    """The backbone's weights (torchvision keys, no fc) as safetensors, carrying what evaluation needs to rebuild
    their input (``input_metadata``: architecture, stem, image size, normalisation, the run's id) and ``meta``."""
    state = {
        k: v.detach().cpu().contiguous().clone()
        for k, v in model.backbone.state_dict().items()
        if not k.startswith("fc.")
    }
    started = read_json(Path(config.out) / "run.json")  # its first start's id names the run across resumes
    meta = {
        **input_metadata(
            architecture=config.backbone,
            small_image_stem=config.small_image_stem,
            image_size=config.image_size,
            run_id=started.get("run_id") if isinstance(started, dict) else None,
        ),
        **meta,
    }
    write_safetensors(state, path, metadata={k: str(v) for k, v in meta.items()})
