"""How far RankMe can choose a checkpoint on the digits: its Spearman correlation with kNN and with linear top-1,
across recipe variants and across the kept steps of one run, per pretraining seed (issue 48); never the test split.

    python benchmarks/rankme_correlation.py --out runs/rankme_study  # docs/evaluation.md's table (45 min, 2 busy cores)
    python benchmarks/rankme_correlation.py --out /tmp/check --seeds 1 --epochs 2 --curve-points 3   # that it runs

For each pretraining seed s (0, 1, ...) and each recipe (the ``digits`` preset of ``bt-hub pretrain`` at
``--batch-size`` and ``--epochs``, and six variants that each change one thing: λ, the projector's widths, the LR, the
epochs; chosen before any was scored, to span a range of quality), ``bt-hub pretrain --preset digits --seed s`` on the
digits' training split of seed s (``--seed`` also draws the digits' train/test split), the default recipe keeping
``--curve-points`` log-spaced steps as ``bt-hub demo`` does (eval/demo.py's ``curve_steps``). Every checkpoint (each
recipe's final weights, with their projector; each earlier kept step of the default recipe, a backbone alone: a kept
step carries no projector) is scored with ``--seed s --holdout HOLDOUT``, so all three stay inside that training split:

- ``bt-hub eval knn --k 20`` and ``bt-hub eval linear --search grid`` (the demo's two columns): top-1 on the held-out
  share of the training split, the bank and the classifier fitted on the rest;
- ``bt-hub eval rankme`` on the rest (``--split train``): the images kNN's bank and the linear head are fitted on, read
  without their labels. The held-out share (287 digits at 0.2) would cap the backbone's RankMe at 287, under its 512
  dimensions, and RankMe wants more images than dimensions (the paper reads 25,600).

Then, per seed, Spearman's rho (scipy.stats.spearmanr) of RankMe (the backbone's; the projector's where every
checkpoint carries one) with kNN top-1 and with linear top-1 (a) across the recipes' final weights and (b) across the
default run's kept steps, and the top-1 lost by keeping the checkpoint of the highest RankMe instead of the best one;
mean ± std (n - 1) over the seeds. Writes into ``--out`` (new, empty, or a study's own, continued): the runs, the
evaluations, ``study.md`` (the tables beside the CPU's model and flags and the load average: the machine may be
shared) and ``study.json`` (every command with its seconds, every checkpoint's numbers, every rho), both rewritten
after each seed. Run again into the same ``--out``, each finished pretraining run is reused (``--resume auto``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import machine  # benchmarks/machine.py, beside this script
import numpy as np
from scipy.stats import spearmanr

from bt_hub import cli
from bt_hub.common.config import from_preset
from bt_hub.common.files import atomic_write_json, atomic_write_text
from bt_hub.common.records import mean_std
from bt_hub.eval.demo import DIGITS, DemoConfig, curve_steps
from bt_hub.train.run_folder import kept_path

DEFAULT = "digits preset"
SCORES = {"rankme": "backbone", "rankme_projector": "projector"}
ACCURACIES = {"knn": "kNN", "linear": "linear"}
SETS = {"recipes": "the 7 recipes' final weights", "kept": "the digits preset's kept steps"}


def recipes(epochs: int) -> dict[str, dict[str, str]]:
    """The default recipe (no flag changed) and six variants of it, each changing one setting (the LR variant scales
    the biases' LR with the weights', as the demo does): flag -> value."""
    lr = DIGITS["lr_weights"] / 8
    return {
        DEFAULT: {},
        "lambd 0.01": {"--lambd": "0.01"},
        "lambd 1": {"--lambd": "1"},
        "projector 128-128-8": {"--projector": "128-128-8"},
        "projector 512-512-128": {"--projector": "512-512-128"},
        f"lr-weights {lr:g}": {
            "--lr-weights": f"{lr:g}",
            "--lr-biases": f"{lr * DIGITS['lr_biases'] / DIGITS['lr_weights']:g}",
        },
        f"epochs {max(1, epochs // 2)}": {"--epochs": str(max(1, epochs // 2))},
    }


def correlate(points: Sequence[Mapping[str, Any]], score: str, accuracy: str) -> dict[str, float]:
    """Over one seed's checkpoints: Spearman's rho of ``score`` with ``accuracy``, and the ``accuracy`` lost by
    keeping the checkpoint of the highest ``score`` instead of the best one (both NaN where one lacks the score)."""
    if any(p.get(score) is None for p in points):
        return {"rho": math.nan, "lost": math.nan}
    scores, accuracies = [p[score] for p in points], [p[accuracy] for p in points]
    rho = spearmanr(scores, accuracies)[0]
    return {"rho": float(rho), "lost": max(accuracies) - accuracies[int(np.argmax(scores))]}


def summarise(by_seed: Mapping[int, Sequence[Mapping[str, Any]]], score: str, accuracy: str) -> dict[str, Any]:
    """:func:`correlate` on each seed's checkpoints, and the mean and std (n - 1) of its rho and loss over the
    seeds."""
    per_seed = {seed: correlate(points, score, accuracy) for seed, points in by_seed.items()}
    return {"per_seed": per_seed} | {key: mean_std([v[key] for v in per_seed.values()]) for key in ("rho", "lost")}


def cell(summary: Mapping[str, Any], key: str, digits: int) -> str:
    """``0.43 ± 0.20 (0.57, 0.29)``: mean ± std over seeds, then each seed's value."""
    values = [v[key] for v in summary["per_seed"].values()]
    if any(math.isnan(v) for v in values):
        return "—"
    mean, std = summary[key]
    return f"{mean:.{digits}f} ± {std:.{digits}f} ({', '.join(f'{v:.{digits}f}' for v in values)})"


