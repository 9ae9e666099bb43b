"""Run folders keep what they hold: a finished run is not replaced, a folder keeps to its kind and to its
live holder, nothing is written through a symbolic link, a non-finite checkpoint is not resumed, and
``bt-hub report`` reads pretraining runs only."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_output import one_sentence

from bt_hub.cli import main as cli_main
from bt_hub.common.files import WriteError, atomic_write_text
from bt_hub.common.runs import (
    LOCK_NAME,
    MARKER_NAME,
    RunDir,
    RunDirBusyError,
    RunLock,
    check_run_dir,
    claim_run_dir,
    read_jsonl,
    remove_stale_temp_files,
    run_kind,
)
from bt_hub.train.resume import training_stopped

# 32 synthetic images, batch 8: a run of 2 of the schedule's 8 steps, a checkpoint at each.
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
    "--checkpoint-every",
    "1",
    "--max-steps",
    "2",
    "--seed",
    "7",
    "--probe-max-dim",
    "0",
]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    assert cli_main([*TINY, "--out", str(out)]) == 0
    return out


@pytest.fixture
def run(finished_run, tmp_path) -> Path:
    """A copy of a finished 2-step run (checkpoint, metrics, run.json, backbone.safetensors, config.json)."""
    return Path(shutil.copytree(finished_run, tmp_path / "run", symlinks=True))


def _files(folder: Path) -> dict[str, bytes]:
    """Every file's bytes but the lock's (a run that takes the lock writes its pid there, by design)."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in folder.rglob("*")
        if p.is_file() and not p.is_symlink() and p.name != LOCK_NAME
    }


def _error(capsys) -> str:
    return one_sentence(capsys.readouterr().err)


def test_a_finished_run_without_its_checkpoint_is_not_replaced_by_a_fresh_run(run, capsys):
    # Guards: once checkpoint.pth was gone, a fresh pretrain (--seed 5) replaced the finished run's weights, exit 0,
    # and run.json recorded it as a resume from step 0 under the old seed.
    (run / "checkpoint.pth").unlink()
    before = _files(run)
    for extra in ([], ["--resume", "auto"]):
        assert cli_main([*TINY, "--out", str(run), "--seed", "5", *extra]) == 2
        err = _error(capsys)
        assert f"--out {run} holds a finished run (backbone.safetensors of step 2) and no checkpoint.pth" in err
        assert "pass --overwrite to replace that run with a new one, or choose a new --out" in err
        assert _files(run) == before


def test_overwrite_starts_a_new_run_in_place_and_run_json_keeps_the_replaced_record(run, capsys):
    old_weights, old_record = (run / "backbone.safetensors").read_bytes(), json.loads((run / "run.json").read_text())
    assert cli_main([*TINY, "--out", str(run), "--seed", "5"]) == 2
    assert "already holds checkpoint.pth; pass --resume auto to continue it, --overwrite to replace" in _error(capsys)
    assert cli_main([*TINY, "--out", str(run), "--seed", "5", "--overwrite"]) == 0, capsys.readouterr().err
    record = json.loads((run / "run.json").read_text())
    assert record["config"]["seed"] == 5 and record["kind"] == "pretrain" and "resumes" not in record
    assert record["replaced"] == [old_record]
    assert (run / "backbone.safetensors").read_bytes() != old_weights
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2]
    assert torch.load(run / "checkpoint.pth", weights_only=True)["config"]["seed"] == 5


def test_eval_refuses_a_pretraining_run_as_its_out_and_changes_nothing(run, capsys):
    # Guards: `eval linear --out <pretrain run>` appended epoch rows to its metrics.jsonl and itself to its run.json.
    before = _files(run)
    assert cli_main(["eval", "linear", "--weights", str(run), "--data", "synthetic:40", "--out", str(run)]) == 2
    assert (
        f"--out {run} holds a bt-hub pretrain run, and bt-hub eval does not write into a folder of another kind of "
        "run; choose another --out"
    ) in _error(capsys)
    assert _files(run) == before


