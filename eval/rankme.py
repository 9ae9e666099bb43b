"""RankMe of frozen features (``bt-hub eval rankme``): how many dimensions a checkpoint's embeddings use, read without
a label (Garrido, Balestriero, Najman, LeCun, ICML 2023; the formula and how it is computed:
bt_hub/method/rankme.py, which the pretraining monitor calls too).

The backbone's features are scored, and the projector's output too where the weights carry a projector (a
pretraining run, its checkpoint.pth, a Hugging Face folder with projector.safetensors), on at most ``--max-images``
images of one split: all of them where the split holds no more, else a draw seeded by ``--seed``, whose indices'
sha256 the record keeps. A folder of images without class folders is read as one class (no label is used).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
from torch import nn

from bt_hub.common.config import option
from bt_hub.common.distributed import is_main_process
from bt_hub.data.datasets import dataset_fingerprint
from bt_hub.eval.config import EvalConfig
from bt_hub.eval.features import module_fingerprint
from bt_hub.eval.report import Table
from bt_hub.eval.runner import Cell, EvalRun, Scored
from bt_hub.eval.splits import indices_sha256, take
from bt_hub.method.rankme import EPSILON, MAX_IMAGES, rankme
from bt_hub.weights.load import load_projector

TABLE = Table(
    "RankMe (label-free effective rank; Garrido et al., ICML 2023)",
    ("rankme", "rankme_projector"),
    task="image-feature-extraction",
)


@dataclass
class RankmeConfig(EvalConfig):
    """``bt-hub eval rankme``: RankMe of the frozen backbone's features (and of the projector's output where the
    weights carry one) on at most ``--max-images`` images of one split; no label is read."""

    RUN_FIELDS: ClassVar[tuple[str, ...]] = EvalConfig.RUN_FIELDS + ("batch_size",)
    SCORED: ClassVar[bool] = False  # no label: one class, or a folder of images without class folders, will do

    split: Literal["train", "test"] = option(
        "train",
        "the split scored: train, or test (the held-out folder --test-split names, or the part --holdout draws)",
    )
    max_images: int = option(
        MAX_IMAGES,
        "images scored at most (the paper's 25,600): a split holding more is scored on a draw of this many, "
        "seeded by --seed (the indices' sha256 goes into results.json), and only those are extracted",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_positive("max_images")

    @property
    def splits(self) -> list[str]:
        """The splits the run reads (``EvalRun.splits``): the training split, and the held-out one for ``--split
        test``."""
        return ["train"] if self.split == "train" else ["train", "test"]

    def unused_flags(self) -> dict[str, str]:
        """``--test-split`` when the training split is scored."""
        unused = super().unused_flags()
        if self.split == "train":
            unused["test_split"] = "names the held-out folder, and --split train scores the training split"
        return unused


def drawn_rows(size: int, max_images: int, seed: int) -> list[int]:
    """The rows of a split of ``size`` images that are scored, in order: all of them up to ``max_images``, else a
    draw of ``max_images`` seeded by ``seed``."""
    if size <= max_images:
        return list(range(size))
    return sorted(np.random.default_rng(seed).choice(size, max_images, replace=False).tolist())


def _scored(outputs: Mapping[str, Any], rows: Sequence[int], size: int, split: str, seed: int) -> Scored:
    """RankMe of each output's features (``rankme``: the backbone's; ``rankme_<output>``) and what the record says:
    N, D and the largest possible value min(N, D) of each, epsilon, the split and the drawn subset."""
    metrics, described = {}, {}
    for output, features in outputs.items():
        metric = "rankme" if output == "backbone" else f"rankme_{output}"
        n, d = features.shape
        metrics[metric] = rankme(features)
        described[metric] = {"output": output, "n": n, "d": d, "max_value": min(n, d)}
    notes = {
        "split": split,
        "epsilon": EPSILON,
        "outputs": described,
        "subset": {"count": len(rows), "of": size, "seed": seed, "indices_sha256": indices_sha256(rows)},
    }
    return Scored(metrics, mode="features", notes=notes, table=TABLE)


def score(run: EvalRun) -> Scored:
    """``bt-hub eval rankme``'s step: what :func:`score_cell` scores, on the drawn images alone (a split of more than
    ``--max-images`` has only those extracted), and the projector's output too where the weights carry one."""
    config = run.config
    dataset = getattr(run.splits, config.split)
    rows = drawn_rows(len(dataset), config.max_images, config.seed)
    drawn: dict[str, Any] = {}
    if len(rows) < len(dataset):
        subset = take(dataset, rows)
        drawn = {"dataset": subset, "dataset_id": dataset_fingerprint(subset)}
    extract = lambda **network: run.features(config.split, **network, **drawn)[0]  # noqa: E731
    outputs = {"backbone": extract()}
    projector = load_projector(run.weights.source, run.network, allow_non_finite=config.allow_non_finite)
    if projector is not None:
        outputs["projector"] = extract(
            network=nn.Sequential(run.network, projector),
            weights_id=f"{run.weights.sha256} projector {module_fingerprint(projector)}",
            label=f"{config.split} projector",
        )
    if not is_main_process():
        return Scored({})
    return _scored(outputs, rows, len(dataset), config.split, config.seed)


def score_cell(cell: Cell, config: RankmeConfig, seed: int) -> Scored:
    """RankMe of the backbone's features of ``config.split`` (``cell``'s: an EvalRun, or a row of ``eval compare``)
    on its rows drawn with ``seed`` (all of them up to ``--max-images``); no label is read."""
    features, _ = cell.features(config.split)
    rows = drawn_rows(len(features), config.max_images, seed)
    if not is_main_process():
        return Scored({})
    drawn = features if len(rows) == len(features) else features[rows]
    return _scored({"backbone": drawn}, rows, len(features), config.split, seed)
