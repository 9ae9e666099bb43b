"""Where the detection YAMLs live and how a detectron2 config is built from them.

The YAMLs sit in ``detection_configs/`` at the repository root. The wheel ships that
folder as the ``detection_configs`` package (pyproject ``packages``); an editable install
or a source checkout finds it beside the ``eval`` package instead.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import Any, Sequence

__all__ = ["CONFIGS", "FLAG_OWNED_KEYS", "build_cfg", "configs_dir", "resolve_config"]

CONFIGS = {
    "voc": "voc0712_faster_rcnn_R_50_C4_24k.yaml",
    "coco": "coco_mask_rcnn_R_50_C4_1x.yaml",
}

# detectron2 keys that `bt-hub detect` sets from its own flags; opts must not set them.
FLAG_OWNED_KEYS = {"MODEL.WEIGHTS": "--weights", "MODEL.DEVICE": "--device", "SEED": "--seed", "OUTPUT_DIR": "--out"}


def configs_dir() -> Path:
    """The ``detection_configs`` folder (installed package first, then the source checkout)."""
    try:
        installed = Path(str(importlib.resources.files("detection_configs")))
    except ModuleNotFoundError:
        installed = None
    if installed is not None and (installed / CONFIGS["voc"]).is_file():
        return installed
    return Path(__file__).resolve().parents[2] / "detection_configs"


def resolve_config(name_or_path: str) -> Path:
    """``voc`` / ``coco`` -> the shipped YAML; anything else must be an existing YAML file.

    Raises:
        FileNotFoundError: the name is neither an alias nor an existing file.
    """
    if name_or_path in CONFIGS:
        path = configs_dir() / CONFIGS[name_or_path]
        if not path.is_file():
            raise FileNotFoundError(f"--config {name_or_path}: {path} is missing from this installation of bt_hub")
        return path
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"--config must be 'voc', 'coco' or a detectron2 YAML file, got {name_or_path!r} (no such file)")
    return path


def build_cfg(path: str | Path, opts: Sequence[str], *, weights: str, device: str, seed: int, output_dir: str | Path) -> Any:
    """A frozen detectron2 ``CfgNode``: defaults, then the YAML, then the flags, then ``opts``.

    Args:
        path: the YAML (``_BASE_`` is resolved relative to it).
        opts: ``KEY VALUE`` pairs, detectron2's command-line override syntax.
        weights: ``MODEL.WEIGHTS`` (a detectron2 ``.pkl``).
        device: ``MODEL.DEVICE``.
        seed: ``SEED``.
        output_dir: ``OUTPUT_DIR``.

    Raises:
        ValueError: an odd number of opts, an opt that a flag owns, or a key detectron2 does not know.
    """
    from detectron2.config import get_cfg

    opts = list(opts)
    if len(opts) % 2:
        raise ValueError(f"opts must be KEY VALUE pairs, got an odd number of items: {opts}")
    for key in opts[0::2]:
        if key in FLAG_OWNED_KEYS:
            raise ValueError(f"opts may not set {key}; use {FLAG_OWNED_KEYS[key]} instead")
    cfg = get_cfg()
    cfg.merge_from_file(str(path))
    cfg.MODEL.WEIGHTS = str(weights)
    cfg.MODEL.DEVICE = device
    cfg.SEED = int(seed)
    cfg.OUTPUT_DIR = str(output_dir)
    try:
        cfg.merge_from_list(opts)
    except (KeyError, AssertionError, ValueError) as err:
        raise ValueError(f"opts {opts} do not fit the detectron2 config {path}: {err}") from err
    cfg.freeze()
    return cfg
