"""Hugging Face Hub: ``save_pretrained`` / ``from_pretrained`` / ``push_to_hub`` and the model card.

A folder holds ``model.safetensors`` (the backbone in torchvision names, no ``fc``),
``projector.safetensors`` when the projector is known, ``config.json`` (ours: architecture,
projector, recipe, dataset, epochs; timm's: ``architecture``, ``num_classes: 0``,
``pretrained_cfg``, so ``timm.create_model("hf-hub:org/name", pretrained=True, num_classes=0)``
loads it) and ``README.md``, a model card whose ``model-index`` comes from evaluation
``results.json`` files. Loading is strict (huggingface_hub's mixin defaults to
``strict=False``; this module does not use it).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Union

import torch
from torch import nn

from bt_hub.checkpoint import load_backbone, read_projector_state_dict, save_safetensors
from bt_hub.formats import infer_architecture, projector_spec
from bt_hub.model import BarlowTwins
from bt_hub.optional import require
from bt_hub.results import card_table, data_label, read_records, task_label
from bt_hub.runs import atomic_write_json, atomic_write_text, package_version
from bt_hub.weights import IMAGENET_MEAN, IMAGENET_STD

FEATURE_DIMS = {"resnet18": 512, "resnet34": 512, "resnet50": 2048, "resnet101": 2048}
TAGS = ["barlow-twins", "self-supervised-learning", "image-feature-extraction", "pytorch", "timm", "bt_hub"]
# Protocol name (as eval/ writes it) -> Hugging Face task type.
_TASKS = {"detect": "object-detection", "detection": "object-detection", "voc07+12": "object-detection", "coco": "object-detection"}

ModelLike = Union[nn.Module, str, os.PathLike]


def _eval_results(rows: list[dict[str, Any]]) -> list[Any]:
    """The card's model-index entries: one per run and metric, named by what the run was (bt_hub.results)."""
    hf = require("huggingface_hub", "writing a model card")
    out = []
    for row in rows:
        protocol = str(row.get("protocol", "evaluation"))
        dataset_name = data_label(row) or "unknown"
        task_type = _TASKS.get(protocol.split("-")[0], "image-classification")
        for metric, value in (row.get("metrics") or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out.append(hf.EvalResult(
                    task_type=task_type, task_name=task_label(row), dataset_type=dataset_name, dataset_name=dataset_name,
                    metric_type=metric, metric_name=metric, metric_value=round(float(value), 1),
                ))
    return out


def model_card(config: Mapping[str, Any], results: list[dict[str, Any]], *, name: str, license: str = "apache-2.0") -> str:
    """The README.md of a Hugging Face folder: YAML metadata, usage, recipe and results."""
    hf = require("huggingface_hub", "writing a model card")
    dataset = config.get("dataset")
    data = hf.ModelCardData(
        library_name="bt_hub", license=license, tags=[t for t in TAGS if t != "timm" or "pretrained_cfg" in config], pipeline_tag="image-feature-extraction",
        datasets=[str(dataset)] if dataset else None, model_name=name,
        eval_results=_eval_results(results) or None,
    )
    arch = config.get("architecture", "resnet50")
    recipe = {k: config[k] for k in ("dataset", "epochs", "projector", "lambd", "image_size") if k in config}
    recipe.update(config.get("recipe") or {})
    recipe_rows = "\n".join(f"| {k} | {v} |" for k, v in recipe.items()) or "| (not recorded) | |"
    timm_usage = (
        f'```python\nimport timm                                           # the same weights as a timm feature extractor\n'
        f'model = timm.create_model("hf-hub:{name}", pretrained=True, num_classes=0)\n```\n'
        if "pretrained_cfg" in config else ""
    )
    return f"""---
{data.to_yaml()}
---

# {name}

A {arch} backbone pretrained with Barlow Twins (Zbontar, Jing, Misra, LeCun, Deny: *Barlow Twins:
Self-Supervised Learning via Redundancy Reduction*, ICML 2021, https://arxiv.org/abs/2103.03230).
torchvision parameter names, `fc = Identity`: the output is a {config.get('feature_dim', 2048)}-d feature vector, not class scores.
Preprocess as for ImageNet evaluation: resize 256, centre crop 224, mean {list(IMAGENET_MEAN)}, std {list(IMAGENET_STD)}.

## Usage

```python
from bt_hub.hub import from_pretrained
backbone = from_pretrained("{name}").eval()          # strict load; works offline from the cache
features = backbone(images)                           # (N, {config.get('feature_dim', 2048)})
```

{timm_usage}
```python
from bt_hub.checkpoint import load_backbone           # the same, by its hf:// address (also in torch.hub's resnet50)
backbone = load_backbone("hf://{name}")
```

## Training

| setting | value |
|---|---|
{recipe_rows}

## Evaluation

{card_table(results)}
"""


def _timm_fields(arch: str, feature_dim: int) -> dict[str, Any]:
    """The fields timm reads from config.json (its ResNets use torchvision's parameter names)."""
    return {
        "num_classes": 0,
        "num_features": feature_dim,
        "pretrained_cfg": {
            "tag": "barlowtwins", "input_size": [3, 224, 224], "interpolation": "bilinear", "crop_pct": 0.875,
            "crop_mode": "center", "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD), "num_classes": 0,
            "pool_size": [7, 7], "first_conv": "conv1", "classifier": "fc",
        },
    }


def save_pretrained(
    model_or_backbone: ModelLike,
    save_directory: Union[str, os.PathLike],
    *,
    config: Optional[Mapping[str, Any]] = None,
    results: Iterable[Union[str, os.PathLike, Mapping[str, Any]]] = (),
    name: Optional[str] = None,
    license: str = "apache-2.0",
) -> Path:
    """Write a Hugging Face folder: model.safetensors, [projector.safetensors], config.json, README.md.

    Args:
        model_or_backbone: a ``BarlowTwins`` model, a ResNet backbone, or any source ``load_backbone`` reads.
        save_directory: the folder (created).
        config: training facts for config.json and the card (e.g. a run's config.json); merged under ours.
        results: evaluation ``results.json`` paths or dicts, for the card's model-index.
        name: the model's name in the card (``org/name``); by default the folder name.
        license: the card's license.

    Returns:
        The folder.
    """
    folder = Path(save_directory)
    projector: dict[str, torch.Tensor] = {}
    if isinstance(model_or_backbone, BarlowTwins):
        backbone, projector = model_or_backbone.backbone, model_or_backbone.projector.state_dict()
        config = {**model_or_backbone.config, **(config or {})}
    elif isinstance(model_or_backbone, nn.Module):
        backbone = model_or_backbone
    else:
        backbone = load_backbone(model_or_backbone)
        projector = read_projector_state_dict(model_or_backbone)
        config = {**(backbone.weights_info.get("config") or {}), **(config or {})}
    state = {k: v for k, v in backbone.state_dict().items() if not k.startswith("fc.")}
    arch, small = infer_architecture(state, str(folder))
    feature_dim = FEATURE_DIMS[arch]
    ours = {**dict(config or {}), "architecture": arch, "small_image_stem": small, "feature_dim": feature_dim,
            "format": "torchvision", "bt_hub_version": package_version()}
    ours.pop("backbone", None)
    if projector:
        ours["projector"] = projector_spec(projector)
    if not small:
        ours.update(_timm_fields(arch, feature_dim))
    save_safetensors(state, folder / "model.safetensors", {"format": "pt", "architecture": arch})
    if projector:
        save_safetensors(projector, folder / "projector.safetensors", {"format": "pt"})
    atomic_write_json(folder / "config.json", ours)
    atomic_write_text(folder / "README.md", model_card(ours, read_records(results), name=name or folder.resolve().name, license=license))
    return folder


def from_pretrained(repo_id_or_dir: Union[str, os.PathLike], revision: Optional[str] = None, *, map_location: str = "cpu") -> nn.Module:
    """The backbone of a Hugging Face repo or folder, loaded strictly (``fc = Identity``).

    Args:
        repo_id_or_dir: ``org/name`` on the Hub (cached; ``HF_HUB_OFFLINE=1`` reads the cache only) or a local folder.
        revision: branch, tag or commit of the Hub repo.
        map_location: device of the returned network.
    """
    path = Path(os.fspath(repo_id_or_dir)).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hub repos, but {path} is a local folder")
        return load_backbone(path, map_location=map_location)
    spec = os.fspath(repo_id_or_dir).removeprefix("hf://")
    return load_backbone(f"hf://{spec}@{revision}" if revision else f"hf://{spec}", map_location=map_location)


def push_to_hub(
    model_or_backbone: ModelLike,
    repo_id: str,
    *,
    private: Optional[bool] = None,
    token: Optional[str] = None,
    revision: Optional[str] = None,
    commit_message: str = "Upload Barlow Twins weights with bt_hub",
    config: Optional[Mapping[str, Any]] = None,
    results: Iterable[Union[str, os.PathLike, Mapping[str, Any]]] = (),
    license: str = "apache-2.0",
    endpoint: Optional[str] = None,
) -> Any:
    """Create ``repo_id`` if needed and upload the ``save_pretrained`` folder as one commit.

    Returns:
        huggingface_hub's ``CommitInfo``.
    """
    hf = require("huggingface_hub", "pushing to the Hugging Face Hub")
    api = hf.HfApi(endpoint=endpoint, token=token)
    with tempfile.TemporaryDirectory(prefix="bt_hub_push_") as tmp:
        folder = save_pretrained(model_or_backbone, Path(tmp) / repo_id.split("/")[-1], config=config, results=results, name=repo_id, license=license)
        api.create_repo(repo_id, private=private, exist_ok=True)
        return api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=commit_message, revision=revision)


