"""Write backbone weights as torchvision ``.pth``, safetensors, detectron2 ``.pkl`` or a Hugging Face folder."""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import re
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from bt_hub.common.config import REQUIRED, option
from bt_hub.common.files import (
    atomic_write,
    atomic_write_json,
    atomic_write_text,
    write_safetensors,
)
from bt_hub.common.optional import require
from bt_hub.common.records import display_path
from bt_hub.common.runs import owned_by_bt_hub, package_version
from bt_hub.method.model import ARCHITECTURES
from bt_hub.method.transforms import IMAGENET_MEAN, IMAGENET_STD, input_metadata
from bt_hub.weights.card import card_rows, model_card, timm_fields
from bt_hub.weights.formats import PKL_INPUT_KEY, infer_architecture, projector_spec, torchvision_to_detectron2_key
from bt_hub.weights.load import load_backbone, read_projector_state_dict

__all__ = [
    "ExportConfig",
    "HF_FOLDER_FILES",
    "export",
    "save_detectron2",
    "save_hf_folder",
    "save_safetensors",
    "save_torchvision",
    "to_detectron2",
]

HF_FOLDER_FILES = ("model.safetensors", "projector.safetensors", "config.json", "README.md")
FILE_SUFFIXES = {"safetensors": ".safetensors", "detectron2": ".pkl"}  # the single-file formats and their --out ends


def _backbone_only(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in state.items() if not k.startswith("fc.")}


def _standard_stem_only(state: Mapping[str, torch.Tensor], target: str, library: str) -> None:
    """Refuse weights whose ``conv1`` is not torchvision's 7x7 for a ``target`` that ``library`` loads."""
    conv1 = state.get("conv1.weight")
    if conv1 is not None and tuple(conv1.shape[-2:]) != (7, 7):
        kernel = "x".join(str(n) for n in conv1.shape[-2:])
        raise ValueError(
            f"{target} cannot carry bt_hub's small-image stem ({kernel} conv1, no max-pool): {library} builds a 7x7 "
            "conv1 and a max-pool, so the file would not load there; export these weights as safetensors or a "
            "Hugging Face folder (--format safetensors / --format hf), which carry the small stem"
        )


# --------------------------------------------------------------------------- single files


def to_detectron2(state_dict: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The detectron2 pickle payload (docs/protocols.md §3) of a torchvision-named ResNet state dict."""
    _standard_stem_only(state_dict, "a detectron2 .pkl", "detectron2's ResNet")
    model = {torchvision_to_detectron2_key(k): v.numpy() for k, v in _backbone_only(state_dict).items()}
    return {"model": model, "__author__": "bt_hub", "matching_heuristics": True}


def save_detectron2(
    state_dict: Mapping[str, torch.Tensor], path: str | os.PathLike, metadata: Mapping[str, str] | None = None
) -> Path:
    """Write ``to_detectron2(state_dict)`` as a ``.pkl`` that detectron2's ``MODEL.WEIGHTS`` loads, with
    ``metadata`` (``input_metadata``) under a key of its own, which detectron2's checkpointer ignores."""
    payload = to_detectron2(state_dict)
    if metadata:
        payload[PKL_INPUT_KEY] = dict(metadata)
    return atomic_write(path, lambda f: pickle.dump(payload, f, protocol=pickle.HIGHEST_PROTOCOL))


def save_safetensors(
    state_dict: Mapping[str, torch.Tensor], path: str | os.PathLike, metadata: Mapping[str, str] | None = None
) -> Path:
    """Write the weights (no ``fc``) as safetensors, marked ``written_by: bt_hub`` in the metadata."""
    return write_safetensors(_backbone_only(state_dict), path, metadata)


def _torchvision_bytes(state_dict: Mapping[str, torch.Tensor], path: str | os.PathLike) -> tuple[Path, bytes, str]:
    _standard_stem_only(state_dict, "a torchvision .pth", "torchvision's resnet")
    buffer = io.BytesIO()
    torch.save(_backbone_only(state_dict), buffer)
    data = buffer.getvalue()
    sha = hashlib.sha256(data).hexdigest()
    path = Path(path)
    # torch's own names end in .pt as often as .pth: m.pt is m-<hash>.pth, not m.pt-<hash>.pth
    stem = re.sub(r"-[a-f0-9]{8,}$", "", path.stem if path.suffix in (".pth", ".pt") else path.name)
    return path.with_name(f"{stem}-{sha[:8]}.pth"), data, sha


def save_torchvision(state_dict: Mapping[str, torch.Tensor], path: str | os.PathLike) -> tuple[Path, str]:
    """Write a torchvision ``.pth`` (no ``fc``) named ``<stem>-<8 hex of its sha256>.pth``; the path and sha256."""
    target, data, sha = _torchvision_bytes(state_dict, path)
    atomic_write(target, lambda f: f.write(data))
    return target, sha


# --------------------------------------------------------------------------- Hugging Face folder


def check_hf_target(folder: Path, *, force: bool) -> None:
    """Refuse a folder that is not empty (unless ``force``) or that holds a file of ours bt_hub did not write."""
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"--out {folder} is a file; a Hugging Face export needs a folder")
    if not folder.is_dir() or not any(folder.iterdir()):
        return
    if not force:
        raise FileExistsError(
            f"folder {folder} is not empty; pass --force to replace the files bt_hub wrote there (other files are kept)"
        )
    foreign = [name for name in HF_FOLDER_FILES if (folder / name).exists() and not owned_by_bt_hub(folder / name)]
    if foreign:
        raise FileExistsError(
            f"{folder / foreign[0]} was not written by bt_hub, so even --force does not replace it; "
            "move it away or export to another folder"
        )


