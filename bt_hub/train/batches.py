"""What bt_hub.train.pretrain feeds the model: each epoch's loader (or decoded store), each image's two views,
and the probe batch it records."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from bt_hub.common.distributed import get_rank, get_world_size
from bt_hub.common.files import atomic_write
from bt_hub.common.signals import ignore_group_signals
from bt_hub.data.datasets import to_uint8_tensor
from bt_hub.data.decode import Decoding, PackedItems, collate_packed, to_device_images, worker_item
from bt_hub.data.store import (
    DecodedImages,
    StoreView,
    default_directory,
    fits_auto,
    open_store,
    small_images,
    store_device,
)
from bt_hub.method.loss import EPS
from bt_hub.method.model import BarlowTwins, parse_projector
from bt_hub.method.views import VIEW_A, VIEW_B, BatchedTwoViews, TwoViewTransform, ViewParams
from bt_hub.train.config import PretrainConfig
from bt_hub.train.resume import EpochBatchSampler, derive_seed, seeded_generator

PROBE_SIZE = 256


def view_pair(config: PretrainConfig) -> tuple[ViewParams, ViewParams]:
    """The paper's two views with ``--crop-scale-min``, ``--no-flip`` and ``--no-blur`` applied."""
    changes: dict[str, Any] = {"crop_scale": (config.crop_scale_min, 1.0)}
    if not config.flip:
        changes["flip_p"] = 0.0
    if not config.blur:
        changes["blur_p"] = 0.0
    return dataclasses.replace(VIEW_A, **changes), dataclasses.replace(VIEW_B, **changes)


class ViewDataset(Dataset):
    """Items keyed by (epoch, index): two seeded PIL views, or for batched views the uint8 image or the file's bytes
    (``decoding`` says which JPEGs are left to the device's decoder; see :func:`bt_hub.data.decode.worker_item`)."""

    def __init__(
        self,
        dataset: Dataset,
        image_size: int,
        seed: int,
        batched: bool,
        views: tuple[ViewParams, ViewParams] = (VIEW_A, VIEW_B),
        files: bool = False,
        decoding: Decoding | None = None,
        store: DecodedImages | None = None,
    ) -> None:
        self.store = store  # the folder decoded once: batches are gathered from it, no loader
        self.dataset, self.seed, self.batched, self.decoding = dataset, seed, batched, decoding or Decoding()
        self.file_items = batched and files  # images of their own sizes, packed a batch at a time
        self.transform = TwoViewTransform(image_size, views)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        if self.file_items:  # the file's bytes for the device decoder, or the image decoded in this worker
            return worker_item(self.dataset.samples[index][0], self.decoding, index)
        image, _ = self.dataset[index]
        if self.batched:
            return to_uint8_tensor(image)
        return self.transform(image, generator=seeded_generator(self.seed, epoch, index))


def decoded_store(config: PretrainConfig, dataset: Any, device: torch.device) -> DecodedImages | None:
    """The folder decoded once into a store of whole images (``--store``), held on the GPU with ``device`` (and
    ``auto`` when it fits); None: the loader workers decode the files every epoch.

    ``auto`` makes one on the CPU only, for images up to ``SMALL_SIDE`` px that fit the disk: there the workers'
    decoding takes the cores the model needs. On an H200 with 14 workers, 28-px PNGs, a ResNet-18 at 32 px and
    batch 512 trained at 16.9k images/s with the workers decoding every epoch and at 10.2k from the store in GPU
    memory (benchmarks/pretrain_throughput.py rows (f) and (b), two runs alike), so on CUDA ``auto`` decodes.
    """
    if config.store == "off" or (config.store == "auto" and device.type == "cuda"):
        return None
    directory = Path(config.store_dir) if config.store_dir else default_directory()
    if config.store == "auto":
        per_image = small_images(dataset)
        if per_image is None or not fits_auto(len(dataset), per_image, directory):
            return None
    store = open_store(dataset, StoreView(), directory, num_workers=config.num_workers, desc="decode")
    where = store_device(config.store, store.nbytes, device)
    return store.to(where) if where.type != "cpu" else store


