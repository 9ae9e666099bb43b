"""Runs you can watch: the online kNN monitor, progress lines off a terminal, TensorBoard scalars, --precision auto."""

from __future__ import annotations

import io
import json
import os
import re
import sys
import types

import pytest
import torch
from PIL import Image

import bt_hub.data.measured as measured
import bt_hub.data.precision as precision
from bt_hub.cli import main as cli_main
from bt_hub.common.progress import LineProgress, progress
from bt_hub.common.reuse import inputs_key
from bt_hub.data.datasets import ImageFolderDataset
from bt_hub.method.knn import knn_hits, nearest_neighbours
from bt_hub.method.rankme import rankme
from bt_hub.method.transforms import normalize
from bt_hub.train.monitor import KnnMonitor, monitor_sets

# the demo's recipe on the 8-px digits: kNN climbs from ~15% to ~65% in five steps
DIGITS = [
    "pretrain",
    "--preset",
    "digits",
    "--image-size",
    "8",
    "--projector",
    "128-128-32",
    "--lambd",
    "0.1",
    "--batch-size",
    "64",
    "--lr-weights",
    "8",
    "--lr-biases",
    "0.192",
    "--crop-scale-min",
    "0.4",
    "--warmup-epochs",
    "1",
    "--probe-max-dim",
    "0",
]


@pytest.fixture(scope="module")
def monitored_run(tmp_path_factory):
    """Ten steps on the digits with the kNN monitor every five, progress written to a captured stream."""
    out = tmp_path_factory.mktemp("monitor") / "run"
    stderr, sys.stderr = sys.stderr, io.StringIO()
    try:
        code = cli_main(
            [
                *DIGITS,
                "--out",
                str(out),
                "--max-steps",
                "10",
                "--monitor-knn",
                "5",
                "--log-every",
                "5",
                "--probe-max-dim",
                "32",
            ]
        )
        lines = sys.stderr.getvalue()
    finally:
        sys.stderr = stderr
    assert code == 0, lines[-2000:]
    return out, lines


def test_knn_monitor_rises_on_the_digits_within_the_first_epoch_and_is_logged(monitored_run):
    out, _ = monitored_run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    knn = {r["step"]: r["knn_top1"] for r in rows if "knn_top1" in r}
    assert sorted(knn) == [0, 5, 10]  # before training, then every 5 steps (22 steps make an epoch)
    assert knn[10] > knn[0] + 30, knn
    first = rows[0]  # the baselines beside the first point: the same vote on pixels and a default-init network
    assert first["step"] == 0 and 80 < first["knn_pixels"] <= 100 and 50 < first["knn_random_init"] <= 100
    assert sum("knn_pixels" in r for r in rows) == 1
    assert all("loss" in r for r in rows if r["step"] in (5, 10))


def test_rankme_of_the_monitors_bank_is_logged_at_the_knn_monitors_cadence(monitored_run):
    # guards: metrics.jsonl carried no label-free measure of the embeddings' rank during pretraining
    out, _ = monitored_run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    ranks = {r["step"]: r["rankme"] for r in rows if "rankme" in r}
    assert sorted(ranks) == [0, 5, 10] == sorted(r["step"] for r in rows if "knn_top1" in r)
    assert all(1 < value <= 512 for value in ranks.values()), ranks  # ResNet-18: D = 512 < the bank's 2000 images


def test_off_a_terminal_progress_is_a_line_every_log_every_steps_with_the_knn(monitored_run):
    _, lines = monitored_run
    progress_lines = [line for line in lines.splitlines() if line.startswith("pretrain: ")]
    assert len(progress_lines) == 2 and progress_lines[0].startswith("pretrain: 5/10 step (50%)")
    assert "loss=" in progress_lines[1] and "knn=" in progress_lines[1] and "\r" not in lines


def test_the_progress_line_shows_the_knn_of_its_own_step_as_metrics_jsonl_does(monitored_run):
    # Guards: the progress line showed the monitor's previous value (77.8) when metrics.jsonl already had the new one.
    out, lines = monitored_run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    knn = {r["step"]: r["knn_top1"] for r in rows if "knn_top1" in r}
    shown = {int(m[1]): m[2] for m in re.finditer(r"^pretrain: (\d+)/\d+ step .*knn=([\d.]+)", lines, re.MULTILINE)}
    assert shown == {5: f"{knn[5]:.1f}", 10: f"{knn[10]:.1f}"} and knn[5] != knn[0]


