"""The weights wing: everything that names, fetches, reads, converts or publishes weights (registry, paper, download,
sources, formats, load, builders, export, card, hf).

Its public names load on first use (PEP 562): ``from bt_hub.weights import load_backbone`` imports
``bt_hub.weights.load`` and what it needs, and ``import bt_hub.weights.paper`` (the paper's numbers, which every
results table shows) loads no download, export, Hugging Face or card module.
"""

import importlib
import sys
import types
from typing import Any

# where each public name lives: module -> its names, space-separated (as namedtuple takes its fields)
HOMES = {
    "bt_hub.common.files": "CheckpointError",
    "bt_hub.method.transforms": "IMAGENET_MEAN IMAGENET_STD eval_transforms transforms_for",
    "bt_hub.weights.builders": "barlow_twins resnet18 resnet34 resnet50 resnet101",
    "bt_hub.weights.download": "DownloadError cache_path download",
    "bt_hub.weights.export": "ExportConfig export save_detectron2 save_hf_folder save_safetensors save_torchvision "
    "to_detectron2",
    "bt_hub.weights.hf": "PushConfig PushError from_pretrained push push_to_hub save_pretrained",
    "bt_hub.weights.load": "load_backbone read_backbone_state_dict read_projector_state_dict weights_fingerprint",
    "bt_hub.weights.paper": "PAPER_RESULTS RECIPE",
    "bt_hub.weights.registry": "BarlowTwinsWeights Weights get_weights list_weights",
    "bt_hub.weights.sources": "ResolvedWeights resolve",
}
_HOME = {name: module for module, names in HOMES.items() for name in names.split()}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    """A public name of the wing, imported from its module on first use."""
    if name not in _HOME:
        raise AttributeError(f"module 'bt_hub.weights' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value
    return value


class _Wing(types.ModuleType):
    """The package, whose functions ``export`` and ``download`` keep their names when their modules load (the
    import system sets a package's attribute to each submodule it loads)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if not (name in _HOME and isinstance(value, types.ModuleType)):
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Wing
