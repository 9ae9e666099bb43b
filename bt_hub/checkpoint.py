"""Load a ResNet backbone from any checkpoint; write torchvision, safetensors and detectron2 files.

``load_backbone(source)`` takes a local file, a URL (downloaded into torch.hub's cache),
``hf://org/name[@revision]``, a run directory written by ``bt-hub pretrain`` or a Hugging
Face folder, recognises the key layout (bt_hub/formats.py) and loads the weights strictly
into ``bt_hub.model.build_backbone``: a missing key or a wrong shape is an error, never a
partial load. ``bt-hub export`` writes the same weights in another format.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Optional
from urllib.parse import urlparse

import torch
from torch import nn

from bt_hub.formats import CheckpointError, check_fits, extract_backbone, extract_projector, infer_architecture, read_file
from bt_hub.formats import torchvision_to_detectron2_key
from bt_hub.model import build_backbone
from bt_hub.runs import atomic_write

__all__ = [
    "CheckpointError", "ExportConfig", "export", "load_backbone", "read_backbone_state_dict", "resolve_source",
    "save_detectron2", "save_safetensors", "save_torchvision", "to_detectron2", "weights_fingerprint",
]

# Files a directory may hold, in the order they are preferred.
_DIRECTORY_FILES = ("model.safetensors", "backbone.safetensors")
_HASH_REGEX = re.compile(r"-([a-f0-9]*)\.")


# --------------------------------------------------------------------------- sources

def cached_download(url: str, *, file_name: str | None = None, progress: bool = True) -> Path:
    """Download ``url`` into torch.hub's cache (``<hub dir>/checkpoints``) once, as ``load_state_dict_from_url`` does.

    The hash prefix in the file name (``name-<sha256 prefix>.ext``, torch.hub's convention)
    is checked; a cached file is reused without any network access.
    """
    cache = Path(torch.hub.get_dir()) / "checkpoints"
    cache.mkdir(parents=True, exist_ok=True)
    name = file_name or os.path.basename(urlparse(url).path)
    if not name:
        raise ValueError(f"URL {url} names no file; pass file_name")
    cached = cache / name
    if not cached.exists():
        match = _HASH_REGEX.search(name)
        try:
            torch.hub.download_url_to_file(url, str(cached), match.group(1) if match else None, progress=progress)
        except RuntimeError as err:
            raise RuntimeError(f"download of {url} was refused: {err}") from err
    return cached


def hf_download(spec: str, filename: str, *, required: bool = True) -> Path | None:
    """``filename`` of the Hub repo ``org/name[@revision]``, through huggingface_hub's cache.

    Honours ``HF_ENDPOINT``, ``HF_HOME`` and ``HF_HUB_OFFLINE=1`` (then only the cache is read).
    Returns None for a missing optional file.
    """
    from bt_hub.optional import require

    hf = require("huggingface_hub", "loading weights from the Hugging Face Hub")
    repo_id, _, revision = spec.partition("@")
    try:
        return Path(hf.hf_hub_download(repo_id, filename, revision=revision or None))
    except hf.errors.EntryNotFoundError:
        if required:
            raise
        return None


def resolve_source(source: str | os.PathLike, *, progress: bool = True) -> tuple[Path, dict[str, Any] | None]:
    """The local weights file for ``source`` and the ``config.json`` beside it (or None).

    Args:
        source: a local file, an ``http(s)://`` URL, ``hf://org/name[@revision]``, a run
            directory (``backbone.safetensors`` + ``config.json``) or a Hugging Face folder.
        progress: show a progress bar while downloading.
    """
    text = os.fspath(source)
    if text.startswith("hf://"):
        hf_download(text[len("hf://"):], "config.json", required=False)
        return resolve_source(hf_download(text[len("hf://"):], "model.safetensors").parent, progress=progress)
    if text.startswith(("http://", "https://")):
        return cached_download(text, progress=progress), None
    path = Path(text).expanduser()
    if path.is_dir():
        config = _read_config(path / "config.json")
        for name in _DIRECTORY_FILES:
            if (path / name).is_file():
                return path / name, config
        arch = (config or {}).get("architecture")
        for name in ([f"{arch}.pth"] if arch else []) + ["checkpoint.pth"]:
            if (path / name).is_file():
                return path / name, config
        raise CheckpointError(
            f"directory {path} holds none of {list(_DIRECTORY_FILES)}, <architecture>.pth or checkpoint.pth"
        )
    if not path.exists():
        raise CheckpointError(f"weights file {path} does not exist")
    sibling = path.parent / "config.json"
    return path, _read_config(sibling) if path.suffix == ".safetensors" else None


def _read_config(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"config file {path} is not valid JSON ({err})") from err
    if not isinstance(config, dict):
        raise CheckpointError(f"config file {path} holds {type(config).__name__}; expected a JSON object")
    return config


# --------------------------------------------------------------------------- reading

def read_backbone_state_dict(source: str | os.PathLike, *, progress: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The backbone weights of ``source`` in torchvision names (no ``fc``), and what was recognised.

    Returns:
        ``(state_dict, info)``; ``info`` holds ``file``, ``format``, ``prefix``, ``dropped``
        (keys of the file that are not backbone weights) and ``config`` (config.json or None).
    """
    path, config = resolve_source(source, progress=progress)
    state, info = extract_backbone(read_file(path), str(path))
    info.update(file=str(path), config=config)
    return state, info


def weights_fingerprint(source: str | os.PathLike) -> str:
    """The sha256 (hex) of the weights file behind ``source`` (recorded in results.json)."""
    path, _ = resolve_source(source)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _architecture(state: Mapping[str, torch.Tensor], info: Mapping[str, Any], arch: str | None, small: bool | None) -> tuple[str, bool]:
    config = info.get("config") or {}
    inferred_arch, inferred_small = None, None
    try:
        inferred_arch, inferred_small = infer_architecture(state, info["file"])
    except CheckpointError:
        if arch is None and "architecture" not in config:
            raise
    arch = arch or config.get("architecture") or inferred_arch
    if small is None:
        small = bool(config["small_image_stem"]) if "small_image_stem" in config else bool(inferred_small)
    return arch, small


def load_backbone(
    source: str | os.PathLike,
    *,
    arch: str | None = None,
    small_image_stem: bool | None = None,
    map_location: str | torch.device = "cpu",
    progress: bool = True,
) -> nn.Module:
    """A ``build_backbone`` ResNet (``fc = Identity``) with the weights of ``source`` loaded strictly.

    Args:
        source: a local file, URL, ``hf://org/name[@revision]``, run directory or Hugging Face folder.
        arch: resnet18/34/50/101; by default from config.json, else inferred from the keys.
        small_image_stem: 3x3 stem; by default from config.json, else from conv1's shape.
        map_location: device of the returned network.
        progress: show a progress bar while downloading.

    Returns:
        The network in train mode, with ``weights_info``: file, format, prefix, dropped keys,
        config.json (or None), architecture and small_image_stem.

    Raises:
        CheckpointError: unreadable file, unknown layout, missing keys or wrong shapes (one sentence naming the file).
    """
    state, info = read_backbone_state_dict(source, progress=progress)
    arch, small = _architecture(state, info, arch, small_image_stem)
    with torch.device("meta"):  # no random initialisation: every tensor comes from the file
        model = build_backbone(arch, small_image_stem=small)
    expected = model.state_dict()
    check_fits(state, expected, arch, info["file"])
    state = {k: state[k].to(v.dtype) if k in state else torch.zeros((), dtype=v.dtype) for k, v in expected.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.weights_info = {**info, "architecture": arch, "small_image_stem": small}
    return model.to(map_location)


def read_projector_state_dict(source: str | os.PathLike, *, progress: bool = True) -> dict[str, torch.Tensor]:
    """The projector weights of ``source`` (``Sequential`` keys ``0.weight`` ...), or ``{}`` when it has none.

    Beside a ``.safetensors`` backbone, ``projector.safetensors`` (Hugging Face folder) and
    ``checkpoint.pth`` (run directory) are looked at too.
    """
    text = os.fspath(source)
    if text.startswith("hf://"):
        hf_download(text[len("hf://"):], "projector.safetensors", required=False)
    path, _ = resolve_source(source, progress=progress)
    candidates = [path]
    if path.suffix == ".safetensors":
        candidates += [path.parent / "projector.safetensors", path.parent / "checkpoint.pth"]
    for candidate in candidates:
        if candidate.is_file():
            obj = read_file(candidate)
            projector = extract_projector({"projector": obj} if candidate.name == "projector.safetensors" else obj)
            if projector:
                return projector
    return {}


# --------------------------------------------------------------------------- writing

def _backbone_only(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in state.items() if not k.startswith("fc.")}


def to_detectron2(state_dict: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The detectron2 pickle payload of PROTOCOLS.md §3 for a torchvision-named ResNet state dict."""
    model = {torchvision_to_detectron2_key(k): v.numpy() for k, v in _backbone_only(state_dict).items()}
    return {"model": model, "__author__": "bt_hub", "matching_heuristics": True}


def save_detectron2(state_dict: Mapping[str, torch.Tensor], path: str | os.PathLike) -> Path:
    """Write ``to_detectron2(state_dict)`` as a ``.pkl`` that detectron2's ``MODEL.WEIGHTS`` loads."""
    import pickle

    payload = to_detectron2(state_dict)
    return atomic_write(path, lambda f: pickle.dump(payload, f, protocol=pickle.HIGHEST_PROTOCOL))


def save_safetensors(state_dict: Mapping[str, torch.Tensor], path: str | os.PathLike, metadata: Mapping[str, str] | None = None) -> Path:
    """Write the backbone weights (no ``fc``) as safetensors."""
    from safetensors.torch import save

    data = _sorted_metadata(save(_backbone_only(state_dict), metadata=dict(metadata) if metadata else None))
    return atomic_write(path, lambda f: f.write(data))


def _sorted_metadata(data: bytes) -> bytes:
    """safetensors bytes with the ``__metadata__`` keys sorted.

    safetensors serialises metadata from a hash map in random order, so the same weights
    would hash differently from one save to the next; the header keeps its length.
    """
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    metadata = header.pop("__metadata__", None)
    ordered = {"__metadata__": dict(sorted(metadata.items())), **header} if metadata else header
    text = json.dumps(ordered, separators=(",", ":")).encode("utf-8")
    return data[:8] + text.ljust(size, b" ") + data[8 + size :]


def save_torchvision(state_dict: Mapping[str, torch.Tensor], path: str | os.PathLike) -> tuple[Path, str]:
    """Write a torchvision ``.pth`` named ``<stem>-<first 8 hex of its sha256>.pth`` (torch.hub's convention).

    Returns:
        ``(path written, full sha256)``.
    """
    import io

    buffer = io.BytesIO()
    torch.save(_backbone_only(state_dict), buffer)
    data = buffer.getvalue()
    sha = hashlib.sha256(data).hexdigest()
    path = Path(path)
    stem = re.sub(r"-[a-f0-9]{8,}$", "", path.stem if path.suffix == ".pth" else path.name)
    target = path.with_name(f"{stem}-{sha[:8]}.pth")
    atomic_write(target, lambda f: f.write(data))
    return target, sha


@dataclass
class ExportConfig:
    """Flags of ``bt-hub export``."""

    weights: str = field(metadata={"help": "weights to convert: file, URL, hf://org/name[@rev], run directory or Hugging Face folder"})
    out: str = field(metadata={"help": "output: a file (torchvision: '<name>.pth' gets '-<sha256 prefix>' appended), or a folder for hf"})
    format: Literal["torchvision", "safetensors", "detectron2", "hf"] = field(
        default="torchvision", metadata={"help": "torchvision .pth, safetensors, detectron2 .pkl, or a Hugging Face folder"}
    )
    arch: Optional[str] = field(default=None, metadata={"help": "resnet18/34/50/101; by default from config.json or the keys"})

    def __post_init__(self) -> None:
        if not self.weights:
            raise ValueError("--weights must name weights to convert")
        if not self.out:
            raise ValueError("--out must name a file or folder")
        suffix = {"safetensors": ".safetensors", "detectron2": ".pkl"}.get(self.format)
        if suffix and not self.out.endswith(suffix):
            raise ValueError(f"--out for --format {self.format} must end in {suffix}, got {self.out!r}")


def export(config: ExportConfig) -> Path:
    """Convert ``config.weights`` to ``config.format`` at ``config.out``; print what was written (and the hash)."""
    backbone = load_backbone(config.weights, arch=config.arch)
    state = backbone.state_dict()
    info = backbone.weights_info
    if config.format == "torchvision":
        path, sha = save_torchvision(state, config.out)
        print(f"wrote {path} (sha256 {sha})")
        return path
    if config.format == "safetensors":
        meta = {"architecture": info["architecture"], "small_image_stem": str(info["small_image_stem"]), "source_format": info["format"]}
        path = save_safetensors(state, config.out, meta)
    elif config.format == "detectron2":
        path = save_detectron2(state, config.out)
    else:
        from bt_hub.hub import save_pretrained

        path = save_pretrained(backbone, config.out, config=info.get("config"))
    print(f"wrote {path}")
    return path
