"""The fine-tuning budget of `bt-hub eval compare`'s semi columns and supervised baseline, chosen on a held-out
part of the digits' training split (never the test split).

    python benchmarks/finetune_budget.py --weights demo_out/pretrain/kept/step-000880.safetensors
    python benchmarks/finetune_budget.py --weights RUN --epochs 30 100 200 --seeds 2

For each `--epochs` E, `bt-hub eval compare --protocols semi --fractions 10 --baselines supervised
--holdout 0.2 --semi.min-steps 0` fine-tunes the given weights and trains the same network from
scratch on 10% of the labels of the other 80% (115 digits, 4 steps of 32 per epoch) for E
epochs, and scores both on the held-out 20%. The table gives
validation top-1 (mean ± std over the seeds) and the wall time, so the budget can be chosen
where the supervised row is far above chance (the aim: >= 80 at 10% of the labels) at a cost
that fits.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from machine import cpu  # noqa: E402

CLI = [sys.executable, "-c", "from bt_hub.cli import main; main()"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", required=True, help="pretrained weights (file or run folder)")
    parser.add_argument("--out", required=True, help="folder of the comparisons (a rerun reuses finished ones)")
    parser.add_argument("--epochs", type=int, nargs="+", default=[30, 100, 200], help="budgets to measure")
    parser.add_argument("--seeds", type=int, default=2, help="seeds per cell")
    parser.add_argument("--image-size", type=int, default=8, help="side of the digits in pixels")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the comparison")
    args = parser.parse_args()
    print(f"CPU: {cpu()}")
    rows = ["| epochs at 10% | fine-tuned weights | supervised from scratch | wall s |", "|---|---|---|---|"]
    for epochs in args.epochs:
        out = Path(args.out) / f"epochs-{epochs}"
        tick = time.perf_counter()
        if not (out / "results.json").exists():
            command = ["eval", "compare", "--weights", args.weights, "--protocols", "semi", "--fractions", "10"]
            command += ["--baselines", "supervised", "--semi.epochs", str(epochs), "--supervised-epochs", str(epochs)]
            command += ["--semi.min-steps", "0"]  # the epochs as given
            command += ["--data", "digits", "--holdout", "0.2", "--image-size", str(args.image_size)]
            command += ["--seeds", str(args.seeds), "--out", str(out), "--overwrite", "--threads", str(args.threads)]
            subprocess.run([*CLI, *command], check=True)
        table = json.loads((out / "results.json").read_text())["table"]
        weights = next(row for row in table if row != "supervised")
        cells = [table[row]["semi 10%"]["mean_std"] for row in (weights, "supervised")]
        rows.append(f"| {epochs} | {' | '.join(cells)} | {time.perf_counter() - tick:.0f} |")
        print("\n".join(rows), flush=True)


if __name__ == "__main__":
    main()
