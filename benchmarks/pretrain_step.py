"""Pairs per second of one full pretraining step: ours vs a reference-style step, each in a process of its own.

    python benchmarks/pretrain_step.py                      # ResNet-18 small stem, 32 px, 128 pairs, default path
    python benchmarks/pretrain_step.py --curve-steps 50     # plus both loss curves over 50 steps

A step is views + forward + loss + backward + LARS. The reference-style step follows
facebookresearch/barlowtwins main.py: per-image PIL views through a torchvision
``transforms.Compose`` pipeline (re-written here), fp32, NCHW, and the dense loss through
``BatchNorm1d(D, affine=False)`` and the D x D cross-correlation with its off-diagonal
view. Ours: bt_hub's batched tensor views on the device, bt_hub's loss (``auto`` picks the
Gram form when 2N < D), and by default the path a long ``bt-hub pretrain`` takes:
``--precision auto``, channels-last where that gives bf16/fp16, and ``--compile auto`` as
``bt_hub.train.compile_auto.compile_pays`` decides it for a run of ``--planned-steps`` from
ours' eager warm-up steps (the table says which path ran and why), its foreach LARS, and the
allocator setting every ``bt-hub`` command makes (``keep_freed_memory``: glibc reuses freed
blocks instead of unmapping them). The reference-style step runs with the reference code's
per-tensor LARS and the default allocator, as the reference runs; a third row gives it bt_hub's
allocator setting, so the table shows what that setting alone is worth. All start from the same
weights (checked), see the same images in the same order, use the same warm-up + cosine
schedule, and are timed step by step in alternation (one process works while the others wait)
so that load from other processes hits all alike. The loss curves differ only through the
random views, so they should agree within noise.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
import torchvision.transforms as T
from PIL import Image, ImageFilter, ImageOps
from torch import nn

from bt_hub.common.config import keep_freed_memory
from bt_hub.data.datasets import build_dataset, to_uint8_tensor
from bt_hub.data.precision import autocast_dtype, resolve_channels_last, resolve_precision
from bt_hub.method.loss import barlow_twins_loss
from bt_hub.method.model import BarlowTwins
from bt_hub.method.optim import LARS, param_groups, set_learning_rates, trust_ratio
from bt_hub.method.views import BatchedTwoViews
from bt_hub.train.compile_auto import compile_pays


class _PilBlur:
    """Gaussian blur with σ ~ U(0.1, 2.0) applied with probability p (the reference's PIL op)."""

    def __init__(self, p: float) -> None:
        self.p = p

    def __call__(self, img: Image.Image) -> Image.Image:
        if torch.rand(()) < self.p:
            return img.filter(ImageFilter.GaussianBlur(radius=float(torch.empty(()).uniform_(0.1, 2.0))))
        return img


class _PilSolarize:
    """Solarise at 128 with probability p."""

    def __init__(self, p: float) -> None:
        self.p = p

    def __call__(self, img: Image.Image) -> Image.Image:
        return ImageOps.solarize(img) if torch.rand(()) < self.p else img


def reference_transforms(size: int) -> tuple[T.Compose, T.Compose]:
    """The two asymmetric reference pipelines (blur 1.0 / 0.1, solarise 0.0 / 0.2)."""

    def pipeline(blur: float, solarize: float) -> T.Compose:
        return T.Compose(
            [
                T.RandomResizedCrop(size, interpolation=T.InterpolationMode.BICUBIC),
                T.RandomHorizontalFlip(p=0.5),
                T.RandomApply([T.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.2, hue=0.1)], p=0.8),
                T.RandomGrayscale(p=0.2),
                _PilBlur(blur),
                _PilSolarize(solarize),
                T.ToTensor(),
                T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
            ]
        )

    return pipeline(1.0, 0.0), pipeline(0.1, 0.2)


def off_diagonal(c: torch.Tensor) -> torch.Tensor:
    """The off-diagonal entries of a square matrix as a flat view."""
    n = c.shape[0]
    return c.flatten()[:-1].view(n - 1, n + 1)[:, 1:].flatten()


class ReferenceLoss(nn.Module):
    """The reference loss: BatchNorm1d without affine per view, C = aᵀb / N, dense terms."""

    def __init__(self, dim: int, lambd: float) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(dim, affine=False)
        self.lambd = lambd

    def forward(self, z_a: torch.Tensor, z_b: torch.Tensor) -> torch.Tensor:
        c = self.bn(z_a).T @ self.bn(z_b) / z_a.shape[0]
        on_diag = torch.diagonal(c).add_(-1).pow_(2).sum()
        return on_diag + self.lambd * off_diagonal(c).pow_(2).sum()


class ReferenceLARS(LARS):
    """The reference code's LARS step: one parameter at a time, the update in two new tensors."""

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = p.grad
                if p.ndim != 1:
                    update = update.add(p, alpha=group["weight_decay"])
                    update = update.mul(trust_ratio(torch.norm(p), torch.norm(update), group["eta"]))
                state = self.state[p]
                if "mu" not in state:
                    state["mu"] = torch.zeros_like(p)
                mu = state["mu"]
                mu.mul_(group["momentum"]).add_(update)
                p.add_(mu, alpha=-group["lr"])


