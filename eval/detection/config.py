"""Where the detection YAMLs live, and how detectron2 (``get_cfg``) and the torchvision engine read them."""

from __future__ import annotations

import ast
import copy
import functools
import importlib.resources
import operator
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from bt_hub.common.presets import shown

__all__ = [
    "CONFIGS",
    "FLAG_OWNED_KEYS",
    "Settings",
    "build_cfg",
    "configs_dir",
    "load_settings",
    "opts_overrides",
    "resolve_config",
]

CONFIGS = {
    "voc": "voc0712_faster_rcnn_R_50_C4_24k.yaml",
    "coco": "coco_mask_rcnn_R_50_C4_1x.yaml",
    # the installation check on `bt-hub make-detection-data` output (docs/detection.md, "Check an installation")
    "shapes-voc": "shapes_faster_rcnn_R_50_C4.yaml",
    "shapes-coco": "shapes_mask_rcnn_R_50_C4.yaml",
}

# detectron2 keys that `bt-hub detect` sets from its own flags; opts must not set them.
FLAG_OWNED_KEYS = {"MODEL.WEIGHTS": "--weights", "MODEL.DEVICE": "--device", "SEED": "--seed", "OUTPUT_DIR": "--out"}


def configs_dir() -> Path:
    """The installed ``bt_hub.detection_configs`` folder."""
    return Path(str(importlib.resources.files("bt_hub.detection_configs")))


def resolve_config(name_or_path: str) -> Path:
    """``voc`` / ``coco`` -> the shipped YAML; anything else must be an existing YAML file (else FileNotFoundError)."""
    if name_or_path in CONFIGS:
        path = configs_dir() / CONFIGS[name_or_path]
        if not path.is_file():
            raise FileNotFoundError(
                f"--detection-config {name_or_path}: {path} is missing from this installation of bt_hub"
            )
        return path
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        aliases = ", ".join(f"'{a}'" for a in CONFIGS)
        raise FileNotFoundError(
            f"--detection-config must be {aliases} or a detectron2 YAML file, got {name_or_path!r} (no such file)"
        )
    return path


def _check_opts(opts: Sequence[str]) -> list[str]:
    opts = list(opts)
    if len(opts) % 2:
        raise ValueError(f"opts must be KEY VALUE pairs, got an odd number of items: {shown(opts)}")
    for key in opts[0::2]:
        if key in FLAG_OWNED_KEYS:
            raise ValueError(f"opts may not set {key}; use {FLAG_OWNED_KEYS[key]} instead")
    return opts


def build_cfg(
    path: str | Path, opts: Sequence[str], *, weights: str, device: str, seed: int, output_dir: str | Path
) -> Any:
    """A frozen detectron2 ``CfgNode``: defaults, YAML, flags, then ``opts`` (ValueError for a bad one)."""
    from detectron2.config import get_cfg

    opts = _check_opts(opts)
    cfg = get_cfg()
    cfg.merge_from_file(str(path))
    cfg.MODEL.WEIGHTS = str(weights)
    cfg.MODEL.DEVICE = device
    cfg.SEED = int(seed)
    cfg.OUTPUT_DIR = str(output_dir)
    try:
        cfg.merge_from_list(opts)
    except (KeyError, AssertionError, ValueError) as err:
        raise ValueError(f"opts {shown(opts)} do not fit the detectron2 config {path}: {err}") from err
    cfg.freeze()
    return cfg


class Settings:
    """A merged YAML tree read by dotted key; a missing key is an error naming ``source``, the file."""

    def __init__(self, tree: dict[str, Any], source: str | Path) -> None:
        self.tree = tree
        self.source = str(source)

    def __getitem__(self, key: str) -> Any:
        node: Any = self.tree
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                raise ValueError(
                    f"the config {self.source} has no {key}; the torchvision engine reads every setting from the YAML "
                    "(set it there, as detection_configs/Base-RCNN-C4-BN.yaml does)"
                )
            node = node[part]
        return copy.deepcopy(node)

    def get(self, key: str, default: Any = None) -> Any:
        """The value at ``key``, or ``default`` when the tree does not have it."""
        try:
            return self[key]
        except ValueError:
            return default

    def replace(self, values: dict[str, Any]) -> Settings:
        """A copy with ``{dotted key: value}`` set (the keys must exist)."""
        tree = copy.deepcopy(self.tree)
        for key, value in values.items():
            self[key]  # noqa: B018  (raises for a key the tree lacks)
            *parents, last = key.split(".")
            functools.reduce(operator.getitem, parents, tree)[last] = value
        return Settings(tree, self.source)


