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
        "bt-hub pretrain",  # the stretch row: 100 epochs and their curve
        "bt-hub eval compare",
    ], done.stdout[-3000:]
    steps = re.findall(r"^== (.+): exit (\d+) after", done.stdout, re.M)
    assert len(steps) == 7 and all(rc == "0" for _, rc in steps), steps
    assert (tmp_path / "out/summary.md").exists()


GPU_TEST_FILES = ("test_cuda.py", "test_decode.py", "test_features.py")
CLI_CALL = re.compile(r"\bcli(_main|\.main)\(")


def _is_gpu(test, module) -> bool:
    marks = [*getattr(test, "pytestmark", []), *getattr(module, "pytestmark", [])]
    return any(mark.name == "gpu" for mark in marks)


def _gpu_tests() -> list[tuple[str, object, object]]:
    """(id, test, module) of every gpu-marked test that runs bt-hub, itself or through a helper of its module."""
    found = []
    for file in GPU_TEST_FILES:
        spec = importlib.util.spec_from_file_location(f"gpu_{file[:-3]}", REPO / "tests" / file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for name, test in vars(module).items():
            if not (name.startswith("test_") and inspect.isfunction(test) and _is_gpu(test, module)):
                continue
            helpers = [
                getattr(module, n) for n in test.__code__.co_names if inspect.isfunction(getattr(module, n, None))
            ]
            if any(CLI_CALL.search(inspect.getsource(f)) for f in (test, *helpers)):
                found.append((f"{file}::{name}", test, module))
    return found


GPU_TESTS = _gpu_tests()


@pytest.mark.parametrize("name, test, module", GPU_TESTS, ids=[name for name, _, _ in GPU_TESTS])
def test_every_command_line_of_the_gpu_tests_parses(name, test, module, tmp_path, monkeypatch, capsys):
    real_main = cli.main

    def parse_only(argv):
        monkeypatch.setenv("BT_HUB_PARSE_ONLY", "1")
        assert real_main(argv) == 0, capsys.readouterr().err
        assert "parsed (BT_HUB_PARSE_ONLY" in capsys.readouterr().out
        raise _Parsed

    monkeypatch.setattr(cli, "main", parse_only)
    if hasattr(module, "cli_main"):  # ``from bt_hub.cli import main as cli_main``
        monkeypatch.setattr(module, "cli_main", parse_only)
    given = {"tmp_path": tmp_path, "precision": "fp32", "monkeypatch": monkeypatch}
    arguments = {p: given.get(p, tmp_path / f"{p}.pth") for p in inspect.signature(test).parameters}
    with pytest.raises(_Parsed):
        test(**arguments)


def test_the_parse_check_sees_the_cli_calls_of_every_gpu_test_file():
    # test_features.py's GPU test calls extract_features, no command
    assert {name.split("::")[0] for name, _, _ in GPU_TESTS} == {"test_cuda.py", "test_decode.py"}
    assert len(GPU_TESTS) >= 5
