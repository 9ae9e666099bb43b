"""Imports of optional dependencies that fail with the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRAS = {
    "huggingface_hub": "pip install 'bt_hub[hub]'",
    "faiss": "pip install 'bt_hub[eval]'",
    "pycocotools": "pip install 'bt_hub[detection]'",
    "timm": "pip install timm",
    "tensorboard": "pip install 'bt_hub[tensorboard]'",
    "pandas": "pip install 'bt_hub[analysis]'",
    "pyarrow": "pip install 'bt_hub[analysis]'",
    "nvidia.nvimgcodec": "pip install 'bt_hub[nvimgcodec]'",
    "detectron2": (
        "detectron2 is not on PyPI: pip install --no-build-isolation "
        "'git+https://github.com/facebookresearch/detectron2.git'"
    ),
}


class MissingDependencyError(ImportError):
    """An optional dependency is not installed; the message says how to install it."""


def require(module: str, purpose: str) -> ModuleType:
    """Import ``module`` or raise one sentence naming what needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        top = module if module in EXTRAS else module.split(".")[0]
        how = EXTRAS.get(top, f"pip install {top}")
        raise MissingDependencyError(f"{purpose} needs {top}, which is not installed; install it with: {how}") from err