def test_a_run_folder_records_its_kind_and_other_kinds_are_refused_even_with_overwrite(tmp_path, finished_run):
    evaluation = tmp_path / "eval"
    RunDir(evaluation, {"epochs": 1}, kind="eval").log({"epoch": 0, "top1": 50.0})
    assert run_kind(evaluation) == "eval" == json.loads((evaluation / MARKER_NAME).read_text())["kind"]
    assert json.loads((evaluation / "run.json").read_text())["kind"] == "eval"
    for overwrite in (False, True):
        with pytest.raises(ValueError, match="holds a bt-hub eval run, and bt-hub pretrain does not write into"):
            claim_run_dir(evaluation, kind="pretrain", overwrite=overwrite)
    claim_run_dir(evaluation, kind="eval")
    assert run_kind(finished_run) == "pretrain"
    # the kind is the caller's to name: it is never guessed from the calling module
    for claim in (check_run_dir, claim_run_dir, RunDir):
        with pytest.raises(TypeError, match="kind"):
            claim(finished_run)
    # a pretraining run of an earlier bt_hub (no kind recorded) is recognised by its run.json
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / MARKER_NAME).write_text('{"created_by": "bt_hub"}')
    (legacy / "run.json").write_text(
        json.dumps({"bt_hub_version": "0.1.0", "started": "x", "config": {"projector": "16-16", "lr_weights": 0.2}})
    )
    assert run_kind(legacy) == "pretrain"


def test_no_command_writes_into_a_folder_that_a_live_run_holds(tmp_path):
    # Guards: eval wrote into a pretraining folder while its run was live.
    out = claim_run_dir(tmp_path / "run", kind="eval")
    lock = RunLock(out)  # flock is per open file: this process's next open of the lock file is refused as another's
    try:
        with pytest.raises(RunDirBusyError, match=rf"--out {out} is in use by another bt-hub run \(pid {os.getpid()}"):
            check_run_dir(out, kind="eval")
        with pytest.raises(RunDirBusyError):
            RunDir(out, {"epochs": 1}, kind="eval")
    finally:
        lock.release()
    check_run_dir(out, kind="eval")


def test_a_symlinked_lock_is_refused_and_the_file_it_points_to_is_untouched(run, tmp_path, capsys):
    # Guards: the lock was opened through a symbolic link and truncated: ~/notes.txt became {"pid": ...}.
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    (run / LOCK_NAME).unlink()
    (run / LOCK_NAME).symlink_to(notes)
    before = _files(run)
    for extra in (["--resume", "auto", "--max-steps", "3"], ["--overwrite"]):
        assert cli_main([*TINY, "--out", str(run), *extra]) == 2
        assert f"refused to write {run / LOCK_NAME}: it is a symbolic link (to {notes})" in _error(capsys)
        assert notes.read_text() == "my notes\n" and _files(run) == before


def test_logs_atomic_writes_and_temp_cleanup_never_write_through_a_symlink(tmp_path):
    # Guards: eval appended through a metrics.jsonl symbolic link to a file outside its folder.
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"mine\n")
    run = RunDir(tmp_path / "run", kind="eval")
    for name in ("metrics.jsonl", "run.json", "results.json", ".checkpoint.pth.0a1b2c3d.tmp"):
        (run.path / name).symlink_to(outside)
    with pytest.raises(WriteError, match=r"refused to write .*metrics.jsonl: it is a symbolic link \(to "):
        run.log({"epoch": 0})
    with pytest.raises(WriteError, match=r"refused to write .*run.json: it is a symbolic link"):
        run.start({"epochs": 1})
    with pytest.raises(WriteError, match=r"refused to write .*results.json: it is a symbolic link"):
        atomic_write_text(run.path / "results.json", "{}")
    assert remove_stale_temp_files(run.path) == []
    assert all((run.path / n).is_symlink() for n in ("results.json", ".checkpoint.pth.0a1b2c3d.tmp"))
    assert not [p for p in run.path.iterdir() if p.name.endswith(".tmp") and not p.is_symlink()]
    assert outside.read_bytes() == b"mine\n"


@pytest.mark.parametrize("part", ["model", "optimizer"])
def test_a_checkpoint_holding_nan_is_not_resumed_and_the_message_names_the_tensor(run, capsys, part):
    # Guards: resuming a finished run whose checkpoint held a NaN wrote NaN final weights, exit 0.
    state = torch.load(run / "checkpoint.pth", weights_only=True)
    if part == "model":
        state["model"]["backbone.conv1.weight"][0, 0, 0, 0] = float("nan")
        name = "model.backbone.conv1.weight"
    else:
        state["optimizer"]["state"][0]["mu"].fill_(float("inf"))
        name = "optimizer.state.0.mu"
    torch.save(state, run / "checkpoint.pth")
    before = _files(run)
    assert cli_main([*TINY, "--out", str(run), "--resume", "auto"]) == 2
    assert (
        f"checkpoint {run / 'checkpoint.pth'} holds NaN or inf in 1 tensor ({name}), so it cannot be resumed"
        in _error(capsys)
    )
    assert _files(run) == before


