"""Crash consistency of ``bt-hub pretrain``.

SIGKILLs at seeded random moments, torchrun's agent killed, elastic restarts.

Every interrupted run, continued with ``--resume auto``, must end bit-identical (weights,
optimiser state) to an uninterrupted one, with the same ``metrics.jsonl`` (the timing
field aside) and no temp file left. A checkpoint every step (about 90 MB with the
optimiser state) makes checkpoint writes a large share of the run, so kills land inside them.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

# 40 synthetic images, batch 8: 4 steps per epoch, 20 in all, a checkpoint after each (the fast test stops at 8).
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
    "5",
    "--warmup-epochs",
    "1",
    "--checkpoint-every",
    "1",
    "--log-every",
    "1",
    "--seed",
    "3",
    "--probe-max-dim",
    "0",
]
TOTAL_STEPS, FAST_STEPS = 20, 8
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
TIMING = "pairs_per_s"


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _cmd(out: Path, *extra: str, launcher: list[str] | None = None) -> list[str]:
    return [*(launcher or [sys.executable]), "-m", "bt_hub.cli", "pretrain", *FLAGS, "--out", str(out), *extra]


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def _wait_for(condition: Callable[[], bool], proc: subprocess.Popen, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}: {proc.stderr.read()[-2000:] if proc.stderr else ''}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.005)


def _checkpoint_step(out: Path) -> int:
    path = out / "checkpoint.pth"
    return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["step"]) if path.exists() else 0


def _last_logged_step(path: Path) -> int:
    lines = path.read_text().splitlines() if path.exists() else []
    return json.loads(lines[-1])["step"] if lines else 0


def _kill_resumed_run(out: Path, moment: str, rng: random.Random, *extra: str) -> bool:
    """Start ``--resume auto`` into ``out`` and SIGKILL it at a seeded random moment of kind ``moment``.

    ``startup``: 0-3 s after launch; ``step``: 0-0.3 s after it logs a new step;
    ``checkpoint``: 0-20 ms after a checkpoint temp file appears. Returns whether the kill
    left a temp file behind (it cut a write short).
    """
    metrics, before = (
        out / "metrics.jsonl",
        (out / "metrics.jsonl").read_bytes() if (out / "metrics.jsonl").exists() else b"",
    )
    resumed_from = _checkpoint_step(out)
    proc = subprocess.Popen(
        _cmd(out, "--resume", "auto", *extra),
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        if moment == "startup":
            time.sleep(rng.uniform(0.0, 3.0))
        elif moment == "step":
            _wait_for(
                lambda: (
                    metrics.exists() and metrics.read_bytes() != before and _last_logged_step(metrics) > resumed_from
                ),
                proc,
                "a new step",
            )
            time.sleep(rng.uniform(0.0, 0.3))
        else:
            _wait_for(lambda: any(out.glob(".checkpoint.pth.*.tmp")), proc, "a checkpoint write")
            time.sleep(rng.uniform(0.0, 0.02))
        assert proc.poll() is None, "the run ended before it could be killed; make the schedule longer"
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    return any(out.glob(".*.tmp"))


def _metrics_without_timing(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in (TIMING, "run_id")} for row in rows]  # run_id: which start


def _assert_identical_runs(expected: Path, got: Path, steps: int) -> None:
    a = torch.load(expected / "checkpoint.pth", map_location="cpu", weights_only=True)
    b = torch.load(got / "checkpoint.pth", map_location="cpu", weights_only=True)
    assert a["step"] == b["step"] == steps
    assert a["model"].keys() == b["model"].keys()
    assert not [k for k in a["model"] if not torch.equal(a["model"][k], b["model"][k])], "weights differ"
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for key, state in a["optimizer"]["state"].items():
        assert all(torch.equal(v, b["optimizer"]["state"][key][name]) for name, v in state.items()), (
            f"optimizer state {key} differs"
        )
    backbone_a, backbone_b = (load_file(d / "backbone.safetensors") for d in (expected, got))
    assert all(torch.equal(backbone_a[k], backbone_b[k]) for k in backbone_a)
    assert _metrics_without_timing(expected) == _metrics_without_timing(got)
    assert [r["step"] for r in _metrics_without_timing(got)] == list(range(1, steps + 1))
    assert not list(got.glob(".*.tmp")), "temp files were left behind"


def _crash_and_resume(out: Path, moments: list[str], seed: int, *extra: str) -> int:
    """Kill a run at each of ``moments`` (resuming it each time), then let it finish.

    Returns how many of the kills cut a write.
    """
    rng = random.Random(seed)
    cut = sum(_kill_resumed_run(out, moment, rng, *extra) for moment in moments)
    _run(_cmd(out, "--resume", "auto", *extra))
    return cut


def test_two_sigkills_one_inside_a_checkpoint_write_then_resume_end_bit_identical(tmp_path):
    # Guards, under real kills: metrics lines logged after the last checkpoint were kept (so resumed runs
    # duplicated them), and the temp files of writes cut by a kill were never removed.
    stop = ("--max-steps", str(FAST_STEPS))
    _run(_cmd(tmp_path / "uninterrupted", *stop))
    assert _crash_and_resume(tmp_path / "run", ["checkpoint", "step"], 0, *stop) >= 1
    _assert_identical_runs(tmp_path / "uninterrupted", tmp_path / "run", FAST_STEPS)


@pytest.mark.slow
def test_a_dozen_sigkills_at_seeded_random_moments_then_resume_end_bit_identical(tmp_path):
    moments = ["startup", "step", "checkpoint"] * 4
    random.Random(1).shuffle(moments)
    _run(_cmd(tmp_path / "uninterrupted"))
    assert _crash_and_resume(tmp_path / "run", moments, 1) >= 2
    _assert_identical_runs(tmp_path / "uninterrupted", tmp_path / "run", TOTAL_STEPS)


def _children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.ddp
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_killing_the_torchrun_agent_ends_its_workers_and_nothing_more_is_written(tmp_path):
    # Guards: the workers of a killed torchrun agent kept training and writing into --out.
    out = tmp_path / "run"
    agent = subprocess.Popen(
        _cmd(out, "--epochs", "100", launcher=TORCHRUN), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    workers: list[int] = []
    try:
        _wait_for(lambda: _last_logged_step(out / "metrics.jsonl") >= 2, agent, "two logged steps")
        workers = _children(agent.pid)
        assert len(workers) == 2
        agent.kill()
        agent.wait(timeout=60)
        deadline = time.monotonic() + 30
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [w for w in workers if _alive(w)], "torchrun's workers outlived it"
        written = {p.name: p.stat().st_size for p in out.iterdir()}
        time.sleep(3)
        assert {p.name: p.stat().st_size for p in out.iterdir()} == written
    finally:
        for pid in [agent.pid, *workers]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        agent.wait(timeout=60)


@pytest.mark.ddp
@pytest.mark.slow
def test_torchrun_max_restarts_resumes_a_killed_worker_from_the_checkpoint_bit_identical(tmp_path):
    # the elastic recipe of docs/pretraining.md: torchrun --max-restarts N ... --resume auto
    straight, elastic = tmp_path / "straight", tmp_path / "elastic"
    _run(_cmd(straight, launcher=TORCHRUN))
    agent = subprocess.Popen(
        _cmd(elastic, "--resume", "auto", launcher=[*TORCHRUN, "--max-restarts", "1"]),
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        _wait_for(lambda: _checkpoint_step(elastic) >= 6, agent, "the checkpoint of step 6")
        os.kill(max(_children(agent.pid)), signal.SIGKILL)
        assert agent.wait(timeout=600) == 0, agent.stderr.read()[-3000:]
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(timeout=60)
    assert len(json.loads((elastic / "run.json").read_text())["resumes"]) == 1
    _assert_identical_runs(straight, elastic, TOTAL_STEPS)


# digits, 8 px: about 180 steps an epoch, so a run stopped at 40 checkpoints only at its end (or on SIGTERM)
DIGITS = ("--data", "digits", "--checkpoint-every", "0", "--max-steps", "40")
# two loader workers, and a shorter run (its steps end within the first epoch: the workers start once)
WORKERS = ("--num-workers", "2", "--max-steps", "12")


def _sigterm_after(
    out: Path,
    steps: int,
    *extra: str,
    launcher: list[str] | None = None,
    group: bool = False,
    signum: int = signal.SIGTERM,
) -> subprocess.CompletedProcess:
    """Start ``out``'s run, send it ``signum`` (the launcher, under torchrun) once ``steps`` steps are logged; its exit.

    With ``group`` the run has a process group of its own and the signal goes to all of it, as ``timeout`` and
    SLURM's scancel (and its ``--signal=USR1@T`` warning) send it: the main process and its DataLoader workers alike.
    """
    proc = subprocess.Popen(
        _cmd(out, *DIGITS, *extra, launcher=launcher),
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=group,
    )
    try:
        _wait_for(lambda: _last_logged_step(out / "metrics.jsonl") >= steps, proc, f"{steps} logged steps")
        if group:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", err)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Callable[..., Path]:
    """Factory: the uninterrupted run of ``DIGITS`` and ``extra`` flags, run once a module (the SIGTERM and SIGINT
    cases share theirs) and only read."""
    made: dict[tuple[str, ...], Path] = {}

    def run(*extra: str) -> Path:
        if extra not in made:
            made[extra] = tmp_path_factory.mktemp("uninterrupted") / "run"
            _run(_cmd(made[extra], *DIGITS, *extra))
        return made[extra]

    return run


@pytest.mark.parametrize(
    "extra,group,signum",
    [
        pytest.param((), False, signal.SIGTERM, id="SIGTERM-to-the-main-process"),
        pytest.param(WORKERS, True, signal.SIGUSR1, id="SIGUSR1-to-the-group-with-workers"),
        pytest.param((), False, signal.SIGINT, id="SIGINT-to-the-main-process"),
    ],
)
def test_sigterm_checkpoints_the_step_it_is_on_says_so_and_resume_auto_ends_bit_identical(
    tmp_path, uninterrupted, extra, group, signum
):
    # Guards: SIGTERM (a scheduler's preemption) ended pretraining with exit code 143, no line and nothing saved,
    # losing every step since the last --checkpoint-every. Sent to the process group (timeout, scancel), it killed
    # the DataLoader workers first: exit 2, "DataLoader worker (pid ...) is killed by signal: Terminated", and no
    # checkpoint. SIGUSR1, the warning Slurm's --signal=USR1@T sends every process of a job ahead of its time limit,
    # ended the run on the spot (its default action), with no checkpoint and no line. Ctrl-C (SIGINT, which LSF's
    # bkill sends first) kept only the last checkpoint, losing the steps since.
    expected = uninterrupted(*extra)
    out = tmp_path / "run"
    done = _sigterm_after(out, 3, *extra, group=group, signum=signum)
    assert done.returncode == 128 + signum, done.stderr[-3000:]  # 130 for SIGINT
    assert "Traceback" not in done.stderr
    stopped = _checkpoint_step(out)
    steps = 12 if extra else 40
    assert 3 <= stopped < steps and stopped == _last_logged_step(out / "metrics.jsonl")
    line = done.stderr.strip().splitlines()[-1]
    how = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    checkpoint = out / "checkpoint.pth"
    assert line.startswith(f"bt-hub pretrain: {how}; the last checkpoint {checkpoint} (step {stopped}) is kept; ")
    assert line.endswith("--resume auto")
    _run(_cmd(out, *DIGITS, *extra, "--resume", "auto"))
    _assert_identical_runs(expected, out, steps)


@pytest.mark.ddp
@pytest.mark.slow
def test_sigterm_to_torchrun_stops_every_rank_at_one_checkpointed_step_and_resume_ends_bit_identical(tmp_path):
    # torchrun forwards SIGTERM to its workers; the ranks agree on the step to stop at (one all-reduce a step).
    _run(_cmd(tmp_path / "uninterrupted", *DIGITS, launcher=TORCHRUN))
    out = tmp_path / "run"
    done = _sigterm_after(out, 3, launcher=TORCHRUN)
    assert done.returncode != 0  # torchrun's own exit code and report of the signal it forwarded
    stopped = _checkpoint_step(out)
    assert 3 <= stopped < 40 and stopped == _last_logged_step(out / "metrics.jsonl")
    assert f"stopped by SIGTERM; the last checkpoint {out / 'checkpoint.pth'} (step {stopped}) is kept" in done.stderr
    _run(_cmd(out, *DIGITS, "--resume", "auto", launcher=TORCHRUN))
    _assert_identical_runs(tmp_path / "uninterrupted", out, 40)
