"""Label subsets for semi-supervised evaluation (docs/protocols.md §2): a SimCLR-format list file
(``1percent.txt``, whose published hashes are pinned here) or a seeded class-balanced subset; sorted indices.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bt_hub.common.files import file_sha256
from bt_hub.common.presets import first_few

# The lists google-research/simclr publishes under imagenet_subsets/ (Apache 2.0).
PUBLISHED_SUBSETS: dict[str, str] = {
    "1percent.txt": "71e82a48ba78252683ae334c4d019ebd5c6e855b9599c1389fbe83eb9549cf17",
    "10percent.txt": "6d09de11e7bdaf5b1f3b1f249b6183695f97310cdd20f0c03e7235b6b9392091",
}
PUBLISHED_URL = "https://raw.githubusercontent.com/google-research/simclr/master/imagenet_subsets/{name}"
SHOWN_MISSING = 5


@dataclass(frozen=True)
class SubsetList:
    """A label-subset list read from a file: its ``names`` in order, ``sha256``, and which ``published`` list it is."""

    path: Path
    names: tuple[str, ...]
    sha256: str
    published: str | None

    @property
    def classes(self) -> list[str]:
        """The sorted distinct classes (text before the first ``_`` of each name)."""
        return sorted({class_of(n) for n in self.names})


def class_of(name: str) -> str:
    """The class of a SimCLR-list file name: the text before the first ``_``."""
    base = os.path.basename(name)
    if "_" not in base:
        raise ValueError(
            f"subset file name {name!r} has no '_'; expected '<class>_<id>.<ext>' as in n04235860_14959.JPEG"
        )
    return base.split("_", 1)[0]


def read_subset_file(path: str | os.PathLike) -> SubsetList:
    """Read a SimCLR-format subset list; warn when a published list's name has another hash."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"subset file {path} does not exist; expected a SimCLR-format list such as 1percent.txt "
            f"({PUBLISHED_URL.format(name='1percent.txt')})"
        )
    sha = file_sha256(path)
    try:
        names = tuple(line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    except UnicodeDecodeError as err:
        raise ValueError(
            f"subset file {path} is not UTF-8 text (byte {err.start}); expected a file name a line"
        ) from None
    if not names:
        raise ValueError(f"subset file {path} is empty; expected one training file name per line")
    for n in names:
        class_of(n)
    published = next((name for name, digest in PUBLISHED_SUBSETS.items() if digest == sha), None)
    if published is None and path.name in PUBLISHED_SUBSETS:
        warnings.warn(
            f"subset file {path} has sha256 {sha}, not the published {path.name}'s {PUBLISHED_SUBSETS[path.name]}; "
            "results will not be comparable with the paper's",
            stacklevel=2,
        )
    return SubsetList(path=path, names=names, sha256=sha, published=published)


def dataset_file_names(dataset: object) -> list[str]:
    """The base file name of every sample of an ImageFolder-like dataset (``.samples``)."""
    samples = getattr(dataset, "samples", None)
    if samples is None:
        raise ValueError(
            "a subset file needs a dataset of image files (ImageFolder / ImageNet layout), "
            f"got {type(dataset).__name__}; use --fraction for a seeded class-balanced subset instead"
        )
    return [os.path.basename(str(s[0])) for s in samples]


def indices_from_list(dataset: object, subset: SubsetList) -> list[int]:
    """Indices of the samples a subset list names, by base file name (ValueError when some are missing)."""
    names = dataset_file_names(dataset)
    position = {name: i for i, name in enumerate(names)}
    repeated = {n for n, c in Counter(names).items() if c > 1} if len(position) < len(names) else set()
    if twice := sorted({os.path.basename(n) for n in subset.names} & repeated):
        raise ValueError(
            f"subset file {subset.path} names {twice[0]}, found in several class folders; rename them apart"
        )
    missing = [n for n in subset.names if os.path.basename(n) not in position]
    if missing:
        raise ValueError(
            f"subset file {subset.path} names {len(missing)} of its {len(subset.names)} files "
            f"that are not in the dataset: {first_few(missing, SHOWN_MISSING)}"
        )
    return sorted({position[os.path.basename(n)] for n in subset.names})


def balanced_subset_indices(
    targets: Sequence[int], percent: float, seed: int = 0, *, leave_one: bool = False
) -> list[int]:
    """A seeded class-balanced subset: ``percent`` % of each class, at least one (``leave_one``: never all of it)."""
    if not 0 < percent <= 100:
        raise ValueError(f"--fraction must be a percentage in (0, 100], got {percent}")
    targets = np.asarray(targets)
    rng = np.random.default_rng(seed)
    chosen: list[int] = []
    for c in np.unique(targets):
        members = np.flatnonzero(targets == c)
        k = max(1, int(round(len(members) * percent / 100)))
        if leave_one:
            k = min(k, len(members) - 1)
        chosen.extend(rng.choice(members, size=k, replace=False).tolist())
    if not leave_one and len(chosen) > 2 * percent / 100 * len(targets):  # one a class at least: far more labels
        warnings.warn(f"{percent}% labels {len(chosen)} of {len(targets)} images (one a class at least)", stacklevel=2)
    return sorted(chosen)


def subset_indices(
    dataset: object, *, percent: float | None = None, subset_file: str | os.PathLike | None = None, seed: int = 0
) -> list[int]:
    """The labelled training indices: from ``subset_file`` when given, else class-balanced ``percent``."""
    if subset_file is not None:
        return indices_from_list(dataset, read_subset_file(subset_file))
    if percent is None:
        raise ValueError("a label subset needs --fraction or --subset-file")
    return balanced_subset_indices(dataset.targets, percent, seed)
