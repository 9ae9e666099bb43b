"""``resolve(source)``: the one way every entry point turns a weights argument into a local file."""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from bt_hub.common.artifacts import whose
from bt_hub.common.files import CheckpointError, file_sha256
from bt_hub.common.runs import lock_holder, run_kind
from bt_hub.method.model import ARCHITECTURES
from bt_hub.train.run_folder import kept_weights
from bt_hub.weights.download import DownloadError, at_commit, check_cached, download_unchecked, hf_download
from bt_hub.weights.registry import BarlowTwinsWeights, Weights, find_weights, list_weights

WeightsSource = BarlowTwinsWeights | str | os.PathLike

# Files a folder may hold, in the order they are preferred (then <architecture>.pth, checkpoint.pth).
FOLDER_FILES = ("model.safetensors", "backbone.safetensors")
WEIGHT_SUFFIXES = (".pth", ".pt", ".pkl", ".safetensors", ".torch", ".ckpt", ".bin", ".tar")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True)
class ResolvedWeights:
    """Where a weights argument led: the local ``path``, its ``config.json`` (or None), the registered ``record``
    and the ``url`` whose download cache holds it (or None).
    """

    source: str
    path: Path
    config: dict[str, Any] | None
    record: Weights | None
    url: str | None = None

    def check(self, sha256: str) -> str:
        """``sha256``, of bytes read from ``path``, once the download cache has accepted it (see ``check_cached``)."""
        if self.url is None:
            return sha256
        return check_cached(self.path, self.url, self.record.sha256 if self.record else None, sha256)

    def fingerprint(self) -> str:
        """The sha256 (hex) of the weights file, hashed now (and checked when it is a download)."""
        return self.check(file_sha256(self.path))

    def provenance(self) -> str | None:
        """How the weights were trained, where bt_hub can tell (registry, pretraining run, config.json)."""
        if self.record is not None:
            return f"registered Barlow Twins weights {self.record.short_name}"
        if run_kind(self.path.parent) == "pretrain":
            return "a bt_hub Barlow Twins pretraining run"
        config = self.config or {}
        found = config.get("provenance") if "bt_hub_version" in config else None
        return found if isinstance(found, str) and found else None


def resolve(source: WeightsSource, *, progress: bool = True, projector: bool = False) -> ResolvedWeights:
    """The local weights file behind ``source``, fetched and verified first when remote."""
    if isinstance(source, BarlowTwinsWeights):
        return _from_record(source, progress)
    text = os.fspath(source)
    if text.startswith("hf://"):
        return _from_hub(text, text[len("hf://") :], projector)
    if text.startswith(("http://", "https://")):
        return ResolvedWeights(text, download_unchecked(text, progress=progress)[0], None, None, text)
    path = Path(text).expanduser()
    if path.exists():
        return _from_path(path, text)
    member = find_weights(text)
    if member is not None:
        return _from_record(member, progress)
    if looks_like_path(text):
        where = "" if str(path.absolute()) == text else f" ({path.absolute()})"
        raise CheckpointError(f"weights {text}: no such file or folder{where}")
    if _HUB_ID.fullmatch(text.partition("@")[0]):
        return _from_hub(text, text, projector, bare=True)
    raise CheckpointError(
        f"weights {text!r} name no file or folder, URL, Hub repo (org/name) or registered weights; "
        f"registered names: {', '.join(list_weights())}"
    )


def looks_like_path(text: str) -> bool:
    """Whether ``text`` can only be meant as a path (never a registered name or an ``org/name`` Hub id)."""
    repo = text.partition("@")[0]
    return (
        text.startswith(("/", "./", "../", "~", ".\\"))
        or "\\" in text
        or text.endswith("/")
        or repo.count("/") > 1
        or text.lower().endswith(WEIGHT_SUFFIXES)
    )


def _from_record(member: BarlowTwinsWeights, progress: bool) -> ResolvedWeights:
    record = member.value
    path = download_unchecked(record.url, file_name=record.file_name, sha256=record.sha256, progress=progress)[0]
    return ResolvedWeights(record.short_name, path, None, record, record.url)


def _from_hub(text: str, spec: str, projector: bool, *, bare: bool = False) -> ResolvedWeights:
    try:
        weights = cast(Path, hf_download(spec, "model.safetensors"))
    except DownloadError as err:
        if bare:
            raise DownloadError(
                f"weights {text}: no such file or folder ({Path(text).absolute()}), and as a Hugging Face Hub id: {err}"
            ) from None
        raise
    same_commit = at_commit(spec, weights)
    hf_download(same_commit, "config.json", required=False)
    if projector:
        hf_download(same_commit, "projector.safetensors", required=False)
    return ResolvedWeights(text, weights, read_config(weights.parent / "config.json"), None)


def _from_path(path: Path, text: str) -> ResolvedWeights:
    if path.is_dir():
        config = read_config(path / "config.json")
        arch = (config or {}).get("architecture")
        for name in FOLDER_FILES + ((f"{arch}.pth",) if arch else ()) + ("checkpoint.pth",):
            if (path / name).is_file():
                return ResolvedWeights(text, path / name, config, None)
        raise CheckpointError(f"folder {path} holds none of {list(FOLDER_FILES)}, <architecture>.pth or checkpoint.pth")
    config = read_config(path.parent / "config.json") if path.suffix == ".safetensors" else None
    return ResolvedWeights(text, path, config, None)


def read_config(path: Path) -> dict[str, Any] | None:
    """A ``config.json`` as a dict, or None when there is none; its ``architecture`` must be one bt_hub builds."""
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"config file {path} is not valid JSON ({err})") from err
    if not isinstance(config, dict):
        raise CheckpointError(f"config file {path} holds {type(config).__name__}; expected a JSON object")
    arch = config.get("architecture", "resnet50")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise CheckpointError(
            f'config file {path} names architecture {arch!r} (key "architecture"); '
            f"expected one of {', '.join(ARCHITECTURES)}"
        )
    return config


def kept_steps(run_dir: str | os.PathLike) -> list[tuple[int, float, Path]]:
    """The weights a pretraining run kept for its learning curve (``bt-hub pretrain --keep-every``), each a source
    ``bt-hub eval`` reads: (step, training seconds until then, path), by step; [] where it kept none."""
    return kept_weights(Path(run_dir))


def live_run(run_dir: Path) -> str | None:
    """How far a pretraining run still going has got, for a curve of its kept weights so far (None when no live
    process holds its lock): ``still live (pid 4242 on host node7, started ...): 40 steps so far, 3 kept``."""
    holder = lock_holder(run_dir)
    if holder is None:
        return None
    steps = 0
    with contextlib.suppress(OSError):  # a line the run is appending may be cut short: it is left out
        for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8", errors="replace").splitlines():
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                steps = max(steps, int(json.loads(line).get("step", 0)))
    return f"still live ({whose(holder, command=False)}): {steps} steps so far, {len(kept_steps(run_dir))} kept"
