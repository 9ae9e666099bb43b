"""The detectron2 trainer of the transfer runs, the weights check and one trial end to end (needs detectron2)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from detectron2.config import CfgNode
from detectron2.data import MetadataCatalog
from detectron2.engine import DefaultTrainer, HookBase, hooks
from detectron2.evaluation import COCOEvaluator, DatasetEvaluator, PascalVOCDetectionEvaluator
from detectron2.utils import comm
from detectron2.utils.env import seed_all_rng
from detectron2.utils.logger import setup_logger

from bt_hub.common.files import atomic_write_text
from bt_hub.common.runs import RunDir
from bt_hub.eval.detection.detectron2_engine import roi_heads  # noqa: F401  (registers Res5ROIHeadsExtraNorm)
from bt_hub.eval.detection.detectron2_engine.datasets import num_classes, register_datasets
from bt_hub.eval.detection.evaluation import write_trial

__all__ = ["LossLog", "Trainer", "evaluate_dataset", "run_trial", "unloaded_parameters"]


class LossLog(HookBase):
    """Append each iteration's losses, lr and seconds to ``metrics.jsonl`` (main process)."""

    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir

    def after_step(self) -> None:
        it = self.trainer.iter
        latest = self.trainer.storage.latest()
        row = {"iter": it}
        row.update(
            {
                k: float(v)
                for k, (v, i) in latest.items()
                if i == it and (k.startswith("loss") or k in ("total_loss", "lr", "time"))
            }
        )
        self.run_dir.log(row)


class Trainer(DefaultTrainer):
    """DefaultTrainer with VOC/COCO evaluators, a per-iteration loss log and one final evaluation (no periodic one)."""

    def __init__(self, cfg: CfgNode, run_dir: RunDir) -> None:
        self._run_dir = run_dir
        super().__init__(cfg)

    @classmethod
    def build_evaluator(cls, cfg: CfgNode, dataset_name: str) -> DatasetEvaluator:
        """VOC AP/AP50/AP75 (11-point on VOC2007) or COCO box (and mask) AP."""
        return _evaluator(dataset_name, output_dir=str(Path(cfg.OUTPUT_DIR) / "inference"))

    def build_hooks(self) -> list[HookBase]:
        kept = [h for h in super().build_hooks() if not isinstance(h, hooks.EvalHook)]
        if comm.is_main_process():
            kept.append(LossLog(self._run_dir))
        return kept


def _evaluator(
    dataset_name: str, *, output_dir: str | None = None, tasks: tuple[str, ...] | None = None
) -> DatasetEvaluator:
    kind = MetadataCatalog.get(dataset_name).get("evaluator_type")
    if kind == "pascal_voc":
        return PascalVOCDetectionEvaluator(dataset_name)
    if kind == "coco":
        return COCOEvaluator(dataset_name, tasks=tasks, distributed=False, output_dir=output_dir)
    raise ValueError(f"dataset {dataset_name!r} has no VOC or COCO evaluator (metadata evaluator_type {kind!r})")


def evaluate_dataset(
    data_root: str | Path, dataset_name: str, predictions: Mapping[Any, Mapping[str, Any]], *, with_masks: bool
) -> dict[str, dict[str, float]]:
    """detectron2's own evaluator of ``dataset_name`` on predictions in bt_hub.eval.detection.evaluation's form."""
    from detectron2.data import DatasetCatalog
    from detectron2.structures import Boxes, Instances
    from pycocotools import mask as mask_util

    register_datasets([dataset_name], data_root)
    evaluator = _evaluator(dataset_name, tasks=("bbox", "segm") if with_masks else ("bbox",))
    evaluator.reset()
    for record in DatasetCatalog.get(dataset_name):
        p = predictions.get(record["image_id"])
        if p is None:
            continue
        instances = Instances((record["height"], record["width"]))
        instances.pred_boxes = Boxes(torch.as_tensor(np.asarray(p["boxes"], dtype=np.float32).reshape(-1, 4)))
        instances.scores = torch.as_tensor(np.asarray(p["scores"], dtype=np.float32))
        instances.pred_classes = torch.as_tensor(np.asarray(p["labels"], dtype=np.int64))
        if with_masks:
            masks = p["masks"]
            masks = (
                np.stack([mask_util.decode(m) for m in masks])
                if isinstance(masks, list) and masks
                else np.asarray(masks)
            )
            instances.pred_masks = torch.as_tensor(masks.reshape(-1, record["height"], record["width"]).astype(bool))
        evaluator.process(
            [{"image_id": record["image_id"], "height": record["height"], "width": record["width"]}],
            [{"instances": instances}],
        )
    return evaluator.evaluate()


