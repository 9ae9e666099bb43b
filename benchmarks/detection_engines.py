"""Detection installation check, both engines on the same data and budget: AP, seconds per iteration, CPU time.

    # torchvision, then detectron2 if importable
    python benchmarks/detection_engines.py --out /tmp/detcheck
    python benchmarks/detection_engines.py --out /tmp/detcheck --engines torchvision --config shapes-coco
    # the same on a GPU
    python benchmarks/detection_engines.py --out /tmp/detgpu --device cuda
    # other shapes, other weights
    python benchmarks/detection_engines.py --out /tmp/detseed1 --data-seed 1 --weights-seed 1

Writes the generated shapes (``bt-hub make-detection-data``, 600 train / 100 test images of
128 px) and a seeded random ResNet-50 exported with ``bt-hub export``, then runs
``bt-hub detect --engine E --config shapes-voc`` for each engine in a child process limited
to ``--threads`` threads (both engines read the same YAML). The table gives the held-out AP,
AP50 and AP75 (box, and mask for ``shapes-coco``), the median seconds per training iteration,
the child's CPU time (user + sys, the number to compare with the "27 CPU minutes" of
docs/detection.md, "Check an installation"), its wall time, and the load average while it ran: on a shared machine wall
time is inflated by the neighbours, CPU time much less so. Runs already in ``--out`` are
reused (delete ``--out/<engine>`` to rerun one).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _bt_hub(*args: str, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-m", "bt_hub.cli", *args], check=True, env=env)


def _weights(out: Path, env: dict[str, str], seed: int) -> Path:
    """A seeded random torchvision ResNet-50, exported as a torchvision .pth by ``bt-hub export``."""
    import torch

    from bt_hub.method.model import build_backbone

    name = f"r50_random_seed{seed}"  # the seed in the name: another --weights-seed never reuses these weights
    exported = sorted(out.glob(f"{name}-*.pth"))
    if exported:
        return exported[0]
    torch.manual_seed(seed)
    source = out / f"{name}_source.pth"
    torch.save(build_backbone("resnet50").state_dict(), source)
    _bt_hub("export", "--weights", str(source), "--format", "torchvision", "--out", str(out / f"{name}.pth"), env=env)
    return sorted(out.glob(f"{name}-*.pth"))[0]


def run_engine(
    engine: str, config: str, data: Path, weights: Path, out: Path, env: dict[str, str], opts: list[str], device: str
) -> dict[str, object]:
    """One ``bt-hub detect`` in a child process; its metrics, s/iteration, CPU and wall time, load."""
    run_dir = out / engine
    timing_file = run_dir / "timing.json"
    if not (run_dir / "results.json").is_file():
        before, load_before, start = resource.getrusage(resource.RUSAGE_CHILDREN), os.getloadavg()[0], time.time()
        _bt_hub(
            "detect",
            "--engine",
            engine,
            "--config",
            config,
            "--weights",
            str(weights),
            "--data",
            str(data),
            "--out",
            str(run_dir),
            "--device",
            device,
            *opts,
            env=env,
        )
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        timing = {
            "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "wall_s": time.time() - start,
            "load": [load_before, os.getloadavg()[0]],
        }
        timing_file.write_text(json.dumps(timing))
    timing = json.loads(timing_file.read_text())
    record = json.loads((run_dir / "results.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "trial0" / "metrics.jsonl").read_text().splitlines()]
    return {
        "engine": engine,
        **record["metrics"],
        "s_per_iter": statistics.median(r["time"] for r in rows[1:] if "time" in r),
        **timing,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="working folder (data, weights, one run folder per engine)"
    )
    parser.add_argument(
        "--engines",
        nargs="+",
        default=None,
        help="torchvision and/or detectron2 (default: both, detectron2 when importable)",
    )
    parser.add_argument(
        "--config", default="shapes-voc", help="shapes-voc (Faster R-CNN, VOC AP) or shapes-coco (Mask R-CNN, COCO AP)"
    )
    parser.add_argument(
        "--threads", type=int, default=2, help="threads of each run (the check is specified for 2 CPU cores)"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (--device of bt-hub detect)")
    parser.add_argument("--data-seed", type=int, default=0, help="--seed of make-detection-data")
    parser.add_argument("--weights-seed", type=int, default=0, help="seed of the random ResNet-50")
    parser.add_argument("opts", nargs="*", help="KEY VALUE overrides passed to both engines")
    args = parser.parse_args()

    engines = args.engines
    if engines is None:
        try:
            import detectron2  # noqa: F401

            engines = ["torchvision", "detectron2"]
        except ImportError:
            engines = ["torchvision"]
    args.out.mkdir(parents=True, exist_ok=True)
    # PASSIVE: OpenMP threads sleep instead of spinning while they wait; on a shared machine the
    # spinning can multiply the CPU time of a step several times over (the compute is the same).
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "MKL_NUM_THREADS": str(args.threads),
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    data = args.out / "data"
    _bt_hub("make-detection-data", "--out", str(data), "--seed", str(args.data_seed), env=env)
    weights = _weights(args.out, env, args.weights_seed)
    results = [
        run_engine(e, args.config, data, weights, args.out / args.config, env, args.opts, args.device) for e in engines
    ]

    tasks = ["bbox", "segm"] if any("segm_AP" in r for r in results) else ["bbox"]
    metrics = [f"{t}_{m}" for t in tasks for m in ("AP", "AP50", "AP75")]
    print(
        f"config {args.config}, device {args.device}, {args.threads} threads, {os.cpu_count()} CPU cores, "
        f"data seed {args.data_seed}, weights seed {args.weights_seed}"
    )
    print(
        "| engine | "
        + " | ".join(metrics)
        + " | s/iter (median) | CPU min (user+sys) | wall min | load avg (start, end) |"
    )
    print("|---" * (len(metrics) + 5) + "|")
    for r in results:
        cells = [f"{r.get(m, float('nan')):.1f}" for m in metrics]
        load = ", ".join(f"{v:.1f}" for v in r["load"])
        print(
            f"| {r['engine']} | "
            + " | ".join(cells)
            + f" | {r['s_per_iter']:.2f} | {r['cpu_s'] / 60:.1f} | {r['wall_s'] / 60:.1f} | {load} |"
        )


if __name__ == "__main__":
    main()
