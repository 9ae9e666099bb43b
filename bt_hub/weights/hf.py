"""Hugging Face Hub: ``save_pretrained`` / ``from_pretrained`` (strict) / ``push_to_hub`` (docs/weights.md)."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from bt_hub.common.config import REQUIRED, option
from bt_hub.common.optional import require
from bt_hub.method.model import BarlowTwins
from bt_hub.weights.download import at_commit, first_line, hf_download, hub_client_errors
from bt_hub.weights.export import CardResults, check_repo_id, save_hf_folder, trained_config
from bt_hub.weights.load import load_backbone, read_projector_state_dict
from bt_hub.weights.sources import looks_like_path

__all__ = ["PushConfig", "PushError", "from_pretrained", "push", "push_to_hub", "save_pretrained"]


class PushError(OSError):
    """An upload to the Hugging Face Hub failed; the message names the endpoint, the repo and the fix."""


ModelLike = nn.Module | str | os.PathLike


def save_pretrained(
    model_or_backbone: ModelLike,
    save_directory: str | os.PathLike,
    *,
    config: Mapping[str, Any] | None = None,
    results: Iterable[str | os.PathLike | Mapping[str, Any]] = (),
    other_results: Iterable[str | os.PathLike | Mapping[str, Any]] = (),
    name: str | None = None,
    license: str = "apache-2.0",
    force: bool = True,
) -> Path:
    """Write a Hugging Face folder: model.safetensors, [projector.safetensors], config.json, README.md; return it.

    Weights given by name, path or URL keep their sha256 and provenance; a network in memory may have
    changed since it was loaded, so its card says the provenance is unknown and takes no results as its own.

    Args:
        model_or_backbone: a ``BarlowTwins`` model, a ResNet backbone, or any weights ``load_backbone`` reads.
        config: training facts for config.json and the card (e.g. a run's config.json).
        results: ``results.json`` paths or dicts of these weights; ``other_results``: of other weights.
        force: replace what bt_hub wrote in a non-empty folder (never files it did not write).
    """
    projector: dict[str, torch.Tensor] = {}
    info: dict[str, Any] = {}
    if isinstance(model_or_backbone, BarlowTwins):
        backbone, projector = model_or_backbone.backbone, model_or_backbone.projector.state_dict()
        config = {**model_or_backbone.config, **(config or {})}
    elif isinstance(model_or_backbone, nn.Module):
        backbone = model_or_backbone
    else:
        backbone = load_backbone(model_or_backbone)
        projector = read_projector_state_dict(model_or_backbone)
        info = backbone.weights_info
        config = {**trained_config(info), **(config or {})}
    return save_hf_folder(
        backbone.state_dict(),
        save_directory,
        projector=projector,
        config=config,
        results=results,
        other_results=other_results,
        name=name,
        license=license,
        force=force,
        sha256=info.get("sha256"),
        provenance=info.get("provenance"),
    )


def from_pretrained(
    repo_id_or_dir: str | os.PathLike,
    revision: str | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    force_download: bool = False,
    local_files_only: bool = False,
    token: str | bool | None = None,
    map_location: str = "cpu",
    allow_non_finite: bool = False,
) -> nn.Module:
    """The backbone of a Hugging Face repo or folder, loaded strictly (``fc = Identity``, with ``transforms``).

    ``repo_id_or_dir`` is ``org/name`` (or ``hf://org/name[@revision]``), or anything ``load_backbone`` takes.
    The Hub options are ``PyTorchModelHubMixin.from_pretrained``'s, passed to ``hf_hub_download``
    (``revision`` is refused for a local folder).

    Raises:
        DownloadError: a Hub file that could not be fetched.
        CheckpointError: weights that do not load strictly.
    """
    text = os.fspath(repo_id_or_dir)
    repo_id, _, pinned = text.removeprefix("hf://").partition("@")
    local = Path(text).expanduser().exists() or looks_like_path(text)
    if local or not (text.startswith("hf://") or "/" in repo_id):  # a folder, file, URL or registered name
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hub repos (org/name), not to {text}")
        return load_backbone(text, map_location=map_location, allow_non_finite=allow_non_finite)
    if pinned and revision is not None and pinned != revision:
        raise ValueError(f"{text} pins revision {pinned!r}, which contradicts revision={revision!r}")
    spec = f"{repo_id}@{revision}" if revision else text.removeprefix("hf://")
    options = {
        "cache_dir": cache_dir,
        "force_download": force_download,
        "local_files_only": local_files_only,
        "token": token,
    }
    weights = cast(Path, hf_download(spec, "model.safetensors", **options))
    hf_download(at_commit(spec, weights), "config.json", **options)
    return load_backbone(weights.parent, map_location=map_location, allow_non_finite=allow_non_finite)


def push_to_hub(
    model_or_backbone: ModelLike,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | None = None,
    revision: str | None = None,
    commit_message: str = "Upload Barlow Twins weights with bt_hub",
    config: Mapping[str, Any] | None = None,
    results: Iterable[str | os.PathLike | Mapping[str, Any]] = (),
    other_results: Iterable[str | os.PathLike | Mapping[str, Any]] = (),
    license: str = "apache-2.0",
    endpoint: str | None = None,
) -> Any:
    """Create ``repo_id`` if needed and upload the ``save_pretrained`` folder as one commit."""
    hf = require("huggingface_hub", "pushing to the Hugging Face Hub")
    errors = require("huggingface_hub.errors", "pushing to the Hugging Face Hub")
    api = hf.HfApi(endpoint=endpoint, token=token)
    with tempfile.TemporaryDirectory(prefix="bt_hub_push_") as tmp:
        folder = save_pretrained(
            model_or_backbone,
            Path(tmp) / repo_id.split("/")[-1],
            config=config,
            results=results,
            other_results=other_results,
            name=repo_id,
            license=license,
        )
        try:
            api.create_repo(repo_id, private=private, exist_ok=True)
            return api.upload_folder(
                repo_id=repo_id, folder_path=folder, commit_message=commit_message, revision=revision
            )
        except hub_client_errors(errors) as err:
            raise _push_error(err, repo_id, api.endpoint, errors) from None


def _push_error(err: BaseException, repo_id: str, endpoint: str, errors: Any) -> PushError:
    """One sentence for a failed push: what the Hub said (or that it was not reached) and what to do."""
    first = first_line(err)
    status = getattr(getattr(err, "response", None), "status_code", None)
    if isinstance(err, errors.HfHubHTTPError) and status in (401, 403):
        fix = f"check the token (--token, HF_TOKEN or `hf auth login`) and that it may write to {repo_id}"
        return PushError(f"the Hub at {endpoint} refused to push {repo_id} ({first}); {fix}; nothing was uploaded")
    if isinstance(err, errors.HfHubHTTPError) and status is not None:
        return PushError(f"the Hub at {endpoint} refused to push {repo_id} ({first}); nothing was uploaded")
    return PushError(
        f"could not reach the Hugging Face Hub at {endpoint} to push {repo_id} ({first}); check the network "
        "connection, or HF_ENDPOINT if you use a mirror; nothing was uploaded"
    )


@dataclass
class PushConfig(CardResults):
    """Flags of ``bt-hub push``."""

    weights: str = option(
        REQUIRED,
        "weights to publish: a registered name, run directory, file, Hugging Face folder, URL, "
        "hf://org/name or org/name",
    )
    repo_id: str = option(REQUIRED, "Hub repository, 'org/name' (created if missing)")
    private: bool = option(False, "create the repository as private")
    token: str | None = option(None, "Hub token (default: HF_TOKEN or the cached login)")
    revision: str | None = option(None, "branch to commit to (default: main)")
    license: str = option("apache-2.0", "license in the model card")
    commit_message: str = option("Upload Barlow Twins weights with bt_hub", "commit message")

    def __post_init__(self) -> None:
        check_repo_id("--repo-id", self.repo_id)
        super().__post_init__()


def push(config: PushConfig) -> Any:
    """``bt-hub push``: upload the weights with config.json and a model card; return the Hub's commit info.

    The flags past ``--weights`` and ``--repo-id`` are ``push_to_hub``'s keyword arguments, by name.
    """
    options = dataclasses.asdict(config)
    return push_to_hub(options.pop("weights"), options.pop("repo_id"), **options)
