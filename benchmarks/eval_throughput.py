"""Images per second of evaluation feature extraction from image files: the ceiling, bt_hub and the usual loop.

    python benchmarks/eval_throughput.py --rows abwsc                     # ResNet-50, 224 px, JPEGs 500x375, CUDA
    python benchmarks/eval_throughput.py --device cpu --arch resnet18 --small-image-stem --image-size 32 \\
        --jpeg-size 32x32 --batch-size 128 --workers 2                    # the CPU goal: CIFAR-like files, 2 cores

The script writes ImageNet-like JPEGs (``benchmarks/pretrain_throughput.py``'s generator) into
``--data-dir`` (a temporary folder by default), then times one frozen backbone in eval mode on
one device, each row after an untimed warm-up pass over ``--warmup`` batches:

(a) ceiling: the backbone alone on one batch already in device memory, at bt_hub's precision
    and memory format;
(b) bt_hub: ``bt_hub.eval.features.extract_features`` from the files, as ``bt-hub eval`` runs it
    (``--decode auto``: the decoders at hand timed on the first JPEGs, the faster one decoding on the device
    with the workers decoding their measured share of each batch on CUDA, the faster one in the workers on a
    CPU; the choice and why are printed first; workers read bytes, the device resizes and crops the batch, the
    next batch prepared on a side stream on CUDA; ``--precision auto``: bf16 on GPUs and on AMX / avx512_bf16
    CPUs; channels-last);
(t) the same with ``--decode device``: torchvision's decoder on the device (nvJPEG on the GPU's SMs; on a CPU
    PIL in the workers), no share for the workers;
(n) the same with ``--decode nvimgcodec``: nvImageCodec on the device (the hardware JPEG engines where the GPU
    has them; on a CPU its CPU backend in the workers), no share for the workers (skipped without it);
(w) the same with ``--decode workers`` (PIL resize and crop per image in the workers);
(s) the same from the files' decoded store (``--store``: decoded once, untimed; the test crops read back, on the
    GPU when they fit), what every kept step and seed of a learning curve after the first costs;
(p) (b)'s device path phase by phase (ms a batch, the device synchronised between phases): read (and the
    workers' share decoded), copy and decode, resize and crop, normalise, forward;
(i) the input side alone: bt_hub's loader over the files (workers read bytes and hand over one
    tensor a batch), against the same loader handing over a list of tensors a batch (DataLoader's
    per-item transfer: one shared-memory block a file); files/s, no model;
(c) reference: the usual loop: torchvision ``ImageFolder`` + PIL ``Resize/CenterCrop/ToTensor/
    Normalize`` in the same number of workers (or once per count of ``--reference-workers``),
    fp32 on the CPU / fp16 autocast on CUDA, NCHW.

The table goes to stdout (and ``--out``, default ``$OUT`` when set) with the CPU's flags and
load beside it: the CPU may be shared, so the load says what the numbers are worth. The last
line reads ``speedup: X.XXx (bt_hub B images/s vs reference C images/s)``, against the first (c) row.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Subset
from torchvision import datasets
from torchvision import transforms as T

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402
from pretrain_throughput import write_jpegs  # noqa: E402

from bt_hub.common.optional import MissingDependencyError  # noqa: E402
from bt_hub.data.datasets import build_dataset  # noqa: E402
from bt_hub.data.decode import Decoding, PackedItems, collate_packed, nvimgcodec  # noqa: E402
from bt_hub.data.decode_auto import decode_choice  # noqa: E402
from bt_hub.data.precision import autocast_dtype, resolve_precision  # noqa: E402
from bt_hub.data.store import StoreView, open_store, store_device  # noqa: E402
from bt_hub.eval.features import EncodedItems, extract_features  # noqa: E402
from bt_hub.method.model import build_backbone  # noqa: E402
from bt_hub.method.transforms import IMAGENET_MEAN, IMAGENET_STD, DeviceEvalTransform, eval_transforms  # noqa: E402

ROWS = "abtnwsicp"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _backbone(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_backbone(args.arch, small_image_stem=args.small_image_stem).eval().to(device)


def ceiling(args: argparse.Namespace, device: torch.device, precision: str) -> float:
    """(a): forward passes of the backbone on one batch in device memory; images/s."""
    net = _backbone(args, device).to(memory_format=torch.channels_last)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    x = x.contiguous(memory_format=torch.channels_last)
    amp = autocast_dtype(precision)
    with torch.no_grad(), torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
        for _ in range(args.warmup):
            net(x)
        _sync(device)
        tick = time.perf_counter()
        for _ in range(args.steps):
            net(x)
        _sync(device)
    return args.batch_size * args.steps / (time.perf_counter() - tick)


def chosen_decoding(args: argparse.Namespace, data: Path, device: torch.device, decode: str) -> tuple[Decoding, str]:
    """``--decode decode`` resolved as ``bt-hub eval`` resolves it (``auto``: timed, or read from its cache); why."""
    chosen = decode_choice(decode, device, data, args.workers)
    return chosen.decoding, chosen.reason


def bt_hub_extraction(
    args: argparse.Namespace, data: Path, device: torch.device, precision: str, decode: str, store: bool = False
) -> float:
    """(b), (t), (n), (w): ``extract_features`` over the files, as ``bt-hub eval`` runs it with ``--decode decode``;
    images/s of the timed pass. ``store``: (s), from the files' decoded store (made first, untimed, as a curve's
    first step does; on the GPU as ``--store auto`` puts it)."""
    net = _backbone(args, device)
    dataset: torch.utils.data.Dataset = build_dataset(str(data), "train", image_size=None)
    transform = eval_transforms(args.image_size) if decode == "workers" else DeviceEvalTransform(args.image_size)
    decoding = chosen_decoding(args, data, device, decode)[0]
    if store:
        stored = open_store(dataset, StoreView.for_eval(transform), None, num_workers=args.workers)
        dataset = stored.to(where) if (where := store_device("auto", stored.nbytes, device)).type != "cpu" else stored

    def run(ds: torch.utils.data.Dataset) -> None:
        extract_features(
            net,
            ds,
            transform=transform,
            batch_size=args.batch_size,
            device=device,
            num_workers=args.workers,
            precision=precision,
            desc="bt_hub",
            decoding=decoding,
        )

    if not store:  # a store is read whole every pass; its warm-up pass is the same as the timed one
        run(Subset(dataset, range(args.warmup * args.batch_size)))
    else:
        run(dataset)
    _sync(device)
    tick = time.perf_counter()
    run(dataset)
    _sync(device)
    return len(dataset) / (time.perf_counter() - tick)


def phases(args: argparse.Namespace, data: Path, device: torch.device, precision: str) -> str:
    """(p): milliseconds a batch of (b)'s device path spends in each phase, timed one after another with the device
    synchronised between them (no overlap, unlike (b)): the loader's read (with the workers' share decoded), the
    host-to-device copy and decode (``to_device_images``), the resize and crop (one call a size group), the
    normalisation, the forward pass."""
    from bt_hub.data.decode import to_device_images

    net = _backbone(args, device).to(memory_format=torch.channels_last)
    transform = DeviceEvalTransform(args.image_size)
    decoding = chosen_decoding(args, data, device, args.decode if args.decode != "workers" else "device")[0]
    items = EncodedItems(build_dataset(str(data), "train", image_size=None), decoding)
    loader = DataLoader(items, batch_size=args.batch_size, num_workers=args.workers, collate_fn=_packed)
    amp = autocast_dtype(precision)
    totals = dict.fromkeys(("read", "copy + decode", "resize + crop", "normalise", "forward"), 0.0)
    batches = 0
    tick = time.perf_counter()
    for i, packed in enumerate(loader):
        marks = [tick, time.perf_counter()]  # the wait for the loader's batch: its read
        images = to_device_images(packed, device, decoding.device or "torchvision")
        _sync(device)
        marks.append(time.perf_counter())
        crops = transform.crop(images) if isinstance(images, torch.Tensor) else transform(images)
        _sync(device)
        marks.append(time.perf_counter())
        x = transform.finish(crops) if isinstance(images, torch.Tensor) else crops
        _sync(device)
        marks.append(time.perf_counter())
        with torch.no_grad(), torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            net(x.contiguous(memory_format=torch.channels_last))
        _sync(device)
        marks.append(time.perf_counter())
        if i >= args.warmup:
            batches += 1
            for key, start, stop in zip(totals, marks, marks[1:]):
                totals[key] += stop - start
        tick = time.perf_counter()
    per_batch = {k: 1000 * v / max(batches, 1) for k, v in totals.items()}
    return "(p) ms a batch, phase by phase, synchronised: " + ", ".join(f"{k} {v:.1f}" for k, v in per_batch.items())


def _packed(items: list) -> PackedItems:
    return collate_packed([image for image, _ in items])


def _listed(items: list) -> list:
    return [image for image, _ in items]


def input_side(args: argparse.Namespace, data: Path, packed: bool) -> float:
    """(i): files/s of bt_hub's loader alone (one tensor a batch if ``packed``, else a list of tensors)."""
    dataset = EncodedItems(build_dataset(str(data), "train", image_size=None))

    def run(ds: torch.utils.data.Dataset) -> None:
        loader = DataLoader(
            ds, batch_size=args.batch_size, num_workers=args.workers, collate_fn=_packed if packed else _listed
        )
        for batch in loader:
            if packed:
                batch.unpack()

    run(Subset(dataset, range(args.warmup * args.batch_size)))
    tick = time.perf_counter()
    run(dataset)
    return len(dataset) / (time.perf_counter() - tick)