def save_hf_folder(
    backbone_state: Mapping[str, torch.Tensor],
    folder: str | os.PathLike,
    *,
    projector: Mapping[str, torch.Tensor] | None = None,
    config: Mapping[str, Any] | None = None,
    results: Iterable[str | os.PathLike | Mapping[str, Any]] = (),
    other_results: Iterable[str | os.PathLike | Mapping[str, Any]] = (),
    name: str | None = None,
    license: str = "apache-2.0",
    force: bool = True,
    sha256: str | None = None,
    provenance: str | None = None,
) -> Path:
    """Write model.safetensors, [projector.safetensors], config.json and README.md into ``folder``.

    The arguments are ``save_pretrained``'s, and ``sha256`` and ``provenance`` of the weights file (None: unknown).
    """
    folder = Path(folder)
    check_hf_target(folder, force=force)
    rows = card_rows(results, other_results, sha256)
    state = _backbone_only(backbone_state)
    arch, small = infer_architecture(state, str(folder))
    ours = {
        **{k: v for k, v in (config or {}).items() if k not in ("backbone", "projector")},
        "architecture": arch,
        "small_image_stem": small,
        "feature_dim": ARCHITECTURES[arch].feature_dim,
        "format": "torchvision",
        "bt_hub_version": package_version(),
        "provenance": provenance,
    }
    if projector:
        ours["projector"] = projector_spec(projector)
    if "dataset" in ours:  # the folder is published: a local data path by its name, as the card shows it
        ours["dataset"] = display_path(ours["dataset"])
    ours.update(timm_fields(ours))
    size = ours.get("image_size")
    meta = input_metadata(
        architecture=arch,
        small_image_stem=small,
        image_size=size if isinstance(size, int) and not isinstance(size, bool) else None,
        run_id=ours.get("run_id") if isinstance(ours.get("run_id"), str) else None,
    )
    save_safetensors(state, folder / "model.safetensors", {"format": "pt", **meta})
    if projector:
        save_safetensors(projector, folder / "projector.safetensors", {"format": "pt"})
    elif (folder / "projector.safetensors").exists():
        os.unlink(folder / "projector.safetensors")  # bt_hub's own, from an earlier export (check_hf_target)
    atomic_write_json(folder / "config.json", ours)
    atomic_write_text(folder / "README.md", model_card(ours, rows, name=name, license=license))
    return folder


# --------------------------------------------------------------------------- bt-hub export


@dataclass(kw_only=True)
class CardResults:
    """The evaluation records a model card shows, of these weights and of others (``bt-hub export --format hf``,
    ``bt-hub push``), each refused unless it is a file."""

    results: list[str] = option(
        [],
        "evaluation results of these weights for the model card (records of other weights are refused; eval "
        "compare's baselines are shown as baselines): results.json or results.jsonl",
    )
    other_results: list[str] = option(
        [], "results of other weights, shown in the model card as theirs, never as this model's"
    )

    def __post_init__(self) -> None:
        for flag, paths in (("--results", self.results), ("--other-results", self.other_results)):
            for path in paths:
                if not Path(path).is_file():
                    raise ValueError(f"{flag} file {path} does not exist")


