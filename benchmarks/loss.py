"""Time and peak extra memory of the reference Barlow Twins loss vs ours, forward + backward.

The reference is facebookresearch/barlowtwins main.py's formulation (BatchNorm1d without
affine, the D x D cross-correlation C, fp32); ours is ``barlow_twins_loss(method="auto")``,
which picks the N x N Gram form when 2N < D. Both run in this process on the same inputs.

Peak extra memory is measured beyond the inputs: on CUDA with ``max_memory_allocated``;
on CPU as the rise of the process's resident-set high-water mark (VmHWM, reset through
/proc/self/clear_refs before each measurement), with glibc told to map every block of
64 KiB or more on its own so that freed memory leaves the resident set; it includes the
gradients of the two N x D inputs for both sides. Reference cells that would not fit (estimated from D²) or
would run too long (extrapolated from the reference's measured FLOP rate) are skipped
and marked so.

    python benchmarks/loss.py                        # the whole grid
    python benchmarks/loss.py --n 256 --d 8192 65536 --repeats 3
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from bt_hub.method.loss import barlow_twins_loss, choose_method

LAMBD = 0.0051
# C, its gradient, the in-place diagonal/off-diagonal temporaries: about four D x D fp32 matrices.
REFERENCE_DxD_COPIES = 4


def off_diagonal(x: torch.Tensor) -> torch.Tensor:
    """facebookresearch/barlowtwins main.py."""
    n, m = x.shape
    return x.flatten()[:-1].view(n - 1, n + 1)[:, 1:].flatten()


def reference_loss(z1: torch.Tensor, z2: torch.Tensor, bn: nn.Module) -> torch.Tensor:
    """facebookresearch/barlowtwins main.py, one process."""
    c = bn(z1).T @ bn(z2)
    c.div_(z1.shape[0])
    on_diag = torch.diagonal(c).add_(-1).pow_(2).sum()
    off_diag = off_diagonal(c).pow_(2).sum()
    return on_diag + LAMBD * off_diag


def ours_loss(z1: torch.Tensor, z2: torch.Tensor, bn: nn.Module) -> torch.Tensor:
    """bt_hub's loss, formulation chosen by cost."""
    return barlow_twins_loss(z1, z2, LAMBD, "auto").loss


def _map_large_blocks_separately() -> None:
    """Fixed glibc mmap threshold (64 KiB): large blocks are unmapped when freed, so RSS tracks live memory."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_mmap_threshold, m_trim_threshold = -3, -1
    libc.mallopt(m_mmap_threshold, 64 * 1024)
    libc.mallopt(m_trim_threshold, 64 * 1024)


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {key} line")


def _peak_extra_bytes(fn, device: torch.device) -> int:
    """Peak memory one call of ``fn`` adds beyond what is allocated before it."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - base) * 1024


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable line")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(loss_fn, z1: torch.Tensor, z2: torch.Tensor, repeats: int) -> dict:
    """Median seconds of forward + backward, peak extra bytes, and the loss value."""
    bn = nn.BatchNorm1d(z1.shape[1], affine=False).to(z1.device)
    result = {}

    def step() -> None:
        z1.grad = z2.grad = None
        loss = loss_fn(z1, z2, bn)
        loss.backward()
        result["loss"] = loss.item()

    step()  # warm-up
    z1.grad = z2.grad = None
    result["bytes"] = _peak_extra_bytes(step, z1.device)
    times = []
    for _ in range(repeats):
        z1.grad = z2.grad = None
        _sync(z1.device)
        start = time.perf_counter()
        step()
        _sync(z1.device)
        times.append(time.perf_counter() - start)
    z1.grad = z2.grad = None
    result["seconds"] = statistics.median(times)
    return result


def _reference_skip_reason(n: int, d: int, device: torch.device, args, flop_rate: float | None) -> str | None:
    need = REFERENCE_DxD_COPIES * d * d * 4
    if need > args.memory_fraction * _available_bytes(device):
        return f"needs ~{need / 2**30:.0f} GiB > {args.memory_fraction:.0%} of available"
    if flop_rate is not None:
        estimate = 6 * n * d * d / flop_rate
        if estimate > args.max_reference_seconds:
            return f"~{estimate:.0f} s per run > --max-reference-seconds"
    return None


def main(argv: list[str] | None = None) -> None:
    """Run the grid and print the table (markdown)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[256, 1024, 2048], help="batch sizes N")
    parser.add_argument(
        "--d", type=int, nargs="+", default=[2048, 8192, 16384, 32768, 65536], help="embedding widths D"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per cell (median reported), after one warm-up"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument(
        "--memory-fraction",
        type=float,
        default=0.5,
        help="skip the reference when ~4 D² floats exceed this share of free memory",
    )
    parser.add_argument(
        "--max-reference-seconds",
        type=float,
        default=120.0,
        help="skip the reference when one run is extrapolated to take longer",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        _map_large_blocks_separately()
    if args.threads:
        torch.set_num_threads(args.threads)

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = (
            f"CPU ({os.cpu_count()} cores), {torch.get_num_threads()} threads, "
            f"load average {os.getloadavg()[0]:.1f} at start"
        )
    print(
        f"# Barlow Twins loss, forward + backward, fp32 inputs; {name}; torch {torch.__version__}; "
        f"median of {args.repeats}"
    )
    print()
    print(
        "| N | D | ours | reference s | ours s | speed-up | reference extra MiB | ours extra MiB | memory ratio "
        "| rel. loss diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    flop_rate = None
    for n in args.n:
        for d in args.d:
            g = torch.Generator().manual_seed(args.seed)
            z1 = torch.randn(n, d, generator=g).to(device).requires_grad_()
            z2 = (z1.detach() + torch.randn(n, d, generator=g).to(device)).requires_grad_()
            ours = measure(ours_loss, z1, z2, args.repeats)
            method = choose_method(n, d)
            reason = _reference_skip_reason(n, d, device, args, flop_rate)
            cells = [str(n), str(d), method]
            if reason is None:
                ref = measure(reference_loss, z1, z2, args.repeats)
                rate = 6 * n * d * d / ref["seconds"]
                flop_rate = rate if flop_rate is None else max(flop_rate, rate)
                cells += [
                    f"{ref['seconds']:.4f}",
                    f"{ours['seconds']:.4f}",
                    f"{ref['seconds'] / ours['seconds']:.1f}x",
                    f"{ref['bytes'] / 2**20:.0f}",
                    f"{ours['bytes'] / 2**20:.0f}",
                    f"1/{ref['bytes'] / ours['bytes']:.1f}" if ours["bytes"] > 0 else "-",
                    f"{abs(ours['loss'] - ref['loss']) / abs(ref['loss']):.1e}",
                ]
            else:
                cells += [
                    f"skipped: {reason}",
                    f"{ours['seconds']:.4f}",
                    "-",
                    "-",
                    f"{ours['bytes'] / 2**20:.0f}",
                    "-",
                    "-",
                ]
            print("| " + " | ".join(cells) + " |", flush=True)
            del z1, z2
            gc.collect()


if __name__ == "__main__":
    main()
