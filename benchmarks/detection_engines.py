"""Detection installation check, both engines on the same data and budget: AP, seconds per iteration, CPU time.

    # torchvision, then detectron2 if importable
    python benchmarks/detection_engines.py --out /tmp/detcheck
    python benchmarks/detection_engines.py --out /tmp/detcheck --engines torchvision --config shapes-coco
    # the same on a GPU
    python benchmarks/detection_engines.py --out /tmp/detgpu --device cuda
    # other shapes, other weights
    python benchmarks/detection_engines.py --out /tmp/detseed1 --data-seed 1 --weights-seed 1
    # the spread over seeds 0-4 (data seed = weights seed), and what a broken installation scores
    python benchmarks/detection_engines.py --out /tmp/detseeds --seeds 0 1 2 3 4 --broken

Writes the generated shapes (``bt-hub make-detection-data`` with its defaults) and a seeded
ResNet-50 at torchvision's default initialisation, exported with ``bt-hub export``, then runs
``bt-hub detect --engine E --detection-config shapes-voc`` for each engine in a child process limited
to ``--threads`` threads (both engines read the same YAML). The table gives the held-out AP,
AP50 and AP75 (box, and mask for ``shapes-coco``), the median seconds per training iteration,
the child's CPU time (user + sys, the number to compare with the CPU minutes of
docs/detection.md, "Check an installation"), its wall time, and the load average while it ran: on a shared machine wall
time is inflated by the neighbours, CPU time much less so. With several ``--seeds`` it adds
each engine's lowest, mean and highest box AP50. ``--broken`` scores each torchvision run's
trained model once more as three broken installations would: the class map shifted by one,
boxes read as (x, y, w, h), and the predictions scored against another image's annotations
(the wrong split). Runs already in ``--out`` are reused (delete a run's ``<config>/<engine>`` folder
to rerun it), so the seeds can run as separate processes and one last call prints them all.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import machine  # benchmarks/machine.py, beside this script
import numpy as np

BROKEN: dict[str, Callable[[dict[Any, dict[str, Any]], int], dict[Any, dict[str, Any]]]] = {
    "class map shifted by one": lambda preds, k: {i: {**p, "labels": (p["labels"] + 1) % k} for i, p in preds.items()},
    "boxes read as x, y, w, h": lambda preds, k: {
        i: {**p, "boxes": np.concatenate([p["boxes"][:, :2], p["boxes"][:, 2:] - p["boxes"][:, :2]], axis=1)}
        for i, p in preds.items()
    },
    "another image's annotations (wrong split)": lambda preds, k: dict(
        zip(list(preds)[1:] + list(preds)[:1], preds.values())
    ),
}


def _bt_hub(*args: str, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-m", "bt_hub.cli", *args], check=True, env=env)


def child_env(threads: int) -> dict[str, str]:
    """The environment of each child process: ``threads`` OpenMP/MKL threads that sleep while they wait.

    PASSIVE: on a shared machine spinning threads can multiply the CPU time of a step several
    times over (the compute is the same).
    """
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "OMP_WAIT_POLICY": "PASSIVE",
    }


def _weights(out: Path, env: dict[str, str], seed: int) -> Path:
    """A seeded ResNet-50 at torchvision's default initialisation, exported as a torchvision .pth by ``bt-hub export``.

    torchvision's own initialisation, not bt_hub's pretraining one (``zero_init_residual``): with every
    residual branch zeroed, the network starts as a chain of strided 1x1 shortcuts and the check
    measures that degenerate start more than the installation.
    """
    import torch
    import torchvision

    name = f"r50_torchvision_init_seed{seed}"  # the seed in the name: another --weights-seed never reuses these weights
    exported = sorted(out.glob(f"{name}-*.pth"))
    if exported:
        return exported[0]
    torch.manual_seed(seed)
    source = out / f"{name}_source.pth"
    torch.save(torchvision.models.resnet50().state_dict(), source)
    _bt_hub("export", "--weights", str(source), "--format", "torchvision", "--out", str(out / f"{name}.pth"), env=env)
    return sorted(out.glob(f"{name}-*.pth"))[0]


def run_engine(
    engine: str, config: str, data: Path, weights: Path, out: Path, env: dict[str, str], opts: list[str], device: str
) -> dict[str, Any]:
    """One ``bt-hub detect`` in a child process; its metrics, s/iteration, CPU and wall time, load."""
    run_dir = out / engine
    timing_file = run_dir / "timing.json"
    if not (run_dir / "results.json").is_file():
        before, load_before, start = resource.getrusage(resource.RUSAGE_CHILDREN), os.getloadavg()[0], time.time()
        _bt_hub(
            "detect",
            "--engine",
            engine,
            "--detection-config",
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


def broken_scores(run_dir: Path, data: Path) -> dict[str, float]:
    """Box AP50 of a torchvision run's trained model as it is, and under each mistake of ``BROKEN``."""
    import torch
    import yaml

    from bt_hub.eval.detection.config import Settings
    from bt_hub.eval.detection.data import load_records, locate
    from bt_hub.eval.detection.torchvision_engine.model import build_c4_model
    from bt_hub.eval.detection.torchvision_engine.trainer import evaluate_dataset, predict
    from bt_hub.method.model import build_backbone

    trial = run_dir / "trial0"
    settings = Settings(yaml.safe_load((trial / "config.yaml").read_text()), trial / "config.yaml")
    model = build_c4_model(settings, build_backbone(f"resnet{settings['MODEL.RESNETS.DEPTH']}"))
    model.load_state_dict(torch.load(trial / "checkpoint.pth", weights_only=True)["model"])
    (test,) = settings["DATASETS.TEST"]
    predictions = predict(model, load_records(locate(test, data))[0], torch.device("cpu"), with_masks=False)
    k = int(settings["MODEL.ROI_HEADS.NUM_CLASSES"])
    scores = {"as trained (no precise BN)": evaluate_dataset(data, test, predictions, with_masks=False)}
    scores |= {name: evaluate_dataset(data, test, f(predictions, k), with_masks=False) for name, f in BROKEN.items()}
    return {name: s["bbox"]["AP50"] for name, s in scores.items()}


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
    parser.add_argument(
        "--weights-seed", type=int, default=0, help="seed of the ResNet-50 at torchvision's default initialisation"
    )
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=None,
        help="run each seed S as data seed S and weights seed S (in --out/seed-S), instead of the two flags above",
    )
    parser.add_argument(
        "--broken", action="store_true", help="also score each torchvision run as three broken installations would"
    )
    parser.add_argument("opts", nargs="*", help="KEY VALUE overrides passed to both engines")
    args = parser.parse_args()

    engines = args.engines
    if engines is None:
        try:
            import detectron2  # noqa: F401

            engines = ["torchvision", "detectron2"]
        except ImportError:
            engines = ["torchvision"]
    env = child_env(args.threads)
    runs = [(s, s, args.out / f"seed-{s}") for s in args.seeds] if args.seeds else []
    runs = runs or [(args.data_seed, args.weights_seed, args.out)]
    results = []
    for data_seed, weights_seed, out in runs:
        out.mkdir(parents=True, exist_ok=True)
        data = out / "data"
        _bt_hub("make-detection-data", "--out", str(data), "--seed", str(data_seed), env=env)
        weights = _weights(out, env, weights_seed)
        for engine in engines:
            result = run_engine(engine, args.config, data, weights, out / args.config, env, args.opts, args.device)
            if args.broken and engine == "torchvision":
                result["broken"] = broken_scores(out / args.config / engine, data)
            results.append({**result, "seeds": f"{data_seed} / {weights_seed}"})

    tasks = ["bbox", "segm"] if any("segm_AP" in r for r in results) else ["bbox"]
    metrics = [f"{t}_{m}" for t in tasks for m in ("AP", "AP50", "AP75")]
    print(f"config {args.config}, device {args.device}, {args.threads} threads, {os.cpu_count()} CPU cores")
    print(f"CPU: {machine.cpu()}")
    print(
        "| engine | data / weights seed | "
        + " | ".join(metrics)
        + " | s/iter (median) | CPU min (user+sys) | wall min | load avg (start, end) |"
    )
    print("|---" * (len(metrics) + 6) + "|")
    for r in results:
        cells = [f"{r.get(m, float('nan')):.1f}" for m in metrics]
        load = ", ".join(f"{v:.1f}" for v in r["load"])
        print(
            f"| {r['engine']} | {r['seeds']} | "
            + " | ".join(cells)
            + f" | {r['s_per_iter']:.2f} | {r['cpu_s'] / 60:.1f} | {r['wall_s'] / 60:.1f} | {load} |"
        )
    if len(runs) > 1:
        print("\n| engine | seeds | box AP50 lowest | mean | highest |\n|---|---|---|---|---|")
        for engine in engines:
            ap50 = [r["bbox_AP50"] for r in results if r["engine"] == engine]
            print(f"| {engine} | {len(ap50)} | {min(ap50):.1f} | {statistics.fmean(ap50):.1f} | {max(ap50):.1f} |")
    broken = [r for r in results if "broken" in r]
    if broken:
        names = list(broken[0]["broken"])
        print("\n| data / weights seed | " + " | ".join(f"box AP50: {n}" for n in names) + " |")
        print("|---" * (len(names) + 1) + "|")
        for r in broken:
            print(f"| {r['seeds']} | " + " | ".join(f"{r['broken'][n]:.1f}" for n in names) + " |")


if __name__ == "__main__":
    main()
