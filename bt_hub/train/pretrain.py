"""``bt-hub pretrain``: the Barlow Twins training loop (single process or torchrun/DDP).

The recipe is docs/protocols.md §1; what a run directory holds, resuming and preemption: docs/pretraining.md.
"""

from __future__ import annotations

import dataclasses
import math
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as nnf
from torch import nn

from bt_hub.common.config import config_dict
from bt_hub.common.distributed import (
    barrier,
    broadcast_object,
    cleanup_distributed,
    convert_sync_batchnorm,
    distributed_data_parallel,
    get_world_size,
    init_distributed,
    is_main_process,
)
from bt_hub.common.progress import progress
from bt_hub.common.runs import RunDir
from bt_hub.common.signals import Terminated, deferred_stop
from bt_hub.data.datasets import build_dataset, dataset_fingerprint, is_builtin
from bt_hub.data.decode_auto import decode_choice
from bt_hub.data.precision import autocast_dtype, precision_choice, resolve_channels_last
from bt_hub.data.prefetch import Prefetcher
from bt_hub.method.loss import LossTerms
from bt_hub.method.model import BarlowTwins
from bt_hub.method.optim import LARS, param_groups, set_learning_rates
from bt_hub.method.views import BatchedTwoViews
from bt_hub.train.batches import (
    ViewDataset,
    decoded_store,
    epoch_loader,
    probe_views,
    save_probe,
    to_views,
    view_pair,
)
from bt_hub.train.compile_auto import AutoCompile
from bt_hub.train.config import PretrainConfig
from bt_hub.train.monitor import KnnMonitor, TensorBoardScalars, monitor_sets
from bt_hub.train.resume import (
    CHECKPOINT_NAME,
    save_checkpoint,
    set_rng_state,
    training_stopped,
)
from bt_hub.train.run_folder import (
    clear_replaced_run,
    kept_path,
    resume_state,
    resumed_seconds,
    write_backbone,
    write_weights,
)


class _TrainStep(nn.Module):
    """What DDP wraps: both views through the model, the loss, and the embedding spread."""

    def __init__(self, model: BarlowTwins) -> None:
        super().__init__()
        self.model = model

    def forward(self, y_a: torch.Tensor, y_b: torch.Tensor) -> tuple[LossTerms, torch.Tensor]:
        z_a, z_b = self.model.embed(y_a), self.model.embed(y_b)
        terms = self.model.loss(z_a, z_b)
        # std over the batch of L2-normalised embeddings: ~1/sqrt(D) when healthy, 0 on collapse
        spread = nnf.normalize(z_a.detach().float(), dim=1).std(dim=0).mean()
        return terms, spread


def _keep(loop: _Loop, step: int) -> None:
    """Keep this step's backbone for the learning curve (main process), with the seconds trained so far."""
    if is_main_process():
        path = kept_path(Path(loop.config.out), step)
        path.parent.mkdir(exist_ok=True)
        seconds = f"{loop.seconds:.3f}"
        write_weights(path, loop.model, loop.config, step=step, train_seconds=seconds, device=loop.device.type)


def pretrain(config: PretrainConfig) -> Path:
    """Train per ``config`` (joining torchrun's process group if launched by it); return the run directory."""
    device = init_distributed(config.device)
    try:
        with RunDir.for_training(config.out, overwrite=config.overwrite, kind="pretrain") as run:
            return _train(config, device, run)
    finally:
        cleanup_distributed()


def _train(config: PretrainConfig, device: torch.device, run: RunDir) -> Path:
    world = get_world_size()
    out = Path(config.out)
    if config.batch_size % world:
        raise ValueError(f"--batch-size {config.batch_size} is not a multiple of the {world} processes")
    is_dir = not is_builtin(config.data)
    dataset = build_dataset(config.data, "train", image_size=None if is_dir else config.image_size, seed=config.seed)
    config.schedule_steps(len(dataset))  # the data and the schedule refused before anything is measured
    chosen = broadcast_object(precision_choice(config.precision, device) if is_main_process() else None)
    decode = config.decode if config.views == "batched" else "workers"  # PIL views: the workers decode and augment
    decoded = broadcast_object(
        decode_choice(decode, device, config.data, config.num_workers) if is_main_process() else None
    )
    config = dataclasses.replace(
        config,
        precision=chosen["precision"],
        channels_last=resolve_channels_last(config.channels_last, chosen["precision"]),
        decode=decoded.decode,
    )
    data = broadcast_object(dataset_fingerprint(dataset, content=False) if is_main_process() else None)
    state = resume_state(config, out, data)
    steps_per_epoch = len(dataset) // config.batch_size
    total_steps, warmup_steps, last_step = config.schedule_steps(len(dataset), int(state["step"]) if state else 0)

    model, optimizer, scaler, step = _seeded_model(config, device, state)
    step_module = _wrapped(model, config, device, world, last_step - step)  # before the probe: it sees wrapped BNs
    if state is None and config.overwrite and is_main_process():
        clear_replaced_run(out, config)
    facts = {**chosen, "decode_reason": decoded.reason, **decoded.decoding.described()}
    facts.update(decode_share=decoded.decoding.worker_share, decode_agreement=decoded.agreement)
    run.start(config, step, fresh=state is None and (config.resume is None or config.overwrite), facts=facts)
    view_params = view_pair(config)
    batched = BatchedTwoViews(config.image_size, view_params) if config.views == "batched" else None
    views = ViewDataset(
        dataset,
        config.image_size,
        config.seed,
        batched is not None,
        view_params,
        files=is_dir,
        decoding=decoded.decoding,
        store=decoded_store(config, dataset, device) if is_dir and batched is not None else None,
    )
    probe = probe_views(views, config, device, batched) if is_main_process() else None
    if step == 0 and is_main_process():
        save_probe(out / "cross_correlation_start.npy", model, probe)
    loop = _Loop(
        config=config,
        device=device,
        run=run,
        model=model,
        optimizer=optimizer,
        scaler=scaler,
        step_module=step_module,
        amp_dtype=autocast_dtype(config.precision),
        views=views,
        batched=batched,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        warmup_steps=warmup_steps,
        last_step=last_step,
        monitor=_knn_monitor(config),
        scalars=TensorBoardScalars(out / "tensorboard") if config.tensorboard and is_main_process() else None,
        seconds=resumed_seconds(state, out),
        data=data,
    )
    step = _run_loop(loop, step)
    if is_main_process():
        save_probe(out / "cross_correlation_end.npy", model, probe)
        write_backbone(out, model, config, step, len(dataset), {**loop.step_module.record, **chosen})
    barrier()
    return out


