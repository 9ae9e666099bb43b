"""``EvalConfig``: the flags every evaluation protocol shares, and the warnings when a preset's assumptions
(``PRESET_ASSUMPTIONS``) are far from the data or a step schedule's milestones never fire.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from bt_hub.common.config import REQUIRED, RunConfig, check_image_size, option, out_field
from bt_hub.common.presets import preset_values
from bt_hub.common.runs import check_run_dir
from bt_hub.data.decode import nvimgcodec
from bt_hub.method.model import ARCHITECTURES

DEFAULT_IMAGE_SIZE = 224  # the paper's crop, used when neither --image-size nor the weights' config.json gives one


class EvalWarning(UserWarning):
    """A run setting that is allowed but doubtful, or something the run repaired (one line each)."""


class PresetWarning(UserWarning):
    """A preset's assumptions are far from the data's, or its schedule idles."""


@dataclass
class EvalConfig(RunConfig):
    """Weights, data, output and compute settings shared by all protocols."""

    RUN_FIELDS: ClassVar[tuple[str, ...]] = RunConfig.RUN_FIELDS + (
        "weights",
        "data",
        "num_workers",
        "cache_dir",
        "cache_dtype",
        "test_split",
        "holdout",
        "allow_non_finite",
        "image_size",
        "precision",
        "decode",
        "store",
    )
    # The command caches features under OUT/feature_cache when --cache-dir is not given (compare, eval all, embed).
    CACHE_UNDER_OUT: ClassVar[bool] = False
    # The command extracts features of each split more than once (eval all's protocols, compare's rows and
    # baselines): --store auto then decodes each split once into a store, even without a --cache-dir.
    REUSES_SPLITS: ClassVar[bool] = False

    weights: str = option(
        REQUIRED,
        "weights to evaluate: a registered name (bt-hub weights list), file, folder (run directory, "
        "Hugging Face folder), URL, hf://org/name[@rev] or org/name",
    )
    data: str = option(
        "digits",
        "dataset: 'digits' (embedded), 'synthetic[:N]', or a directory with train/ beside val/ or test/ "
        "(ImageFolder class folders in each)",
    )
    out: str | None = out_field(
        "runs/eval",
        "output directory: results.json (this run), results.jsonl (every run), results.md "
        "and the protocol's logs go here",
    )
    arch: str | None = option(
        None, "backbone architecture; overrides what the checkpoint implies", choices=tuple(ARCHITECTURES)
    )
    small_image_stem: bool | None = option(
        None, "3x3 stem without max-pool (32-px data); default: what the checkpoint implies"
    )
    batch_size: int = option(
        256,
        "images per batch: of feature extraction, and the training batch of linear, transfer and semi "
        "(global under torchrun)",
    )
    num_workers: int = option(0, "DataLoader worker processes")
    image_size: int | None = option(
        None,
        "crop side; the test transform is Resize(image_size*256/224) + CenterCrop(image_size); digits "
        f"and synthetic are drawn at this size (default: the image_size of the weights' config.json, run and "
        f"Hugging Face folders, else {DEFAULT_IMAGE_SIZE})",
    )
    test_split: Literal["val", "test"] = option(
        "val",
        "held-out split of a directory --data: val/ (ImageNet layout) or test/; digits and synthetic hold "
        "out one part under both names",
    )
    holdout: float | None = option(
        None,
        "score on a seeded, class-stratified FRACTION of the training split instead of --test-split (a "
        "flat ImageFolder; or tuning without touching the test split); the held-out indices' sha256 goes into "
        "results.json",
    )
    cache_dir: str | None = option(
        None, "feature cache directory; a second protocol on the same weights, data and transform reuses the features"
    )
    cache_dtype: Literal["float32", "float16"] = option(
        "float32", "dtype of cached features (float16 halves the disk use)"
    )
    allow_non_finite: bool = option(False, "evaluate weights holding NaN or inf (for forensics; refused otherwise)")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = option(
        "auto",
        "autocast dtype of feature extraction; auto: bf16 on GPUs with bf16; on a CPU the faster of "
        "fp32 and bf16 on a micro-benchmark timed once per CPU model (the choice and both times are recorded in "
        "results.json)",
    )
    decode: Literal["auto", "device", "nvimgcodec", "pil", "workers"] = option(
        "auto",
        "feature extraction's input pipeline: 'device' (workers read bytes; --device decodes, resizes, "
        "crops and normalises the batch, as pretraining does, JPEGs with torchvision's nvJPEG on CUDA; on the CPU "
        "the workers decode with PIL), 'nvimgcodec' (the same with nvImageCodec, on the GPU's hardware JPEG engines "
        "where it has them, its CPU backend in the workers on a CPU; pip install 'bt_hub[nvimgcodec]'), 'pil' (the "
        "same with PIL decoding every file in the workers), 'workers' (PIL per image in the workers); auto: the "
        "decoders at hand timed on the data's first JPEGs once per machine and their pixels checked against PIL's, "
        "the faster one that matches, and on CUDA the workers decoding the share of each batch that keeps pace with "
        "the GPU (the choice, the rates and the pixel check are recorded in results.json)",
    )

    store: Literal["auto", "off", "disk", "device"] = option(
        "auto",
        "with --decode device on a folder: decode each split once into a store of test crops that every "
        "extraction reads (in --cache-dir/decoded, else in memory; its size is printed first), in GPU memory "
        "(device) or memory-mapped (disk); auto: when a --cache-dir is given or the command extracts a split "
        "several times (eval all, eval compare), on the GPU when it takes under 30% of its free memory; off: "
        "decode the files for every extraction",
    )

    def __post_init__(self) -> None:
        if not str(self.weights).strip():
            raise ValueError("--weights must name a checkpoint, got an empty string")
        self.require_positive("batch_size", "image_size")
        check_image_size(self.image_size, "eval")
        super().__post_init__()
        if self.precision == "fp16" and not self.device.startswith("cuda"):
            raise ValueError("--precision fp16 needs --device cuda; use bf16 on the CPU")
        if self.decode == "nvimgcodec":
            nvimgcodec()  # a missing extra is refused here, before the run claims --out
        if self.cache_dtype not in ("float32", "float16"):
            raise ValueError(f"--cache-dtype must be 'float32' or 'float16', got {self.cache_dtype!r}")
        if self.holdout is not None and not 0 < self.holdout < 1:
            raise ValueError(f"--holdout must be a fraction in (0, 1), e.g. 0.2, got {self.holdout}")
        preset = getattr(self, "preset", None)
        if preset is not None:
            preset_values(type(self), preset, self.flag("preset"))  # an unknown name fails here, listing the valid ones
        if self.out is not None:
            check_run_dir(self.out, kind="eval", overwrite=self.overwrite)
            if self.CACHE_UNDER_OUT and self.cache_dir is None:
                self.cache_dir = str(Path(self.out) / "feature_cache")
        self.build_children()  # and refuses the flags given that this run would not read

    def unused_flags(self) -> dict[str, str]:
        """Field -> why this run would not read it; such a flag, when given, is refused, never ignored."""
        unused = {}
        if self.cache_dir is None and not (self.CACHE_UNDER_OUT and self.out is not None):
            unused["cache_dtype"] = "sets the dtype of the feature cache, and this run has none (--cache-dir)"
        if self.holdout is not None:
            unused["test_split"] = "names the held-out folder, which --holdout replaces by a part of the training split"
        if self.decode == "workers" and self.store in ("disk", "device"):
            unused["store"] = "keeps a folder decoded once for --decode device, and --decode workers decodes in PIL"
        if getattr(self, "schedule", None) == "cosine":
            why = "only moves the LR of --schedule step, and this run's schedule is cosine"
            unused.update(milestones=why, gamma=why)
        return unused


def preset_warnings(config: Any, *, num_classes: int, train_images: int, image_side: int | None) -> list[str]:
    """One sentence when ``config.preset``'s assumptions are far from the data, else [].

    Far: ten times more or fewer classes, images three times smaller or larger, under four batches per epoch.
    """
    name = getattr(config, "preset", None)
    assumes: Mapping[str, Any] = (getattr(type(config), "PRESET_ASSUMPTIONS", None) or {}).get(name, {})
    if not assumes:
        return []
    found = []
    classes = assumes.get("num_classes")
    if classes and not classes / 10 <= num_classes <= classes * 10:
        found.append(f"{classes} classes (the data has {num_classes})")
    size = config.image_size or DEFAULT_IMAGE_SIZE
    side = min(size, image_side or size)
    expected = assumes.get("image_size")
    if expected and not expected / 3 <= side <= expected * 3:
        found.append(f"images of about {expected} px (the data's are {side} px)")
    steps = -(-train_images // config.batch_size)
    if steps < 4:
        found.append(
            f"at least 4 batches per epoch "
            f"({train_images} training images in batches of {config.batch_size} make {steps})"
        )
    if not found:
        return []
    others = [p for p in getattr(type(config), "PRESETS", {}) if p != name]
    return [
        f"preset {name!r} assumes "
        + ", ".join(found)
        + f"; its hyper-parameters may not fit: see --help for the other presets ({', '.join(others)}) or set the flags"
    ]


def schedule_warnings(config: Any) -> list[str]:
    """One sentence when a step schedule's milestones fall at or after the last epoch (they never fire), else []."""
    if getattr(config, "schedule", None) != "step":
        return []
    idle = [m for m in config.milestones if m >= config.epochs]
    if not idle:
        return []
    milestones = config.flag("milestones")
    return [
        f"{milestones} {' '.join(map(str, idle))} never fire in {config.epochs} epochs, so the LR never drops there: "
        f"lower {milestones} or use {config.flag('schedule')} cosine"
    ]


def warn_about_settings(config: Any, *, num_classes: int, train_images: int, image_side: int | None) -> list[str]:
    """Issue ``preset_warnings`` and ``schedule_warnings`` as ``PresetWarning``s and return them for the record."""
    messages = preset_warnings(config, num_classes=num_classes, train_images=train_images, image_side=image_side)
    messages += schedule_warnings(config)
    for message in messages:
        warnings.warn(message, PresetWarning, stacklevel=2)
    return messages