@dataclass
class ExportConfig(CardResults):
    """Flags of ``bt-hub export``; ``--results`` and ``--other-results`` with ``--format hf`` only."""

    weights: str = option(
        REQUIRED,
        "weights to convert: a registered name, file, folder (run directory, Hugging Face folder), URL, "
        "hf://org/name[@rev] or org/name",
    )
    out: str = option(
        REQUIRED, "output: a file (torchvision: '<name>.pth' gets '-<sha256 prefix>' appended), or a folder for hf"
    )
    format: Literal["torchvision", "safetensors", "detectron2", "hf"] = option(
        "torchvision", "torchvision .pth, safetensors, detectron2 .pkl, or a Hugging Face folder"
    )
    arch: str | None = option(
        None, "architecture; by default from config.json or the keys", choices=tuple(ARCHITECTURES)
    )
    name: str | None = option(None, "hf only: the model's Hub id for the card, e.g. org/barlowtwins-r50")
    force: bool = option(
        False, "replace an existing target (in an hf folder only the files bt_hub wrote; others are kept)"
    )
    allow_non_finite: bool = option(False, "convert weights holding NaN or inf (for forensics; refused otherwise)")

    def __post_init__(self) -> None:
        if not self.weights:
            raise ValueError("--weights must name weights to convert")
        if not self.out:
            raise ValueError("--out must name a file or folder")
        suffix = FILE_SUFFIXES.get(self.format)
        if suffix and not self.out.endswith(suffix):
            raise ValueError(f"--out for --format {self.format} must end in {suffix}, got {self.out!r}")
        named = next((f for f, end in FILE_SUFFIXES.items() if end == Path(self.out).suffix), "torchvision")
        if self.format == "torchvision" != named:
            raise ValueError(f"--out {self.out} is a {named} name but --format is torchvision; pass --format {named}")
        if self.format == "torchvision" and (Path(self.out).is_dir() or self.out.endswith(("/", os.sep))):
            raise ValueError(  # its name would have made <folder>-<sha256[:8]>.pth beside the folder, outside it
                f"--out {self.out} is a folder; --format torchvision writes one file: name it (model.pth becomes "
                "model-<sha256[:8]>.pth), e.g. --out " + str(Path(self.out) / "model.pth")
            )
        if self.format != "hf" and (self.name or self.results or self.other_results):
            raise ValueError(f"--name, --results and --other-results apply to --format hf only, not {self.format}")
        if self.name is not None:
            check_repo_id("--name", self.name)
        super().__post_init__()


def check_repo_id(flag: str, repo_id: str) -> None:
    """Refuse, in one sentence naming ``flag``, a Hub id that is not ``org/name``."""
    if repo_id.count("/") != 1:
        raise ValueError(f"{flag} must be 'org/name', got {repo_id!r}")
    utils = require("huggingface_hub.utils", f"checking {flag}")
    try:
        utils.validate_repo_id(repo_id)
    except utils.HFValidationError as err:
        raise ValueError(
            f"{flag} {repo_id!r} is not a name the Hub accepts (letters, digits, '-', '_' and '.', "
            "no '--' or '..', neither end '-' or '.', at most 96 characters)"
        ) from err


def _refuse_existing(path: Path, force: bool) -> None:
    if path.is_dir():
        raise FileExistsError(
            f"--out {path} is a folder; only --format hf writes folders, the other formats write a file"
        )
    if path.exists() and not force:
        raise FileExistsError(f"{path} already exists; pass --force to replace it")


def trained_config(info: Mapping[str, Any]) -> dict[str, Any]:
    """The config.json of loaded weights (``weights_info``) with what their own metadata adds (image size, run id),
    so that an export of a kept step or of a file moved out of its run folder keeps them."""
    config = dict(info.get("config") or {})
    for key in ("image_size", "run_id"):
        if info.get(key) is not None and key not in config:
            config[key] = info[key]
    return config


def _input_metadata(info: Mapping[str, Any]) -> dict[str, str]:
    """``input_metadata`` of loaded weights: ImageNet's normalisation where bt_hub knows how they were trained."""
    known = info.get("image_size") is not None or info.get("weights") is not None
    return input_metadata(
        architecture=info["architecture"],
        small_image_stem=info["small_image_stem"],
        image_size=info.get("image_size"),
        mean=info.get("mean") or (IMAGENET_MEAN if known else None),
        std=info.get("std") or (IMAGENET_STD if known else None),
        run_id=info.get("run_id"),
    )


def export(config: ExportConfig) -> Path:
    """Convert ``config.weights`` to ``config.format`` at ``config.out``; return the file or folder written."""
    backbone = load_backbone(config.weights, arch=config.arch, allow_non_finite=config.allow_non_finite)
    state = backbone.state_dict()
    info = backbone.weights_info
    out = Path(config.out)
    if config.format == "torchvision":
        target, data, _ = _torchvision_bytes(state, out)
        _refuse_existing(target, config.force)
        atomic_write(target, lambda f: f.write(data))
        if info.get("image_size") not in (None, 224):  # what evaluation falls back to for a file that says nothing
            warnings.warn(
                f"{target} carries no image size (a torchvision .pth is a plain state dict) and these weights were "
                f"pretrained at {info['image_size']} px: evaluate it with --image-size {info['image_size']}, or "
                "export --format safetensors, which carries it",
                stacklevel=2,
            )
        return target
    if config.format == "hf":
        projector = read_projector_state_dict(config.weights, allow_non_finite=config.allow_non_finite)
        return save_hf_folder(
            state,
            out,
            projector=projector,
            config=trained_config(info),
            results=config.results,
            other_results=config.other_results,
            name=config.name,
            force=config.force,
            sha256=info["sha256"],
            provenance=info["provenance"],
        )
    _refuse_existing(out, config.force)
    if config.format == "safetensors":
        return save_safetensors(state, out, {**_input_metadata(info), "source_format": info["format"]})
    return save_detectron2(state, out, _input_metadata(info))