def test_line_progress_writes_every_n_steps_and_the_last_one_on_close():
    stream = io.StringIO()
    bar = LineProgress(7, "job", unit="step", every=3, file=stream)
    for _ in range(7):
        bar.update(1)
    bar.set_postfix(loss="1.5")
    bar.close()
    lines = stream.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "job: 3/7 step (43%)",
        "job: 6/7 step (86%)",
        "job: 7/7 step (100%)",
    ]
    assert lines[-1].endswith("loss=1.5")
    assert isinstance(progress(None, "x", total=5, stream=stream), LineProgress)


def test_monitor_queries_are_held_out_images_and_its_vote_is_the_eval_knn_vote():
    bank, bank_labels, queries, _ = monitor_sets("digits", 8, 0, 100)
    assert bank.shape == (100, 3, 8, 8) and bank.dtype == torch.uint8 and queries.shape == (25, 3, 8, 8)
    train = {tuple(x.flatten().tolist()) for x in bank}
    assert not train & {tuple(x.flatten().tolist()) for x in queries}
    from bt_hub.eval.knn import knn_hits as eval_hits

    assert eval_hits is knn_hits
    identity = KnnMonitor(bank, bank_labels, bank[:20], bank_labels[:20])
    scores = identity(torch.nn.Flatten(), "cpu")
    assert scores["knn_top1"] == 100.0  # each query finds itself first
    assert scores["rankme"] == rankme(normalize(bank.float() / 255).flatten(1))  # eval rankme's function, on the bank
    sims, idx = nearest_neighbours(torch.eye(3), torch.tensor([[0.0, 2.0, 0.1]]), 2)
    assert idx.tolist() == [[1, 2]] and sims[0, 0] > 0.99


def test_tensorboard_scalars_are_written_for_each_metrics_row(tmp_path, monkeypatch):
    written = []

    class SummaryWriter:
        def __init__(self, log_dir):
            written.append(("dir", log_dir))

        def add_scalar(self, tag, value, step):
            written.append((tag, step))

        def flush(self):
            pass

        def close(self):
            written.append(("closed", None))

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = SummaryWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    monkeypatch.setitem(sys.modules, "tensorboard", types.ModuleType("tensorboard"))
    out = tmp_path / "run"
    monitor = ["--monitor-knn", "2", "--monitor-size", "40"]
    assert (
        cli_main([*DIGITS, "--out", str(out), "--max-steps", "2", "--log-every", "1", "--tensorboard", *monitor]) == 0
    )
    assert written[0] == ("dir", str(out / "tensorboard")) and written[-1] == ("closed", None)
    assert ("pretrain/loss", 1) in written and ("pretrain/loss", 2) in written and ("pretrain/lr_weights", 2) in written
    assert ("pretrain/rankme", 2) in written and ("pretrain/knn_top1", 2) in written


def test_tensorboard_without_the_package_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    assert cli_main([*DIGITS, "--out", str(tmp_path / "run"), "--max-steps", "1", "--tensorboard"]) == 2
    assert "pip install 'bt_hub[tensorboard]'" in capsys.readouterr().err


@pytest.mark.parametrize(("fp32_s", "bf16_s", "expected"), [(2.0, 1.0, "bf16"), (1.0, 2.0, "fp32"), (1.0, 1.0, "fp32")])
def test_precision_auto_on_a_cpu_is_the_faster_of_the_two_measured_and_cached(
    tmp_path, monkeypatch, fp32_s, bf16_s, expected
):
    """Guards: auto picked bf16 on any CPU with avx512_bf16, where bf16 ran slower than fp32 on some of them."""
    cache = tmp_path / "cache" / "precision_auto.json"
    monkeypatch.setattr(measured, "cache_file", lambda name: cache.parent / name)
    chosen = precision.cpu_choice(lambda: {"fp32": fp32_s, "bf16": bf16_s})
    assert (chosen["precision"], chosen["precision_fp32_s"], chosen["precision_bf16_s"]) == (expected, fp32_s, bf16_s)
    assert (
        chosen["precision_reason"].endswith("(measured now)")
        and f"{bf16_s:.3g} s in bf16" in chosen["precision_reason"]
    )
    machine = f"{measured.cpu_model()} | torch {torch.__version__}"
    key = inputs_key("measurement", {"machine": machine})
    assert json.loads(cache.read_text()) == {key: {"machine": machine, "measured": {"fp32": fp32_s, "bf16": bf16_s}}}
    assert not list(cache.parent.glob(".*.tmp"))  # written whole, through a temp file

    def not_again():
        raise AssertionError("measured again although this CPU model and torch version are cached")

    again = precision.cpu_choice(not_again)
    assert again["precision"] == expected and again["precision_reason"].endswith(f"(cached in {cache.name})")
    assert str(cache.parent) not in again["precision_reason"]  # Guards: the home folder went into results and cards


