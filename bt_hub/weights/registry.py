"""Named Barlow Twins weights, torchvision-style, and the paper's numbers and recipe that travel with them."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torchvision.models

from bt_hub.common.config import REQUIRED, option
from bt_hub.common.files import file_sha256
from bt_hub.method.transforms import transforms_for
from bt_hub.weights.download import (
    DownloadError,
    cache_path,
    check_cached,
    download,
    download_unchecked,
    expected_hash,
    recorded_sha256,
    sha256_record,
)
from bt_hub.weights.formats import read_backbone
from bt_hub.weights.paper import PAPER_RESULTS, RECIPE

_REFERENCE = "https://dl.fbaipublicfiles.com/barlowtwins"

_EVAL_224 = partial(transforms_for, None)  # Resize 256, CenterCrop 224, ImageNet normalisation; takes tensors


@dataclass(eq=False)  # torchvision's __eq__ (url, meta, transforms), which aliases and deep copies rely on
class Weights(torchvision.models.Weights):
    """One set of published weights: torchvision's record (``url``, ``transforms``, ``meta``) and bt_hub's fields.

    Attributes:
        short_name: the name commands accept (``--weights barlowtwins-in1k``).
        file_name: the file's name in the download cache (two releases are both called ``resnet50.pth``).
        sha256: the published hash, or None (then the first download's is recorded and checked).
        has_projector: the file carries the projector too (``barlow_twins`` can load it).
    """

    short_name: str
    file_name: str | None
    sha256: str | None
    architecture: str
    has_projector: bool


_FIELDS = ("short_name", "file_name", "sha256", "architecture", "has_projector")


def _reference_resnet50(short_name: str, path: str, file_name: str, has_projector: bool, docs: str) -> Weights:
    """A ResNet-50 release of the reference repository: no published hash, the paper's and the release's numbers."""
    return Weights(
        short_name=short_name,
        url=f"{_REFERENCE}/{path}",
        file_name=file_name,
        sha256=None,
        architecture="resnet50",
        has_projector=has_projector,
        transforms=_EVAL_224,
        meta={
            "paper": PAPER_RESULTS,
            "release": {"imagenet_linear": {"top1": 73.5, "top5": 91.0}},
            "recipe": RECIPE,
            "num_params": 23_508_032,
            "docs": docs,
        },
    )


class BarlowTwinsWeights(torchvision.models.WeightsEnum):
    """Published Barlow Twins weights; ``DEFAULT`` is the reference release torch.hub has always served."""

    IN1K_EP1000 = _reference_resnet50(
        "barlowtwins-in1k",
        "ep1000_bs2048_lrw0.2_lrb0.0048_lambd0.0051/resnet50.pth",
        "barlowtwins_ep1000_bs2048_resnet50.pth",
        False,
        "The reference release (facebookresearch/barlowtwins hubconf), backbone only, BN statistics included.",
    )
    IN1K_LJNG = _reference_resnet50(
        "barlowtwins-in1k-ljng",
        "ljng/resnet50.pth",
        "barlowtwins_ljng_resnet50.pth",
        False,
        "The newer reference release (README link), backbone only.",
    )
    IN1K_LJNG_FULL = _reference_resnet50(
        "barlowtwins-in1k-full",
        "ljng/checkpoint.pth",
        "barlowtwins_ljng_checkpoint.pth",
        True,
        "The reference full checkpoint: backbone, 8192-8192-8192 projector and optimiser state.",
    )
    DEFAULT = IN1K_EP1000

    @classmethod
    def verify(cls, obj: BarlowTwinsWeights | str | None) -> BarlowTwinsWeights | None:
        """The member ``obj`` names: a member, its short name, its member name or ``BarlowTwinsWeights.NAME``.

        Raises:
            TypeError: ``obj`` is a member of another weights enum.
            ValueError: an unknown name (the message lists the valid ones).
        """
        if obj is None or isinstance(obj, cls):
            return obj
        if isinstance(obj, enum.Enum):
            raise TypeError(f"weights {obj} belong to {type(obj).__name__}, expected {cls.__name__}")
        found = find_weights(str(obj))
        if found is None:
            raise ValueError(f"weights {str(obj)!r} are unknown; registered names: {', '.join(list_weights())}")
        return found

    def __getattr__(self, name: str) -> Any:
        """bt_hub's fields of the record (``short_name``, ``file_name``, ``sha256``, ...), as attributes."""
        if name in _FIELDS:
            return getattr(self.value, name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def cache_path(self) -> Path:
        """Where the download cache keeps the file (under ``$TORCH_HOME``)."""
        return cache_path(self.url, self.value.file_name, self.sha256)

    def get_state_dict(self, progress: bool = True, *, allow_non_finite: bool = False) -> dict[str, torch.Tensor]:
        """The backbone state dict (torchvision names, no ``fc``), downloaded and verified once."""
        path = download_unchecked(self.url, file_name=self.value.file_name, sha256=self.sha256, progress=progress)[0]
        state, info = read_backbone(path, allow_non_finite=allow_non_finite)
        check_cached(path, self.url, self.sha256, info["sha256"])  # the bytes just read: one read, one hash
        return state


def list_weights() -> list[str]:
    """The short names of the registered weights (``DEFAULT`` first)."""
    return [member.short_name for member in BarlowTwinsWeights]


def find_weights(name: str) -> BarlowTwinsWeights | None:
    """The member called ``name`` (short, member or dotted name), or None."""
    prefix, _, member_name = name.rpartition(".")
    if prefix in ("", BarlowTwinsWeights.__name__) and member_name in BarlowTwinsWeights.__members__:
        return BarlowTwinsWeights[member_name]
    return next((member for member in BarlowTwinsWeights if name == member.short_name), None)


def get_weights(name: str) -> BarlowTwinsWeights:
    """The member called ``name``; an unknown name is a ValueError listing the registered ones."""
    return BarlowTwinsWeights.verify(name)  # type: ignore[return-value]


@dataclass
class ListWeightsConfig:
    """Flags of ``bt-hub weights list`` (none)."""


def weights_table(config: ListWeightsConfig | None = None) -> str:
    """``bt-hub weights list``: name, architecture, cached?, sha256 (published or recorded), URL and cache path."""
    rows = [("name", "architecture", "cached", "sha256", "url", "cache path")]
    for member in BarlowTwinsWeights:
        path = member.cache_path()
        rows.append(
            (
                member.short_name,
                member.architecture,
                "yes" if path.is_file() else "no",
                _listed_sha256(member, path),
                member.url,
                str(path),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row[:5], widths)) + "  " + row[5] for row in rows
    )


@dataclass
class DownloadWeightsConfig:
    """Flags of ``bt-hub weights download``."""

    names: list[str] = option(
        REQUIRED,
        "registered weights to fetch into the verified download cache (bt-hub weights list), or http(s):// URLs",
        positional=True,
        nargs="+",
    )


def download_weights(config: DownloadWeightsConfig) -> str:
    """``bt-hub weights download``: each name's file fetched into the download cache (or found there), verified.

    A download is kept only whole, parsed and matching its expected sha256 (``bt_hub.weights.download``); a cached
    file is hashed again. One line per name: the cache path, the sha256 and what it was checked against.
    """
    lines = []
    for name in config.names:
        member = find_weights(name)
        if member is None and not name.startswith(("http://", "https://")):
            raise ValueError(
                f"weights {name!r} are unknown; expected a registered name ({', '.join(list_weights())}) or an "
                "http(s):// URL"
            )
        url, file_name, sha256 = (member.url, member.file_name, member.sha256) if member else (name, None, None)
        path = download(url, file_name=file_name, sha256=sha256)
        origin = (
            expected_hash(path.name, sha256)[1] or f"none is published: {sha256_record(path).name} holds the first one"
        )
        lines.append(f"{name}: {path} (sha256 {file_sha256(path)}; {origin})")
    return "\n".join(lines)


@dataclass
class VerifyWeightsConfig:
    """Flags of ``bt-hub weights verify``."""

    file: str = option(REQUIRED, "a weights file to identify by its sha256", positional=True, nargs=None)


def verify_weights(config: VerifyWeightsConfig) -> str:
    """``bt-hub weights verify``: which registered weights ``config.file`` is, by its sha256.

    Each entry's published sha256 counts, else the one recorded beside its cached copy when it was first
    downloaded on this machine (``bt-hub weights download NAME`` records it).

    Raises:
        ValueError: the file is missing, or its sha256 is none of those (the sentence says which entries had one).
    """
    path = Path(config.file).expanduser()
    if not path.is_file():
        raise ValueError(f"{config.file}: {'a folder' if path.is_dir() else 'no such file'}; expected a weights file")
    actual = file_sha256(path)
    known = []
    for member in BarlowTwinsWeights:
        cached = member.cache_path()
        recorded = recorded_sha256(cached) if not member.sha256 else None
        for sha256, origin in ((member.sha256, "its published sha256"), (recorded, f"recorded in {cached}.sha256")):
            if sha256 and actual == sha256.lower():
                return f"{config.file}: sha256 {actual} is {member.short_name} ({origin})"
            if sha256:
                known.append(member.short_name)
    parts = [f"it matches no sha256 of {', '.join(known)}"] if known else []
    missing = [name for name in list_weights() if name not in known]
    if missing:
        parts.append(
            f"{', '.join(missing)} have no sha256 to compare with (none is published, and none was recorded on this "
            "machine: bt-hub weights download NAME records one)"
        )
    raise ValueError(f"{config.file} (sha256 {actual}) is none of the registered weights: {'; '.join(parts)}")


def _listed_sha256(member: BarlowTwinsWeights, path: Path) -> str:
    """The sha256 column of ``weights_table``: published, recorded at first use, or "unverified"."""
    if member.sha256:
        return member.sha256[:16]
    try:
        recorded = recorded_sha256(path)
    except DownloadError:
        return "damaged-record"  # loading says which file and what to do
    return f"recorded:{recorded[:16]}" if recorded else "unverified"


__all__ = [
    "PAPER_RESULTS",
    "RECIPE",
    "BarlowTwinsWeights",
    "Weights",
    "DownloadWeightsConfig",
    "ListWeightsConfig",
    "VerifyWeightsConfig",
    "download_weights",
    "find_weights",
    "get_weights",
    "list_weights",
    "verify_weights",
    "weights_table",
]