def unloaded_parameters(model: torch.nn.Module, expected: Mapping[str, Any]) -> list[str]:
    """The model's backbone and res5 names whose tensor is missing from ``expected`` (a ``.pkl``'s) or differs."""
    bad = []
    for name, tensor in getattr(model, "module", model).state_dict().items():  # DDP's inner model
        if name.endswith("num_batches_tracked") or name.startswith("roi_heads.res5.norm."):
            continue
        if name.startswith("backbone."):
            key = name[len("backbone.") :]
        elif name.startswith("roi_heads.res5."):
            key = name[len("roi_heads.") :]
        else:
            continue
        value = expected.get(key)
        if value is None or not torch.equal(tensor.detach().cpu(), torch.as_tensor(np.asarray(value)).to(tensor.dtype)):
            bad.append(name)
    return bad


def run_trial(cfg: CfgNode, data_root: str, expected: Mapping[str, Any] | None, resume: bool) -> None:
    """Train and evaluate one seed in a ``launch``-ed process; the main one writes ``OUTPUT_DIR/trial_metrics.json``.

    ``expected`` (None skips the check) is compared after loading: ValueError for unloaded backbone/res5
    tensors or a class count that does not fit the data.
    """
    out = Path(cfg.OUTPUT_DIR)
    rank = comm.get_rank()
    setup_logger(str(out.parent), distributed_rank=rank, name="detectron2", abbrev_name="d2")
    seed_all_rng(cfg.SEED + rank)
    register_datasets(list(cfg.DATASETS.TRAIN) + list(cfg.DATASETS.TEST), data_root)
    for name in cfg.DATASETS.TEST:
        if num_classes(name) != cfg.MODEL.ROI_HEADS.NUM_CLASSES:
            raise ValueError(
                f"MODEL.ROI_HEADS.NUM_CLASSES is {cfg.MODEL.ROI_HEADS.NUM_CLASSES} but dataset {name} has "
                f"{num_classes(name)} classes; pass `MODEL.ROI_HEADS.NUM_CLASSES {num_classes(name)}` as opts"
            )
    run_dir = RunDir(out, config=_as_dict(cfg), write=comm.is_main_process(), kind="detect")
    trainer = Trainer(cfg, run_dir)
    if comm.is_main_process():  # after detectron2's rescaling to the number of processes
        atomic_write_text(out / "config.yaml", trainer.cfg.dump())
    trainer.resume_or_load(resume=resume)
    if expected is not None and trainer.start_iter == 0:
        bad = unloaded_parameters(trainer.model, expected)
        if bad:
            raise ValueError(
                f"MODEL.WEIGHTS {cfg.MODEL.WEIGHTS} left {len(bad)} backbone/res5 tensors unloaded "
                f"(first: {', '.join(bad[:3])}); expected a ResNet-50 in detectron2 layout"
            )
    trainer.train()
    results = trainer.test(trainer.cfg, trainer.model)
    if comm.is_main_process():
        trial = write_trial(out, cfg.SEED, results, _as_dict(trainer.cfg))
        logging.getLogger("detectron2").info("trial seed %d: %s", cfg.SEED, trial["metrics"])
    comm.synchronize()


def _as_dict(cfg: CfgNode) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(cfg.dump())
