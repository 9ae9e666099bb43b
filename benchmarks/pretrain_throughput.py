"""Images per second of pretraining from JPEG files: the ceiling, bt_hub's pipeline and the reference loop.

    python benchmarks/pretrain_throughput.py                    # ResNet-50, 224 px, projector 8192-8192-8192, on CUDA
    python benchmarks/pretrain_throughput.py --device cpu --arch resnet18 --image-size 32 --projector 64-64 \\
        --batch-size 8 --warmup 1 --steps 2 --jpeg-size 64x48 --workers 1          # the CPU smoke run of the tests
    python benchmarks/pretrain_throughput.py --arch resnet18 --small-image-stem --image-size 32 --format png \
        --jpeg-size 28x28 --projector 2048-2048-2048 --batch-size 512 --rows abf    # small grey PNGs (MNIST-like)

The script writes its own ImageNet-like JPEGs (``--jpeg-size`` 500x375, quality 90, textured
so that files are ~100 KB like ImageNet's) into ``--data-dir`` (a temporary folder by default),
then times on one device, each after ``--warmup`` untimed steps:

(a) ceiling: bt_hub's model + loss + LARS on view tensors already in device memory;
(b) bt_hub: ``bt_hub.train.pretrain.pretrain`` itself from the files (``--views batched``,
    ``--decode auto``: loader workers read bytes and the GPU decodes the batch; ``--store auto``: a folder of
    small images is decoded once into a store, kept on the GPU when it fits), as a user runs it;
(f) the same with ``--store off``: every file decoded again each epoch (by the workers, or the GPU for JPEGs);
(c) reference: facebookresearch/barlowtwins main.py's loop: per-image PIL views
    (``benchmarks/pretrain_step.py``'s copy of its ``Transform``) in ``--workers`` loader
    workers, fp16 autocast + GradScaler on CUDA (fp32 on the CPU), NCHW, the BatchNorm1d
    loss with the D x D cross-correlation, cudnn.benchmark, LARS;
and with ``--compile``, (a) and (b) again under torch.compile (``--compile only``: those two alone).
Images/s counts source images (each gives two views). The table and ``throughput.json`` go to
``--out`` (default ``$OUT`` when set), rewritten after every row, so a run cut short keeps what it measured.
``--profile N`` runs each bt_hub row N steps longer, under torch.profiler after its timed steps, and prints the
profiler's top rows by device time (the views' kernels and copies beside the model's: what the ceiling lacks).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.autograd import DeviceType
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pretrain_step import ReferenceLoss, reference_transforms  # noqa: E402

from bt_hub.data.precision import autocast_dtype, resolve_precision  # noqa: E402
from bt_hub.method.model import BarlowTwins  # noqa: E402
from bt_hub.method.optim import LARS, param_groups  # noqa: E402
from bt_hub.train.pretrain import PretrainConfig, pretrain  # noqa: E402

UNIQUE_IMAGES = 256  # distinct pictures; the files repeat them (decoding costs the same)


# ----------------------------------------------------------------------------- data


def _photo(seed: int, width: int, height: int, image_format: str = "jpeg") -> bytes:
    """A textured colour picture as a quality-90 JPEG (~100 KB at 500 x 375, like an ImageNet file), or as a grey
    PNG (``image_format`` "png": a small-image set of the MNIST kind)."""
    rng = np.random.default_rng(seed)

    def smooth(cells_h: int, cells_w: int) -> np.ndarray:
        small = Image.fromarray((rng.random((cells_h, cells_w, 3)) * 255).astype(np.uint8))
        return np.asarray(small.resize((width, height), Image.Resampling.BICUBIC), dtype=np.float32)

    img = (
        0.55 * smooth(6, 8)
        + 0.45 * (smooth(max(height // 6, 1), max(width // 6, 1)) - 127.5)
        + 40
        + rng.normal(0, 9, (height, width, 3))
    )
    buffer = io.BytesIO()
    picture = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    if image_format == "png":
        picture.convert("L").save(buffer, format="PNG")
    else:
        picture.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def write_jpegs(folder: Path, count: int, width: int, height: int, processes: int, image_format: str = "jpeg") -> None:
    """``count`` JPEG (or grey PNG) files in ``folder/<class>/`` (10 classes), made once and reused if present."""
    marker = folder / f".bt_hub_throughput_{count}_{width}x{height}_{image_format}"
    if marker.exists():
        return
    unique = min(UNIQUE_IMAGES, count)
    with Pool(processes) as pool:
        pictures = pool.starmap(_photo, [(seed, width, height, image_format) for seed in range(unique)])
    suffix = ".png" if image_format == "png" else ".jpg"
    for i in range(count):
        path = folder / f"class{i % 10}" / f"{i:07d}{suffix}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pictures[i % len(pictures)])
    marker.touch()


class _ReferenceDataset(Dataset):
    """The reference's ImageFolder + Transform: PIL decode and two PIL views per image, in the workers."""

    def __init__(self, files: list[Path], size: int) -> None:
        self.files, self.views = files, reference_transforms(size)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        with Image.open(self.files[index]) as img:
            image = img.convert("RGB")
        return self.views[0](image), self.views[1](image)


