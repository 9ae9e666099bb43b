"""The prefetcher: the same batches in the same order, errors where they happen, a clean stop, the same training."""

from __future__ import annotations

import itertools
import json
import threading

import pytest
import torch
from safetensors.torch import load_file

import bt_hub.train.pretrain as pretrain_module
from bt_hub.cli import main as cli_main
from bt_hub.data.prefetch import Prefetcher

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
    ),
]


def _prepare(item: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.full((4, 3), float(item))
    return x * 2, x.sum(dim=1)


@pytest.mark.parametrize("device", DEVICES)
def test_prefetched_batches_equal_the_inline_ones_in_order_and_are_made_in_another_thread(device):
    threads = set()

    def prepare(item):
        threads.add(threading.current_thread().name)
        a, b = _prepare(item)
        return a.to(device), b.to(device)

    with Prefetcher(range(7), prepare, torch.device(device), depth=2) as ahead:
        got = [tuple(t.cpu() for t in pair) for pair in ahead]
    inline = list(Prefetcher(range(7), _prepare, torch.device("cpu"), depth=0))
    assert len(got) == 7 and all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(got, inline))
    assert threads == {"bt_hub-prefetch"}


def test_an_error_while_preparing_is_raised_at_its_item_and_the_thread_stops():
    def prepare(item):
        if item == 3:
            raise OSError("image /data/x.jpg is corrupt or unreadable; remove or replace it")
        return _prepare(item)

    ahead = Prefetcher(range(10), prepare, torch.device("cpu"), depth=2)
    got = [next(ahead) for _ in range(3)]
    with pytest.raises(OSError, match="x.jpg is corrupt"):
        next(ahead)
    assert len(got) == 3 and not ahead._thread.is_alive()


def test_leaving_the_loop_early_stops_an_endless_source():
    with Prefetcher(itertools.count(), _prepare, torch.device("cpu"), depth=2) as ahead:
        first = [next(ahead) for _ in range(2)]
    assert not ahead._thread.is_alive() and float(first[1][0][0, 0]) == 2.0
    with pytest.raises(StopIteration):
        next(ahead)


@pytest.mark.parametrize("device", DEVICES)
def test_pretraining_with_batches_prepared_ahead_equals_preparing_them_in_the_loop(tmp_path, monkeypatch, device):
    """The training loop itself, with the prefetch thread forced on (the CPU prepares in the loop otherwise)."""
    flags = [
        "--data",
        "synthetic:24",
        "--arch",
        "resnet18",
        "--small-image-stem",
        "--image-size",
        "16",
        "--projector",
        "32-32",
        "--batch-size",
        "8",
        "--epochs",
        "2",
        "--warmup-epochs",
        "1",
        "--views",
        "batched",
        "--log-every",
        "1",
        "--probe-max-dim",
        "0",
        "--device",
        device,
        "--precision",
        "fp32",
    ]
    assert cli_main(["pretrain", *flags, "--out", str(tmp_path / "inline")]) == 0

    class Ahead(Prefetcher):
        def __init__(self, items, prepare, device, depth=2):
            super().__init__(items, prepare, device, depth=2)

    monkeypatch.setattr(pretrain_module, "Prefetcher", Ahead)
    assert cli_main(["pretrain", *flags, "--out", str(tmp_path / "ahead")]) == 0
    losses = [
        [json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        for run in ("inline", "ahead")
    ]
    assert len(losses[0]) == 4 and losses[0] == losses[1]  # 2 epochs of the 2 full batches of the training split
    weights = [load_file(tmp_path / run / "backbone.safetensors") for run in ("inline", "ahead")]
    if device == "cpu":
        assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    else:  # cudnn.benchmark may pick other kernels in each run: equal losses, weights equal to float rounding
        for key in weights[0]:
            torch.testing.assert_close(weights[1][key], weights[0][key], rtol=1e-3, atol=1e-5, msg=key)
