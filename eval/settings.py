"""What an evaluation resolves before any data is drawn: the weights read once (:func:`load_weights`) and the
settings every record of the run stores (:func:`resolve_settings`: architecture, stem, image size, normalisation,
precision, decode and device, each with where it came from)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import bt_hub.weights
from bt_hub.common.distributed import broadcast_object, is_main_process
from bt_hub.common.records import FROM_WEIGHTS
from bt_hub.data.decode import Decoding
from bt_hub.data.decode_auto import decode_choice
from bt_hub.data.precision import precision_choice
from bt_hub.eval.config import DEFAULT_IMAGE_SIZE, EvalWarning
from bt_hub.method.transforms import IMAGENET_MEAN, IMAGENET_STD


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
