"""The weights wing: everything that names, fetches, reads, converts or publishes weights (registry, download,
sources, formats, load, builders, export, card, hf).
"""

from bt_hub.common.files import CheckpointError
from bt_hub.method.transforms import IMAGENET_MEAN, IMAGENET_STD, eval_transforms, transforms_for
from bt_hub.weights.builders import barlow_twins, resnet18, resnet34, resnet50, resnet101
from bt_hub.weights.download import DownloadError, cache_path, download
from bt_hub.weights.export import (
    ExportConfig,
    export,
    save_detectron2,
    save_hf_folder,
    save_safetensors,
    save_torchvision,
    to_detectron2,
)
from bt_hub.weights.hf import PushConfig, PushError, from_pretrained, push, push_to_hub, save_pretrained
from bt_hub.weights.load import load_backbone, read_backbone_state_dict, read_projector_state_dict, weights_fingerprint
from bt_hub.weights.registry import PAPER_RESULTS, RECIPE, BarlowTwinsWeights, Weights, get_weights, list_weights
from bt_hub.weights.sources import ResolvedWeights, resolve

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "PAPER_RESULTS",
    "RECIPE",
    "BarlowTwinsWeights",
    "CheckpointError",
    "DownloadError",
    "ExportConfig",
    "PushConfig",
    "PushError",
    "ResolvedWeights",
    "Weights",
    "barlow_twins",
    "cache_path",
    "download",
    "eval_transforms",
    "export",
    "from_pretrained",
    "get_weights",
    "list_weights",
    "load_backbone",
    "push",
    "push_to_hub",
    "read_backbone_state_dict",
    "read_projector_state_dict",
    "resolve",
    "save_detectron2",
    "save_hf_folder",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "save_pretrained",
    "save_safetensors",
    "save_torchvision",
    "to_detectron2",
    "transforms_for",
    "weights_fingerprint",
]
