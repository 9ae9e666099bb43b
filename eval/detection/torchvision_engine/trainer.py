"""The torchvision engine of ``bt-hub detect``: one trial (train, precise BN, evaluate) from the YAML."""

from __future__ import annotations

import bisect
import itertools
import math
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DataLoader, Sampler

from bt_hub.common.distributed import (
    all_gather_objects,
    barrier,
    convert_sync_batchnorm,
    distributed_data_parallel,
    get_rank,
    get_world_size,
    is_distributed,
    is_main_process,
)
from bt_hub.common.files import atomic_torch_save, atomic_write_text
from bt_hub.common.progress import progress
from bt_hub.common.runs import RunDir
from bt_hub.common.signals import ignore_group_signals
from bt_hub.eval.detection.config import Settings, scale_to_world_size
from bt_hub.eval.detection.data import DetectionDataset, Record, coco_api, load_records, locate
from bt_hub.eval.detection.evaluation import coco_evaluate, encode_masks, voc_evaluate, write_trial
from bt_hub.eval.detection.torchvision_engine.model import build_c4_model, unloaded_backbone_tensors

__all__ = ["LOSS_NAMES", "evaluate_dataset", "lr_factor", "param_groups", "precise_bn", "predict", "run_trial"]

# torchvision's loss names -> detectron2's (metrics.jsonl reads the same for both engines).
LOSS_NAMES = {
    "loss_classifier": "loss_cls",
    "loss_box_reg": "loss_box_reg",
    "loss_objectness": "loss_rpn_cls",
    "loss_rpn_box_reg": "loss_rpn_loc",
    "loss_mask": "loss_mask",
}
CHECKPOINT = "checkpoint.pth"


def lr_factor(iteration: int, settings: Settings) -> float:
    """The lr multiplier at ``iteration``: linear warm-up from ``WARMUP_FACTOR``, x ``GAMMA`` per passed step."""
    factor = settings["SOLVER.GAMMA"] ** bisect.bisect_right(sorted(settings["SOLVER.STEPS"]), iteration)
    warmup = int(settings["SOLVER.WARMUP_ITERS"])
    if iteration < warmup:
        alpha = iteration / warmup
        factor *= settings["SOLVER.WARMUP_FACTOR"] * (1 - alpha) + alpha
    return factor


def param_groups(model: nn.Module, weight_decay: float, weight_decay_norm: float) -> list[dict[str, Any]]:
    """Parameters of norm layers (weight decay ``weight_decay_norm``) and all others."""
    norm_ids = {
        id(p)
        for m in model.modules()
        if isinstance(m, (_BatchNorm, nn.GroupNorm, nn.LayerNorm))
        for p in m.parameters(recurse=False)
    }
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if id(p) not in norm_ids], "weight_decay": weight_decay},
        {"params": [p for p in params if id(p) in norm_ids], "weight_decay": weight_decay_norm},
    ]


class EndlessShuffle(Sampler[int]):
    """Indices of ``size`` items, reshuffled every pass (seeded), this rank's share of each pass."""

    def __init__(self, size: int, seed: int, rank: int = 0, world_size: int = 1) -> None:
        self.size, self.seed, self.rank, self.world_size = size, seed, rank, world_size

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed)
        while True:
            yield from torch.randperm(self.size, generator=generator)[self.rank :: self.world_size].tolist()


def _collate(batch: list[Any]) -> tuple[list[Any], list[Any]]:
    images, targets = zip(*batch)
    return list(images), list(targets)


def _batches(
    records: list[Record], settings: Settings, *, with_masks: bool, seed: int
) -> Iterator[tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]]:
    """The endless training stream of this rank: (images, targets) of ``IMS_PER_BATCH / world`` images."""
    world = get_world_size()
    per_rank = int(settings["SOLVER.IMS_PER_BATCH"]) // world
    dataset = DetectionDataset(records, with_masks=with_masks, flip=True)
    loader = DataLoader(
        dataset,
        batch_size=per_rank,
        sampler=EndlessShuffle(len(records), seed, get_rank(), world),
        num_workers=int(settings["DATALOADER.NUM_WORKERS"]),
        collate_fn=_collate,
        worker_init_fn=ignore_group_signals,
    )
    return iter(loader)


def _to(
    images: list[torch.Tensor], targets: list[dict[str, torch.Tensor]], device: torch.device
) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    return [i.to(device) for i in images], [{k: v.to(device) for k, v in t.items()} for t in targets]


