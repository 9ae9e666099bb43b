"""Known answers from the field's reference code, written as the fixtures of tests/test_against_reference.py.

    pip install iopath                     # VISSL's file layer (its svm_trainer imports it)
    python benchmarks/reference_fixtures.py --dino ~/src/dino --vissl ~/src/vissl --barlowtwins ~/src/barlowtwins

Each argument is a checkout of the reference repository (a git clone, or an exported tree with
``--commits dino=SHA vissl=SHA barlowtwins=SHA``); nothing of it is copied into bt_hub. The
script imports the reference functions from there, runs them on fixed seeded inputs and writes,
under ``--out`` (default tests/fixtures/reference/), one ``<name>.npz`` of inputs and one
``<name>.json`` of what the reference returned, with the repository, commit and function named:

- ``knn``: DINO ``eval_knn.knn_classifier`` on L2-normalised features (as eval_knn.py normalises
  them), T = 0.07, k = 20 and 200: top-1 / top-5, and each query's predicted class (the function
  returns only the two rates, so a query's class is the label ``c`` for which the query alone,
  repeated 100 times to fill DINO's 100 chunks, scores top-1 100).
- ``svm``: VISSL ``SVMTrainer`` (``vissl/utils/svm_utils/svm_trainer.py``) with the SVM settings
  of VISSL's ``defaults.yaml`` overridden by its VOC07 benchmark config
  (``eval_resnet_8gpu_transfer_voc07_svm.yaml``): ``train`` then ``test``; the cross-validated AP
  matrix, the chosen cost per class and the test AP. VISSL is imported as a package from the
  checkout, with two changes in its module's namespace: its per-class threads run one after
  another (``threading.Thread`` replaced), because its LinearSVCs take liblinear's shuffle seeds
  from numpy's global generator (seeded 0 here) and racing threads would draw them in a different
  order every run; and ``get_precision_recall``'s AP, a one-element array that NumPy 2 no longer
  stores into a matrix cell, is handed over as its one number.
- ``lars``: official Barlow Twins ``main.py``: ``BarlowTwins`` (its loss; backbone replaced by a
  ``Linear(24, 2048)`` and a ReLU so that ten steps take milliseconds, projector ``128-128-128``), ``LARS``
  with the two parameter groups and filters of ``main_worker``, ``adjust_learning_rate`` for
  global steps 5..14 of a 100-step run with 10 warm-up steps (five warm-up, five cosine), batch 32,
  fp32 on the CPU, the all_reduce in a one-process gloo group: the loss of every step and, after
  every step, each parameter's norm and its distance from the start.
- ``linear``: official Barlow Twins ``evaluate.py`` ``main_worker`` itself (``--weights freeze``,
  one epoch, batch 64, the defaults' LR 0.3 and weight decay 1e-6) with a feature table standing
  in for ResNet-50 and ImageFolder, on the CPU (``.cuda`` and ``set_device`` made no-ops, nccl
  replaced by gloo, DDP without ``device_ids``): the classifier's initial and trained weights, the
  loss of every step (``--print-freq 1``) and the epoch's top-1 / top-5 as its stats line gives them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import subprocess
import sys
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from bt_hub.common.files import atomic_write, atomic_write_json

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "reference"
KNN_KS = (20, 200)
KNN_T = 0.07
LARS_STEPS = range(5, 15)  # global steps of a run of LARS_TOTAL steps with LARS_WARMUP warm-up steps
LARS_TOTAL, LARS_WARMUP, LARS_BATCH, LARS_PROJECTOR, LARS_IN = 100, 10, 32, "128-128-128", 24
LINEAR_BATCH = 64


def _module(path: Path, name: str) -> types.ModuleType:
    """Import one file of a checkout under ``name``, its folder first on sys.path (its sibling imports)."""
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _commit(path: Path, given: str | None) -> str:
    if given:
        return given
    try:
        return subprocess.run(
            ["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as err:
        raise SystemExit(f"{path} is not a git checkout; name its commit with --commits NAME=SHA") from err


def _write(out: Path, name: str, inputs: dict[str, np.ndarray], record: dict[str, Any]) -> None:
    atomic_write(out / f"{name}.npz", lambda f: np.savez_compressed(f, **inputs))
    atomic_write_json(out / f"{name}.json", record)
    print(f"wrote {out / name}.npz and .json")


@contextlib.contextmanager
def _one_process_group() -> Iterator[None]:
    """A gloo group of one process, for reference code that calls torch.distributed unconditionally."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- kNN (DINO)