@dataclass
class _Loop:
    """What the training loop works with, built once by ``_train``."""

    config: PretrainConfig
    device: torch.device
    run: RunDir
    model: BarlowTwins
    optimizer: LARS
    scaler: torch.amp.GradScaler
    step_module: AutoCompile
    amp_dtype: torch.dtype | None
    views: ViewDataset
    batched: BatchedTwoViews | None
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int
    last_step: int
    monitor: KnnMonitor | None
    scalars: TensorBoardScalars | None
    seconds: float = 0.0  # training time (data and steps) since step 0, carried over a resume by the checkpoint
    data: str = ""  # the fingerprint of the training data, which a resume of the checkpoint compares

    @property
    def checkpoint_path(self) -> Path:
        return Path(self.config.out) / CHECKPOINT_NAME


def _run_loop(loop: _Loop, step: int) -> int:
    """Train from ``step`` to ``loop.last_step``: log, monitor and checkpoint on the way; return the last step."""
    config, device, model = loop.config, loop.device, loop.model
    bar = progress(None, "pretrain", total=loop.last_step, initial=step, unit="step", every=config.log_every)
    postfix: dict[str, str] = {}
    if loop.monitor is not None and step == 0:
        scores = loop.monitor(model.backbone, device, loop.amp_dtype)
        postfix["knn"] = f"{scores['knn_top1']:.1f}"
        baselines = loop.monitor.baselines(
            config.backbone, config.small_image_stem, config.seed, device, loop.amp_dtype
        )
        loop.run.log({"step": 0, "knn_top1": float(postfix["knn"]), "rankme": scores["rankme"], **baselines})
    model.train()
    with deferred_stop(device) as terminated:
        while step < loop.last_step:
            step = _run_epoch(loop, step, bar, postfix, terminated)
    bar.close()
    if loop.scalars is not None:
        loop.scalars.close()
    return step


def _run_epoch(loop: _Loop, step: int, bar: Any, postfix: dict[str, str], terminated: Callable[[], int]) -> int:
    """Train from ``step`` to the end of its epoch (or ``loop.last_step``); return the step reached.

    After Ctrl-C, SIGTERM or another of the signals that stop a run (``terminated()``, agreed by every rank), the
    step just done is checkpointed and KeyboardInterrupt / :class:`Terminated` raised, so ``--resume auto``
    continues from it.
    """
    config, device, model = loop.config, loop.device, loop.model
    epoch = step // loop.steps_per_epoch
    loader = epoch_loader(loop.views, config, epoch, step % loop.steps_per_epoch, device)
    tick, tick_step = time.perf_counter(), step
    # on CUDA the next batches are decoded and viewed on a side stream while this step trains
    with Prefetcher(
        enumerate(loader, step),
        lambda item: to_views(item[1], item[0], config, device, loop.batched, loop.views),
        device,
        depth=2 if device.type == "cuda" else 0,
    ) as batches:
        mark = time.perf_counter()
        for y_a, y_b in batches:
            rates, loss, terms, spread = _optimizer_step(loop, y_a, y_b, step)
            step += 1
            loop.seconds += time.perf_counter() - mark
            if config.keeps(step, loop.last_step):
                _keep(loop, step)
            row: dict[str, Any] = {}
            if step % config.log_every == 0 or step == loop.last_step:
                now = time.perf_counter()
                # one metrics.jsonl row: LRs, the loss and its two terms, the embeddings' spread, speed
                row |= {
                    "epoch": epoch,
                    "lr_weights": rates[0],
                    "lr_biases": rates[1],
                    "loss": loss,
                    "invariance": float(terms.invariance_term),
                    "redundancy": float(terms.redundancy_term),
                    "embedding_std": float(spread),
                    "pairs_per_s": config.batch_size * (step - tick_step) / max(now - tick, 1e-9),
                }
                tick, tick_step = now, step
            if loop.monitor is not None and (step % config.monitor_knn == 0 or step == loop.last_step):
                row |= loop.monitor(model.backbone, device, loop.amp_dtype)  # knn_top1, rankme
                postfix["knn"] = f"{row['knn_top1']:.1f}"
            if row:
                loop.run.log({"step": step, **row})
                if loop.scalars is not None:
                    loop.scalars.log({"step": step, **row})
            # the postfix is set before update(1) so the line shows this step's values
            bar.set_postfix(loss=f"{loss:.4g}", epoch=epoch, **postfix)
            bar.update(1)
            # a checkpoint at each epoch end, at the last step, and every --checkpoint-every steps
            every = config.checkpoint_every
            due = step % loop.steps_per_epoch == 0 or step == loop.last_step or bool(every and step % every == 0)
            if due:
                _checkpoint(loop, step)
            if step >= loop.last_step:
                break
            if signum := terminated():
                if not due:
                    _checkpoint(loop, step)
                raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)
            mark = time.perf_counter()
    return step