# ----------------------------------------------------------------------------- rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _model(args: argparse.Namespace, device: torch.device) -> BarlowTwins:
    torch.manual_seed(0)
    return BarlowTwins(args.arch, args.projector, small_image_stem=args.small_image_stem).to(device)


def ceiling(args: argparse.Namespace, device: torch.device, precision: str, compile_model: bool) -> float:
    """(a): steps of model + loss + LARS on fixed view tensors in device memory; images/s."""
    model = _model(args, device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = LARS(param_groups(model, 0.2, 0.0048, 1e-6), lr=0.1, weight_decay=1e-6)
    step_fn = torch.compile(model) if compile_model else model
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    g = torch.Generator(device=device).manual_seed(0)
    y_a, y_b = (
        torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device, generator=g).contiguous(
            memory_format=fmt
        )
        for _ in range(2)
    )
    dtype = autocast_dtype(precision)
    times = []
    for k in range(args.warmup + args.steps):
        _sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = step_fn(y_a, y_b).loss
        float(loss.detach())  # bt_hub's loop reads the loss every step (NaN guard)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        _sync(device)
        if k >= args.warmup:
            times.append(time.perf_counter() - start)
    return args.batch_size * len(times) / sum(times)


def bt_hub_pipeline(
    args: argparse.Namespace,
    data: Path,
    device: torch.device,
    precision: str,
    compile_model: bool,
    work: Path,
    store: str = "off",
) -> float:
    """(b): ``bt_hub.train.pretrain.pretrain`` from the image files (``store``: its ``--store``); images/s over the
    steps after warm-up (a store is made before step 1, outside the timed steps)."""
    out = work / ("run_compiled" if compile_model else "run")
    shutil.rmtree(out, ignore_errors=True)
    last_timed = args.warmup + args.steps
    config = PretrainConfig(
        data=str(data),
        out=str(out),
        backbone=args.arch,
        small_image_stem=args.small_image_stem,
        store=store,
        store_dir=str(work / "stores"),
        projector=args.projector,
        image_size=args.image_size,
        batch_size=args.batch_size,
        epochs=100,
        warmup_epochs=0,
        views="batched",
        decode=args.decode,
        precision=precision,
        channels_last="on" if args.channels_last else "off",
        compile="on" if compile_model else "off",
        num_workers=args.workers,
        device=str(device),
        max_steps=last_timed + args.profile,
        log_every=args.warmup,
        checkpoint_every=0,
        probe_max_dim=0,
    )
    with _profiled(args, device, f"bt_hub pretrain, store {store}, compile {config.compile}"):
        pretrain(config)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] <= last_timed]
    timed = [r for r in rows if r["step"] > args.warmup]
    steps = [r["step"] - prev["step"] for prev, r in zip(rows, rows[1:]) if r["step"] > args.warmup]
    seconds = sum(n * args.batch_size / r["pairs_per_s"] for n, r in zip(steps, timed))
    shutil.rmtree(out, ignore_errors=True)  # the end-of-run checkpoint of a ResNet-50 run is over a gigabyte
    return args.batch_size * sum(steps) / seconds


