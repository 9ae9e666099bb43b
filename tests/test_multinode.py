"""Two torchrun "nodes" on loopback train like one process on the whole batch.

c10d rendezvous, one gloo process each.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bt_hub.cli import main as cli_main

pytestmark = pytest.mark.ddp

# PIL views are seeded per (seed, epoch, index), so both layouts see the same views of the same images.
FLAGS = [
    "--data",
    "synthetic:40",
    "--arch",
    "resnet18",
    "--small-image-stem",
    "--image-size",
    "8",
    "--projector",
    "32-32",
    "--batch-size",
    "8",
    "--epochs",
    "2",
    "--warmup-epochs",
    "0",
    "--lr-weights",
    "2.0",
    "--max-steps",
    "3",
    "--views",
    "pil",
    "--precision",
    "fp32",
    "--seed",
    "3",
    "--probe-max-dim",
    "0",
    "--checkpoint-every",
    "0",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def test_two_nodes_on_loopback_give_the_weights_of_one_process_on_the_concatenated_batch(tmp_path):
    single = tmp_path / "single"  # in this process: the reference needs no process of its own
    assert cli_main(["pretrain", *FLAGS, "--out", str(single)]) == 0

    port, nodes = _free_port(), tmp_path / "nodes"
    launchers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(rank),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "bt-hub-test",
                "--local-addr",
                "127.0.0.1",
                "-m",
                "bt_hub.cli",
                "pretrain",
                *FLAGS,
                "--out",
                str(nodes),
            ],
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        errors = [p.communicate(timeout=300)[1] for p in launchers]
    finally:
        for p in launchers:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in launchers), "\n".join(e[-2000:] for e in errors)

    a = torch.load(single / "checkpoint.pth", weights_only=True)
    b = torch.load(nodes / "checkpoint.pth", weights_only=True)
    assert a["step"] == b["step"] == 3
    for key, value in a["model"].items():
        if value.is_floating_point():
            torch.testing.assert_close(b["model"][key], value, rtol=1e-4, atol=1e-5, msg=key)
        else:
            assert torch.equal(b["model"][key], value), key
    losses = [
        [json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (single, nodes)
    ]
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)
    assert Path(nodes / "backbone.safetensors").exists()