def tables(points: Sequence[Mapping[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """The correlation table and every checkpoint's numbers (mean ± std over seeds), as markdown; the summaries."""
    lines = [
        "| checkpoints, per seed | RankMe of | ρ with kNN top-1 | ρ with linear top-1 | kNN top-1 lost by RankMe's "
    ]
    lines[0] += "pick | linear top-1 lost by RankMe's pick |"
    lines.append("|---|---|---|---|---|---|")
    summaries = []
    for name, label in SETS.items():
        by_seed: dict[int, list[Mapping[str, Any]]] = {}
        for p in points:
            if name in p["sets"]:
                by_seed.setdefault(p["seed"], []).append(p)
        for score, output in SCORES.items() if by_seed else ():
            found = {a: summarise(by_seed, score, a) for a in ACCURACIES}
            summaries.append({"checkpoints": name, "score": score, **found})
            rho = " | ".join(cell(found[a], "rho", 2) for a in ACCURACIES)
            lost = " | ".join(cell(found[a], "lost", 1) for a in ACCURACIES)
            lines.append(f"| {label} | {output} | {rho} | {lost} |")
    lines += [
        "",
        "| checkpoint | RankMe (backbone) | RankMe (projector) | kNN top-1 | linear top-1 |",
        "|---|---|---|---|---|",
    ]
    for name in dict.fromkeys((p["recipe"], p["step"]) for p in points):
        same = [p for p in points if (p["recipe"], p["step"]) == name]
        values = [[p.get(k) for p in same] for k in (*SCORES, *ACCURACIES)]
        shown = ["—" if None in v else "{:.1f} ± {:.1f}".format(*mean_std(v)) for v in values]
        lines.append(f"| {name[0]}, step {name[1]} | {' | '.join(shown)} |")
    return "\n".join(lines), summaries


def bt_hub(argv: list[str], commands: list[dict[str, Any]]) -> None:
    """``bt-hub ARGV`` in this process, its printout kept back (shown if it fails); the command line and its wall
    seconds are printed and added to ``commands``."""
    tick, said = time.perf_counter(), io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        code = cli.main(argv)
    if code != 0:
        raise SystemExit(f"{said.getvalue()[-3000:]}\nbt-hub {shlex.join(argv)} exited {code}")
    commands.append({"command": f"bt-hub {shlex.join(argv)}", "seconds": round(time.perf_counter() - tick, 1)})
    print(f"{commands[-1]['seconds']:7.1f} s  {commands[-1]['command']}", flush=True)


def score(weights: str, folder: str, seed: int, args: argparse.Namespace, commands: list[dict[str, Any]]) -> dict:
    """RankMe (backbone, and projector where ``weights`` carry one), kNN and linear top-1 of ``weights``, evaluated
    into ``folder``/{rankme,knn,linear} on the digits' training split of ``seed``, held-out share and rest."""
    shared = ["--weights", weights, "--data", "digits", "--holdout", str(args.holdout), "--seed", str(seed)]
    shared += ["--threads", str(args.threads), "--cache-dir", "cache"]
    numbers: dict[str, Any] = {}
    for protocol, flags in (("rankme", []), ("knn", ["--k", "20"]), ("linear", ["--search", "grid"])):
        bt_hub(["eval", protocol, *flags, *shared, "--out", f"{folder}/{protocol}"], commands)
        metrics = json.loads(Path(folder, protocol, "results.json").read_text())["metrics"]
        numbers |= {k: metrics.get(k) for k in SCORES} if protocol == "rankme" else {protocol: metrics["top1"]}
    return numbers


def study_seed(seed: int, steps: list[int], args: argparse.Namespace, study: dict[str, Any]) -> None:
    """Pretrain every recipe with ``seed`` and score its checkpoints into ``study`` (``points``, ``commands``)."""
    base = {"--batch-size": str(args.batch_size), "--epochs": str(args.epochs), "--threads": str(args.threads)}
    for recipe, changed in recipes(args.epochs).items():
        run = f"seed{seed}/{recipe.replace(' ', '_')}"
        flags = base | changed | ({"--keep-every": ",".join(map(str, steps))} if recipe == DEFAULT else {})
        flags |= {"--seed": str(seed), "--resume": "auto", "--out": run}
        commands: list[dict[str, Any]] = []
        bt_hub(["pretrain", "--preset", "digits", *(v for pair in flags.items() for v in pair)], commands)
        last = json.loads(Path(run, "config.json").read_text())["steps"]
        kept = [(step, str(kept_path(Path(run), step))) for step in steps[:-1]] if recipe == DEFAULT else []
        for step, weights in [*kept, (last, run)]:
            sets = ["kept"] if step != last else ["recipes", "kept"] if recipe == DEFAULT else ["recipes"]
            point = {"seed": seed, "recipe": recipe, "step": step, "weights": weights, "sets": sets}
            point |= score(weights, f"{run}/eval-step{step}", seed, args, commands)
            study["points"].append(point | {"commands": commands})
            commands = []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the study's folder: new, empty, or a study's own (continued)")
    parser.add_argument("--seeds", type=int, default=3, help="pretraining seeds 0, 1, ...")
    parser.add_argument("--batch-size", type=int, default=256, help="pretraining batch (the digits preset's)")
    parser.add_argument("--epochs", type=int, default=15, help="pretraining epochs (the digits preset's: 40)")
    parser.add_argument("--curve-points", type=int, default=5, help="kept steps of the default recipe (the demo's: 5)")
    parser.add_argument("--holdout", type=float, default=0.2, help="held-out share of each seed's training split")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of every command (on 2 cores shared with other jobs, 2 threads ran a pretraining step "
        "7x slower than 1)",
    )
    args = parser.parse_args()
    out = Path(args.out)
    if out.is_dir() and any(out.iterdir()) and not (out / "seed0").is_dir():
        raise SystemExit(f"--out {out} holds files and no study (seed0/): choose a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(out)  # every command and record names the study's files relative to --out
    pretrain = {"epochs": args.epochs, "batch_size": args.batch_size}
    demo = from_preset(DemoConfig, pretrain=pretrain, curve_points=args.curve_points)
    steps = curve_steps(demo)
    tick, load = time.perf_counter(), " ".join(f"{v:.2f}" for v in os.getloadavg())
    study: dict[str, Any] = {"benchmark": shlex.join(["python", *sys.argv]), "cpu": machine.cpu(), "points": []}
    study |= {"settings": vars(args), "kept_steps": steps, "recipes": recipes(args.epochs)}
    for seed in range(args.seeds):
        study_seed(seed, steps, args, study)
        table, study["correlations"] = tables(study["points"])
        minutes = (time.perf_counter() - tick) / 60
        study["wall_minutes"] = round(minutes, 1)
        text = [
            f"`{study['benchmark']}`, {minutes:.0f} min; cpu: {study['cpu']}",
            f"load average at the start / now: {load} / {' '.join(f'{v:.2f}' for v in os.getloadavg())}",
            f"seeds 0-{seed}; pretraining batch {args.batch_size}, {args.epochs} epochs; kept steps {steps}; "
            f"held-out share {args.holdout}",
            "",
            table,
        ]
        atomic_write_json("study.json", study)
        atomic_write_text("study.md", "\n".join(text) + "\n")
    print("\n".join(text))


if __name__ == "__main__":
    main()