def test_a_stopped_run_says_whether_its_kept_checkpoint_is_finite(tmp_path):
    # Guards: the message claimed "every tensor finite" for a checkpoint holding NaN and blamed the learning rate.
    path = tmp_path / "checkpoint.pth"
    torch.save({"step": 3, "model": {"w": torch.tensor([float("nan")])}, "optimizer": {}}, path)
    text = training_stopped(path, 4, "the loss became nan")
    assert f"{path} (step 3) is kept but holds NaN or inf (model.w); it cannot be resumed" in text
    assert "every tensor finite" not in text and "--lr-weights" not in text
    torch.save({"step": 3, "model": {"w": torch.zeros(1)}, "optimizer": {}}, path)
    text = training_stopped(path, 4, "the loss became nan")
    assert "(step 3, every tensor finite) is kept" in text and "--lr-weights" in text


def test_report_refuses_a_folder_that_is_not_a_pretraining_run(tmp_path, capsys):
    # Guards: `bt-hub report <an eval folder>` ended in a KeyError: 'lambd' traceback.
    evaluation = tmp_path / "eval"
    RunDir(evaluation, {"epochs": 1, "lr": 0.3}, kind="eval").log({"epoch": 0, "top1": 50.0})
    assert cli_main(["report", str(evaluation)]) == 2
    assert f"{evaluation} is not a pretraining run (a bt-hub eval folder); bt-hub report draws" in _error(capsys)
    (evaluation / MARKER_NAME).write_text('{"created_by": "bt_hub"}')  # as an earlier bt_hub wrote it
    (evaluation / "run.json").write_text(json.dumps({"bt_hub_version": "0.1.0", "config": {"lr": 0.3}}))
    assert cli_main(["report", str(evaluation)]) == 2
    assert f"{evaluation} is not a pretraining run (not a folder bt-hub pretrain wrote)" in _error(capsys)
    assert not (evaluation / "report").exists()


def test_report_names_a_damaged_metrics_line_and_writes_no_png_when_an_input_is_bad(run, capsys):
    metrics = run / "metrics.jsonl"
    good = metrics.read_text()
    metrics.write_text('{"step": 1, "lo\n' + good.split("\n", 1)[1])
    assert cli_main(["report", str(run)]) == 2
    assert f"{metrics} line 1 is not JSON" in _error(capsys)
    metrics.write_text(good.replace('"loss": ', '"loss": "x", "old": ', 1))
    assert cli_main(["report", str(run)]) == 2
    assert f"{metrics} line 1 is not a metrics row of bt-hub pretrain" in _error(capsys)
    metrics.write_text(good)
    np.save(run / "cross_correlation_end.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    assert cli_main(["report", str(run)]) == 2  # loss.png was written before this file was read
    assert f"{run / 'cross_correlation_end.npy'} is not a readable .npy array" in _error(capsys)
    assert not (run / "report").exists()
    (run / "cross_correlation_end.npy").unlink()
    assert cli_main(["report", str(run)]) == 0 and (run / "report" / "loss.png").is_file()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--image-size", "100000"], "--image-size 100000 is larger than 2048 px, the most bt-hub pretrain accepts"),
        (["--lr-weights", "0"], "--lr-weights must be positive, got 0.0"),
        (["--lr-biases", "-0.1"], "--lr-biases must be positive, got -0.1"),
        (["--lr-weights", "nan"], "--lr-weights must be a finite number, got nan"),
        (["--lambd", "inf"], "--lambd must be a finite number, got inf"),
        (["--projector", "16-100000"], "--projector 16-100000 has a layer of 100000 units, more than the 32768"),
    ],
)
def test_pretrain_flags_out_of_range_are_one_sentence_naming_the_flag(tmp_path, capsys, flags, message):
    # Guards: --image-size 100000 ended in numpy's "Unable to allocate 149 GiB"; a zero or NaN LR trained nothing.
    assert cli_main([*TINY, "--out", str(tmp_path / "run"), *flags]) == 2
    assert message in _error(capsys)
    assert not (tmp_path / "run").exists()