def knn_inputs(seed: int = 0) -> dict[str, np.ndarray]:
    """1000 training and 200 test features (32-d, 10 noisy Gaussian classes: top-1 well below 100)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(10, 32))
    train_y, test_y = rng.integers(0, 10, 1000), rng.integers(0, 10, 200)
    train_x = centres[train_y] + 3.0 * rng.standard_normal((1000, 32))
    test_x = centres[test_y] + 3.0 * rng.standard_normal((200, 32))
    return {
        "train_x": train_x.astype(np.float32),
        "train_y": train_y,
        "test_x": test_x.astype(np.float32),
        "test_y": test_y,
    }


def knn_fixture(dino: Path, commit: str, out: Path) -> None:
    eval_knn = _module(dino / "eval_knn.py", "dino_eval_knn")
    data = knn_inputs()
    train_x = F.normalize(torch.from_numpy(data["train_x"]), dim=1, p=2)  # as eval_knn.py before the classifier
    test_x = F.normalize(torch.from_numpy(data["test_x"]), dim=1, p=2)
    train_y, test_y = torch.from_numpy(data["train_y"]), torch.from_numpy(data["test_y"])
    results = {}
    for k in KNN_KS:
        top1, top5 = eval_knn.knn_classifier(train_x, train_y, test_x, test_y, k, KNN_T, 10)
        predictions = []
        for i in range(len(test_x)):
            query = test_x[i : i + 1].expand(100, -1)
            hits = [
                c
                for c in range(10)
                if eval_knn.knn_classifier(train_x, train_y, query, torch.full((100,), c), k, KNN_T, 10)[0] == 100.0
            ]
            predictions.append(hits[0])
        results[str(k)] = {"top1": top1, "top5": top5, "predictions": predictions}
    record = {
        "repository": "facebookresearch/dino",
        "commit": commit,
        "function": "eval_knn.knn_classifier(train_features, train_labels, test_features, test_labels, k, T, "
        "num_classes) on F.normalize(features, dim=1, p=2)",
        "temperature": KNN_T,
        "num_classes": 10,
        "results": results,
    }
    _write(out, "knn", data, record)


# ----------------------------------------------------------------------------- VOC07 SVM (VISSL)


def svm_inputs(seed: int = 0) -> dict[str, np.ndarray]:
    """VOC-coded multi-label features (1 present, 0 absent, -1 difficult only): 300 train, 300 test, 5 classes."""
    rng = np.random.default_rng(seed)
    directions = rng.normal(size=(5, 32))
    data = {}
    for split in ("train", "test"):
        present = rng.random((300, 5)) < 0.3
        present[np.arange(300), rng.integers(0, 5, 300)] = True
        features = np.abs(rng.standard_normal((300, 32))) * 2.5 + present @ directions
        targets = present.astype(np.int8)
        targets[(~present) & (rng.random((300, 5)) < 0.05)] = -1
        data[f"{split}_x"], data[f"{split}_y"] = features.astype(np.float32), targets
    return data


def svm_fixture(vissl: Path, commit: str, out: Path) -> None:
    import yaml

    sys.path.insert(0, str(vissl))
    from vissl.config import AttrDict
    from vissl.utils.svm_utils import svm_trainer

    svm_trainer.threading = types.SimpleNamespace(Thread=_InlineThread)
    get_precision_recall = svm_trainer.get_precision_recall

    def precision_recall_and_ap(*args: Any) -> tuple[Any, ...]:
        precision, recall, score, ap = get_precision_recall(*args)
        return precision, recall, score, ap.item()

    svm_trainer.get_precision_recall = precision_recall_and_ap
    defaults = yaml.safe_load((vissl / "vissl" / "config" / "defaults.yaml").read_text())["config"]["SVM"]
    voc07 = vissl / "configs/config/benchmark/linear_image_classification/voc07"
    voc07 = voc07 / "eval_resnet_8gpu_transfer_voc07_svm.yaml"
    benchmark = yaml.safe_load(voc07.read_text())["config"]["SVM"]
    config = {**defaults, **benchmark, "costs": {**defaults["costs"], **benchmark["costs"]}}
    data = svm_inputs()
    np.random.seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = svm_trainer.SVMTrainer(AttrDict(config), layer="heads", output_dir=tmp)
        trainer.train(data["train_x"].astype(np.float64), data["train_y"])
        trainer.test(data["test_x"].astype(np.float64), data["test_y"])
        test_ap = np.load(f"{tmp}/heads/test_ap.npy")[:, 0]
        crossval_ap = np.load(f"{tmp}/heads/crossval_ap.npy")
        chosen = np.load(f"{tmp}/heads/chosen_cost.npy")
    record = {
        "repository": "facebookresearch/vissl",
        "commit": commit,
        "function": "vissl.utils.svm_utils.svm_trainer.SVMTrainer(config.SVM).train(...) then .test(...), "
        "features as float64 (as its load_input_data casts them)",
        "config": config,
        "results": {
            "costs": [float(c) for c in trainer.costs_list],
            "chosen_cost": [float(c) for c in chosen],
            "crossval_ap": crossval_ap.tolist(),
            "test_ap": test_ap.tolist(),
        },
    }
    _write(out, "svm", data, record)


class _InlineThread:
    """``threading.Thread`` whose ``start`` runs the target at once, so that VISSL's classes run in order."""

    def __init__(self, target: Any, args: tuple[Any, ...] = ()) -> None:
        self.target, self.args = target, args

    def start(self) -> None:
        self.target(*self.args)

    def join(self) -> None:
        pass