def test_precision_auto_is_measured_again_on_another_cpu_model_or_torch_version(tmp_path, monkeypatch):
    cache = tmp_path / "precision_auto.json"
    monkeypatch.setattr(measured, "cache_file", lambda name: cache)
    assert precision.cpu_choice(lambda: {"fp32": 1.0, "bf16": 2.0})["precision"] == "fp32"
    monkeypatch.setattr(measured, "cpu_model", lambda: "Another CPU")
    assert precision.cpu_choice(lambda: {"fp32": 2.0, "bf16": 1.0})["precision"] == "bf16"
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert precision.cpu_choice(lambda: {"fp32": 3.0, "bf16": 4.0})["precision"] == "fp32"
    assert len(json.loads(cache.read_text())) == 3


@pytest.mark.parametrize(("bf16_gpu", "expected"), [(True, "bf16"), (False, "fp32")])
def test_precision_auto_on_cuda_is_bf16_where_the_gpu_supports_it_without_measuring(monkeypatch, bf16_gpu, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_gpu)
    monkeypatch.setattr(precision, "measure_cpu", lambda: pytest.fail("measured a CPU for a CUDA device"))
    assert precision.resolve_precision("auto", "cuda") == expected
    assert precision.resolve_precision("fp32", "cuda") == "fp32"


def test_precision_auto_is_recorded_resolved_and_a_resume_with_auto_accepts_it(tmp_path, monkeypatch):
    monkeypatch.setattr(measured, "cache_file", lambda name: tmp_path / "precision_auto.json")
    monkeypatch.setattr(precision, "measure_cpu", lambda: {"fp32": 0.25, "bf16": 0.125})
    out = tmp_path / "run"
    tiny = [
        "--preset",
        "digits",
        "--image-size",
        "8",
        "--projector",
        "16-16",
        "--batch-size",
        "32",
        "--probe-max-dim",
        "0",
        "--out",
        str(out),
    ]
    assert cli_main(["pretrain", *tiny, "--max-steps", "1"]) == 0
    started, recipe = (json.loads((out / name).read_text()) for name in ("run.json", "config.json"))
    assert started["config"]["precision"] == "bf16" and "--precision" not in started["command"]
    assert (started["precision_fp32_s"], started["precision_bf16_s"]) == (0.25, 0.125)
    assert "0.125 s in bf16 and 0.25 s in fp32" in started["precision_reason"]
    assert recipe["recipe"]["precision"] == "bf16" and recipe["recipe"]["precision_bf16_s"] == 0.125
    assert cli_main(["pretrain", *tiny, "--max-steps", "2", "--resume", "auto"]) == 0  # the cached choice again
    monkeypatch.setattr(measured, "cache_file", lambda name: tmp_path / "elsewhere.json")
    monkeypatch.setattr(precision, "measure_cpu", lambda: {"fp32": 0.125, "bf16": 0.25})
    assert (
        cli_main(["pretrain", *tiny, "--max-steps", "3", "--resume", "auto"]) == 2
    )  # auto is fp32 now: not the checkpoint's recipe


def test_report_draws_the_loss_the_cross_correlations_and_the_knn_curve_of_a_run(monitored_run, tmp_path, capsys):
    out, _ = monitored_run
    assert cli_main(["report", str(out), "--out", str(tmp_path / "plots")]) == 0
    printed = capsys.readouterr().out.split()
    assert [p.rsplit("/", 1)[1] for p in printed] == ["loss.png", "cross_correlation.png", "knn.png"]
    for name in ("loss.png", "cross_correlation.png", "knn.png"):
        assert (tmp_path / "plots" / name).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert cli_main(["report", str(tmp_path / "missing")]) == 2
    assert f"run directory {tmp_path / 'missing'} does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("splits", [(), ("train", "test")])
