"""One frozen-backbone feature extractor shared by every protocol, with an on-disk cache.

``extract_features`` runs the backbone in eval mode without gradients (autocast on
CUDA) over a dataset in its own order and returns ``(features, labels)``. Pools:

- ``"avg"``: the backbone's output (global average pool of res5; 2048-d for ResNet-50).
- ``"voc_res5"``: VISSL's VOC07 feature: the res5 map (7x7 at 224 px) through
  ``AvgPool2d(6, stride=1)`` then flattened channel-major, 2x2x2048 = 8192-d. Other
  input sizes go through the same op, giving (H-5)x(W-5)xC features; the res5 map must
  be at least 6x6 (>= 161 px input with the standard stem).

Under torchrun each rank embeds its share of every global batch and the shares are
gathered back in dataset order, so every rank ends with the full, ordered features.

With a ``FeatureCache`` the features are streamed into ``<key>.features.npy`` (float32 or
float16) and returned as a read-only memmap; the key hashes everything that changes the
features: the weights fingerprint, the architecture they were loaded into, the dataset
fingerprint, the transform (so the image size), the pool, the dtype and the precision (CUDA
autocast or float32), so a second protocol that asks for the same features loads them
instead of running the model, and any other request computes its own. Either way,
``np.asarray(features[a:b], dtype=np.float32)`` reads rows ``a:b``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms

from bt_hub.common.distributed import (
    all_gather_cat,
    barrier,
    broadcast_object,
    get_rank,
    get_world_size,
    is_distributed,
    is_main_process,
)
from bt_hub.common.files import atomic_write, atomic_write_json, file_sha256
from bt_hub.common.progress import progress
from bt_hub.common.runs import claim_run_dir
from bt_hub.method.transforms import IMAGENET_MEAN, IMAGENET_STD, eval_transforms

if TYPE_CHECKING:
    from bt_hub.eval.config import EvalConfig

Pool = Literal["avg", "voc_res5"]


# ----------------------------------------------------------------------------- transforms


def train_transform(image_size: int = 224, crop_scale_min: float = 0.08, flip: bool = True) -> transforms.Compose:
    """The training transform of the linear and semi-supervised protocols: RandomResizedCrop + flip.

    The paper's crops cover 8% to 100% of the image and are flipped half the time; small
    images want larger crops (``crop_scale_min``) and digits or text no flips.
    """
    steps: list[Callable[[Any], Any]] = [transforms.RandomResizedCrop(image_size, scale=(crop_scale_min, 1.0))]
    if flip:
        steps.append(transforms.RandomHorizontalFlip())
    return transforms.Compose([*steps, transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)])


class TransformedDataset(Dataset):
    """``(transform(image), label)`` for every item of a dataset of ``(image, label)``."""

    def __init__(self, dataset: Dataset, transform: Callable[[Any], torch.Tensor]) -> None:
        self.dataset = dataset
        self.transform = transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, Any]:
        image, label = self.dataset[index][:2]
        return self.transform(image), label


# ----------------------------------------------------------------------------- fingerprints


def module_fingerprint(module: nn.Module) -> str:
    """sha256 of a module's state dict (names, shapes, dtypes and bytes), for in-memory weights."""
    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")  # reshape: 0-d counters
    return h.hexdigest()


CONTENT_SAMPLE = 32  # files of a directory whose bytes go into its fingerprint


def _sampled_content(paths: list[Path]) -> bytes:
    """sha256s of ``CONTENT_SAMPLE`` evenly spaced files: two folders with the same names and sizes still differ."""
    picks = sorted({int(i) for i in np.linspace(0, len(paths) - 1, min(len(paths), CONTENT_SAMPLE))}) if paths else []
    return "".join(file_sha256(paths[i]) for i in picks).encode()