def epoch_loader(
    views: ViewDataset, config: PretrainConfig, epoch: int, start: int, device: torch.device
) -> DataLoader:
    """This rank's batches of ``epoch`` from step ``start`` within it, in the seeded order (exact resume)."""
    rank, world = get_rank(), get_world_size()
    sampler = EpochBatchSampler(len(views), config.batch_size, config.seed, epoch, start, rank, world)
    if views.store is not None:  # the keys alone: the prefetch thread gathers each batch from the decoded store
        return sampler
    return DataLoader(
        views,
        batch_sampler=sampler,
        num_workers=config.num_workers,
        pin_memory=device.type == "cuda",
        collate_fn=collate_packed if views.file_items else None,
        generator=torch.Generator().manual_seed(derive_seed(config.seed, epoch, rank)),
        worker_init_fn=ignore_group_signals,
    )


def to_views(
    batch: Any,
    step: int,
    config: PretrainConfig,
    device: torch.device,
    batched: BatchedTwoViews | None,
    views: ViewDataset,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two view batches on the device (batched views are drawn per (seed, step, rank)).

    Batched views draw their parameters on the host (a CPU generator) and send them in one copy, so that making
    them never waits for the device; with a decoded store (``views.store``) the batch is the sampler's (epoch, index)
    keys: one gather from the store, the same views as the images a loader decodes from the files; file bytes are
    decoded by ``views.decoding``'s device decoder.
    """
    if batched is None:
        y_a, y_b = (v.to(device, non_blocking=True) for v in batch)
    else:
        if views.store is not None:
            images = views.store.batch([index for _, index in batch], device)
        elif isinstance(batch, PackedItems):  # a folder's images (or bytes), one copy to the device
            images = to_device_images(batch, device, views.decoding.device or "pil")
        else:
            images = batch.to(device, non_blocking=True)
        y_a, y_b = batched(images, generator=seeded_generator(config.seed, step, get_rank()))
    if config.channels_last == "on":
        y_a, y_b = y_a.contiguous(memory_format=torch.channels_last), y_b.contiguous(memory_format=torch.channels_last)
    return y_a, y_b


@torch.no_grad()
def cross_correlation(model: BarlowTwins, y_a: torch.Tensor, y_b: torch.Tensor) -> np.ndarray:
    """The D x D cross-correlation of standardised embeddings (model in eval mode, this process only)."""
    was_training = model.training
    model.eval()
    try:
        z_a, z_b = model.embed(y_a).float(), model.embed(y_b).float()
    finally:
        model.train(was_training)
    a, b = ((z - z.mean(0)) / torch.sqrt(z.var(0, unbiased=False) + EPS) for z in (z_a, z_b))
    return (a.T @ b / a.shape[0]).cpu().numpy()


def save_probe(path: Path, model: BarlowTwins, probe: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    if probe is not None:
        c = cross_correlation(model, *probe)
        atomic_write(path, lambda f: np.save(f, c))


def probe_views(
    views: ViewDataset, config: PretrainConfig, device: torch.device, batched: BatchedTwoViews | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Views of the first images of the dataset, seeded apart from training (epoch key -1)."""
    if parse_projector(config.projector)[-1] > config.probe_max_dim:
        return None
    keys = [(-1, i) for i in range(min(PROBE_SIZE, len(views)))]
    if batched is not None and views.store is not None:
        return batched(views.store.batch([i for _, i in keys], device), generator=seeded_generator(config.seed, -1))
    if batched is not None and views.file_items:
        images = to_device_images([views[k] for k in keys], device, views.decoding.device or "pil")
        return batched(images, generator=seeded_generator(config.seed, -1))
    if batched is not None:
        return batched(torch.stack([views[k] for k in keys]).to(device), generator=seeded_generator(config.seed, -1))
    view_a, view_b = zip(*(views[k] for k in keys))
    return torch.stack(view_a).to(device), torch.stack(view_b).to(device)
