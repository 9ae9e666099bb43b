"""A learning curve's seconds per cell on the CPU: each row's linear cell scored alone against the rows' linear cells
scored together (issue 42, item 4), in one run.

    python benchmarks/curve_cells.py                                    # 1,200 + 300 PNGs, 10 kept steps (minutes)
    python benchmarks/curve_cells.py --train 48 --val 12 --steps 2      # a check that it runs (~1 min)

Writes TRAIN + VAL distinct grey 28-px PNGs in 10 classes (pretrain_throughput.py's pictures) into a temporary
folder, pretrains a ``--preset cifar`` run on train/ for STEPS steps keeping each one (batch 32, projector 64-64: the
curve scores the backbone's 512-d features, whatever the run learnt), then runs ``bt-hub eval compare --over-steps
--protocols linear knn --baselines pixels random-init --seeds 1`` of it twice in this process, each into a fresh
folder (its own feature cache and decoded store):

- *together*, as compare runs now: at a column's first cell ``linear.score_cells`` trains the grids of every row
  whose features share a width (the kept steps and random-init) as one set of heads, pixels' as another;
- *alone*, as compare ran before 481654a: ``linear.score_cells`` is patched to score its cells one by one (as
  tests/test_comparison.py does), so each row's linear cell is scored by itself, as ``linear.score_cell`` does.

Together runs first: whatever the first run warms up favours *alone*. The linear column comes first so that it
holds every row's feature extraction in both runs (the first column a row meets extracts its features, and
*together* meets every row's at its first cell) and the kNN column only its votes. The table gives each run's wall
seconds, seconds per cell, and its records' ``wall_time_s`` summed by column, beside the CPU's model, flags and
load average (the machine may be shared); the two runs' metrics must be equal.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import tempfile
import time
from pathlib import Path
from unittest import mock

import machine  # benchmarks/machine.py, beside this script
from pretrain_throughput import _photo

from bt_hub import cli
from bt_hub.eval import linear

COLUMNS = ("linear", "kNN")  # linear first: it holds every row's feature extraction in both runs


def bt_hub(argv: list[str]) -> float:
    """``bt-hub ARGV`` in this process, its printout and progress lines kept back (shown if it fails): its wall
    seconds."""
    tick, said = time.perf_counter(), io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        code = cli.main(argv)
    if code != 0:
        raise SystemExit(f"{said.getvalue()[-3000:]}\nbt-hub {' '.join(argv)} exited {code}")
    return time.perf_counter() - tick


def curve(flags: list[str], out: Path, alone: bool) -> tuple[float, list[dict]]:
    """``bt-hub eval compare FLAGS --out OUT``: its wall seconds and records; ``alone``: each linear cell by itself."""
    together = linear.score_cells
    one_by_one = (lambda cells, *args: [together([c], *args)[0] for c in cells]) if alone else together
    with mock.patch.object(linear, "score_cells", one_by_one):
        seconds = bt_hub([*flags, "--out", str(out)])
    return seconds, [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=1200, help="training PNGs (pretraining and the classifiers)")
    parser.add_argument("--val", type=int, default=300, help="held-out PNGs (val/, what the cells score)")
    parser.add_argument("--steps", type=int, default=10, help="pretraining steps, each one kept: the curve's rows")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--workers", type=int, default=2, help="loader workers of pretraining and compare")
    args = parser.parse_args()
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    runs = {}
    with tempfile.TemporaryDirectory() as work:
        data = Path(work) / "data"
        for i in range(args.train + args.val):
            folder = data / ("train" if i < args.train else "val") / f"class{i % 10}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{i:05d}.png").write_bytes(_photo(i, 28, 28, "png"))
        common = ["--device", "cpu", "--threads", str(args.threads), "--num-workers", str(args.workers)]
        pretraining = ["pretrain", "--data", str(data / "train"), "--preset", "cifar", "--batch-size", "32"]
        pretraining += ["--projector", "64-64", "--warmup-epochs", "1", "--max-steps", str(args.steps)]
        pretraining += ["--keep-every", "1", "--store-dir", f"{work}/decoded", "--out", f"{work}/run", *common]
        pretrained = bt_hub(pretraining)
        flags = ["eval", "compare", "--weights", f"{work}/run", "--over-steps", "--data", str(data)]
        flags += ["--image-size", "32", "--protocols", "linear", "knn", "--baselines", "pixels", "random-init"]
        flags += ["--seeds", "1", *common]
        for label, alone in (("together (score_cells)", False), ("alone, cell by cell (score_cell)", True)):
            runs[label] = curve(flags, Path(work) / f"curve-{int(alone)}", alone)
    (after, together), (before, alone) = runs.values()
    same = [(r["notes"]["compare"], r["metrics"]) for r in together] == [
        (r["notes"]["compare"], r["metrics"]) for r in alone
    ]
    print(f"cpu: {machine.cpu()}")
    print(f"load average before / after: {load} / {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(
        f"{args.train} + {args.val} grey 28-px PNGs at 32 px; {args.steps} kept steps of a --preset cifar run "
        f"(pretrained in {pretrained:.0f} s) + pixels + random-init = {len(together) // 2} rows x 2 columns; "
        f"torch threads {args.threads}, loader workers {args.workers}\n"
    )
    print("| linear cells scored | compare wall s | s per cell | linear column s (+ extraction) | kNN column s |")
    print("|---|---|---|---|---|")
    for label, (seconds, records) in runs.items():
        by_column = [sum(r["wall_time_s"] for r in records if r["notes"]["compare"]["column"] == c) for c in COLUMNS]
        cells = " | ".join(f"{s:.1f}" for s in by_column)
        print(f"| {label} | {seconds:.1f} | {seconds / len(records):.2f} | {cells} |")
    print(f"\ntogether / alone: {after / before:.2f}x wall; every cell's metrics equal: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
