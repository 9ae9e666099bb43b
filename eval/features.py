"""One frozen-backbone feature extractor shared by every protocol (PIL or on-device preprocessing, cached).

``extract_features`` runs the backbone in eval mode without gradients, channels-last, in the precision
asked for (fp32, or bf16 / fp16 autocast), over a dataset in its own order, and returns ``(features,
labels)``. Images are preprocessed either per image by PIL in the loader's workers, or as pretraining
does (``DeviceEvalTransform``): workers read bytes, the device decodes, resizes, crops and normalises
the batch. Pools: ``"avg"``, the backbone's output (2048-d for ResNet-50); ``"voc_res5"``, VISSL's VOC07
feature, the res5 map through ``AvgPool2d(6, stride=1)`` flattened channel-major (8192-d at 224 px; the
map must be at least 6x6).

Gather order under torchrun: the rows go in global batches of ``batch_size x world_size``; rank r embeds
rows ``start + r·B .. start + (r+1)·B`` of each (under several ranks the last global batch is padded by
repeating row n−1, so that every rank runs as many equal batches and every collective lines up), and
``all_gather_cat`` concatenates the shares in rank order, which is dataset order; the padding rows are
dropped. Every rank thus ends with the full, ordered features. With a cache, rank 0 alone writes the
files while the other ranks take part in every gather; then all read rank 0's file after a barrier.

Cache key (``FeatureCache.key``, the first 24 hex digits of a sha256 of a JSON record, computed on rank 0
and broadcast): the weights (their file's sha256; a caller holding weights only in memory passes
``module_fingerprint``), the architecture they were loaded into (``architecture_fingerprint``: the
module's repr), the dataset (``bt_hub.data.datasets.dataset_fingerprint``: each file's relative path,
size, mtime, ctime and label plus the bytes of 32 evenly spaced files), the transform
(``describe_transform``: its repr without memory addresses, so the image size and where preprocessing
runs), the pool, the stored dtype (float32 or float16) and the precision. The same request from another
protocol loads the features; any other request computes its own. The meta file, written last, records
the key's parts and each file's size, sha256, shape and dtype, checked before a read; a file that fails
is computed again with one warning. A cut extraction resumes from the rows it kept (a multiple of the
global batch).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate
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
from bt_hub.common.progress import progress
from bt_hub.common.signals import ignore_group_signals
from bt_hub.data.datasets import to_uint8_tensor
from bt_hub.data.decode import (
    Decoding,
    EncodedImage,
    PackedItems,
    collate_packed,
    to_device_images,
    worker_item,
)
from bt_hub.data.precision import autocast_dtype
from bt_hub.data.prefetch import Prefetcher
from bt_hub.data.store import DecodedImages, StoreView, rows
from bt_hub.eval.config import EvalWarning
from bt_hub.eval.feature_cache import CACHE_MISSING, Extraction, FeatureCache, cache_problem, read_cache
from bt_hub.method.transforms import IMAGENET_MEAN, IMAGENET_STD, DeviceEvalTransform, eval_transforms

Pool = Literal["avg", "voc_res5"]


# ----------------------------------------------------------------------------- transforms


def train_transform(image_size: int = 224, crop_scale_min: float = 0.08, flip: bool = True) -> transforms.Compose:
    """The linear and semi-supervised training transform: RandomResizedCrop (``crop_scale_min``..1) + optional flip."""
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


def _global_batches(n: int, batch_size: int, world_size: int, rank: int, first: int = 0) -> list[list[int]]:
    """This rank's index lists of each global batch from row ``first``, padded to B under several ranks."""
    step = batch_size * world_size
    batches = []
    for start in range(first, n, step):
        lo = start + rank * batch_size
        idx = (
            [min(i, n - 1) for i in range(lo, lo + batch_size)]
            if world_size > 1
            else list(range(lo, min(lo + batch_size, n)))
        )
        batches.append(idx)
    return batches


class EncodedItems(Dataset):
    """``(image, label)`` for the device path: a file's bytes that ``decoding`` leaves to the device, else the image
    decoded in the loader worker (:func:`bt_hub.data.decode.worker_item`), or in-memory pixels, as a uint8 tensor."""

    def __init__(self, dataset: Dataset, decoding: Decoding | None = None) -> None:
        self.dataset, self.decoding = dataset, decoding or Decoding()
        resized = getattr(dataset, "image_size", None) is not None
        self.samples = None if resized else getattr(dataset, "samples", None)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[EncodedImage | torch.Tensor, Any]:
        if self.samples is not None:
            path, label = self.samples[index][:2]
            return worker_item(path, self.decoding, index), label
        image, label = self.dataset[index][:2]
        return (image if isinstance(image, torch.Tensor) else to_uint8_tensor(image)), label


