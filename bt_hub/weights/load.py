"""Load a ResNet backbone (and the projector) from anything ``resolve`` accepts, strictly and safely:
a missing key, a wrong shape or a NaN/inf tensor is an error naming the file, never a partial load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from bt_hub.common.files import CheckpointError, read_file_and_sha256
from bt_hub.method.model import build_backbone, build_projector
from bt_hub.method.transforms import transforms_for
from bt_hub.weights.formats import (
    check_finite,
    check_fits,
    extract_projector,
    infer_architecture,
    projector_spec,
    read_backbone,
)
from bt_hub.weights.registry import get_weights
from bt_hub.weights.sources import WeightsSource, resolve

__all__ = ["load_backbone", "read_backbone_state_dict", "read_projector_state_dict", "weights_fingerprint"]


def read_backbone_state_dict(
    source: WeightsSource, *, progress: bool = True, allow_non_finite: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The backbone weights of ``source`` in torchvision names (no ``fc``), and ``info`` on what was recognised."""
    resolved = resolve(source, progress=progress)
    state, info = read_backbone(resolved.path, allow_non_finite=allow_non_finite)
    info.update(
        sha256=resolved.check(info["sha256"]),
        config=resolved.config,
        weights=resolved.record.short_name if resolved.record else None,
        provenance=resolved.provenance(),
    )
    return state, info


def weights_fingerprint(source: WeightsSource) -> str:
    """The sha256 (hex) of the weights file behind ``source`` (recorded in results.json)."""
    return resolve(source, progress=False).fingerprint()


def _input_settings(
    state: Mapping[str, torch.Tensor], info: Mapping[str, Any], arch: str | None, small: bool | None
) -> dict[str, Any]:
    """Architecture, stem and image side of the weights, each with where it came from (``<name>_from``): the caller
    (``given``), the file's own metadata, the config.json beside it, the keys (not for the image side), or None;
    and the normalisation and run the file's metadata names."""
    meta, config = info.get("metadata") or {}, info.get("config") or {}
    inferred_arch, inferred_small = None, None
    try:
        inferred_arch, inferred_small = infer_architecture(state, info["file"])
    except CheckpointError:
        if arch is None and "architecture" not in meta and "architecture" not in config:
            raise
    trained = config.get("image_size")
    if trained is not None and (isinstance(trained, bool) or not isinstance(trained, int) or trained <= 0):
        raise CheckpointError(
            f"config.json of weights {info['file']} has image_size {trained!r}; expected a positive integer"
        )
    found: dict[str, Any] = {}
    for key, given, inferred in (
        ("architecture", arch, inferred_arch),
        ("small_image_stem", small, inferred_small),
        ("image_size", None, None),
    ):
        choices = ((given, "given"), (meta.get(key), "weights metadata"), (config.get(key), "weights config.json"))
        value, where = next(((v, w) for v, w in choices if v is not None), (inferred, "weights keys"))
        found[key], found[f"{key}_from"] = value, where if value is not None else None
    found["small_image_stem"] = bool(found["small_image_stem"])
    return {**found, "mean": meta.get("mean"), "std": meta.get("std"), "run_id": meta.get("run_id")}


def load_backbone(
    source: WeightsSource,
    *,
    arch: str | None = None,
    small_image_stem: bool | None = None,
    map_location: str | torch.device = "cpu",
    progress: bool = True,
    allow_non_finite: bool = False,
) -> nn.Module:
    """A ``build_backbone`` ResNet (``fc = Identity``) with the weights of ``source`` loaded strictly.

    ``arch`` and ``small_image_stem`` default to what the file's own metadata says, then its config.json, else what
    the keys show. The network (in train mode) carries ``weights_info`` (with each setting's source, the image side
    and normalisation the weights were trained at, where known) and ``transforms`` (its evaluation preprocessing).

    Args:
        source: what ``bt_hub.weights.sources.resolve`` accepts: a registered weights member or its name, a
            file (torchvision ``.pth``, ``.safetensors``, a pretraining ``checkpoint.pth``, another framework's
            checkpoint, a detectron2 ``.pkl``) or a folder holding one (with its config.json), an http(s) URL
            (downloaded to the cache), or a Hugging Face repo as ``hf://org/name`` or ``org/name[@revision]``.
        arch: the architecture to build (a key of ``ARCHITECTURES``, e.g. ``"resnet50"``); None: config.json's,
            else the one the keys' shapes show. A value the weights do not fit raises.
        small_image_stem: build the 3x3 stride-1 stem without max-pool (32-px images); None: config.json's,
            else what the ``conv1`` weight's shape shows.
        map_location: device the returned network is moved to (the tensors are read on the CPU).
        progress: show a progress bar while a remote file downloads.
        allow_non_finite: accept NaN or inf values (refused by default: such weights score nothing).

    Raises:
        CheckpointError: unreadable file, unknown layout, missing keys, wrong shapes or non-finite values.
    """
    state, info = read_backbone_state_dict(source, progress=progress, allow_non_finite=allow_non_finite)
    settings = _input_settings(state, info, arch, small_image_stem)
    arch, small = settings["architecture"], settings["small_image_stem"]
    with torch.device("meta"):  # no random initialisation: every tensor comes from the file
        model = build_backbone(arch, small_image_stem=small)
    expected = model.state_dict()
    check_fits(state, expected, arch, info["file"])
    state = {k: state[k].to(v.dtype) if k in state else torch.zeros((), dtype=v.dtype) for k, v in expected.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.weights_info = {**info, **settings}
    model.transforms = get_weights(info["weights"]).transforms() if info["weights"] else transforms_for(settings)
    return model.to(map_location)


def read_projector_state_dict(
    source: WeightsSource, *, progress: bool = True, allow_non_finite: bool = False
) -> dict[str, torch.Tensor]:
    """The projector weights of ``source`` (``Sequential`` keys), or ``{}``; looks beside a backbone file too."""
    resolved = resolve(source, progress=progress, projector=True)
    path = resolved.path
    candidates = [path]
    if path.suffix == ".safetensors":
        candidates += [path.parent / "projector.safetensors", path.parent / "checkpoint.pth"]
    for candidate in candidates:
        if candidate.is_file():
            obj, sha256 = read_file_and_sha256(candidate)
            if candidate == path:
                resolved.check(sha256)  # a download must still be the file the cache verified
            projector = extract_projector({"projector": obj} if candidate.name == "projector.safetensors" else obj)
            if projector:
                check_finite(projector, str(candidate), allow=allow_non_finite)
                return projector
    return {}


def load_projector(
    source: WeightsSource, backbone: nn.Module, *, progress: bool = True, allow_non_finite: bool = False
) -> nn.Sequential | None:
    """The projector of ``source`` (:func:`read_projector_state_dict`) on ``backbone``'s features, loaded strictly;
    None where the weights carry none."""
    state = read_projector_state_dict(source, progress=progress, allow_non_finite=allow_non_finite)
    if not state:
        return None
    projector = build_projector(backbone.feature_dim, projector_spec(state))
    try:
        projector.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise CheckpointError(
            f"projector weights of {backbone.weights_info['file']} do not fit {projector_spec(state)}: "
            f"{str(err).splitlines()[0]}"
        ) from None
    return projector