def dataset_fingerprint(dataset_or_path: Dataset | str | os.PathLike) -> str:
    """A sha256 that changes when the images, their order or their labels change.

    Directories and file-backed datasets (a ``samples`` list of ``(path, label)``) hash
    the folder's name, relative paths, sizes and labels, and the bytes of 32 evenly spaced
    files, so fingerprinting ImageNet takes seconds, and a ``val/`` whose file names and
    sizes repeat ``train/``'s still gets its own fingerprint (and its own cached features).
    In-memory datasets (an ``images`` array) hash the array and labels; any other dataset
    hashes every item's pixels and label.
    """
    h = hashlib.sha256()
    if isinstance(dataset_or_path, (str, os.PathLike)):
        spec = str(dataset_or_path)
        root = Path(spec).expanduser()
        if not root.is_dir():
            h.update(spec.encode())
            return h.hexdigest()
        files = []
        for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
            dirnames.sort()
            for name in sorted(filenames):
                p = Path(dirpath) / name
                files.append(p)
                h.update(f"{p.relative_to(root).as_posix()}:{p.stat().st_size};".encode())
        h.update(_sampled_content(files))
        return h.hexdigest()
    dataset = dataset_or_path
    samples = getattr(dataset, "samples", None)
    images = getattr(dataset, "images", None)
    if samples is not None:
        root = Path(getattr(dataset, "root", "/"))
        h.update(f"{root.name}/;".encode())
        for path, label in samples:
            p = Path(path)
            rel = p.relative_to(root).as_posix() if p.is_relative_to(root) else p.as_posix()
            h.update(f"{rel}:{p.stat().st_size}:{label!r};".encode())
        h.update(_sampled_content([Path(s[0]) for s in samples]))
    elif isinstance(images, np.ndarray):
        h.update(f"{images.shape}:{images.dtype};".encode())
        h.update(np.ascontiguousarray(images).tobytes())
        h.update(repr(list(getattr(dataset, "targets", []))).encode())
    else:
        for i in range(len(dataset)):
            image, label = dataset[i][:2]
            h.update(np.asarray(image).tobytes())
            h.update(f":{label!r};".encode())
    return h.hexdigest()


# ----------------------------------------------------------------------------- cache


@dataclass(frozen=True)
class FeatureCache:
    """Where cached features live and what they were computed from.

    Args:
        directory: the cache directory (created on first write).
        weights: the weights fingerprint (``bt_hub.weights.weights_fingerprint`` or
            ``module_fingerprint``).
        dataset: the dataset fingerprint (``dataset_fingerprint``).
        model: what the weights were loaded into (``architecture_fingerprint``): the same
            file read as another architecture or stem gives other features.
    """

    directory: str | os.PathLike
    weights: str
    dataset: str
    model: str = ""

    def key(self, transform: str, pool: str, dtype: str, precision: str = "float32") -> str:
        """The file stem for features of these weights, model and data under a transform, pool, dtype and precision."""
        record = {
            "weights": self.weights,
            "model": self.model,
            "dataset": self.dataset,
            "transform": transform,
            "pool": pool,
            "dtype": dtype,
            "precision": precision,
        }
        return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:24]

    def paths(self, key: str) -> tuple[Path, Path, Path]:
        """(features .npy, labels .npy, meta .json) for a key; the meta file is written last."""
        d = Path(self.directory)
        return d / f"{key}.features.npy", d / f"{key}.labels.npy", d / f"{key}.meta.json"


# ----------------------------------------------------------------------------- extraction


