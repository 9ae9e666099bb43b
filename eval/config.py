"""What an evaluation runs with: the flags every protocol shares (``EvalConfig``), the weights read once
(:func:`load_weights`), the settings both resolve to before any data is drawn (:func:`resolve_settings`: architecture,
stem, image size, normalisation, precision, decode and device, each with where it came from), and the warnings when a
preset's assumptions (``PRESET_ASSUMPTIONS``) are far from the data or a step schedule's milestones never fire.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from torch import nn

import bt_hub.weights
from bt_hub.common.config import REQUIRED, RunConfig, check_image_size, option, out_field
from bt_hub.common.distributed import broadcast_object, is_main_process
from bt_hub.common.presets import preset_values
from bt_hub.common.records import FROM_WEIGHTS
from bt_hub.common.runs import check_run_dir
from bt_hub.data.decode import Decoding, nvimgcodec
from bt_hub.data.decode_auto import decode_choice
from bt_hub.data.precision import precision_choice
from bt_hub.method.model import ARCHITECTURES
from bt_hub.method.transforms import IMAGENET_MEAN, IMAGENET_STD

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


@dataclass(frozen=True)
class Settings:
    """What an evaluation resolved before any data was drawn, and where each came from (a flag, the weights'
    metadata or config.json, their keys, or the default); every record of the run stores it."""

    arch: str
    small_image_stem: bool
    image_size: int
    image_size_from: str
    precision: str
    decode: str
    device: str
    arch_from: str = "default"
    small_image_stem_from: str = "default"
    normalisation: str = "ImageNet mean/std"
    normalisation_from: str = "default"
    weights_run: str | None = None  # the id of the pretraining run the weights came from, where they say it
    precision_from: str = "default"  # --precision, or why auto chose it (on a CPU: both measured times)
    decode_from: str = "default"  # --decode, or why auto chose it (the decoders' measured rates)
    decode_share: float = 0.0  # the fraction of the device's JPEGs that the loader workers decode (auto on CUDA)
    # auto on JPEGs: each timed decoder's pixels against PIL's (max and mean levels), a decoder over the tolerance
    # never taken
    decode_agreement: Mapping[str, Mapping[str, float]] | None = None
    decoding: Decoding = Decoding()  # who decodes, handed to the loaders; recorded as its decoder and decoded_on

    def as_dict(self) -> dict[str, Any]:
        """The settings as a JSON-ready dict (``decoding`` as the ``decoder`` that ran and where: ``decoded_on``)."""
        found = {k: v for k, v in dataclasses.asdict(self).items() if k != "decoding"}
        return {**found, **self.decoding.described()}


@dataclass(frozen=True)
class LoadedWeights:
    """Weights read once: the network, the sha256 of the bytes read, and what the loader recognised."""

    source: str
    network: nn.Module
    sha256: str
    info: Mapping[str, Any]

    @property
    def label(self) -> str:
        """A short display name: the file or folder name, URL or Hub id (never the identity; that is ``sha256``)."""
        return Path(self.source).name or self.source if "://" not in self.source else self.source


def load_weights(
    source: str, *, arch: str | None = None, small_image_stem: bool | None = None, allow_non_finite: bool = False
) -> LoadedWeights:
    """Read ``source`` once into a backbone (``bt_hub.weights.load_backbone``, which the wing imports on first use:
    reading no weights loads no registry or downloader) with the hash of those bytes."""
    network = bt_hub.weights.load_backbone(
        source, arch=arch, small_image_stem=small_image_stem, allow_non_finite=allow_non_finite
    )
    info = dict(getattr(network, "weights_info", None) or {})
    return LoadedWeights(str(source), network, str(info["sha256"]), info)


def eval_image_size(
    given: int | None, trained: int | None, trained_from: str | None, weights: str, given_from: str = "--image-size"
) -> tuple[int, str]:
    """The crop side and its source: ``given`` from ``given_from`` (``--image-size``, or the ``--config`` file; warned
    if unlike the weights'), what the weights say of themselves (their metadata or config.json: ``trained`` from
    ``trained_from``), or the default."""
    if given is None:
        return (trained, str(trained_from)) if trained else (DEFAULT_IMAGE_SIZE, "default")
    if trained and given != trained:
        warnings.warn(
            f"--image-size {given} differs from the {trained} px the weights {weights} were pretrained at "
            f"(from {FROM_WEIGHTS.get(str(trained_from), trained_from)}); features at another size usually score "
            f"lower: leave --image-size out to use {trained}",
            EvalWarning,
            stacklevel=3,
        )
    return given, given_from


def _normalisation(info: Mapping[str, Any], weights: str) -> str:
    """Where the ImageNet mean/std every protocol normalises with came from; refuses weights trained with others."""
    mean, std = info.get("mean"), info.get("std")
    if mean is None and std is None:
        return "default"
    if tuple(mean or IMAGENET_MEAN) != IMAGENET_MEAN or tuple(std or IMAGENET_STD) != IMAGENET_STD:
        raise ValueError(
            f"weights {weights} were trained on inputs normalised with mean {list(mean or IMAGENET_MEAN)} and std "
            f"{list(std or IMAGENET_STD)} (their metadata), but bt_hub evaluates with ImageNet's "
            f"{list(IMAGENET_MEAN)} / {list(IMAGENET_STD)}, so the scores would be of another input"
        )
    return "weights metadata"


def decode_settings(config: Any, device: torch.device) -> dict[str, Any]:
    """The run's decode settings (``decode``, ``decode_from``, ``decode_share``, ``decode_agreement`` and who decodes,
    ``decoding``): ``--decode`` resolved on the main process (:func:`bt_hub.data.decode_auto.decode_choice`: ``auto``
    measures the decoders there) and shared with every rank."""
    chosen = broadcast_object(
        decode_choice(config.decode, device, config.data, config.num_workers) if is_main_process() else None
    )
    reason = chosen.reason if config.decode == "auto" else config.given_from("decode", chosen.reason)
    return {
        "decode": chosen.decode,
        "decode_from": reason,
        "decode_share": chosen.decoding.worker_share,
        "decode_agreement": chosen.agreement,
        "decoding": chosen.decoding,
    }


def resolve_settings(config: Any, weights: LoadedWeights, device: torch.device) -> Settings:
    """The run's :class:`Settings`: the config's flags where given, else what the weights say of themselves."""
    info = weights.info
    size, size_from = eval_image_size(
        config.image_size,
        info.get("image_size"),
        info.get("image_size_from"),
        weights.source,
        config.given_from("image_size", "--image-size"),
    )
    chosen = broadcast_object(precision_choice(config.precision, device) if is_main_process() else None)
    if config.precision != "auto":  # "--precision fp32": the setting given, by its flag or the --config file
        chosen["precision_reason"] = config.given_from("precision", chosen["precision_reason"])
    flags = {
        "architecture": config.given_from("arch", "--arch"),
        "small_image_stem": config.given_from("small_image_stem", "--small-image-stem"),
    }
    source = {key: flags[key] if info.get(f"{key}_from") == "given" else info.get(f"{key}_from") for key in flags}
    return Settings(
        arch=str(info.get("architecture") or config.arch),
        small_image_stem=bool(info.get("small_image_stem")),
        image_size=int(size),
        image_size_from=size_from,
        precision=chosen["precision"],
        precision_from=chosen["precision_reason"],
        **decode_settings(config, device),
        device=str(device),
        arch_from=str(source["architecture"] or "default"),
        small_image_stem_from=str(source["small_image_stem"] or "default"),
        normalisation_from=_normalisation(info, weights.source),
        weights_run=info.get("run_id"),
    )


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