def test_the_monitor_queries_a_flat_folder_outside_its_bank_and_a_test_folder_when_there_is_no_val(
    image_folder, tmp_path, splits
):
    """Guards: pretrain --monitor-knn on a flat folder (or train/ + test/) was refused for want of a val/ folder."""
    root = image_folder(tmp_path / "data", classes=("a", "b"), per_class=20, size=8, splits=splits)
    for path in (root / "test").rglob("*.png"):  # black test images: queries read from test/ are all zero
        Image.new("RGB", (8, 8)).save(path)
    bank, _, queries, _ = monitor_sets(str(root), 8, 0, 24)
    assert bank.shape[0] == 24 and queries.shape[0] == 6
    assert not {q.numpy().tobytes() for q in queries} & {b.numpy().tobytes() for b in bank}  # no query in the bank
    assert bool(splits) == bool((queries == 0).all())
    if not splits:  # the default bank (2000) takes every image but the queries: a fifth of a small set
        assert [len(t) for t in monitor_sets(str(root), 8, 0, 2000)[::2]] == [32, 8]
        with pytest.raises(ValueError, match="gives 12 bank images and it needs at least 20: pass --monitor-data"):
            monitor_sets(str(root), 8, 0, 12)  # a --monitor-size under 20; --data, not --monitor-data, gave it


def test_a_loss_logged_once_is_drawn_as_points():
    """Guards: a run shorter than --log-every logs one row, and loss.png drew three lines of one point each: nothing."""
    from bt_hub.train.report import plot_losses

    fig = plot_losses([{"step": 6, "loss": 9.0, "invariance": 8.0, "redundancy": 100.0}], 0.0051)
    assert [line.get_marker() for line in fig.axes[0].get_lines()] == ["o", "o", "o"]


@pytest.mark.slow
def test_cifar_preset_learns_on_the_digits_at_32_px_within_the_first_epoch(tmp_path):
    """kNN rises within the first epoch and beats the same 20 steps at learning rate 0.

    Learning rate 0 only moves the BN statistics.

    Seed 0, 2 CPU threads: 60.0 -> 72.0 learning, 60.0 -> 69.0 at LR 0; the preset's 10 warm-up
    epochs keep the LR at a tenth of its peak here, so most of the early rise is BN statistics.
    """
    common = [
        "pretrain",
        "--preset",
        "cifar",
        "--data",
        "digits",
        "--image-size",
        "32",
        "--batch-size",
        "64",
        "--max-steps",
        "20",
        "--monitor-knn",
        "20",
        "--monitor-size",
        "400",
        "--log-every",
        "10",
        "--probe-max-dim",
        "0",
    ]
    knn = {}
    for name, extra in (("learning", []), ("frozen", ["--lr-weights", "0", "--lr-biases", "0"])):
        assert cli_main([*common, *extra, "--out", str(tmp_path / name)]) == 0
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        knn[name] = {r["step"]: r["knn_top1"] for r in rows if "knn_top1" in r}
    assert knn["learning"][0] == knn["frozen"][0]
    assert knn["learning"][20] >= knn["learning"][0] + 10 and knn["learning"][20] > knn["frozen"][20], knn


def test_the_monitor_bank_of_an_image_folder_is_decoded_by_the_loader_workers(image_folder, tmp_path, monkeypatch):
    # Guards: the kNN monitor opened and decoded its bank and queries one file after another in the main process.
    root = image_folder(tmp_path / "data", classes=("a", "b", "c"), per_class=12, size=10)
    main_pid, read = os.getpid(), ImageFolderDataset.__getitem__

    def outside_main(self, index):
        assert os.getpid() != main_pid, "the main process opened an image file of the monitor's bank"
        return read(self, index)

    monkeypatch.setattr(ImageFolderDataset, "__getitem__", outside_main)
    bank, bank_labels, queries, query_labels = monitor_sets(str(root), 8, 0, 24, num_workers=2)
    assert bank.shape == (24, 3, 8, 8) and bank.dtype == torch.uint8 and queries.shape[0] == 6
    monkeypatch.setattr(ImageFolderDataset, "__getitem__", read)
    assert torch.equal(monitor_sets(str(root), 8, 0, 24)[0], bank)  # the same images as read in place
    assert torch.equal(monitor_sets(str(root), 8, 0, 24)[1], bank_labels)