class Pipeline:
    """One training setup: model, optimiser, how views are made and how the loss is computed."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        torch.manual_seed(args.seed)
        ours = name == OURS
        model = BarlowTwins("resnet18", args.projector, small_image_stem=True, loss_method=args.loss_method)
        self.name, self.model, self.args, self.ours = name, model.to(args.device), args, ours
        self.device = torch.device(args.device)
        self.channels_last = ours and args.channels_last
        if self.channels_last:
            model.to(memory_format=torch.channels_last)
        lars = LARS if ours else ReferenceLARS
        self.optimizer = lars(param_groups(model, 0.2, 0.0048, 1e-6), weight_decay=1e-6)
        self.batched = BatchedTwoViews(args.image_size)
        self.ref_views = reference_transforms(args.image_size)
        self.ref_loss = ReferenceLoss(int(args.projector.split("-")[-1]), model.lambd).to(self.device)
        self.amp = autocast_dtype(args.precision) if ours else None
        self.forward = torch.compile(model.embed) if ours and args.compile == "on" else model.embed

    def fingerprint(self) -> float:
        """A number that differs between two models that do not start from the same weights."""
        with torch.no_grad():
            return float(sum(p.double().sum() * (i + 1) for i, p in enumerate(self.model.parameters())))

    def views(self, images: list[Image.Image], step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ours:
            batch = torch.stack([to_uint8_tensor(im) for im in images]).to(self.device)
            gen = torch.Generator().manual_seed(1000 + step)  # on the host, as bt-hub pretrain draws them
            y_a, y_b = self.batched(batch, generator=gen)
        else:
            t_a, t_b = self.ref_views
            y_a = torch.stack([t_a(im) for im in images]).to(self.device)
            y_b = torch.stack([t_b(im) for im in images]).to(self.device)
        if self.channels_last:
            y_a, y_b = (
                y_a.contiguous(memory_format=torch.channels_last),
                y_b.contiguous(memory_format=torch.channels_last),
            )
        return y_a, y_b

    def step(
        self, images: list[Image.Image], step: int, total: int, phases: dict[str, float] | None = None
    ) -> tuple[float, float]:
        """One full step; returns (loss, seconds). ``phases`` accumulates the seconds of each part."""
        marks = [("start", self._now())]
        set_learning_rates(self.optimizer, step, total, max(total // 5, 1), self.args.pairs)
        y_a, y_b = self.views(images, step)
        marks.append(("views", self._now()))
        with torch.autocast(self.device.type, dtype=self.amp or torch.float32, enabled=self.amp is not None):
            z_a, z_b = self.forward(y_a), self.forward(y_b)
            marks.append(("forward (backbone + projector)", self._now()))
            if self.ours:
                loss = barlow_twins_loss(z_a, z_b, self.model.lambd, self.model.loss_method).loss
            else:
                loss = self.ref_loss(z_a.float(), z_b.float())
        marks.append(("loss", self._now()))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        marks.append(("backward", self._now()))
        self.optimizer.step()
        marks.append(("LARS step", self._now()))
        value = float(loss.detach())
        marks.append(("rest", self._now()))
        if phases is not None:
            for (_, before), (name, after) in zip(marks, marks[1:]):
                phases[name] = phases.get(name, 0.0) + after - before
        return value, marks[-1][1] - marks[0][1]

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()


def batches(args: argparse.Namespace) -> list[list[Image.Image]]:
    data = build_dataset("digits", "train", image_size=args.image_size)
    images = [data[i][0] for i in range(len(data))]
    per = args.pairs
    return [
        images[(k * per) % (len(images) - per) :][:per]
        for k in range(max(args.warmup + args.timed_steps, args.curve_steps))
    ]


REFERENCE, REFERENCE_ALLOCATOR, OURS = "reference-style", "reference-style, bt_hub's allocator setting", "bt_hub"


def serve(name: str, args: argparse.Namespace, conn: Connection) -> None:
    """One pipeline in its own process: answers ``(op, ...)`` requests from the driver until ``None``."""
    if name != REFERENCE:
        keep_freed_memory()
    if args.threads:
        torch.set_num_threads(args.threads)
    data = batches(args)
    pipe = Pipeline(name, args)
    conn.send((pipe.fingerprint(), torch.get_num_threads()))
    while (request := conn.recv()) is not None:
        op, *rest = request
        if op == "step":
            k, total = rest
            phases: dict[str, float] = {}
            conn.send((*pipe.step(data[k], k, total, phases), phases))
        elif op == "compile":  # compiling happens in the first call: one more untimed step
            pipe.forward = torch.compile(pipe.model.embed)
            pipe.step(data[rest[0]], rest[0], rest[1])
            conn.send(None)
        elif op == "curve":
            fresh = Pipeline(name, args)
            conn.send([fresh.step(data[k], k, rest[0])[0] for k in range(rest[0])])


class Workers:
    """The pipelines' processes (spawned), asked in turn."""

    def __init__(self, names: list[str], args: argparse.Namespace) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = {}, []
        for name in names:
            here, there = ctx.Pipe()
            proc = ctx.Process(target=serve, args=(name, args, there), daemon=True)
            proc.start()
            self.conns[name] = here
            self.procs.append(proc)
        started = {name: conn.recv() for name, conn in self.conns.items()}
        if len({fingerprint for fingerprint, _ in started.values()}) != 1:
            raise RuntimeError(f"the pipelines do not start from the same weights: {started}")
        self.threads = next(iter(started.values()))[1]

    def ask(self, name: str, *request: object) -> Any:
        self.conns[name].send(request)
        return self.conns[name].recv()

    def close(self) -> None:
        for conn in self.conns.values():
            conn.send(None)
        for proc in self.procs:
            proc.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=128, help="images per step (each gives two views)")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--projector", default="8192-8192-8192")
    parser.add_argument("--loss-method", default="auto", choices=["auto", "dense", "gram"])
    parser.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "fp32", "bf16", "fp16"],
        help="ours only; auto: as bt-hub pretrain decides it (bf16 on GPUs with bf16, the measured faster on a CPU)",
    )
    parser.add_argument(
        "--channels-last", action=argparse.BooleanOptionalAction, default=None, help="default: on for bf16/fp16"
    )
    parser.add_argument(
        "--compile",
        default="auto",
        choices=["auto", "on", "off"],
        help="ours only: torch.compile the backbone + projector; auto: as bt-hub pretrain decides for --planned-steps",
    )
    parser.add_argument("--planned-steps", type=int, default=10_000, help="the run --compile auto decides for")
    parser.add_argument(
        "--profile", action="store_true", help="also print where each step's time goes (synchronised phases)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per pipeline")
    parser.add_argument("--timed-steps", type=int, default=3)
    parser.add_argument(
        "--curve-steps", type=int, default=0, help="also train each pipeline this many steps and print the losses"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.precision = resolve_precision(args.precision, args.device)
    if args.channels_last is None:
        args.channels_last = resolve_channels_last("auto", args.precision) == "on"
    names = [REFERENCE, REFERENCE_ALLOCATOR, OURS]
    workers = Workers(names, args)
    times: dict[str, list[float]] = {name: [] for name in names}
    phases: dict[str, dict[str, float]] = {name: {} for name in names}
    total = args.warmup + args.timed_steps
    reason = f"--compile {args.compile}"
    try:
        for k in range(total):
            for name in names:
                _, seconds, step_phases = workers.ask(name, "step", k, total)
                times[name].append(seconds)
                if k >= args.warmup:
                    for phase, value in step_phases.items():
                        phases[name][phase] = phases[name].get(phase, 0.0) + value
            if k == args.warmup - 1 and args.compile == "auto":
                eager = statistics.median(times[OURS])
                pays, reason = compile_pays(args.planned_steps - args.warmup, eager, torch.device(args.device).type)
                args.compile = "on" if pays else "off"
                if pays:
                    workers.ask(OURS, "compile", k, total)
        curves = {name: workers.ask(name, "curve", args.curve_steps) for name in names} if args.curve_steps else {}
    finally:
        workers.close()
    times = {name: t[args.warmup :] for name, t in times.items()}
    print(
        f"ResNet-18 small stem, {args.image_size} px, {args.pairs} pairs, projector {args.projector}, "
        f"device {args.device}, threads {workers.threads}, median of {args.timed_steps} steps after {args.warmup} "
        "warm-up, each pipeline in its own process"
    )
    print(f"{'step':<56}{'s/step':>10}{'pairs/s':>10}{'speed-up':>10}")
    ref = statistics.median(times[REFERENCE])
    for name in names:
        med = statistics.median(times[name])
        label = (
            name
            if name != OURS
            else (
                f"bt_hub ({args.precision}, {'channels-last' if args.channels_last else 'NCHW'}, "
                f"loss {args.loss_method}, compile {args.compile})"
            )
        )
        print(f"{label:<56}{med:>10.3f}{args.pairs / med:>10.1f}{ref / med:>9.2f}x")
    print(f"compile {args.compile}: {reason}")
    if args.profile:
        print(f"\nseconds per step by phase (mean of {args.timed_steps} steps)")
        print(f"{'phase':<34}" + "".join(f"{name[:20]:>22}" for name in names))
        for phase in phases[OURS]:
            print(f"{phase:<34}" + "".join(f"{phases[name][phase] / args.timed_steps:>22.3f}" for name in names))
    if curves:
        marks = sorted({0, *range(9, args.curve_steps, 10), args.curve_steps - 1})
        print(f"\nloss over {args.curve_steps} steps (same init, same images, independent random views)")
        print(f"{'step':<8}" + "".join(f"{name[:20]:>22}" for name in curves))
        for k in marks:
            print(f"{k + 1:<8}" + "".join(f"{curves[name][k]:>22.2f}" for name in curves))


if __name__ == "__main__":
    main()