def _optimizer_step(
    loop: _Loop, y_a: torch.Tensor, y_b: torch.Tensor, step: int
) -> tuple[list[float], float, LossTerms, torch.Tensor]:
    """One LARS step on a pair of view batches at this step's LRs; the rates, the loss read before the step (the one
    wait for the device a step: read again after it, the host would wait for the whole step), the loss terms and
    the embedding spread."""
    rates = set_learning_rates(loop.optimizer, step, loop.total_steps, loop.warmup_steps, loop.config.batch_size)
    amp_dtype = loop.amp_dtype
    with torch.autocast(loop.device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
        terms, spread = loop.step_module(y_a, y_b)
    loss = float(terms.loss.detach())
    if not math.isfinite(loss):
        raise RuntimeError(training_stopped(loop.checkpoint_path, step + 1, f"the loss became {loss}"))
    loop.optimizer.zero_grad(set_to_none=True)
    loop.scaler.scale(terms.loss).backward()
    loop.scaler.step(loop.optimizer)
    loop.scaler.update()
    return rates, loss, terms, spread


def _checkpoint(loop: _Loop, step: int) -> None:
    """The full checkpoint of ``step`` (written by the main process; every rank waits for it)."""
    if is_main_process():
        save_checkpoint(
            loop.checkpoint_path,
            model=loop.model.state_dict(),
            optimizer=loop.optimizer.state_dict(),
            scaler=loop.scaler.state_dict(),
            step=step,
            epoch=step // loop.steps_per_epoch,
            config=config_dict(loop.config),
            train_seconds=loop.seconds,
            data_fingerprint=loop.data,
        )
    barrier()


def _seeded_model(
    config: PretrainConfig, device: torch.device, state: dict[str, Any] | None
) -> tuple[BarlowTwins, LARS, torch.amp.GradScaler, int]:
    """The model, LARS and the loss scaler, seeded by ``--seed`` and restored from ``state``; the step to start at."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed shapes: let cuDNN pick its fastest kernels, as the reference does
    torch.manual_seed(config.seed)
    np.random.seed(config.seed % 2**32)
    random.seed(config.seed)
    model = BarlowTwins(
        config.backbone,
        config.projector,
        config.lambd,
        small_image_stem=config.small_image_stem,
        loss_method=config.loss_method,
        reference_grad_scale=config.reference_grad_scale,
    ).to(device)
    if config.channels_last == "on":
        model = model.to(memory_format=torch.channels_last)
    optimizer = LARS(
        param_groups(model, config.lr_weights, config.lr_biases, config.weight_decay), weight_decay=config.weight_decay
    )
    scaler = torch.amp.GradScaler("cuda", enabled=config.precision == "fp16")
    if state is None:
        return model, optimizer, scaler, 0
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if "scaler" in state:
        scaler.load_state_dict(state["scaler"])
    set_rng_state(state["rng"])
    return model, optimizer, scaler, int(state["step"])


def _wrapped(model: BarlowTwins, config: PretrainConfig, device: torch.device, world: int, steps: int) -> AutoCompile:
    """What the loop calls: the views through the model and the loss, under DDP, compiled per ``--compile``."""
    step_module: nn.Module = _TrainStep(model)
    if world > 1:
        step_module = convert_sync_batchnorm(step_module)  # SyncBatchNorm on CUDA, GlobalBatchNorm on CPU/gloo
    return AutoCompile(distributed_data_parallel(step_module, device), config.compile, steps, device)


def _knn_monitor(config: PretrainConfig) -> KnnMonitor | None:
    """The kNN monitor of ``--monitor-knn`` on the main process, else None."""
    if not (config.monitor_knn and is_main_process()):
        return None
    return KnnMonitor(
        *monitor_sets(
            config.monitor_data or config.data, config.image_size, config.seed, config.monitor_size, config.num_workers
        )
    )