# ----------------------------------------------------------------------------- ten LARS steps (main.py)


def lars_inputs(seed: int = 0) -> dict[str, np.ndarray]:
    """Initial weights (float16-exact, to keep the file small) of backbone + projector, and ten steps of views."""
    rng = np.random.default_rng(seed)
    sizes = [2048, *map(int, LARS_PROJECTOR.split("-"))]

    def weight(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float16)

    init = {
        "backbone.0.weight": weight(2048, LARS_IN),
        "backbone.0.bias": (0.1 * rng.standard_normal(2048)).astype(np.float16),
    }
    for i in range(len(sizes) - 1):
        init[f"projector.{3 * i}.weight"] = weight(sizes[i + 1], sizes[i])
        if i < len(sizes) - 2:
            init[f"projector.{3 * i + 1}.weight"] = (1 + 0.1 * rng.standard_normal(sizes[i + 1])).astype(np.float16)
            init[f"projector.{3 * i + 1}.bias"] = (0.1 * rng.standard_normal(sizes[i + 1])).astype(np.float16)
    views = rng.standard_normal((len(LARS_STEPS), 2, LARS_BATCH, LARS_IN)).astype(np.float32)
    return {**{f"init/{k}": v for k, v in init.items()}, "views": views}


def lars_fixture(barlowtwins: Path, commit: str, out: Path) -> None:
    main = _module(barlowtwins / "main.py", "barlowtwins_main")
    data = lars_inputs()
    args = main.parser.parse_args(["unused", "--batch-size", str(LARS_BATCH), "--projector", LARS_PROJECTOR])
    args.epochs = LARS_TOTAL  # adjust_learning_rate: epochs x len(loader) steps, 10 x len(loader) of warm-up
    loader = range(LARS_TOTAL // args.epochs)  # len(loader) = 1: one step per "epoch", 10 warm-up steps
    model = main.BarlowTwins(args)
    model.backbone = nn.Sequential(nn.Linear(LARS_IN, 2048), nn.ReLU())
    init = {k.removeprefix("init/"): torch.from_numpy(v.astype(np.float32)) for k, v in data.items() if "/" in k}
    missing, unexpected = model.load_state_dict(init, strict=False)
    assert not unexpected and all(k.startswith("bn.") or "running" in k or "num_batches" in k for k in missing)
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    # main_worker's groups and optimiser
    weights = [p for p in model.parameters() if p.ndim != 1]
    biases = [p for p in model.parameters() if p.ndim == 1]
    optimizer = main.LARS(
        [{"params": weights}, {"params": biases}],
        lr=0,
        weight_decay=args.weight_decay,
        weight_decay_filter=True,
        lars_adaptation_filter=True,
    )
    losses, norms, moved, lrs = [], [], [], []
    with _one_process_group():
        for i, step in enumerate(LARS_STEPS):
            y1, y2 = (torch.from_numpy(v) for v in data["views"][i])
            main.adjust_learning_rate(args, optimizer, loader, step)
            lrs.append([g["lr"] for g in optimizer.param_groups])
            optimizer.zero_grad()
            loss = model.forward(y1, y2)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
            with torch.no_grad():
                norms.append({n: float(p.double().norm()) for n, p in model.named_parameters()})
                moved.append({n: float((p.double() - start[n].double()).norm()) for n, p in model.named_parameters()})
    record = {
        "repository": "facebookresearch/barlowtwins",
        "commit": commit,
        "function": "main.BarlowTwins(args).forward, main.LARS(..., weight_decay_filter=True, "
        "lars_adaptation_filter=True).step, main.adjust_learning_rate; fp32 on the CPU",
        "settings": {
            "steps": list(LARS_STEPS),
            "total_steps": LARS_TOTAL,
            "warmup_steps": LARS_WARMUP,
            "batch_size": LARS_BATCH,
            "projector": LARS_PROJECTOR,
            "backbone": f"Sequential(Linear({LARS_IN}, 2048), ReLU())",
            "learning_rate_weights": args.learning_rate_weights,
            "learning_rate_biases": args.learning_rate_biases,
            "weight_decay": args.weight_decay,
            "lambd": args.lambd,
        },
        "results": {"lrs": lrs, "losses": losses, "norms": norms, "moved": moved},
    }
    _write(out, "lars", data, record)


# ----------------------------------------------------------------------------- linear head (evaluate.py)


def linear_inputs(seed: int = 0) -> dict[str, np.ndarray]:
    """512 training and 256 test features (64-d, 10 classes, separable only in part)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(10, 64))
    train_y, test_y = rng.integers(0, 10, 512), rng.integers(0, 10, 256)
    return {
        "train_x": (0.25 * centres[train_y] + rng.standard_normal((512, 64))).astype(np.float32),
        "train_y": train_y,
        "test_x": (0.25 * centres[test_y] + rng.standard_normal((256, 64))).astype(np.float32),
        "test_y": test_y,
    }


class _FeatureTable(nn.Module):
    """Stands in for ResNet-50: its input rows are the frozen features, ``fc`` the classifier evaluate.py trains."""

    def __init__(self, dim: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, classes)
        self.initial: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.initial:
            self.initial = {k: v.detach().clone() for k, v in self.fc.state_dict().items()}
        return self.fc(x)


def linear_fixture(barlowtwins: Path, commit: str, out: Path) -> None:
    evaluate = _module(barlowtwins / "evaluate.py", "barlowtwins_evaluate")
    data = linear_inputs()
    splits = {
        "train": torch.utils.data.TensorDataset(torch.from_numpy(data["train_x"]), torch.from_numpy(data["train_y"])),
        "val": torch.utils.data.TensorDataset(torch.from_numpy(data["test_x"]), torch.from_numpy(data["test_y"])),
    }
    torch.manual_seed(0)  # the draws of make_classifier after torch.manual_seed(0): Linear's init, then normal_
    table = _FeatureTable(64, 10)
    with tempfile.TemporaryDirectory() as tmp:
        pretrained = Path(tmp) / "backbone.pth"
        torch.save({}, pretrained)  # no backbone weights: load_state_dict finds fc.weight and fc.bias missing
        args = evaluate.parser.parse_args(
            [tmp, str(pretrained), "--epochs", "1", "--batch-size", str(LINEAR_BATCH), "--workers", "0"]
            + ["--print-freq", "1", "--checkpoint-dir", f"{tmp}/lincls"]
        )
        args.rank, args.world_size, args.dist_url = 0, 1, f"file://{tmp}/store"
        with _on_the_cpu(evaluate, table, splits):
            evaluate.main_worker(0, args)
        lines = [json.loads(line) for line in (Path(tmp) / "lincls" / "stats.txt").read_text().splitlines()[1:]]
        with torch.serialization.safe_globals([argparse.Namespace]):  # evaluate.py saves best_acc as a Namespace
            trained = torch.load(Path(tmp) / "lincls" / "checkpoint.pth", weights_only=True)["model"]
    steps = [line for line in lines if "step" in line]
    (epoch,) = [line for line in lines if "acc1" in line]
    inputs = {**data, **{f"initial_fc_{k}": v.numpy() for k, v in table.initial.items()}}
    inputs |= {f"trained_fc_{k.split('.')[-1]}": v.numpy() for k, v in trained.items() if "fc." in k}
    record = {
        "repository": "facebookresearch/barlowtwins",
        "commit": commit,
        "function": "evaluate.main_worker(0, args) with --weights freeze --epochs 1 --batch-size 64 --workers 0 "
        "--print-freq 1 (LR 0.3, weight decay 1e-6 by default), on a feature table instead of ResNet-50, on the CPU",
        "results": {
            "losses": [s["loss"] for s in steps],
            "lr_classifier": [s["lr_classifier"] for s in steps],
            "acc1": epoch["acc1"],
            "acc5": epoch["acc5"],
        },
    }
    _write(out, "linear", inputs, record)


@contextlib.contextmanager
def _on_the_cpu(evaluate: types.ModuleType, table: nn.Module, splits: dict[str, Any]) -> Iterator[None]:
    """evaluate.main_worker on one CPU process: the GPU calls made no-ops, the feature table for model and data."""
    saved = (torch.Tensor.cuda, nn.Module.cuda, torch.cuda.set_device, dist.init_process_group)
    ddp, models, datasets = evaluate.torch.nn.parallel.DistributedDataParallel, evaluate.models, evaluate.datasets
    init = dist.init_process_group
    torch.Tensor.cuda = lambda self, *a, **k: self
    nn.Module.cuda = lambda self, *a, **k: self
    torch.cuda.set_device = lambda *a, **k: None
    dist.init_process_group = lambda backend, **kw: init("gloo", **kw)
    evaluate.torch.nn.parallel.DistributedDataParallel = lambda module, device_ids=None: ddp(module)
    evaluate.models = types.SimpleNamespace(resnet50=lambda: table)
    evaluate.datasets = types.SimpleNamespace(ImageFolder=lambda root, transform: splits[Path(root).name])
    try:
        yield
    finally:
        torch.Tensor.cuda, nn.Module.cuda, torch.cuda.set_device, dist.init_process_group = saved
        evaluate.torch.nn.parallel.DistributedDataParallel, evaluate.models, evaluate.datasets = ddp, models, datasets
        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dino", type=Path, required=True, help="checkout of facebookresearch/dino")
    parser.add_argument("--vissl", type=Path, required=True, help="checkout of facebookresearch/vissl")
    parser.add_argument("--barlowtwins", type=Path, required=True, help="checkout of facebookresearch/barlowtwins")
    parser.add_argument(
        "--commits", nargs="*", default=[], metavar="NAME=SHA", help="commits of checkouts that are not git clones"
    )
    parser.add_argument("--out", type=Path, default=OUT, help="fixture folder (default: tests/fixtures/reference)")
    parser.add_argument(
        "--only", nargs="*", choices=["knn", "svm", "lars", "linear"], default=["knn", "svm", "lars", "linear"]
    )
    args = parser.parse_args()
    given = dict(item.split("=", 1) for item in args.commits)
    torch.set_num_threads(1)  # one thread: the reduction order, so the float rounding, of one core
    if "knn" in args.only:
        knn_fixture(args.dino, _commit(args.dino, given.get("dino")), args.out)
    if "svm" in args.only:
        svm_fixture(args.vissl, _commit(args.vissl, given.get("vissl")), args.out)
    if "lars" in args.only:
        lars_fixture(args.barlowtwins, _commit(args.barlowtwins, given.get("barlowtwins")), args.out)
    if "linear" in args.only:
        linear_fixture(args.barlowtwins, _commit(args.barlowtwins, given.get("barlowtwins")), args.out)


if __name__ == "__main__":
    main()