def test_report_never_replaces_a_png_of_yours_in_any_folder(run, tmp_path, capsys):
    # Guards: `bt-hub report RUN --out DIR` replaced the user's own loss.png in any folder, exit code 0.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "loss.png").write_bytes(b"my plot")
    assert cli_main(["report", str(run), "--out", str(mine)]) == 2
    assert f"--out {mine} is not empty and was not created by bt-hub" in _error(capsys)
    assert [p.name for p in mine.iterdir()] == ["loss.png"] and (mine / "loss.png").read_bytes() == b"my plot"
    assert cli_main(["report", str(run), "--out", str(run)]) == 2  # nor into the run's own folder
    assert f"--out {run} holds a bt-hub pretrain run" in _error(capsys)
    for _ in range(2):  # its own folder: drawn again in place
        assert cli_main(["report", str(run)]) == 0 and (run / "report" / "loss.png").is_file()
    assert cli_main(["report", str(run), "--out", str(mine), "--overwrite"]) == 0
    assert (mine / "loss.png").read_bytes().startswith(b"\x89PNG")


def test_pretrain_into_a_read_only_run_folder_is_one_sentence_naming_the_folder_and_flag(run, monkeypatch, capsys):
    # Guards: a run folder on a read-only file system printed a raw "[Errno 30] Read-only file system" line.
    import errno

    import bt_hub.common.runs as runs

    opened = runs.open_no_follow

    def read_only(path, flags, mode=0o666):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return opened(path, flags, mode)

    monkeypatch.setattr(runs, "open_no_follow", read_only)
    before = _files(run)
    assert cli_main([*TINY, "--out", str(run), "--max-steps", "3", "--resume", "auto"]) == 2
    line = _error(capsys)
    assert line == (
        f"bt-hub pretrain: error: --out {run} is not writable (Read-only file system: could not open its "
        f"{LOCK_NAME}); choose a writable --out"
    )
    assert _files(run) == before


def test_a_failed_eval_takes_its_claim_back_and_leaves_no_folder_holding_only_the_marker(tmp_path, capsys):
    # Guards: an eval that failed (here: unknown weights) left its --out holding only .bt_hub_run.
    fail = ["eval", "knn", "--weights", str(tmp_path / "missing.pth"), "--arch", "resnet18"]
    out = tmp_path / "new"
    assert cli_main([*fail, "--out", str(out)]) == 2 and "missing.pth" in _error(capsys)
    assert not out.exists()
    out.mkdir()  # an empty folder of yours: left empty
    assert cli_main([*fail, "--out", str(out)]) == 2 and "missing.pth" in _error(capsys)
    assert not list(out.iterdir())
    earlier = tmp_path / "earlier"  # a folder bt_hub claimed before keeps its marker
    claim_run_dir(earlier, kind="eval")
    assert cli_main([*fail, "--out", str(earlier)]) == 2 and "missing.pth" in _error(capsys)
    assert [p.name for p in earlier.iterdir()] == [MARKER_NAME]


def test_temp_files_of_interrupted_writes_go_however_recent_but_a_live_write_and_files_of_yours_stay(tmp_path):
    # Guards: temp files of interrupted writes stayed in eval folders (and --cache-dir) for good, and those of a
    # write killed less than a minute before the next run stayed after it.
    import fcntl

    folder = claim_run_dir(tmp_path / "eval", kind="eval")
    stale, live, recent, yours = (
        folder / ".results.json.0a1b2c3d.tmp",
        folder / ".features.npy.1b2c3d4e.tmp",
        folder / ".results.md.2c3d4e5f.tmp",
        folder / ".notes.tmp",
    )
    for path in (stale, live, recent, yours):
        path.write_bytes(b"x")
    hour_ago = os.stat(stale).st_mtime - 3600
    for path in (stale, live, yours):
        os.utime(path, (hour_ago, hour_ago))
    with open(live, "rb") as writer:
        fcntl.flock(writer, fcntl.LOCK_EX)  # as atomic_write holds it until its rename
        assert claim_run_dir(folder, kind="eval") == folder
        assert sorted(p.name for p in folder.iterdir()) == sorted([MARKER_NAME, live.name, yours.name])
    assert remove_stale_temp_files(folder) == [live]
    assert yours.is_file()


