"""RunConfig: the fields every command that runs shares, and the one device check."""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
import sys

import pytest
import torch

from bt_hub.common.config import REQUIRED, RunConfig, check_device, option
from bt_hub.eval.demo import DemoConfig
from bt_hub.eval.detection.detect import DetectConfig
from bt_hub.eval.knn import KnnConfig
from bt_hub.eval.linear import LinearConfig
from bt_hub.eval.semi_supervised import SemiSupervisedConfig
from bt_hub.train.pretrain import PretrainConfig

COMMANDS = {
    PretrainConfig: {},
    KnnConfig: {"weights": "w.pth"},
    DetectConfig: {"weights": "w.pth", "data": "root"},
    DemoConfig: {},
}


@pytest.mark.parametrize("config_cls", list(COMMANDS), ids=lambda c: c.__name__)
def test_every_run_command_shares_one_declaration_of_the_run_fields(config_cls):
    assert issubclass(config_cls, RunConfig)
    base = {f.name: f for f in dataclasses.fields(RunConfig)}
    # out (each command's own folder) and the demo's threads (its timings assume 2) only change the default
    for field in dataclasses.fields(config_cls):
        if field.name in base and field.name not in ("out", "threads"):
            assert field is base[field.name], field.name
    assert set(RunConfig.RUN_FIELDS) <= set(config_cls.RUN_FIELDS)


@pytest.mark.parametrize("config_cls", list(COMMANDS), ids=lambda c: c.__name__)
@pytest.mark.parametrize("device", ["mps", "gpu", "cuda:x", ""])
def test_every_command_refuses_an_unknown_device_in_the_same_sentence(config_cls, device, tmp_path):
    # Guards: eval accepted --device mps without saying so, and pretrain and detect each had their own wording.
    with pytest.raises(ValueError, match=rf"^--device must be 'cpu', 'cuda' or 'cuda:N', got '{device}'$"):
        config_cls(out=str(tmp_path / "o"), device=device, **COMMANDS[config_cls])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is missing")
@pytest.mark.parametrize("config_cls", list(COMMANDS), ids=lambda c: c.__name__)
def test_every_command_refuses_cuda_where_there_is_none(config_cls, tmp_path):
    with pytest.raises(ValueError, match="--device cuda was asked for but CUDA is not available; use --device cpu"):
        config_cls(out=str(tmp_path / "o"), device="cuda", **COMMANDS[config_cls])


def test_an_option_carries_its_help_and_metadata_and_each_config_gets_its_own_list():
    @dataclasses.dataclass
    class Flags:
        name: str = option(REQUIRED, "a name", flag="who", positional=True)
        files: list = option([], "files")

    first, second = Flags("a"), Flags("b")
    first.files.append("x")
    assert second.files == [] and Flags("c").files == []
    name = dataclasses.fields(Flags)[0]
    assert name.default is dataclasses.MISSING and dict(name.metadata) == {
        "help": "a name",
        "flag": "who",
        "positional": True,
    }
    with pytest.raises(TypeError):
        Flags()


def test_check_device_accepts_cpu():
    check_device("cpu")


@pytest.mark.parametrize("config_cls", list(COMMANDS), ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    "field,value,message",
    [
        ("seed", -1, "--seed must be an integer from 0 to 4294967295, got -1 (int)"),
        (
            "seed",
            12345678901234567890123,
            "--seed must be an integer from 0 to 4294967295, got 12345678901234567890123 (int)",
        ),
        ("seed", 2**32, "--seed must be an integer from 0 to 4294967295, got 4294967296 (int)"),
        ("threads", 100000, "--threads must be an integer from 0 (torch's default) to 1024, got 100000 (int)"),
        ("threads", -1, "--threads must be an integer from 0 (torch's default) to 1024, got -1 (int)"),
        ("out", "", "--out must name a directory, got an empty string"),
        ("out", "runs/a\0b", "--out must be a path without NUL bytes, got 'runs/a\\x00b'"),
    ],
)
def test_every_command_refuses_hostile_run_fields_naming_the_flag_and_range(
    config_cls, field, value, message, tmp_path
):
    # Guards: --seed -1 failed in numpy ("expected non-negative integer") and a 23-digit --seed in torch ("Overflow
    # when unpacking long long"), neither naming the flag; --threads had no upper bound and --out '' meant the cwd.
    kwargs = {"out": str(tmp_path / "o"), **COMMANDS[config_cls], field: value}
    with pytest.raises(ValueError) as err:
        config_cls(**kwargs)
    assert str(err.value) == message


@pytest.mark.parametrize(
    "config_cls,given,child",
    [
        (PretrainConfig, {}, ""),
        (LinearConfig, {"weights": "w.pth", "search": "fixed"}, ""),
        (SemiSupervisedConfig, {"weights": "w.pth"}, ""),
        (DemoConfig, {}, "pretrain"),  # the demo's pretraining runs: its child's own check, naming the nested flag
    ],
    ids=lambda c: getattr(c, "__name__", ""),
)
@pytest.mark.parametrize("value", [0.0, 1.5, -0.1])
def test_every_command_with_random_crops_refuses_a_crop_scale_min_outside_0_1_in_the_same_sentence(
    config_cls, given, child, value, tmp_path
):
    # Guards the one check (RunConfig.require_fraction) that pretrain, eval linear, eval semi and the demo share.
    crop = {child: {"crop_scale_min": value}} if child else {"crop_scale_min": value}
    with pytest.raises(ValueError) as err:
        config_cls(out=str(tmp_path / "o"), **crop, **given)
    assert str(err.value) == f"--{child + '.' if child else ''}crop-scale-min must be in (0, 1], got {value}"


def test_the_largest_seed_is_accepted(tmp_path):
    assert PretrainConfig(out=str(tmp_path / "o"), seed=2**32 - 1).seed == 2**32 - 1


_FRESH_BLOCK_FAULTS = """
import resource, torch
from bt_hub.common.config import keep_freed_memory
applied = keep_freed_memory()
def faults_of_a_256_mib_block():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(64 * 2**20)  # made and freed, as a training step's gradients and casts are
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(applied, *(faults_of_a_256_mib_block() for _ in range(12)))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the allocator setting is glibc's")
def test_freed_memory_is_reused_without_new_page_faults_unless_the_user_set_mallocs_own_variables():
    def run(**extra: str) -> tuple[str, list[int]]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | extra
        out = subprocess.run([sys.executable, "-c", _FRESH_BLOCK_FAULTS], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        applied, *faults = out.stdout.split()
        return applied, [int(f) for f in faults]

    applied, faults = run()  # the first few blocks grow the heap (2 to 5 of them here) until freed ones fit
    assert applied == "True" and max(faults[-3:]) < 1000, faults  # then the freed blocks' pages are reused
    applied, faults = run(MALLOC_MMAP_MAX_="65536")
    assert applied == "False" and min(faults) > 30_000, faults  # glibc's default: 65,536 pages mapped and zeroed anew