@torch.no_grad()
def precise_bn(model: nn.Module, batches: Iterator[Any], num_iter: int, device: torch.device) -> None:
    """Replace every BatchNorm's running statistics by their average over ``num_iter`` training batches (PRECISE_BN)."""
    bns = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
    saved = [(bn.momentum, bn.num_batches_tracked.clone()) for bn in bns]
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None  # cumulative average over the batches below
    for images, targets in itertools.islice(batches, num_iter):
        model(*_to(images, targets, device))
    for bn, (momentum, tracked) in zip(bns, saved):
        bn.momentum = momentum
        bn.num_batches_tracked.copy_(tracked)


@torch.no_grad()
def predict(
    model: nn.Module, records: list[Record], device: torch.device, *, with_masks: bool
) -> dict[Any, dict[str, Any]]:
    """This rank's share of ``records`` in eval mode: boxes (XYXY), scores, 0-based labels, mask RLEs."""
    model.eval()
    dataset = DetectionDataset(records)
    out = {}
    for index in progress(range(get_rank(), len(records), get_world_size()), "detect predict", unit="image"):
        image, _ = dataset[index]
        (result,) = model([image.to(device)])
        p = {
            "boxes": result["boxes"].cpu().numpy(),
            "scores": result["scores"].cpu().numpy(),
            "labels": result["labels"].cpu().numpy() - 1,
        }
        if with_masks:
            p["masks"] = encode_masks((result["masks"][:, 0] >= 0.5).cpu().numpy())
        out[records[index].image_id] = p
    return out


def evaluate_dataset(
    data_root: str | Path, dataset_name: str, predictions: Mapping[Any, Mapping[str, Any]], *, with_masks: bool
) -> dict[str, dict[str, float]]:
    """Percent metrics of ``predictions`` on a named dataset: VOC AP (11-point for VOC2007) or COCO AP."""
    loc = locate(dataset_name, data_root)
    records, names, category_ids = load_records(loc)
    if loc.kind == "voc":
        return voc_evaluate(records, predictions, len(names), use_07_metric=loc.year == 2007)
    return coco_evaluate(coco_api(loc.json_file), predictions, category_ids, with_masks=with_masks)


def _training_records(settings: Settings, data_root: str) -> tuple[list[Record], tuple[str, ...]]:
    records, names = [], None
    for name in settings["DATASETS.TRAIN"]:
        part, part_names, _ = load_records(locate(name, data_root))
        if names is not None and part_names != names:
            raise ValueError(
                f"the training datasets {settings['DATASETS.TRAIN']} have different class lists: "
                f"{list(names)} and {list(part_names)}"
            )
        records += [r for r in part if (~r.iscrowd).any()]  # detectron2's FILTER_EMPTY_ANNOTATIONS
        names = part_names
    if not records:
        raise ValueError(
            f"the training datasets {settings['DATASETS.TRAIN']} under --data {data_root} have no annotated image"
        )
    return records, names


def _check_classes(settings: Settings, data_root: str) -> None:
    expected = int(settings["MODEL.ROI_HEADS.NUM_CLASSES"])
    for name in settings["DATASETS.TEST"]:
        _, names, _ = load_records(locate(name, data_root))
        if len(names) != expected:
            raise ValueError(
                f"MODEL.ROI_HEADS.NUM_CLASSES is {expected} but dataset {name} has {len(names)} classes; "
                f"pass `MODEL.ROI_HEADS.NUM_CLASSES {len(names)}` as opts"
            )


def run_trial(
    settings: Settings,
    *,
    data_root: str,
    resnet: nn.Module,
    expected: Mapping[str, torch.Tensor] | None,
    out: Path,
    seed: int,
    device: torch.device,
    resume: bool,
) -> dict[str, Any] | None:
    """Train and evaluate one seed in this process; ``{"seed", "metrics", "config"}`` on the main process, else None.

    ``settings`` are the YAML's before the world-size rescaling; ``expected`` (None when resuming) is compared
    with the built model. ValueError for unloaded tensors or classes, FloatingPointError for a non-finite loss.
    """
    settings = scale_to_world_size(settings, get_world_size())
    torch.manual_seed(seed + get_rank())
    np.random.seed((seed + get_rank()) % 2**32)
    records, _ = _training_records(settings, data_root)
    _check_classes(settings, data_root)
    with_masks = bool(settings["MODEL.MASK_ON"])

    model = _model(settings, resnet, expected, device)
    optimizer = torch.optim.SGD(
        param_groups(model, settings["SOLVER.WEIGHT_DECAY"], settings["SOLVER.WEIGHT_DECAY_NORM"]),
        lr=settings["SOLVER.BASE_LR"],
        momentum=settings["SOLVER.MOMENTUM"],
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: lr_factor(it, settings))
    start = _resume(out / CHECKPOINT, model, optimizer, scheduler, device) if resume else 0
    trained = distributed_data_parallel(model, device)
    # the trial's run directory (run.json, metrics.jsonl); the main process also writes config.yaml
    run_dir = RunDir(out, config=settings.tree, write=is_main_process(), kind="detect")
    if is_main_process():
        atomic_write_text(out / "config.yaml", yaml.safe_dump(settings.tree, sort_keys=False))
    batches = _batches(records, settings, with_masks=with_masks, seed=seed + start)
    _train(
        trained, model, optimizer, scheduler, batches, settings, start=start, run_dir=run_dir, out=out, device=device
    )
    if settings["TEST.PRECISE_BN.ENABLED"]:
        precise_bn(
            model,
            _batches(records, settings, with_masks=with_masks, seed=seed + 1_000_003),
            int(settings["TEST.PRECISE_BN.NUM_ITER"]),
            device,
        )

    results = _evaluate(model, settings, data_root, device, with_masks=with_masks)
    barrier()
    if not is_main_process():
        return None
    return write_trial(
        out, seed, results[settings["DATASETS.TEST"][0]] if len(results) == 1 else results, settings.tree
    )


