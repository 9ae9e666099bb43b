"""The pretraining loop: exact resume after SIGKILL (1 process and torchrun x2), the CLI, errors."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_output import one_sentence
from PIL import Image
from safetensors.torch import load_file

from bt_hub.cli import main as cli_main
from bt_hub.method.model import build_backbone
from bt_hub.method.views import VIEW_A, VIEW_B
from bt_hub.train.batches import view_pair
from bt_hub.train.config import PretrainConfig
from bt_hub.train.pretrain import pretrain
from bt_hub.weights import load_backbone

# 32 synthetic training images, batch 8: 4 steps per epoch, 8 in all; checkpoints at 3 (mid-epoch), 4, 6 (mid-epoch), 8.
TINY = [
    "--data",
    "synthetic:40",
    "--arch",
    "resnet18",
    "--small-image-stem",
    "--image-size",
    "8",
    "--projector",
    "64-64",
    "--batch-size",
    "8",
    "--epochs",
    "2",
    "--warmup-epochs",
    "1",
    "--checkpoint-every",
    "3",
    "--log-every",
    "1",
    "--seed",
    "7",
    "--probe-max-dim",
    "0",
]
STEPS_PER_EPOCH, TOTAL_STEPS = 4, 8
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _pretrain_cmd(out: Path, *extra: str, launcher: list[str] | None = None) -> list[str]:
    prefix = launcher + ["-m", "bt_hub.cli"] if launcher else [sys.executable, "-m", "bt_hub.cli"]
    return prefix + ["pretrain", *TINY, "--out", str(out), *extra]


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def _checkpoint_step(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["step"])


def _kill_after_mid_epoch_checkpoint(cmd: list[str], out: Path) -> int:
    """Run ``cmd`` in its own process group; after each logged step freeze it (SIGSTOP) and
    SIGKILL the whole group as soon as the checkpoint on disk is inside an epoch."""
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    metrics, ckpt, seen = out / "metrics.jsonl", out / "checkpoint.pth", 0
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read()[-2000:]}"
            lines = metrics.read_text().count("\n") if metrics.exists() else 0
            if lines > seen and ckpt.exists():
                seen = lines
                os.killpg(proc.pid, signal.SIGSTOP)
                step = _checkpoint_step(ckpt)
                if step % STEPS_PER_EPOCH and step < TOTAL_STEPS:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=30)
                    return step
                os.killpg(proc.pid, signal.SIGCONT)
            time.sleep(0.02)
        pytest.fail("no mid-epoch checkpoint appeared within 240 s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _assert_same_final_state(a: Path, b: Path) -> None:
    sa = torch.load(a / "checkpoint.pth", map_location="cpu", weights_only=True)
    sb = torch.load(b / "checkpoint.pth", map_location="cpu", weights_only=True)
    assert sa["step"] == sb["step"] == TOTAL_STEPS
    assert sa["model"].keys() == sb["model"].keys()
    different = [k for k in sa["model"] if not torch.equal(sa["model"][k], sb["model"][k])]
    assert not different, f"tensors differ after resume: {different[:5]}"
    for (ka, ma), (kb, mb) in zip(sa["optimizer"]["state"].items(), sb["optimizer"]["state"].items()):
        assert ka == kb and torch.equal(ma["mu"], mb["mu"])
    backbone_a = load_file(a / "backbone.safetensors")
    backbone_b = load_file(b / "backbone.safetensors")
    assert all(torch.equal(backbone_a[k], backbone_b[k]) for k in backbone_a)
    losses = [[json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (a, b)]
    assert losses[0] == losses[1] and len(losses[0]) == TOTAL_STEPS


@pytest.mark.parametrize(
    "launcher",
    [pytest.param(None, id="single-process"), pytest.param(TORCHRUN, id="torchrun-2-gloo", marks=pytest.mark.ddp)],
)
def test_run_killed_mid_epoch_and_resumed_is_bit_identical(tmp_path, launcher):
    _run(_pretrain_cmd(tmp_path / "straight", launcher=launcher))
    interrupted = tmp_path / "interrupted"
    step = _kill_after_mid_epoch_checkpoint(_pretrain_cmd(interrupted, launcher=launcher), interrupted)
    assert 0 < step < TOTAL_STEPS and step % STEPS_PER_EPOCH
    assert not (interrupted / "backbone.safetensors").exists()
    _run(_pretrain_cmd(interrupted, "--resume", "auto", launcher=launcher))
    _assert_same_final_state(tmp_path / "straight", interrupted)


def test_pretrain_on_digits_writes_its_final_weights_once_as_safetensors_with_torchvision_keys(tmp_path, capsys):
    # Guards: a run wrote the same tensors twice (resnet18.pth and backbone.safetensors, besides the checkpoint).
    out = tmp_path / "run"
    code = cli_main(
        [
            "pretrain",
            "--data",
            "digits",
            "--out",
            str(out),
            "--arch",
            "resnet18",
            "--small-image-stem",
            "--image-size",
            "8",
            "--projector",
            "32-32",
            "--batch-size",
            "32",
            "--epochs",
            "1",
            "--warmup-epochs",
            "1",
            "--max-steps",
            "2",
            "--probe-max-dim",
            "64",
            "--views",
            "batched",
            "--log-every",
            "1",
        ]
    )
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["lr_weights"] == 0.0 and rows[1]["lr_weights"] > 0  # warm-up starts at 0
    assert all(np.isfinite(r["loss"]) and r["embedding_std"] > 0 for r in rows)
    state = load_file(out / "backbone.safetensors")
    assert (
        "conv1.weight" in state and "layer1.0.bn1.running_mean" in state and not any(k.startswith("fc.") for k in state)
    )
    net = build_backbone("resnet18", small_image_stem=True)
    net.load_state_dict(state, strict=True)
    assert sorted(p.name for p in out.glob("*.pth")) == ["checkpoint.pth"]
    assert torch.equal(load_backbone(out).conv1.weight, state["conv1.weight"])  # the folder loads as weights
    config = json.loads((out / "config.json").read_text())
    assert (config["architecture"], config["small_image_stem"], config["projector"], config["dataset"]) == (
        "resnet18",
        True,
        "32-32",
        "digits",
    )
    assert config["steps"] == 2 and config["recipe"]["batch_size"] == 32
    assert config["recipe"]["compile"] == "off" and config["recipe"]["compile_reason"] == "auto: 2 steps planned"
    start, end = np.load(out / "cross_correlation_start.npy"), np.load(out / "cross_correlation_end.npy")
    assert start.shape == end.shape == (32, 32) and not np.array_equal(start, end)


def test_non_finite_loss_stops_with_a_clear_error_and_keeps_the_last_checkpoint(tmp_path):
    config = PretrainConfig(
        data="synthetic:40",
        out=str(tmp_path),
        backbone="resnet18",
        small_image_stem=True,
        image_size=8,
        projector="16-16",
        batch_size=8,
        epochs=2,
        warmup_epochs=0,
        lr_biases=1e36,
        checkpoint_every=1,
        probe_max_dim=0,
    )
    with pytest.raises(
        RuntimeError,
        match=(
            r"the loss became nan at step (\d+); training stopped and the last good checkpoint "
            r".*checkpoint.pth \(step"
        ),
    ):
        pretrain(config)
    state = torch.load(tmp_path / "checkpoint.pth", weights_only=True)
    assert state["step"] >= 1 and all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())
    assert not (tmp_path / "backbone.safetensors").exists()


def _all_finite(state: dict) -> bool:
    tensors = [*state["model"].values(), *(v for s in state["optimizer"]["state"].values() for v in s.values())]
    return all(torch.isfinite(t).all() for t in tensors if t.is_floating_point())


def test_a_diverging_run_keeps_only_an_all_finite_checkpoint_and_resuming_it_stops_again_clearly(tmp_path, capsys):
    # Guards: the checkpoint kept from a diverging run held non-finite BatchNorm running_var tensors.
    out = tmp_path / "run"
    flags = [
        "pretrain",
        *TINY,
        "--projector",
        "16-16",
        "--warmup-epochs",
        "0",
        "--lr-weights",
        "1e9",
        "--checkpoint-every",
        "1",
        "--out",
        str(out),
    ]
    assert cli_main(flags) == 2
    err = one_sentence(capsys.readouterr().err)
    found = re.search(
        r"at step (\d+); training stopped and the last good checkpoint (\S+) "
        r"\(step (\d+), every tensor finite\) is kept",
        err,
    )
    assert found, err
    assert Path(found[2]) == out / "checkpoint.pth" and int(found[3]) == int(found[1]) - 1
    state = torch.load(out / "checkpoint.pth", weights_only=True)
    assert state["step"] == int(found[3]) and _all_finite(state)
    kept = (out / "checkpoint.pth").read_bytes()
    assert cli_main([*flags, "--resume", "auto"]) == 2  # deterministic: the same divergence, the same sentence
    assert found[0] in capsys.readouterr().err
    assert (out / "checkpoint.pth").read_bytes() == kept and not (out / "backbone.safetensors").exists()


def test_resume_without_a_checkpoint_restarts_the_metrics_and_a_cut_last_line_is_dropped(tmp_path, capsys):
    # Guards: metrics duplicated after a kill before the first checkpoint; "Unterminated string" on a cut last line;
    # temp files of interrupted writes never removed; run.json rewritten by every resume.
    out = tmp_path / "run"
    assert cli_main(["pretrain", *TINY, "--out", str(out), "--max-steps", "2"]) == 0
    for name in ("checkpoint.pth", "backbone.safetensors", "config.json"):  # as if killed before any checkpoint
        (out / name).unlink()
    assert cli_main(["pretrain", *TINY, "--out", str(out), "--max-steps", "3", "--resume", "auto"]) == 0
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "epoch": 1, "lo')
    leftovers = [out / ".checkpoint.pth.k3x9q2_a.tmp", out / ".run.json.0f3ab2c4.tmp"]
    users = [out / "notes.tmp", out / ".draft.tmp", out / ".checkpoint.pth.bak"]
    for path in leftovers + users:
        path.write_bytes(b"partial")
    capsys.readouterr()
    assert cli_main(["pretrain", *TINY, "--out", str(out), "--max-steps", "4", "--resume", "auto"]) == 0
    warned = [
        line for line in capsys.readouterr().err.splitlines() if line.startswith("bt-hub pretrain: warning: ")
    ]  # one line each
    assert len(warned) == 1 and "metrics.jsonl: dropped its last line, cut short by an interrupted write" in warned[0]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert not any(p.exists() for p in leftovers) and all(p.exists() for p in users)
    record = json.loads((out / "run.json").read_text())
    assert record["config"]["max_steps"] == 2 and {"command", "started", "host", "git_sha"} <= set(record)
    assert [(r["resumed_from_step"], r["config"]) for r in record["resumes"]] == [
        (0, {"max_steps": 3, "resume": "auto"}),
        (3, {"max_steps": 4, "resume": "auto"}),
    ]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--data", "/no/such/dir"], "data directory /no/such/dir does not exist"),
        (["--batch-size", "0"], "--batch-size must be positive, got 0"),
        (["--projector", "64-x"], "--projector: projector '64-x' is malformed"),
        (["--precision", "fp16"], "--precision fp16 needs --device cuda"),
        (["--batch-size", "4096"], "--batch-size 4096 is larger than the 32 training images of --data synthetic:40"),
        (["--resume", "/no/such/checkpoint.pth"], "checkpoint /no/such/checkpoint.pth does not exist"),
        # Guards: schedules that cannot be what was meant (a warm-up longer than the run, more steps than the
        # schedule has) were accepted.
        (
            ["--warmup-epochs", "50", "--epochs", "1"],
            "--warmup-epochs 50 is longer than the whole schedule (--epochs 1)",
        ),
        (
            ["--max-steps", "100"],
            "--max-steps 100 is more than the 8 steps of the schedule (--epochs 2 x 4 steps per epoch)",
        ),
    ],
)
def test_bad_paths_and_flags_are_one_sentence_errors_naming_them(tmp_path, capsys, flags, message):
    code = cli_main(["pretrain", *TINY, "--out", str(tmp_path / "run"), *flags])
    err = one_sentence(capsys.readouterr().err)
    assert code == 2 and message in err
    assert not (tmp_path / "run").exists()  # a folder claimed for a run that never started is removed again


def test_existing_run_is_not_overwritten_and_resume_checks_the_recipe(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli_main(["pretrain", *TINY, "--projector", "16-16", "--out", str(out), "--max-steps", "2"]) == 0
    assert (
        cli_main(["pretrain", *TINY, "--projector", "16-16", "--out", str(out), "--resume", "auto", "--max-steps", "1"])
        == 2
    )
    assert "--max-steps 1 is before step 2 of the checkpoint being resumed" in capsys.readouterr().err
    assert cli_main(["pretrain", *TINY, "--projector", "16-16", "--out", str(out)]) == 2
    assert f"--out {out} already holds checkpoint.pth; pass --resume auto" in capsys.readouterr().err
    assert (
        cli_main(["pretrain", *TINY, "--projector", "16-16", "--out", str(out), "--resume", "auto", "--seed", "8"]) == 2
    )
    assert "--seed is 8 but checkpoint" in capsys.readouterr().err
    assert (
        cli_main(["pretrain", *TINY, "--projector", "16-16", "--out", str(out), "--resume", "auto", "--no-flip"]) == 2
    )
    assert "--flip is False but checkpoint" in capsys.readouterr().err


def test_resume_refuses_training_data_changed_in_place_and_resumes_an_older_checkpoint_with_a_warning(
    tmp_path, image_folder, capsys
):
    # guards: --resume auto continued a checkpoint on a training folder whose images had been replaced under the same
    # names: its data entered the check as the --data path alone
    data = image_folder(tmp_path / "data", classes=("a", "b"), per_class=8, size=8, splits=())
    out = tmp_path / "run"
    argv = ["pretrain", "--data", str(data), *TINY[2:], "--out", str(out)]
    assert cli_main([*argv, "--max-steps", "2"]) == 0
    checkpoint = out / "checkpoint.pth"
    image = data / "a" / "a_0.png"
    kept = image.read_bytes()
    Image.fromarray(np.full((8, 8, 3), 200, dtype=np.uint8)).save(image)  # same name, other pixels
    capsys.readouterr()
    assert cli_main([*argv, "--max-steps", "3", "--resume", "auto"]) == 2
    assert one_sentence(capsys.readouterr().err) == (
        f"bt-hub pretrain: error: --data {data} is not what checkpoint {checkpoint} was trained on (data changed: an "
        "image was added, removed, relabelled or written since); put back the images it was trained on to resume it, "
        "or start a new run on this data (--overwrite without --resume, or another --out)"
    )
    image.write_bytes(kept)  # the bytes put back, with a new ctime: still a change to the fingerprint
    state = torch.load(checkpoint, weights_only=True)
    del state["data_fingerprint"]  # as a checkpoint written before bt_hub recorded it
    torch.save(state, checkpoint)
    assert cli_main([*argv, "--max-steps", "3", "--resume", "auto"]) == 0
    assert f"checkpoint {checkpoint} records no fingerprint of its training data" in capsys.readouterr().err
    assert int(torch.load(checkpoint, weights_only=True)["step"]) == 3
    assert cli_main([*argv, "--max-steps", "4", "--resume", "auto"]) == 0  # its next checkpoint records the data


def test_views_follow_crop_scale_min_no_flip_and_no_blur_and_keep_the_rest_of_the_paper():
    paper = view_pair(PretrainConfig())
    assert paper == (
        dataclasses.replace(VIEW_A, crop_scale=(0.08, 1.0)),
        dataclasses.replace(VIEW_B, crop_scale=(0.08, 1.0)),
    )
    tiny = view_pair(PretrainConfig(crop_scale_min=0.4, flip=False, blur=False))
    for ours, theirs in zip(tiny, paper):
        assert (ours.crop_scale, ours.flip_p, ours.blur_p) == ((0.4, 1.0), 0.0, 0.0)
        assert (
            dataclasses.replace(ours, crop_scale=theirs.crop_scale, flip_p=theirs.flip_p, blur_p=theirs.blur_p)
            == theirs
        )
    assert PretrainConfig.PRESETS["digits"]["flip"] is False and PretrainConfig.PRESETS["digits"]["blur"] is False


def test_channels_last_auto_follows_the_resolved_precision():
    # Guards: the CLI default was NCHW while benchmarks/pretrain_step.py measured bt_hub channels-last.
    from bt_hub.data.precision import resolve_channels_last

    assert [resolve_channels_last("auto", p) for p in ("bf16", "fp16", "fp32")] == ["on", "on", "off"]
    assert resolve_channels_last("off", "bf16") == "off" and resolve_channels_last("on", "fp32") == "on"
    with pytest.raises(ValueError, match="--channels-last 'yes' is unknown"):
        resolve_channels_last("yes", "bf16")


def test_keep_every_keeps_the_backbone_at_its_steps_with_the_seconds_trained_across_a_resume(tmp_path):
    from bt_hub.train.run_folder import kept_weights

    out = tmp_path / "run"
    assert cli_main(["pretrain", *TINY, "--out", str(out), "--keep-every", "3", "--max-steps", "5"]) == 0
    assert [step for step, _, _ in kept_weights(out)] == [3, 5]  # every 3 steps, and the last one
    assert cli_main(["pretrain", *TINY, "--out", str(out), "--keep-every", "3", "--resume", "auto"]) == 0
    kept = kept_weights(out)
    assert [step for step, _, _ in kept] == [3, 5, 6, 8]
    seconds = [s for _, s, _ in kept]
    assert all(s > 0 for s in seconds) and seconds == sorted(seconds)  # the resumed run counts on from step 5
    final, last = load_file(out / "backbone.safetensors"), load_file(kept[-1][2])
    assert final.keys() == last.keys() and all(torch.equal(final[k], last[k]) for k in final)
    assert not torch.equal(load_file(kept[0][2])["conv1.weight"], final["conv1.weight"])
    assert load_backbone(str(kept[0][2]), arch="resnet18").conv1.kernel_size == (3, 3)  # loads as any weights file

    log_run = tmp_path / "log"
    assert cli_main(["pretrain", *TINY, "--out", str(log_run), "--keep-every", "log", "--max-steps", "6"]) == 0
    assert [step for step, _, _ in kept_weights(log_run)] == [1, 2, 4, 6]
    listed = tmp_path / "listed"
    assert cli_main(["pretrain", *TINY, "--out", str(listed), "--keep-every", "2,5", "--max-steps", "6"]) == 0
    assert [step for step, _, _ in kept_weights(listed)] == [2, 5, 6]


def test_kept_seconds_after_a_resume_count_the_steps_between_the_last_kept_step_and_the_checkpoint(
    tmp_path, monkeypatch
):
    # Guards: a resumed run counted its seconds on from the last kept weights, leaving out the steps trained
    # between them and the checkpoint (step 8 read 8.1 s against 10.3 s uninterrupted), so curve.png's seconds
    # axis was wrong for every resumed run. Here each step takes exactly 1 s of a fake clock.
    import types

    import bt_hub.train.pretrain as loop
    from bt_hub.train.run_folder import kept_weights

    clock = [0.0]
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    step_for_real, checkpoint_for_real = loop._optimizer_step, loop._checkpoint

    def one_second_step(*args, **kwargs):
        clock[0] += 1.0
        return step_for_real(*args, **kwargs)

    def stopped_after_step_6(loop_state, step):
        checkpoint_for_real(loop_state, step)
        if step == 6:
            raise KeyboardInterrupt  # as a kill after the checkpoint of step 6, which is no kept step

    monkeypatch.setattr(loop, "_optimizer_step", one_second_step)
    monkeypatch.setattr(loop, "_checkpoint", stopped_after_step_6)
    out = tmp_path / "run"
    # checkpoints at 3, 4 and 6; weights kept at 4 and 8
    assert cli_main(["pretrain", *TINY, "--out", str(out), "--keep-every", "4"]) == 130
    assert _checkpoint_step(out / "checkpoint.pth") == 6 and [k for k, _, _ in kept_weights(out)] == [4]
    assert cli_main(["pretrain", *TINY, "--out", str(out), "--keep-every", "4", "--resume", "auto"]) == 0
    assert [(k, s) for k, s, _ in kept_weights(out)] == [(4, 4.0), (8, 8.0)]


def test_keep_every_refuses_what_is_not_a_step_count_or_log(tmp_path, capsys):
    assert cli_main(["pretrain", *TINY, "--out", str(tmp_path / "r"), "--keep-every", "often"]) == 2
    assert "--keep-every must be a number of steps (0: off), 'log' or steps joined by ',', got 'often'" in (
        capsys.readouterr().err
    )


def test_a_short_trial_run_is_told_every_flag_it_needs_in_one_message_and_then_runs(tmp_path, capsys):
    """Guards: `pretrain --data DIR --max-steps 20` was refused twice, first for a warm-up longer than the schedule,
    then for a batch of 2048 larger than the data, each naming only its own flag."""
    small = ["--data", "synthetic:40", "--arch", "resnet18", "--small-image-stem", "--image-size", "8"]
    small += ["--projector", "32-32", "--probe-max-dim", "0"]
    assert cli_main(["pretrain", *small, "--max-steps", "3", "--epochs", "1", "--out", str(tmp_path / "a")]) == 2
    err = one_sentence(capsys.readouterr().err)
    assert "--batch-size 2048 is larger than the 32 training images" in err
    assert "--warmup-epochs 10 is longer than the whole schedule (--epochs 1)" in err
    hint = re.search(r"pass these together: (.*?) \(", err).group(1).split()
    assert hint == ["--batch-size", "32", "--epochs", "3", "--warmup-epochs", "0", "--max-steps", "3"]
    assert cli_main(["pretrain", *small, *hint, "--out", str(tmp_path / "b")]) == 0


def test_a_training_step_reads_its_loss_from_the_device_once(tmp_path, device_traffic):
    # Guards a wait for the whole step at its end on CUDA: the progress bar read the loss from the device again after
    # the LARS step, so the host waited for the backward and the update before it could queue the next step.
    def reads(steps: int) -> int:
        config = PretrainConfig(
            data="synthetic:40",
            out=str(tmp_path / str(steps)),
            backbone="resnet18",
            small_image_stem=True,
            image_size=8,
            projector="16-16",
            batch_size=8,
            max_steps=steps,
            log_every=1000,
            checkpoint_every=0,
            probe_max_dim=0,
            precision="fp32",
            views="batched",
            num_workers=0,
        )
        with device_traffic() as seen:
            pretrain(config)
        return seen.ops["aten::_local_scalar_dense"]

    assert reads(4) - reads(2) == 2