def _res5_pool(backbone: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """VISSL's VOC07 res5 feature: res5 map -> AvgPool2d(6, stride 1) -> flatten (8192-d at 224 px)."""
    if not all(hasattr(backbone, n) for n in ("conv1", "bn1", "relu", "maxpool", "layer1", "layer4")):
        raise ValueError(
            f"pool 'voc_res5' needs a torchvision-style ResNet (conv1 ... layer4), got {type(backbone).__name__}"
        )
    x = backbone.maxpool(backbone.relu(backbone.bn1(backbone.conv1(x))))
    x = backbone.layer4(backbone.layer3(backbone.layer2(backbone.layer1(x))))
    if min(x.shape[-2:]) < 6:
        raise ValueError(
            f"pool 'voc_res5' needs a res5 map of at least 6x6, got {tuple(x.shape[-2:])}; "
            "use a larger --image-size (224 gives 7x7)"
        )
    return torch.flatten(nn.functional.avg_pool2d(x, kernel_size=6, stride=1), 1)


def _global_batches(n: int, batch_size: int, world_size: int, rank: int) -> list[list[int]]:
    """This rank's index lists: global step s covers [s*B*W, (s+1)*B*W), rank r the r-th B of it.

    Under several ranks every list has B entries (padded by repeating the last index) so
    the per-step gather has equal shapes; the padding is trimmed after the gather.
    """
    step = batch_size * world_size
    batches = []
    for start in range(0, n, step):
        lo = start + rank * batch_size
        idx = (
            [min(i, n - 1) for i in range(lo, lo + batch_size)]
            if world_size > 1
            else list(range(lo, min(lo + batch_size, n)))
        )
        batches.append(idx)
    return batches


def iter_feature_batches(
    backbone: nn.Module,
    dataset: Dataset,
    *,
    transform: Callable[[Any], torch.Tensor],
    pool: Pool = "avg",
    batch_size: int = 256,
    device: str | torch.device = "cpu",
    num_workers: int = 0,
    desc: str = "features",
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(features float32 [b, F], labels [b, ...])`` on CPU, consecutive chunks in dataset order.

    ``desc`` names the progress report (``features train``, ``features test``).
    """
    if pool not in ("avg", "voc_res5"):
        raise ValueError(f"pool {pool!r} is unknown; expected 'avg' or 'voc_res5'")
    device = torch.device(device)
    n, world = len(dataset), get_world_size()
    loader = DataLoader(
        TransformedDataset(dataset, transform),
        batch_sampler=_global_batches(n, batch_size, world, get_rank()),
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
    )
    was_training = backbone.training
    backbone.eval().to(device)
    done = 0
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=device.type == "cuda"):
            for images, labels in progress(loader, desc, unit="batch"):
                images = images.to(device, non_blocking=True)
                feats = _res5_pool(backbone, images) if pool == "voc_res5" else backbone(images)
                feats = torch.flatten(feats, 1).float()
                labels = torch.as_tensor(labels).to(device)
                if is_distributed():
                    feats, labels = all_gather_cat(feats), all_gather_cat(labels)
                take = min(len(feats), n - done)
                done += take
                yield feats[:take].cpu(), labels[:take].cpu()
    finally:
        backbone.train(was_training)


def describe_transform(transform: Callable[[Any], torch.Tensor]) -> str:
    """The transform's ``repr`` without memory addresses, so cache keys hold across processes."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(transform))


def _npy_header(shape: tuple[int, ...], dtype: np.dtype) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape}
    )
    return buf.getvalue()


def extract_features(
    backbone: nn.Module,
    dataset: Dataset,
    *,
    transform: Callable[[Any], torch.Tensor] | None = None,
    pool: Pool = "avg",
    batch_size: int = 256,
    device: str | torch.device = "cpu",
    num_workers: int = 0,
    cache: FeatureCache | None = None,
    dtype: Literal["float32", "float16"] = "float32",
    desc: str = "features",
) -> tuple[torch.Tensor | np.ndarray, torch.Tensor]:
    """Features of a frozen backbone over a dataset of ``(image, label)``, in dataset order.

    Args:
        backbone: the network (``fc = Identity``); put in eval mode for the pass, restored after.
        dataset: items ``(image, label)``; ``transform`` turns the image into a tensor.
        transform: default ``eval_transforms(224)``; ``describe_transform`` of it is part of the cache key.
        pool: ``"avg"`` (backbone output) or ``"voc_res5"`` (see the module docstring).
        batch_size: images per forward pass (per rank under torchrun).
        device: where the backbone runs; autocast is used on CUDA.
        num_workers: DataLoader workers.
        cache: where to store / find the features; None computes them in memory.
        dtype: dtype of the cached features (float16 halves the disk use).
        desc: the progress report's name, e.g. ``features train``.

    Returns:
        ``(features [N, F], labels [N, ...])``: a float32 tensor without a cache, a
        read-only numpy memmap with one; labels as a tensor.
    """
    if dtype not in ("float32", "float16"):
        raise ValueError(f"cache dtype {dtype!r} is unknown; expected 'float32' or 'float16'")
    transform = transform or eval_transforms(224)
    batches = lambda: iter_feature_batches(  # noqa: E731
        backbone,
        dataset,
        transform=transform,
        pool=pool,
        batch_size=batch_size,
        device=device,
        num_workers=num_workers,
        desc=desc,
    )
    if cache is None:
        chunks = list(batches())
        if not chunks:
            raise ValueError("cannot extract features from an empty dataset")
        return torch.cat([c[0] for c in chunks]), torch.cat([c[1] for c in chunks])
    description = describe_transform(transform)
    precision = (
        "autocast float16" if torch.device(device).type == "cuda" else "float32"
    )  # CUDA features differ in rounding
    key = str(broadcast_object(cache.key(description, pool, dtype, precision)))  # every rank reads rank 0's file
    features_path, labels_path, meta_path = cache.paths(key)
    if not broadcast_object(meta_path.exists()):
        if is_main_process():
            _write_cache(batches(), len(dataset), np.dtype(dtype), features_path, labels_path)
            atomic_write_json(
                meta_path,
                {
                    "key": key,
                    "weights": cache.weights,
                    "model": cache.model,
                    "dataset": cache.dataset,
                    "transform": description,
                    "pool": pool,
                    "dtype": dtype,
                    "precision": precision,
                    "num_samples": len(dataset),
                },
            )
        else:
            for _ in batches():  # the other ranks take part in every gather, then read rank 0's file
                pass
        barrier()
    return np.load(features_path, mmap_mode="r"), torch.from_numpy(np.load(labels_path))