@dataclass
class PushConfig:
    """Flags of ``bt-hub push``."""

    weights: str = field(metadata={"help": "weights to publish: run directory, file, URL or Hugging Face folder"})
    repo_id: str = field(metadata={"help": "Hub repository, 'org/name' (created if missing)"})
    private: bool = field(default=False, metadata={"help": "create the repository as private"})
    token: Optional[str] = field(default=None, metadata={"help": "Hub token (default: HF_TOKEN or the cached login)"})
    revision: Optional[str] = field(default=None, metadata={"help": "branch to commit to (default: main)"})
    results: list[str] = field(default_factory=list, metadata={"help": "evaluation results for the model card: results.json of bt-hub eval or eval all, or a results.jsonl"})
    license: str = field(default="apache-2.0", metadata={"help": "license in the model card"})
    commit_message: str = field(default="Upload Barlow Twins weights with bt_hub", metadata={"help": "commit message"})

    def __post_init__(self) -> None:
        if self.repo_id.count("/") != 1 or not all(self.repo_id.split("/")):
            raise ValueError(f"--repo-id must be 'org/name', got {self.repo_id!r}")
        for path in self.results:
            if not Path(path).is_file():
                raise ValueError(f"--results file {path} does not exist")


def push(config: PushConfig) -> Any:
    """``bt-hub push``: upload the weights with config.json and a model card; print the commit URL."""
    info = push_to_hub(config.weights, config.repo_id, private=config.private, token=config.token, revision=config.revision,
                       commit_message=config.commit_message, results=config.results, license=config.license)
    print(f"pushed {config.weights} to {getattr(info, 'commit_url', config.repo_id)}")
    return info