def _collate_encoded(items: list[tuple[Any, Any]]) -> tuple[PackedItems, torch.Tensor]:
    return collate_packed([item[0] for item in items]), default_collate([item[1] for item in items])


def iter_feature_batches(
    backbone: nn.Module,
    dataset: Dataset,
    *,
    transform: Callable[[Any], torch.Tensor] | DeviceEvalTransform,
    pool: Pool = "avg",
    batch_size: int = 256,
    device: str | torch.device = "cpu",
    num_workers: int = 0,
    desc: str = "features",
    precision: str = "fp32",
    first: int = 0,
    decoding: Decoding | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(features float32 [b, F], labels)`` on CPU, consecutive chunks in dataset order.

    ``first`` (a multiple of the global batch) starts at that row with the batches a run from row 0 has there.
    ``decoding``: who decodes the files of the device path (default: torchvision on CUDA, the workers on a CPU).
    """
    if pool not in ("avg", "voc_res5"):
        raise ValueError(f"pool {pool!r} is unknown; expected 'avg' or 'voc_res5'")
    device = torch.device(device)
    decoding = decoding or (Decoding("torchvision") if device.type == "cuda" else Decoding())
    n, world = len(dataset), get_world_size()
    on_device = isinstance(transform, DeviceEvalTransform)
    indices = _global_batches(n, batch_size, world, get_rank(), first)
    if isinstance(dataset, DecodedImages):  # decoded once: one gather a batch, no loader, nothing opened
        if not isinstance(transform, DeviceEvalTransform) or dataset.view not in (
            StoreView(),
            StoreView.for_eval(transform),
        ):
            raise ValueError(f"a decoded store of {dataset.view.describe()} cannot feed the transform {transform!r}")
        targets = torch.as_tensor(dataset.targets)
        finish = transform.finish if dataset.view.crop else transform
        source: Any = progress(indices, desc, unit="batch")

        def prepare(idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            images = finish(dataset.batch(idx, device))
            return images.contiguous(memory_format=torch.channels_last), targets[rows(idx, targets.device)].to(device)

    else:
        source, prepare = _loaded_batches(dataset, transform, indices, device, num_workers, desc, decoding)

    amp = autocast_dtype(precision)
    was_training = backbone.training
    backbone.eval().to(device, memory_format=torch.channels_last)
    batches = Prefetcher(source, prepare, device, depth=2 if on_device else 0)

    def computed() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        done = 0
        for images, labels in batches:
            feats = _res5_pool(backbone, images) if pool == "voc_res5" else backbone(images)
            feats = torch.flatten(feats, 1).float()
            if is_distributed():
                feats, labels = all_gather_cat(feats), all_gather_cat(labels)
            take = min(len(feats), n - first - done)
            done += take
            yield feats[:take], labels[:take]

    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            yield from _to_host_one_behind(computed(), device)
    finally:
        batches.close()
        # back to the layout as loaded: a protocol fine-tuning the network next (eval all's semi) would compute
        # otherwise after an extraction than after features read from the cache
        backbone.train(was_training).to(memory_format=torch.contiguous_format)


def _loaded_batches(
    dataset: Dataset,
    transform: Callable[[Any], torch.Tensor] | DeviceEvalTransform,
    indices: list[list[int]],
    device: torch.device,
    num_workers: int,
    desc: str,
    decoding: Decoding,
) -> tuple[Iterable[Any], Callable[[Any], tuple[torch.Tensor, torch.Tensor]]]:
    """The loader of ``indices``' batches of a dataset read from its files (or in-memory images) and the step that
    makes each of its batches the network's input on ``device``: the device path (``DeviceEvalTransform``: workers
    hand on bytes or images as ``decoding`` says, the device decodes the rest and preprocesses) or PIL's."""
    on_device = isinstance(transform, DeviceEvalTransform)
    source = progress(
        DataLoader(
            EncodedItems(dataset, decoding) if on_device else TransformedDataset(dataset, transform),
            batch_sampler=indices,
            num_workers=num_workers,
            pin_memory=device.type == "cuda",
            collate_fn=_collate_encoded if on_device else None,
            worker_init_fn=ignore_group_signals,
        ),
        desc,
        unit="batch",
    )

    def prepare(batch: tuple[Any, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = batch
        if on_device:
            images = transform(to_device_images(images, device, decoding.device or "torchvision"))
        else:
            images = images.to(device, non_blocking=True)
        return images.contiguous(memory_format=torch.channels_last), torch.as_tensor(labels).to(device)

    return source, prepare


def _to_host_one_behind(
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]], device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each batch's tensors copied to the host. On CUDA the copy lands in pinned memory without stopping the host
    (non_blocking), and a batch is handed over only once the next one is queued: the host queues the next forward
    before it waits for a copy, so the GPU does not idle between batches."""
    pending: tuple[tuple[torch.Tensor, torch.Tensor], torch.cuda.Event] | None = None
    for features, labels in batches:
        copied = features.to("cpu", non_blocking=True), labels.to("cpu", non_blocking=True)
        if device.type != "cuda":
            yield copied
            continue
        ready = torch.cuda.Event()
        ready.record()
        if pending is not None:
            pending[1].synchronize()
            yield pending[0]
        pending = copied, ready
    if pending is not None:
        pending[1].synchronize()
        yield pending[0]


def describe_transform(transform: Callable[[Any], torch.Tensor]) -> str:
    """The transform's ``repr`` without memory addresses, so cache keys hold across processes."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(transform))


def extract_features(
    backbone: nn.Module, dataset: Dataset, **options: Any
) -> tuple[torch.Tensor | np.ndarray, torch.Tensor]:
    """Features and labels of a frozen backbone over a dataset of ``(image, label)``, in dataset order.

    ``options`` are :func:`extract_with_source`'s (``transform``, ``pool``, ``batch_size``, ``device``,
    ``num_workers``, ``cache``, ``dtype``, ``desc``, ``precision``, ``decoding``). ``transform`` defaults to
    ``eval_transforms(224)``.
    With a ``cache`` they are stored under a key of all that changes them and returned as a read-only memmap; a
    cached file that fails its checks is computed again.
    """
    return extract_with_source(backbone, dataset, **options)[:2]


def extract_with_source(
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
    precision: str = "fp32",
    stored: Callable[[], Dataset] | None = None,
    decoding: Decoding | None = None,
) -> tuple[torch.Tensor | np.ndarray, torch.Tensor, str]:
    """``extract_features`` and where the features came from: ``computed`` or ``cached <key>``.

    ``stored``: where the images come from when the features are computed (the split's decoded store, opened or
    made only then, never for a cache hit); ``dataset`` still names them for the cache.
    """
    if dtype not in ("float32", "float16"):
        raise ValueError(f"cache dtype {dtype!r} is unknown; expected 'float32' or 'float16'")
    if not len(dataset):
        raise ValueError("cannot extract features from an empty dataset")
    transform = transform or eval_transforms(224)
    batches = lambda first=0: iter_feature_batches(  # noqa: E731
        backbone,
        stored() if stored is not None else dataset,
        transform=transform,
        pool=pool,
        batch_size=batch_size,
        device=device,
        num_workers=num_workers,
        desc=desc,
        precision=precision,
        first=first,
        decoding=decoding,
    )
    if cache is None:
        chunks = list(batches())
        return torch.cat([c[0] for c in chunks]), torch.cat([c[1] for c in chunks]), "computed"
    description = describe_transform(transform)
    key = str(broadcast_object(cache.key(description, pool, dtype, precision)))  # every rank reads rank 0's file
    features_path, labels_path, meta_path = cache.paths(key)
    check = lambda: broadcast_object(cache_problem(meta_path, key) if is_main_process() else None)  # noqa: E731
    problem = check()
    with cache.lock(key) if problem is not None and is_main_process() else contextlib.nullcontext():
        problem = problem and check()  # again under the key's lock: the run it waited for may have written them
        if problem is None:
            return read_cache(features_path, labels_path) + (f"cached {key}",)
        if problem != CACHE_MISSING:
            warnings.warn(f"feature cache {problem}; computing the features again", EvalWarning, stacklevel=3)
        extraction = Extraction(cache, key, batch_size * get_world_size(), np.dtype(dtype), len(dataset))
        first = int(broadcast_object(extraction.resume() if is_main_process() else 0))  # rows a cut run kept
        if is_main_process():
            extraction.extend(batches(first))
            extraction.finish(transform=description, pool=pool, dtype=dtype, precision=precision)
        else:
            for _ in batches(first):  # the other ranks take part in every gather, then read rank 0's file
                pass
        barrier()
    features, labels = read_cache(features_path, labels_path)
    source = "computed" if problem == CACHE_MISSING else f"computed ({problem})"
    return features, labels, source + (f", continued at row {first} of a cut run" if first else "")


def as_float32(features: torch.Tensor | np.ndarray, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Rows ``start:stop`` of a feature tensor or memmap as a float32 tensor."""
    if isinstance(features, torch.Tensor):
        return features[start:stop].float()
    return torch.from_numpy(np.array(features[start:stop], dtype=np.float32))


# ----------------------------------------------------------------------------- protocol helpers


def architecture_fingerprint(module: nn.Module) -> str:
    """sha256 of a network's structure (its ``repr``: layers, kernel sizes, widths), not its weights."""
    return hashlib.sha256(describe_transform(module).encode()).hexdigest()