def _write_cache(
    chunks: Iterator[tuple[torch.Tensor, torch.Tensor]], n: int, dtype: np.dtype, features_path: Path, labels_path: Path
) -> None:
    """Stream feature chunks into an .npy file (header first, rows in order), atomically."""
    try:
        first_features, first_labels = next(chunks)
    except StopIteration:
        raise ValueError("cannot extract features from an empty dataset") from None
    labels = [first_labels]

    def write(f: io.BufferedWriter) -> None:
        f.write(_npy_header((n, first_features.shape[1]), dtype))
        f.write(first_features.numpy().astype(dtype).tobytes())
        for feats, labs in chunks:
            f.write(feats.numpy().astype(dtype).tobytes())
            labels.append(labs)

    atomic_write(features_path, write)
    atomic_write(labels_path, lambda f: np.save(f, torch.cat(labels).numpy()))


def as_float32(features: torch.Tensor | np.ndarray, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Rows ``start:stop`` of a feature tensor or memmap as a float32 tensor."""
    if isinstance(features, torch.Tensor):
        return features[start:stop].float()
    return torch.from_numpy(np.array(features[start:stop], dtype=np.float32))


# ----------------------------------------------------------------------------- protocol helpers


def architecture_fingerprint(module: nn.Module) -> str:
    """sha256 of a network's structure (its ``repr``: layers, kernel sizes, widths), not its weights."""
    return hashlib.sha256(describe_transform(module).encode()).hexdigest()


def load_eval_backbone(config: EvalConfig) -> tuple[nn.Module, str]:
    """The backbone named by ``--weights`` (``bt_hub.weights.load_backbone``) and its fingerprint."""
    from bt_hub.weights import load_backbone, weights_fingerprint

    if is_main_process():  # every protocol starts here: claim --out before any work or write
        claim_run_dir(config.out, overwrite=config.overwrite)
    backbone = load_backbone(
        config.weights,
        arch=config.arch,
        small_image_stem=config.small_image_stem,
        allow_non_finite=config.allow_non_finite,
    )
    return backbone, weights_fingerprint(config.weights)


def features_for(
    config: EvalConfig,
    backbone: nn.Module,
    dataset: Dataset,
    *,
    weights_id: str,
    dataset_id: str,
    split: str,
    transform: Callable[[Any], torch.Tensor] | None = None,
    pool: Pool = "avg",
) -> tuple[torch.Tensor | np.ndarray, torch.Tensor]:
    """``extract_features`` with a protocol config's device, batch size, workers and cache settings.

    ``transform`` defaults to ``eval_transforms(config.image_size)``; the cache is used when
    ``config.cache_dir`` is set, keyed by ``weights_id``, the backbone's architecture,
    ``dataset_id``, the transform, the pool, the dtype and the precision; ``split`` names the
    progress report (``features train``).
    """
    cache = (
        FeatureCache(config.cache_dir, weights_id, dataset_id, architecture_fingerprint(backbone))
        if config.cache_dir
        else None
    )
    return extract_features(
        backbone,
        dataset,
        transform=transform or eval_transforms(config.image_size),
        pool=pool,
        batch_size=config.batch_size,
        device=config.device,
        num_workers=config.num_workers,
        cache=cache,
        dtype=config.cache_dtype,
        desc=f"features {split}",
    )