def _merge(base: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in child.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _read_tree(path: Path) -> dict[str, Any]:
    """A YAML with its ``_BASE_`` chain merged as detectron2 merges it (the child wins)."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"the config {path} is not valid YAML ({err})") from None
    base = data.pop("_BASE_", None)
    return _merge(_read_tree(path.parent / base), data) if base else data


def _parse_value(text: str) -> Any:
    """An opts value as detectron2 reads it: a Python literal when it is one, else the string."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return list(value) if isinstance(value, tuple) else value


def load_settings(path: str | Path, opts: Sequence[str] = ()) -> Settings:
    """The YAML at ``path`` (``_BASE_`` merged), then ``opts`` (ValueError for a bad one)."""
    path = Path(path)
    settings = Settings(_read_tree(path), path)
    opts = _check_opts(opts)
    values = {}
    for key, text in zip(opts[0::2], opts[1::2]):
        old, new = settings.get(key, KeyError), _parse_value(text)
        if old is KeyError:
            raise ValueError(
                f"opts key {key} is not set in the config {path}; "
                "the torchvision engine accepts only keys the YAML sets"
            )
        values[key] = float(new) if isinstance(old, float) and isinstance(new, int) else new
    return settings.replace(values)


def opts_overrides(path: str | Path, opts: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``{KEY: {"value": opts' value, "preset": the config's}}`` for every opt that changes the config."""
    opts = _check_opts(opts)
    settings = Settings(_read_tree(Path(path)), path)
    changed = {}
    for key, text in zip(opts[0::2], opts[1::2]):
        preset, value = settings.get(key, KeyError), _parse_value(text)
        if preset is KeyError:
            preset = _detectron2_default(key)
        if isinstance(preset, float) and isinstance(value, int):
            value = float(value)
        if value != preset:
            changed[key] = {"value": value, "preset": preset}
    return changed


def _detectron2_default(key: str) -> Any:
    from detectron2.config import get_cfg

    node = functools.reduce(operator.getitem, key.split("."), get_cfg())
    return list(node) if isinstance(node, tuple) else node


def scale_to_world_size(settings: Settings, world_size: int) -> Settings:
    """``SOLVER.REFERENCE_WORLD_SIZE`` as detectron2 applies it (ValueError when the batch does not split evenly)."""
    reference = int(settings["SOLVER.REFERENCE_WORLD_SIZE"])
    if reference in (0, world_size):
        return settings
    scale = world_size / reference
    batch = int(round(settings["SOLVER.IMS_PER_BATCH"] * scale))
    if batch % world_size:
        raise ValueError(f"SOLVER.IMS_PER_BATCH scaled to {batch} images does not split over {world_size} processes")
    iters = lambda v: int(round(v / scale))  # noqa: E731
    return settings.replace(
        {
            "SOLVER.IMS_PER_BATCH": batch,
            "SOLVER.BASE_LR": settings["SOLVER.BASE_LR"] * scale,
            "SOLVER.MAX_ITER": iters(settings["SOLVER.MAX_ITER"]),
            "SOLVER.WARMUP_ITERS": iters(settings["SOLVER.WARMUP_ITERS"]),
            "SOLVER.STEPS": [iters(s) for s in settings["SOLVER.STEPS"]],
            "SOLVER.CHECKPOINT_PERIOD": iters(settings["SOLVER.CHECKPOINT_PERIOD"]),
            "SOLVER.REFERENCE_WORLD_SIZE": world_size,
        }
    )
