"""Two CPU runs on the same cores: how much each slows down, by how torch's OpenMP threads wait.

Runs ``bt-hub pretrain --preset digits --max-steps STEPS`` alone, then two at once, under each way of waiting:
PyTorch's default (libgomp's threads spin for a while at every barrier before they sleep), ``OMP_WAIT_POLICY=PASSIVE``
(they sleep at once) and ``--threads 1`` (one thread a run, nothing to wait for). Prints a markdown table of the wall
seconds, the machine's CPU flags and its load average before and after: run it on an otherwise quiet machine.

    python benchmarks/shared_cores.py --steps 20 --precision fp32 bf16
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402

WAYS = {
    "PyTorch's default (threads spin, then sleep)": ({}, []),
    "OMP_WAIT_POLICY=PASSIVE (threads sleep)": ({"OMP_WAIT_POLICY": "PASSIVE"}, []),
    "--threads 1": ({}, ["--threads", "1"]),
}


def wall_seconds(
    runs: int, env: dict[str, str], flags: list[str], steps: int, precision: str, root: Path
) -> list[float]:
    """Start ``runs`` digits pretraining runs at once; the wall seconds each took."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    command = ["bt-hub", "pretrain", "--preset", "digits", "--max-steps", str(steps), "--precision", precision]
    started = time.perf_counter()
    processes = [
        subprocess.Popen(
            [*command, *flags, "--out", str(root / f"run{i}"), "--overwrite"],
            env={**base, **env},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i in range(runs)
    ]
    seconds = []
    for process in processes:
        if process.wait() != 0:
            raise SystemExit(f"{' '.join(command)} exited {process.returncode}")
        seconds.append(time.perf_counter() - started)
    return seconds


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="pretraining steps of each run")
    parser.add_argument(
        "--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"], help="each run's --precision"
    )
    args = parser.parse_args()
    print(f"CPU: {machine.cpu()}; {os.cpu_count()} cores; load average before: {os.getloadavg()[0]:.2f}")
    print(f"each run: bt-hub pretrain --preset digits --max-steps {args.steps} --precision P\n")
    print("| P | how the threads wait | alone (s) | two at once (s, each) | slower than alone |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for precision in args.precision:
            for way, (env, flags) in WAYS.items():
                (alone,) = wall_seconds(1, env, flags, args.steps, precision, Path(tmp))
                pair = wall_seconds(2, env, flags, args.steps, precision, Path(tmp))
                shown = " / ".join(f"{s:.1f}" for s in pair)
                print(f"| {precision} | {way} | {alone:.1f} | {shown} | {max(pair) / alone:.1f}x |", flush=True)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