def reference_loop(args: argparse.Namespace, data: Path, device: torch.device, workers: int) -> float:
    """(c): ImageFolder + PIL transforms in workers, fp32 on the CPU / fp16 autocast on CUDA, NCHW; images/s."""
    net = _backbone(args, device)
    transform = T.Compose(
        [
            T.Resize(round(args.image_size * 256 / 224)),
            T.CenterCrop(args.image_size),
            T.ToTensor(),
            T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    dataset = datasets.ImageFolder(str(data), transform=transform)

    def run(ds: torch.utils.data.Dataset) -> None:
        loader = DataLoader(ds, batch_size=args.batch_size, num_workers=workers, pin_memory=device.type == "cuda")
        with torch.no_grad(), torch.autocast(device.type, enabled=device.type == "cuda"):
            for images, _ in loader:
                net(images.to(device, non_blocking=True)).float().cpu()

    run(Subset(dataset, range(args.warmup * args.batch_size)))
    _sync(device)
    tick = time.perf_counter()
    run(dataset)
    _sync(device)
    return len(dataset) / (time.perf_counter() - tick)


def machine_line() -> str:
    """The CPU's model and vector flags (:func:`machine.cpu`), its logical CPUs, and the load now (``uptime``)."""
    uptime = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    return f"CPU: {machine.cpu()}; {os.cpu_count()} logical CPUs\nuptime: {uptime}"


def _table(rows: dict[str, float], header: str) -> str:
    ceiling_rate = rows.get("(a) ceiling: backbone on in-memory tensors")
    reference_rate = next((v for k, v in rows.items() if k.startswith("(c)")), None)
    lines = [header, f"{'row':<72}{'images/s':>10}{'vs (a)':>9}{'vs (c)':>9}"]
    for name, rate in rows.items():
        vs_a = f"{rate / ceiling_rate:.0%}" if ceiling_rate else "—"
        vs_c = f"{rate / reference_rate:.2f}x" if reference_rate else "—"
        lines.append(f"{name:<72}{rate:>10.1f}{vs_a:>9}{vs_c:>9}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--small-image-stem", action="store_true", help="3x3 stem without max-pool (32-px data)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2, help="batches of the untimed warm-up pass of each row")
    parser.add_argument("--steps", type=int, default=20, help="timed batches per row")
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="loader workers of (b), (c)")
    parser.add_argument(
        "--reference-workers", type=int, nargs="+", default=None, help="(c) once per count (default: --workers)"
    )
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"], help="(a) and (b)")
    parser.add_argument(
        "--decode", default="auto", choices=["auto", "device", "nvimgcodec", "workers"], help="(b)'s --decode"
    )
    parser.add_argument("--rows", default="abic", help="which of the rows a, b, t, n, w, s, i, c, p (phases) to run")
    parser.add_argument("--jpeg-size", default="500x375", help="WIDTHxHEIGHT of the generated JPEGs")
    parser.add_argument("--format", default="jpeg", choices=["jpeg", "png"], help="colour JPEGs or grey PNGs")
    parser.add_argument(
        "--data-dir", default=None, help="where the JPEGs go (reused when present); default: a temp dir"
    )
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for eval_throughput.txt (default: $OUT)")
    args = parser.parse_args()
    if set(args.rows) - set(ROWS):
        parser.error(
            f"--rows {args.rows}: unknown rows {''.join(sorted(set(args.rows) - set(ROWS)))}; the rows are {ROWS}"
        )
    if os.environ.get("BT_HUB_PARSE_ONLY"):  # the CPU suite's check of benchmarks/gpu_check.sh's command lines
        print(f"{Path(__file__).name}: parsed (BT_HUB_PARSE_ONLY is set: nothing run)")
        return
    device = torch.device(args.device)
    precision = resolve_precision(args.precision, device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    width, height = (int(v) for v in args.jpeg_size.split("x"))
    work = Path(tempfile.mkdtemp(prefix="bt_hub_eval_throughput_"))
    data = Path(args.data_dir) if args.data_dir else work / "jpegs"
    write_jpegs(data, args.batch_size * args.steps, width, height, max(args.workers, 1), args.format)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    header = (
        f"{args.arch}{' small stem' if args.small_image_stem else ''}, {args.image_size} px, batch "
        f"{args.batch_size}, {name}, bt_hub precision {precision}, channels-last, decode {args.decode}, "
        f"{args.workers} workers, {args.batch_size * args.steps} "
        f"{'grey PNGs' if args.format == 'png' else 'JPEGs q90'} {width}x{height}; torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads\n{machine_line()}"
    )
    print(header, flush=True)
    if set(args.rows) & set("bp"):  # auto's choice, timed now (or read from its cache) before any row
        print(f"(b) decode: {chosen_decoding(args, data, device, args.decode)[1]}", flush=True)
    if "n" in args.rows:
        try:
            print(f"(n) nvImageCodec {nvimgcodec().__version__}", flush=True)
        except MissingDependencyError as err:
            print(f"(n) skipped: {err}", flush=True)
            args.rows = args.rows.replace("n", "")
    rows: dict[str, float] = {}
    reference = "fp16 autocast" if device.type == "cuda" else "fp32"
    runs = [
        ("a", "(a) ceiling: backbone on in-memory tensors", lambda: ceiling(args, device, precision)),
        (
            "b",
            f"(b) bt_hub extract_features from files ({precision}, decode {args.decode})",
            lambda: bt_hub_extraction(args, data, device, precision, args.decode),
        ),
        (
            "t",
            f"(t) bt_hub extract_features from files ({precision}, decode device: torchvision)",
            lambda: bt_hub_extraction(args, data, device, precision, "device"),
        ),
        (
            "n",
            f"(n) bt_hub extract_features from files ({precision}, decode nvimgcodec)",
            lambda: bt_hub_extraction(args, data, device, precision, "nvimgcodec"),
        ),
        (
            "w",
            f"(w) bt_hub extract_features from files ({precision}, decode workers)",
            lambda: bt_hub_extraction(args, data, device, precision, "workers"),
        ),
        (
            "s",
            f"(s) bt_hub extract_features from the decoded store ({precision})",
            lambda: bt_hub_extraction(args, data, device, precision, "device", store=True),
        ),
    ]
    runs += [
        (
            "i",
            f"(i) input side: bt_hub's loader, one tensor a batch, {args.workers} workers (files/s)",
            lambda: input_side(args, data, packed=True),
        ),
        (
            "i",
            f"(i) input side: the same, a list of tensors a batch, {args.workers} workers (files/s)",
            lambda: input_side(args, data, packed=False),
        ),
    ]
    runs += [
        (
            "c",
            f"(c) reference: ImageFolder + PIL transforms in {n} workers ({reference})",
            lambda n=n: reference_loop(args, data, device, n),
        )
        for n in args.reference_workers or [args.workers]
    ]
    if "p" in args.rows:
        print(phases(args, data, device, precision), flush=True)
    for key, label, run in runs:
        if key in args.rows:
            tick = time.perf_counter()
            rows[label] = run()
            print(f"{label}: {rows[label]:.1f} images/s ({time.perf_counter() - tick:.0f} s)", flush=True)
    table = _table(rows, header) + f"\nuptime after: {machine_line().splitlines()[-1].removeprefix('uptime: ')}"
    b = next((v for k, v in rows.items() if k.startswith("(b)")), None)
    c = next((v for k, v in rows.items() if k.startswith("(c)")), None)
    if b and c:
        table += f"\nspeedup: {b / c:.2f}x (bt_hub {b:.1f} images/s vs reference {c:.1f} images/s)"
    print("\n" + table)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "eval_throughput.txt").write_text(table + "\n")
    if not args.data_dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