def test_writing_a_file_removes_the_temp_files_of_its_interrupted_writes_outside_a_run_folder_too(tmp_path):
    # Guards: bt-hub export --force after a kill left the killed write's temp file in the Hugging Face folder (and
    # beside a single exported file) for good: no run folder is claimed there, so nothing removed it.
    left, others = tmp_path / ".config.json.0a1b2c3d.tmp", tmp_path / ".config.json.bak.1b2c3d4e.tmp"
    for path in (left, others):
        path.write_bytes(b"{")
    atomic_write_text(tmp_path / "config.json", "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["config.json", others.name])


def test_a_write_whose_temp_file_a_cleaner_removed_before_its_lock_starts_again_and_ctrl_c_there_leaves_none(
    tmp_path, monkeypatch
):
    # Guards: a cleaner may remove a temp file in the moment between its creation and its writer's lock (which is
    # why leftovers younger than a minute were kept, so a rerun right after a kill left them); Ctrl-C in that
    # moment left the temp file behind.
    import fcntl

    import bt_hub.common.files as files

    real_flock, calls = fcntl.flock, []

    def cleaner_first(fd, op):
        if not calls:  # the writer's lock is not yet held: its file looks left over
            monkeypatch.setattr(files.fcntl, "flock", real_flock)
            calls.append(remove_stale_temp_files(tmp_path))
        return real_flock(fd, op)

    monkeypatch.setattr(files.fcntl, "flock", cleaner_first)
    assert atomic_write_text(tmp_path / "a.txt", "whole").read_text() == "whole"
    assert len(calls[0]) == 1 and [p.name for p in tmp_path.iterdir()] == ["a.txt"]

    def ctrl_c(fd, op):
        raise KeyboardInterrupt

    monkeypatch.setattr(files.fcntl, "flock", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_text(tmp_path / "b.txt", "cut")
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def _writer(command: str, tmp_path: Path, weights: Path) -> tuple[list[str], str, str]:
    """A command that writes a folder: its argv, and the module and function inside its claim that a second
    command is started from."""
    evaluation = ["--weights", str(weights), "--data", "synthetic:40", "--image-size", "8", "--batch-size", "16"]
    if command == "embed":
        return ["embed", *evaluation], "bt_hub.eval.embedding", "_write"
    if command == "eval knn":  # every eval protocol, compare and eval all claim through bt_hub.eval.runner.evaluation
        return ["eval", "knn", *evaluation, "--k", "5"], "bt_hub.eval.runner", "write_records"
    if command == "report":
        assert cli_main([*TINY, "--out", str(tmp_path / "pretrained")]) == 0
        return ["report", str(tmp_path / "pretrained")], "bt_hub.train.report", "save_png"
    if command == "demo":
        return ["demo"], "bt_hub.eval.demo", "_demo"
    from bt_hub.eval.detection.synthetic import DetectionDataConfig, make_detection_data

    data = make_detection_data(DetectionDataConfig(out=str(tmp_path / "shapes"), train=1, test=1, size=32))
    return ["detect", "--weights", str(weights), "--data", str(data)], "bt_hub.eval.detection.detect", "_main"


@pytest.mark.parametrize("command", ["embed", "eval knn", "report", "demo", "detect"])
def test_a_second_writer_into_the_out_of_a_live_command_is_refused_and_the_first_keeps_its_files(
    command, tmp_path, small_stem_weights, monkeypatch, capsys
):
    # Guards: two bt-hub embed runs into one --out both exited 0, the second replacing the first one's files:
    # only pretrain held the folder's lock; every command that writes a folder now holds it while it works.
    import importlib

    argv, module_name, function = _writer(command, tmp_path, small_stem_weights)
    out = tmp_path / "out"
    argv = [*argv, "--out", str(out)]
    module, second = importlib.import_module(module_name), []
    original = getattr(module, function)

    def started_inside_the_first(*args, **kwargs):
        if not second:
            capsys.readouterr()
            second.append(None)  # the second one, if let in, reaches here too: it goes on as a plain run
            second[0] = cli_main(argv)
            second.append(capsys.readouterr().err)
            if command in ("demo", "detect"):  # the first one's work itself is not this test's concern
                return {}
        return original(*args, **kwargs)

    monkeypatch.setattr(module, function, started_inside_the_first)
    capsys.readouterr()
    assert cli_main(argv) == 0, capsys.readouterr().err
    assert second[0] == 2, second[1]
    assert f"--out {out} is in use by another bt-hub run (pid {os.getpid()} on host " in one_sentence(second[1])
    assert out.is_dir() and (out / MARKER_NAME).is_file()
    RunLock(out).release()  # the first one let go of it when it ended
