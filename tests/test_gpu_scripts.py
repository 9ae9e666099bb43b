"""The GPU scripts' command lines, held by the CPU suite: a flag renamed or removed fails here, not on the one GPU
run a task may get (the CUDA tests once passed `bt-hub demo` a flag it no longer took)."""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bt_hub import cli

REPO = Path(__file__).resolve().parents[1]


class _Parsed(Exception):
    """Raised by the stub of ``cli.main`` once a command line parsed: the rest of the CUDA test is not run."""


def test_every_command_line_of_gpu_check_sh_parses(tmp_path):
    env = {**os.environ, "GPU_CHECK_PARSE": "1", "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(REPO / "benchmarks/gpu_check.sh")], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    parsed = re.findall(r"^(\S+(?: \S+)*): parsed \(BT_HUB_PARSE_ONLY", done.stdout, re.M)
    assert parsed == [
        "eval_throughput.py",
        "eval_throughput.py",
        "pretrain_throughput.py",
        "pretrain_throughput.py",
        "bt-hub pretrain",
        "bt-hub eval compare",
        "bt-hub export",
        "bt-hub eval all",
    ], done.stdout[-3000:]
    steps = re.findall(r"^== (.+): exit (\d+) after", done.stdout, re.M)
    assert len(steps) == 6 and all(rc == "0" for _, rc in steps), steps
    assert (tmp_path / "out/summary.md").exists()


def _cuda_tests():
    spec = importlib.util.spec_from_file_location("cuda_tests", REPO / "tests/test_cuda.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [
        (name, f) for name, f in vars(module).items() if name.startswith("test_") and "cli.main" in inspect.getsource(f)
    ]


@pytest.mark.parametrize("name, test", _cuda_tests(), ids=[name for name, _ in _cuda_tests()])
def test_every_command_line_of_the_cuda_tests_parses(name, test, tmp_path, monkeypatch, capsys):
    real_main = cli.main

    def parse_only(argv):
        monkeypatch.setenv("BT_HUB_PARSE_ONLY", "1")
        assert real_main(argv) == 0, capsys.readouterr().err
        assert "parsed (BT_HUB_PARSE_ONLY" in capsys.readouterr().out
        raise _Parsed

    monkeypatch.setattr(cli, "main", parse_only)
    given = {"tmp_path": tmp_path, "precision": "fp32"}
    arguments = {p: given.get(p, tmp_path / f"{p}.pth") for p in inspect.signature(test).parameters}
    with pytest.raises(_Parsed):
        test(**arguments)