@contextlib.contextmanager
def _profiled(args: argparse.Namespace, device: torch.device, label: str) -> Iterator[None]:
    """torch.profiler over the ``--profile`` steps that follow the timed ones (stepped after each optimizer step);
    prints its top rows by self device time (CPU time on the CPU) and the device's busy time a step."""
    if not args.profile:
        yield
        return
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    active = max(args.profile - 1, 1)  # the first profiled step warms the profiler up
    when = torch.profiler.schedule(wait=args.warmup + args.steps, warmup=args.profile - active, active=active, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=when) as prof:
        hook = register_optimizer_step_post_hook(lambda *_: prof.step())
        try:
            yield
        finally:
            hook.remove()
    rows = prof.key_averages()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    # the kernels' own rows (an op's row repeats its kernels' time), as the profiler's table sums them
    on_device = device.type == "cuda"
    kernels = [r for r in rows if not on_device or (r.device_type != DeviceType.CPU and not r.is_user_annotation)]
    busy = sum(getattr(r, key) for r in kernels) / 1e3 / active
    print(f"profile of {label}, over the {active} step(s) after the timed ones: {busy:.1f} ms a step of self "
          f"{'device' if device.type == 'cuda' else 'CPU'} time (streams that overlap add up)")  # fmt: skip
    print(rows.table(sort_by=key, row_limit=15, max_name_column_width=70), flush=True)


def reference_loop(args: argparse.Namespace, files: list[Path], device: torch.device) -> float:
    """(c): the reference training loop (PIL views in workers, AMP fp16 + GradScaler on CUDA); images/s."""
    torch.backends.cudnn.benchmark = True
    model = _model(args, device)
    loss_fn = ReferenceLoss(int(args.projector.split("-")[-1]), model.lambd).to(device)
    optimizer = LARS(param_groups(model, 0.2, 0.0048, 1e-6), lr=0.1, weight_decay=1e-6)
    amp = device.type == "cuda"
    scaler = torch.amp.GradScaler("cuda", enabled=amp)
    loader = DataLoader(
        _ReferenceDataset(files, args.image_size),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        pin_memory=amp,
        drop_last=True,
        persistent_workers=False,
    )
    times, start = [], time.perf_counter()
    for k, (y_a, y_b) in enumerate(loader):
        if k == args.warmup + args.steps:
            break
        y_a, y_b = y_a.to(device, non_blocking=True), y_b.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.float16, enabled=amp):
            loss = loss_fn(model.embed(y_a), model.embed(y_b))
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        _sync(device)
        now = time.perf_counter()
        if k >= args.warmup:
            times.append(now - start)
        start = now
    return args.batch_size * len(times) / sum(times)


# ----------------------------------------------------------------------------- table


