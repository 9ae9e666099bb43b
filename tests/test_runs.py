"""bt_hub.common.runs: run-directory ownership and lock, atomic writes (umask, disk full).

Also run.json and metrics.jsonl.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest
import torch
from cli_output import one_sentence

from bt_hub.cli import main as cli_main
from bt_hub.common.files import WriteError, atomic_torch_save, atomic_write_text
from bt_hub.common.runs import MARKER_NAME, RunDir, RunLock, claim_run_dir, read_jsonl

# 32 synthetic images, batch 8: 4 steps per epoch; --max-steps keeps each run to a few steps.
TINY = [
    "pretrain",
    "--data",
    "synthetic:40",
    "--arch",
    "resnet18",
    "--small-image-stem",
    "--image-size",
    "8",
    "--projector",
    "16-16",
    "--batch-size",
    "8",
    "--epochs",
    "2",
    "--warmup-epochs",
    "1",
    "--log-every",
    "1",
    "--seed",
    "7",
    "--probe-max-dim",
    "0",
]


def _error(capsys) -> str:
    return one_sentence(capsys.readouterr().err)


def test_pretrain_refuses_a_non_empty_directory_it_did_not_create_and_touches_nothing(tmp_path, capsys):
    # Guards: a user's own resnet18.pth / config.json / metrics.jsonl in --out were overwritten or appended to.
    out = tmp_path / "mine"
    out.mkdir()
    files = {"resnet18.pth": b"my weights", "config.json": b'{"mine": true}', "metrics.jsonl": b'{"step": 99}\n'}
    for name, data in files.items():
        (out / name).write_bytes(data)
    assert cli_main([*TINY, "--out", str(out), "--max-steps", "1"]) == 2
    err = _error(capsys)
    assert f"--out {out} is not empty and was not created by bt-hub" in err and "--overwrite" in err
    assert sorted(p.name for p in out.iterdir()) == sorted(files)
    assert all((out / name).read_bytes() == data for name, data in files.items())


def test_pretrain_with_overwrite_adopts_the_directory_and_a_second_run_may_resume_there(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert cli_main([*TINY, "--out", str(out), "--max-steps", "1", "--overwrite"]) == 0, capsys.readouterr().err
    assert (out / MARKER_NAME).is_file() and (out / "notes.txt").read_text() == "keep me"
    assert cli_main([*TINY, "--out", str(out), "--max-steps", "2", "--resume", "auto"]) == 0, capsys.readouterr().err
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2]


def test_out_that_is_a_file_fails_in_one_sentence_before_the_model_is_built(tmp_path, capsys, monkeypatch):
    # Guards: an --out that is a file failed with "[Errno 17] File exists", and only after the model was built.
    import bt_hub.train.pretrain

    target = tmp_path / "run"
    target.write_text("a file")
    monkeypatch.setattr(
        bt_hub.train.pretrain,
        "BarlowTwins",
        lambda *a, **k: pytest.fail("the model was built before --out was checked"),
    )
    assert cli_main([*TINY, "--out", str(target)]) == 2
    assert f"--out {target} is an existing file; expected a directory" in _error(capsys)
    assert cli_main([*TINY, "--out", str(target / "sub")]) == 2
    assert f"lies under {target}, which is a file" in _error(capsys)
    assert target.read_text() == "a file"


def test_a_second_run_into_a_locked_directory_fails_at_once_naming_the_holder(tmp_path, capsys):
    # Guards: two runs into one --out interleaved their metrics and mixed their run.json and weights.
    out = tmp_path / "run"
    claim_run_dir(out, kind="pretrain")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import sys, time
            from bt_hub.common.runs import RunLock
            lock = RunLock({str(out)!r})
            print("locked", flush=True)
            time.sleep(120)
        """),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert cli_main([*TINY, "--out", str(out), "--resume", "auto"]) == 2
        err = _error(capsys)
        assert f"--out {out} is in use by another bt-hub run (pid {holder.pid} on host " in err
        assert not (out / "run.json").exists() and not (out / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait(timeout=30)
    lock = RunLock(out)  # the kernel dropped the dead holder's lock
    lock.release()


def test_atomic_writes_follow_the_umask(tmp_path):
    # Guards: every file atomic_write produced was mode 0600, whatever the umask.
    old = os.umask(0o022)
    try:
        assert stat.S_IMODE(atomic_write_text(tmp_path / "a.txt", "x").stat().st_mode) == 0o644
        os.umask(0o027)
        assert stat.S_IMODE(atomic_torch_save({"w": torch.zeros(2)}, tmp_path / "b.pth").stat().st_mode) == 0o640
    finally:
        os.umask(old)


class _FullDisk:
    """A file object whose writes fail with ENOSPC after ``budget`` bytes, as on a full disk."""

    def __init__(self, f, budget: int) -> None:
        self.f, self.budget = f, budget

    def write(self, data) -> int:
        if len(data) > self.budget:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.budget -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()


def test_disk_full_while_checkpointing_is_one_sentence_and_keeps_the_previous_checkpoint(tmp_path, capsys, monkeypatch):
    # Guards: a full disk while checkpointing failed with torch's
    # "[enforce fail at inline_container.cc:672] . unexpected pos ...".
    out = tmp_path / "run"
    real_fdopen, saves = os.fdopen, []

    def fdopen(fd, *args, **kwargs):
        f = real_fdopen(fd, *args, **kwargs)
        if ".checkpoint.pth." in os.readlink(f"/proc/self/fd/{fd}"):
            saves.append(fd)
            if len(saves) == 3:
                return _FullDisk(f, budget=4096)
        return f

    monkeypatch.setattr(os, "fdopen", fdopen)
    assert cli_main([*TINY, "--out", str(out), "--checkpoint-every", "1"]) == 2
    err = _error(capsys)
    assert (
        f"could not write {out / 'checkpoint.pth'}: no space is left on the device; "
        f"free space on the file system of {out}" in err
    )
    assert "the previous checkpoint.pth is unchanged" in err and "enforce fail" not in err
    assert torch.load(out / "checkpoint.pth", weights_only=True)["step"] == 2
    assert not list(out.glob(".*.tmp"))
    monkeypatch.undo()
    assert cli_main([*TINY, "--out", str(out), "--resume", "auto", "--max-steps", "3"]) == 0, capsys.readouterr().err
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]


