"""benchmarks/pretrain_throughput.py runs end to end at tiny sizes on the CPU and writes its table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "--device",
    "cpu",
    "--arch",
    "resnet18",
    "--image-size",
    "32",
    "--projector",
    "64-64",
    "--batch-size",
    "8",
    "--warmup",
    "1",
    "--steps",
    "2",
    "--jpeg-size",
    "64x48",
    "--workers",
    "1",
    "--precision",
    "fp32",
]


def test_throughput_benchmark_prints_the_three_rows_and_their_ratios(tmp_path):
    # 2 threads, or the one conftest.py gives each xdist worker (a second would spin beside the other worker)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "OUT": str(tmp_path / "out")}
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "pretrain_throughput.py"),
            *TINY,
            "--data-dir",
            str(tmp_path / "jpegs"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "throughput.json").read_text())
    rows = result["images_per_s"]
    assert [name[:3] for name in rows] == ["(a)", "(b)", "(c)"] and all(rate > 0 for rate in rows.values())
    assert "resnet18, 32 px, projector 64-64, batch 8, CPU" in result["header"]
    table = done.stdout.split("\n\n")[-1]
    assert "vs (a)" in table and "100%" in table and "1.00x" in table  # each row against the ceiling and the reference
    assert len(list((tmp_path / "jpegs").rglob("*.jpg"))) == 8 * 4