# ----------------------------------------------------------------------------- setup


def _model(
    settings: Settings, resnet: nn.Module, expected: Mapping[str, torch.Tensor] | None, device: torch.device
) -> nn.Module:
    """The C4 model on ``device`` built around ``resnet`` (checked against ``expected``), SyncBN under torchrun."""
    model = build_c4_model(settings, resnet)
    if expected is not None:
        bad = unloaded_backbone_tensors(model, expected)
        if bad:
            raise ValueError(
                f"--weights left {len(bad)} backbone tensors unloaded (first: {', '.join(bad[:3])}); "
                "expected a torchvision ResNet"
            )
    model.to(device)
    if is_distributed() and settings["MODEL.RESNETS.NORM"] in ("SyncBN", "naiveSyncBN"):
        model = convert_sync_batchnorm(model)
    return model


def _resume(
    checkpoint: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, device: torch.device
) -> int:
    """Load model, optimizer and schedule from ``checkpoint`` when it exists; the iteration to go on from (0 if not)."""
    if not checkpoint.is_file():
        return 0
    state = torch.load(checkpoint, map_location=device, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return int(state["iter"])


# ----------------------------------------------------------------------------- training


def _train(
    trained: nn.Module,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    batches: Iterator[Any],
    settings: Settings,
    *,
    start: int,
    run_dir: RunDir,
    out: Path,
    device: torch.device,
) -> None:
    """Iterations ``start`` to ``MAX_ITER``: a ``metrics.jsonl`` row each, a checkpoint every period and at the end.

    Each is one SGD step on the next batch; its row holds the losses under detectron2's names, the lr and the time.
    """
    max_iter, period = int(settings["SOLVER.MAX_ITER"]), int(settings["SOLVER.CHECKPOINT_PERIOD"])
    trained.train()
    bar = progress(range(start, max_iter), "detect train", total=max_iter, initial=start, unit="iter")
    for it in bar:
        batch = next(batches)
        tic = time.perf_counter()
        losses = trained(*_to(*batch, device))
        total = sum(losses.values())
        if not math.isfinite(float(total.detach())):
            values = {k: float(v.detach()) for k, v in losses.items()}
            raise FloatingPointError(f"the loss became infinite or NaN at iteration {it}: {values}")
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        optimizer.step()
        lr = optimizer.param_groups[0]["lr"]
        scheduler.step()
        row = {"iter": it, "total_loss": float(total.detach()), "lr": lr, "time": time.perf_counter() - tic}
        row.update({LOSS_NAMES.get(k, k): float(v.detach()) for k, v in losses.items()})
        bar.set_postfix(loss=f"{row['total_loss']:.4g}")
        run_dir.log(row)
        if ((period and (it + 1) % period == 0) or it + 1 == max_iter) and is_main_process():
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "iter": it + 1,
            }
            atomic_torch_save(state, out / CHECKPOINT)


# ----------------------------------------------------------------------------- evaluation


def _evaluate(
    model: nn.Module, settings: Settings, data_root: str, device: torch.device, *, with_masks: bool
) -> dict[str, dict[str, dict[str, float]]]:
    """Every test dataset's metrics by name: each rank predicts its share, the main process scores; {} on the others."""
    results = {}
    for name in settings["DATASETS.TEST"]:
        shards = all_gather_objects(
            predict(model, load_records(locate(name, data_root))[0], device, with_masks=with_masks)
        )
        if is_main_process():
            predictions = {k: v for shard in shards for k, v in shard.items()}
            results[name] = evaluate_dataset(data_root, name, predictions, with_masks=with_masks)
    return results
