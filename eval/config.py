"""``EvalConfig``: the flags every evaluation protocol shares (``bt-hub eval <protocol>``).

Each protocol's config dataclass subclasses it and adds its own fields; the CLI turns
every field into a kebab-case flag whose help is the field's ``metadata["help"]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

import torch

from bt_hub.runs import check_run_dir


@dataclass
class EvalConfig:
    """Weights, data, output and compute settings shared by all protocols."""

    weights: str = field(metadata={"help": "weights to evaluate: a registered name (bt-hub weights list), file, folder (run directory, Hugging Face folder), URL, hf://org/name[@rev] or org/name"})
    data: str = field(default="digits", metadata={"help": "dataset: 'digits' (embedded), 'synthetic[:N]', or a path (ImageFolder / ImageNet layout with train/ and val/)"})
    out: str = field(default="runs/eval", metadata={"help": "output directory: results.json, results.md and the protocol's logs go here"})
    overwrite: bool = field(default=False, metadata={"help": "write into an --out that is not empty and was not created by bt-hub (same-named files are replaced)"})
    arch: Optional[str] = field(default=None, metadata={"help": "backbone architecture (resnet18/34/50/101); overrides what the checkpoint implies"})
    small_image_stem: Optional[bool] = field(default=None, metadata={"help": "3x3 stem without max-pool (32-px data); default: what the checkpoint implies"})
    device: str = field(default="cpu", metadata={"help": "'cpu' or 'cuda' (autocast is used on CUDA)"})
    batch_size: int = field(default=256, metadata={"help": "images per forward pass during feature extraction"})
    num_workers: int = field(default=0, metadata={"help": "DataLoader worker processes"})
    image_size: int = field(default=224, metadata={"help": "crop side; the test transform is Resize(image_size*256/224) + CenterCrop(image_size)"})
    seed: int = field(default=0, metadata={"help": "seed of every random choice (data split, initialisation, sampling)"})
    cache_dir: Optional[str] = field(default=None, metadata={"help": "feature cache directory; a second protocol on the same weights, data and transform reuses the features"})
    cache_dtype: Literal["float32", "float16"] = field(default="float32", metadata={"help": "dtype of cached features (float16 halves the disk use)"})
    allow_non_finite: bool = field(default=False, metadata={"help": "evaluate weights holding NaN or inf (for forensics; refused otherwise)"})

    def __post_init__(self) -> None:
        if not str(self.weights).strip():
            raise ValueError("--weights must name a checkpoint, got an empty string")
        for flag, value in (("--batch-size", self.batch_size), ("--image-size", self.image_size)):
            if value <= 0:
                raise ValueError(f"{flag} must be positive, got {value}")
        if self.num_workers < 0:
            raise ValueError(f"--num-workers must be >= 0, got {self.num_workers}")
        if not (self.device == "cpu" or self.device.startswith("cuda") or self.device == "mps"):
            raise ValueError(f"--device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.cache_dtype not in ("float32", "float16"):
            raise ValueError(f"--cache-dtype must be 'float32' or 'float16', got {self.cache_dtype!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {self.device} was asked for but CUDA is not available; use --device cpu")
        check_run_dir(self.out, overwrite=self.overwrite)