def test_a_file_over_the_size_limit_is_one_sentence_and_keeps_the_previous_file(tmp_path):
    # Guards: as above, a failed checkpoint write was torch's raw error; here the kernel itself refuses the write
    # (EFBIG under ulimit -f) instead of a patched write.
    target = tmp_path / "checkpoint.pth"
    target.write_bytes(b"previous")
    script = textwrap.dedent(f"""
        import resource, signal, torch
        from bt_hub.common.files import WriteError, atomic_torch_save
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
        try:
            atomic_torch_save({{"w": torch.zeros(100_000)}}, {str(target)!r})
        except WriteError as err:
            print(err)
    """)
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.stdout.strip() == (
        f"could not write {target}: the file is larger than this process may write (ulimit -f); "
        "raise the limit and run again (the previous checkpoint.pth is unchanged)"
    ), done.stderr
    assert target.read_bytes() == b"previous" and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pth"]


def test_disk_full_while_logging_is_one_sentence_and_leaves_the_log_whole(tmp_path, monkeypatch):
    # Guards: a full disk while logging metrics failed with a raw "[Errno 28] No space left on device".
    run = RunDir(tmp_path / "run", kind="pretrain")
    run.log({"step": 1, "loss": 1.0})
    real_write = os.write

    def half_then_full(fd, data):
        if len(data) > 8:
            return real_write(fd, bytes(data[:8]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(
        WriteError,
        match=r"could not write .*metrics.jsonl: no space is left on the device; free space on the file system of",
    ):
        run.log({"step": 2, "loss": 0.5})
    monkeypatch.undo()
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == json.dumps(
        {"step": 1, "loss": 1.0, "run_id": run.run_id}
    ) + "\n"


def test_a_partial_last_metrics_line_is_dropped_with_a_warning_and_earlier_damage_is_named(tmp_path):
    # Guards: a partial last metrics line (e.g. disk full) made --resume auto fail with "Unterminated string ...".
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    with pytest.warns(UserWarning, match="dropped its last line"):
        assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    path.write_text('{"step": 1}\n{"ste\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl line 2 is not JSON; fix or delete that line"):
        read_jsonl(path)


def test_eval_refuses_a_foreign_directory_before_loading_weights_and_accepts_its_own(
    tmp_path, capsys, resnet18_weights
):
    # Guards: eval protocols wrote into a user's own non-empty --out; every protocol's --out goes through the
    # same check as pretrain's.
    from bt_hub.eval.knn import KnnConfig

    out = tmp_path / "mine"
    out.mkdir()
    (out / "results.md").write_text("my own notes")
    common = [
        "--weights",
        str(resnet18_weights),
        "--data",
        "synthetic:40",
        "--image-size",
        "16",
        "--batch-size",
        "20",
        "--k",
        "5",
    ]
    assert cli_main(["eval", "knn", *common, "--out", str(out)]) == 2
    assert f"--out {out} is not empty and was not created by bt-hub" in _error(capsys)
    assert (out / "results.md").read_text() == "my own notes"
    fresh = tmp_path / "fresh"
    for _ in range(2):  # a second protocol run into bt-hub's own directory is welcome
        assert cli_main(["eval", "knn", *common, "--out", str(fresh)]) == 0, capsys.readouterr().err
    assert len(read_jsonl(fresh / "results.jsonl")) == 2 and (fresh / MARKER_NAME).is_file()
    KnnConfig(weights="w", out=str(out), overwrite=True)  # --overwrite lets it through


def test_eval_on_cuda_without_cuda_fails_up_front_in_one_sentence(monkeypatch, capsys):
    # Guards: --device cuda without CUDA failed late, with torch's raw "Found no NVIDIA driver".
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli_main(["eval", "knn", "--weights", "nothing-loaded.pth", "--device", "cuda"]) == 2
    assert "--device cuda was asked for but CUDA is not available; use --device cpu" in _error(capsys)


def test_run_json_keeps_the_first_run_and_appends_each_resume(tmp_path):
    # Guards: every resume rewrote run.json, losing the original command, start time and host.
    run = RunDir(tmp_path / "run", kind="pretrain")
    run.start({"lr": 0.1, "max_steps": 2}, 0)
    first = json.loads((tmp_path / "run" / "run.json").read_text())
    run.start({"lr": 0.1, "max_steps": 5}, 2)
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert {k: record[k] for k in ("command", "started", "host", "config")} == {
        k: first[k] for k in ("command", "started", "host", "config")
    }
    (resume,) = record["resumes"]
    assert resume["resumed_from_step"] == 2 and resume["config"] == {"max_steps": 5}
    assert {"command", "started", "host", "pid", "bt_hub_version"} <= set(resume)