def _table(rows: dict[str, float], header: str) -> str:
    lines = [header, f"{'row':<58}{'images/s':>10}{'vs (a)':>9}{'vs (c)':>9}"]
    ceiling_rate, reference_rate = (
        rows.get("(a) ceiling: model + loss + LARS on in-memory tensors"),
        rows.get("(c) reference loop: PIL views in workers, AMP"),
    )
    for name, rate in rows.items():
        vs_a = f"{rate / ceiling_rate:.0%}" if ceiling_rate else "—"
        vs_c = f"{rate / reference_rate:.2f}x" if reference_rate else "—"
        lines.append(f"{name:<58}{rate:>10.1f}{vs_a:>9}{vs_c:>9}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--projector", default="8192-8192-8192")
    parser.add_argument("--batch-size", type=int, default=256, help="images per step (each gives two views)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per row")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per row")
    parser.add_argument(
        "--workers", type=int, default=min(16, os.cpu_count() or 1), help="loader workers of (b) and (c)"
    )
    parser.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "fp32", "bf16", "fp16"],
        help="(a) and (b); the reference row keeps its fp16 AMP",
    )
    parser.add_argument("--decode", default="auto", choices=["auto", "device", "workers"], help="(b)'s --decode")
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True, help="(a) and (b)")
    parser.add_argument(
        "--compile",
        nargs="?",
        const="also",
        default="off",
        choices=["off", "also", "only"],
        help="also (or only) time (a) and (b) under torch.compile",
    )
    parser.add_argument("--rows", default="abc", help="which of the rows a, b, f, c to run (f: (b) with --store off)")
    parser.add_argument(
        "--profile", type=int, default=0, help="profile this many steps after each bt_hub row's timed ones (0: none)"
    )
    parser.add_argument("--store", default="auto", choices=["auto", "off", "disk", "device"], help="(b)'s --store")
    parser.add_argument("--jpeg-size", default="500x375", help="WIDTHxHEIGHT of the generated JPEGs")
    parser.add_argument("--format", default="jpeg", choices=["jpeg", "png"], help="colour JPEGs or grey PNGs")
    parser.add_argument("--small-image-stem", action="store_true", help="3x3 stem without max-pool (32-px data)")
    parser.add_argument(
        "--data-dir", default=None, help="where the JPEGs go (reused when present); default: a temporary folder"
    )
    parser.add_argument(
        "--out", default=os.environ.get("OUT"), help="folder for throughput.txt and throughput.json (default: $OUT)"
    )
    args = parser.parse_args()
    if os.environ.get("BT_HUB_PARSE_ONLY"):  # the CPU suite's check of benchmarks/gpu_check.sh's command lines
        print(f"{Path(__file__).name}: parsed (BT_HUB_PARSE_ONLY is set: nothing run)")
        return
    device = torch.device(args.device)
    precision = resolve_precision(args.precision, device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    width, height = (int(v) for v in args.jpeg_size.split("x"))
    work = Path(tempfile.mkdtemp(prefix="bt_hub_throughput_"))
    data = Path(args.data_dir) if args.data_dir else work / "jpegs"
    # (b) ends before its first epoch does (no epoch-end checkpoint)
    count = args.batch_size * (args.warmup + args.steps + args.profile + 1)
    tick = time.perf_counter()
    write_jpegs(data, count, width, height, max(args.workers, 1), args.format)
    files = sorted(data.rglob("*.png" if args.format == "png" else "*.jpg"))
    mean_kb = statistics.mean(f.stat().st_size for f in files[:UNIQUE_IMAGES]) / 1024
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    header = (
        f"{args.arch}, {args.image_size} px, projector {args.projector}, batch {args.batch_size}, {name}, "
        f"precision {precision}, "
        f"{'channels-last' if args.channels_last else 'NCHW'}, {args.workers} workers, "
        f"{len(files)} {'grey PNGs' if args.format == 'png' else 'JPEGs'} {width}x{height} "
        f"(mean {mean_kb:.0f} KB, made in {time.perf_counter() - tick:.0f} s); torch {torch.__version__}; "
        f"{args.steps} timed steps after {args.warmup}"
    )
    print(header, flush=True)
    rows: dict[str, float] = {}
    runs = [
        ("a", "(a) ceiling: model + loss + LARS on in-memory tensors", lambda: ceiling(args, device, precision, False)),
        (
            "b",
            f"(b) bt_hub pretrain from files (decode {args.decode}, store {args.store})",
            lambda: bt_hub_pipeline(args, data, device, precision, False, work, args.store),
        ),
        (
            "f",
            "(f) bt_hub pretrain from files, --store off (decoded every epoch)",
            lambda: bt_hub_pipeline(args, data, device, precision, False, work, store="off"),
        ),
        ("c", "(c) reference loop: PIL views in workers, AMP", lambda: reference_loop(args, files, device)),
    ]
    if args.compile == "only":
        runs = []
    if args.compile != "off":
        runs += [
            ("a", "(a) ceiling, torch.compile", lambda: ceiling(args, device, precision, True)),
            (
                "b",
                f"(b) bt_hub pretrain from files, --compile (store {args.store})",
                lambda: bt_hub_pipeline(args, data, device, precision, True, work, args.store),
            ),
        ]
    for key, label, run in runs:
        if key not in args.rows:
            continue
        tick = time.perf_counter()
        try:
            rows[label] = run()
        except (RuntimeError, ValueError, OSError) as err:  # one failed row (e.g. out of memory) keeps the others
            print(
                f"{label}: failed after {time.perf_counter() - tick:.0f} s: {type(err).__name__}: {str(err)[:300]}",
                flush=True,
            )
            continue
        print(f"{label}: {rows[label]:.1f} images/s ({time.perf_counter() - tick:.0f} s)", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "throughput.txt").write_text(_table(rows, header) + "\n")
            (Path(args.out) / "throughput.json").write_text(
                json.dumps({"header": header, "images_per_s": rows}, indent=2) + "\n"
            )
    print("\n" + _table(rows, header))
    if not args.data_dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
