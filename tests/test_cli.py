"""The CLI surface is a contract: the command table, every subcommand's --help, errors."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import os
import pkgutil
import re
import signal
import subprocess
import sys
import time
from typing import ClassVar, Literal

import pytest
import torch
from cli_output import messages, one_sentence

import bt_hub.eval as eval_pkg
from bt_hub import cli, cli_flags


def _all_commands():
    for name, entry in cli.COMMANDS.items():
        if isinstance(entry, dict):
            for sub, command in entry.items():
                yield [name, sub], command
        else:
            yield [name], entry


def test_top_level_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert f"  {name} " in out


def test_no_arguments_prints_usage_and_fails(capsys):
    assert cli.main([]) == 2
    assert "usage: bt-hub" in capsys.readouterr().out


def test_unknown_command_is_one_clear_error(capsys):
    assert cli.main(["pretrian"]) == 2
    assert "unknown command 'pretrian'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "path,command", list(_all_commands()), ids=lambda x: " ".join(x) if isinstance(x, list) else ""
)
def test_every_subcommand_has_help_from_its_config_dataclass(path, command, capsys):
    module = importlib.import_module(command.module)
    config_cls = getattr(module, command.config)
    assert dataclasses.is_dataclass(config_cls)
    assert command.protocol or callable(getattr(module, command.function))  # a protocol runs through the runner
    with pytest.raises(SystemExit) as exit_info:
        cli.main(path + ["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for field in dataclasses.fields(config_cls):
        if field.init and not field.metadata.get("positional") and field.name != "origin":  # origin: no setting
            assert "--" + field.metadata.get("flag", field.name).replace("_", "-") in out
            assert field.metadata.get("help"), f"{command.config}.{field.name} has no help text"


def test_every_protocol_module_in_eval_has_a_subcommand():
    routed = {command.module for _, command in _all_commands()}
    protocols = {"bt_hub.eval." + m.name for m in pkgutil.iter_modules(eval_pkg.__path__) if not m.ispkg}
    protocols -= {  # the runner, the Python API and what protocols share
        "bt_hub.eval.runner",
        "bt_hub.eval.api",
        "bt_hub.eval.heads",
        "bt_hub.eval.config",
        "bt_hub.eval.features",
        "bt_hub.eval.feature_cache",
        "bt_hub.eval.report",
        "bt_hub.eval.comparison_report",
        "bt_hub.eval.classifier",
        "bt_hub.eval.splits",
        "bt_hub.eval.label_subsets",
        "bt_hub.eval.average_precision",
        "bt_hub.eval.svm_grid",  # voc07-svm's grid, kept free of torch for its worker processes
        "bt_hub.eval.compare_config",  # eval compare's flags; the command is bt_hub.eval.comparison
        "bt_hub.eval.paired_test",  # the test behind eval compare's verdicts
        "bt_hub.eval.protocols",  # the protocol table the eval group is built from
    }
    assert protocols <= routed, f"eval modules without a bt-hub subcommand: {sorted(protocols - routed)}"


def test_add_dataclass_arguments_maps_types_presets_and_required():
    @dataclasses.dataclass
    class Demo:
        PRESETS: ClassVar[dict] = {"fast": {"epochs": 1}}
        data: str = dataclasses.field(metadata={"help": "dataset"})
        epochs: int = dataclasses.field(default=100, metadata={"help": "epochs"})
        lr: float | None = dataclasses.field(default=None, metadata={"help": "lr"})
        mode: Literal["a", "b"] = dataclasses.field(default="a", metadata={"help": "mode"})
        amp: bool = dataclasses.field(default=False, metadata={"help": "amp"})
        ks: list[int] = dataclasses.field(default_factory=lambda: [20, 200], metadata={"help": "ks"})

    parser = cli_flags.argparse.ArgumentParser()
    cli_flags.add_dataclass_arguments(parser, Demo)
    config = cli_flags.build_config(
        Demo, parser.parse_args(["--data", "x", "--preset", "fast", "--amp", "--ks", "1", "2", "--mode", "b"])
    )
    assert config == Demo(data="x", epochs=1, lr=None, mode="b", amp=True, ks=[1, 2])
    config = cli_flags.build_config(
        Demo, parser.parse_args(["--data", "x", "--preset", "fast", "--epochs", "7", "--lr", "0.5"])
    )
    assert (config.epochs, config.lr) == (7, 0.5)
    with pytest.raises(
        ValueError, match="^the following arguments are required: --data \\(on the command line or in a"
    ):
        cli_flags.build_config(Demo, parser.parse_args(["--epochs", "3"]))  # --data may come from a --config file
    with pytest.raises(SystemExit):
        parser.parse_args(["--data", "x", "--mode", "c"])


def _commands_with_presets():
    from bt_hub.common.presets import presets_of

    for path, command in _all_commands():
        config_cls = getattr(importlib.import_module(command.module), command.config)
        flags = {
            f.name: f.metadata.get("flag", f.name) for f in dataclasses.fields(config_cls)
        }  # --arch sets the field backbone
        presets = {name: [flags[key] for key in values] for name, values in presets_of(config_cls).items()}
        if presets:
            yield path, presets


@pytest.mark.parametrize(
    "path,presets", list(_commands_with_presets()), ids=lambda x: " ".join(x) if isinstance(x, list) else ""
)
def test_every_preset_help_lists_what_the_preset_sets(path, presets, capsys):
    with pytest.raises(SystemExit):
        cli.main(path + ["--help"])
    text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # argparse wraps inside flag names
    for name, values in presets.items():
        assert f"{name}:" in text
        for key in values:
            assert "-" + key.replace("_", "-") in text, (name, key)


def test_one_preset_mechanism_builds_eval_and_pretrain_configs():
    from bt_hub.common.config import from_preset, overrides
    from bt_hub.eval.semi_supervised import SemiSupervisedConfig
    from bt_hub.train.pretrain import PretrainConfig

    parser = cli_flags.argparse.ArgumentParser()
    cli_flags.add_dataclass_arguments(parser, PretrainConfig)
    config = cli_flags.build_config(PretrainConfig, parser.parse_args(["--preset", "digits", "--epochs", "3"]))
    assert (config.data, config.backbone, config.epochs, config.flip) == ("digits", "resnet18", 3, False)
    semi = from_preset(SemiSupervisedConfig, "small", weights="w", lr_classifier=0.1)
    assert (semi.preset, semi.batch_size, semi.lr_classifier) == ("small", 32, 0.1)
    assert overrides(semi, ignore=SemiSupervisedConfig.RUN_FIELDS) == {"lr_classifier": {"value": 0.1, "preset": 0.05}}
    with pytest.raises(ValueError, match="--preset 'tiny' is unknown; expected one of paper, reference, small"):
        from_preset(SemiSupervisedConfig, "tiny", weights="w")


def test_a_composite_offers_only_the_child_flags_it_passes_on_and_each_help_line_the_default_that_runs(capsys):
    # guards: the demo's --help offered --knn.data, --knn.weights and --linear.data and ignored them; eval compare's
    # showed no default for --baselines, --protocols or --fractions, nor any flat spelling it still reads
    def help_text(*path: str) -> str:
        with pytest.raises(SystemExit):
            cli.main([*path, "--help"])
        return " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # argparse wraps inside flag names

    demo = help_text("demo")
    assert "--knn.k" in demo and "--linear.lr-grid" in demo and "--pretrain.epochs" in demo
    assert not re.findall(r"--(?:knn|linear)\.(?:data|weights|batch-size|image-size|device)\b", demo)
    compare = help_text("eval", "compare")
    for flag, default in (
        ("--baselines", "pixels random-init"),
        ("--protocols", "knn linear"),
        ("--fractions", "1 10"),
    ):
        name = flag[2:].upper()
        helped = compare.split(f" {flag} {name} [{name} ...] ", 1)[1]  # the help line, and those after it
        assert helped.split("(default: ", 1)[1].startswith(f"{default})"), flag
    assert "(default: 20 200)" in help_text("eval", "knn") and "--knn-k" not in compare
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--knn.data", "digits"])
    assert exit_info.value.code == 2


def test_the_cli_describes_what_a_command_returned_and_prints_nothing_for_plain_data(tmp_path):
    # Guards: export and push printed from inside the library; now they return and the CLI says what was written.
    weights = tmp_path / "w.pth"
    weights.write_bytes(b"weights")
    assert cli._describe(weights, None) == f"wrote {weights} (sha256 {hashlib.sha256(b'weights').hexdigest()})"
    (tmp_path / "folder").mkdir()
    for name in ("config.json", "model.safetensors", ".hidden"):
        (tmp_path / "folder" / name).write_text("x")
    assert cli._describe(tmp_path / "folder", None) == f"wrote {tmp_path / 'folder'} (config.json, model.safetensors)"
    assert cli._describe({"table": {}}, None) is None and cli._describe(["a.png", "b.png"], None) == "a.png\nb.png"


def test_usage_errors_are_one_line_naming_the_flag(capsys):
    # Guards: argparse printed its whole usage block (20 lines for pretrain) above the one line that mattered.
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["pretrain", "--seed", "nan"])
    assert exit_info.value.code == 2
    assert one_sentence(capsys.readouterr().err) == (
        "bt-hub pretrain: error: argument --seed: invalid int value: 'nan'; see 'bt-hub pretrain --help' for the flags"
    )


def test_an_unexpected_exception_is_one_line_with_exit_code_1(monkeypatch, capsys):
    # Guards: an exception outside the refused-input kinds (KeyError: 'lambd' from bt-hub report) ended in a traceback.
    import bt_hub.train.report as report

    monkeypatch.setattr(report, "report", lambda config: {}["lambd"])
    assert cli.main(["report", "somewhere"]) == 1
    line = one_sentence(capsys.readouterr().err)
    assert (
        line.startswith("bt-hub report: error: KeyError: 'lambd'; this is a bug in bt-hub") and "BT_HUB_DEBUG=1" in line
    )


@pytest.mark.parametrize(
    "error, code, said",
    [
        (MemoryError("1 TiB"), 1, "out of memory (1 TiB); ask for less (a smaller --batch-size or --image-size)"),
        (RuntimeError("no such GPU"), 2, "no such GPU"),
        (ImportError("no faiss"), 2, "no faiss"),
    ],
)
def test_out_of_memory_is_a_failure_and_a_refused_input_exits_2(monkeypatch, capsys, error, code, said):
    # Guards the exit codes of main's one handler: MemoryError 1 with what to do, the refused-input kinds 2 as said.
    import bt_hub.train.report as plots

    def fail(config):
        raise error

    monkeypatch.setattr(plots, "report", fail)
    assert cli.main(["report", "somewhere"]) == code
    assert one_sentence(capsys.readouterr().err).startswith(f"bt-hub report: error: {said}")


def _interrupt(config):
    raise KeyboardInterrupt


def _sigterm(config):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)


@pytest.fixture
def sigterm_fails_the_test():
    """SIGTERM that reaches the test process (no handler of bt-hub's) fails the test instead of killing pytest."""

    def fail(signum, frame):
        raise AssertionError("SIGTERM was not handled by bt-hub")

    previous = signal.signal(signal.SIGTERM, fail)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("how,code,said", [(_interrupt, 130, "interrupted"), (_sigterm, 143, "stopped by SIGTERM")])
@pytest.mark.parametrize(
    "path,command", list(_all_commands()), ids=lambda x: " ".join(x) if isinstance(x, list) else ""
)
def test_ctrl_c_or_sigterm_in_any_command_is_one_line_with_its_exit_code(
    path, command, how, code, said, monkeypatch, capsys, sigterm_fails_the_test
):
    # Guards: Ctrl-C ended every long command in a KeyboardInterrupt traceback; SIGTERM (a scheduler's
    # preemption) ended it with exit code 143 and no line at all.
    if command.protocol:  # a protocol of the table runs through the runner
        monkeypatch.setattr(importlib.import_module("bt_hub.eval.runner"), "run_protocol", lambda _, c: how(c))
    else:
        monkeypatch.setattr(importlib.import_module(command.module), command.function, how)
    argv = {
        "report": ["run"],  # keyed by the last word of the command
        "make-detection-data": ["--out", "shapes"],
        "push": ["--weights", "w.pth", "--repo-id", "me/bt"],
        "export": ["--weights", "w.pth", "--out", "x.pth"],
        "voc07-svm": ["--weights", "w.pth", "--data", "VOCdevkit"],
        "detect": ["--weights", "w.pth", "--data", "shapes"],
        "download": ["barlowtwins-in1k"],
        "verify": ["w.pth"],
    }.get(path[-1], [] if path[0] in ("demo", "pretrain", "weights") else ["--weights", "w.pth"])
    assert cli.main([*path, *argv]) == code
    line = one_sentence(capsys.readouterr().err)
    assert line.startswith(f"bt-hub {' '.join(path)}: {said}; ") and "bt-hub " + " ".join(path) in line[20:]


def _printed_settings(err: str) -> str:
    """The YAML block ``--config`` prints on stderr after its header line."""
    lines = err.splitlines()
    start = next(i for i, line in enumerate(lines) if ": settings from " in line) + 1
    block = [line for line in lines[start:] if line.startswith(("  ", "- ")) or ": " in line or line.endswith(":")]
    return "\n".join(block[: next((i for i, line in enumerate(block) if line.startswith("features ")), len(block))])


def test_a_config_file_sets_the_flags_those_given_override_it_and_it_is_printed_and_recorded(
    small_stem_weights, tmp_path, capsys
):
    """Guards: no command read a config file (--config run.yaml, what litgpt and Lightning users reach for)."""
    import json

    import yaml

    config = tmp_path / "run.yaml"
    config.write_text(f"weights: {small_stem_weights}\ndata: synthetic:40\nimage_size: 8\nbatch_size: 16\nk: [3]\n")
    assert cli.main(["eval", "knn", "--config", str(config), "--k", "5", "--out", str(tmp_path / "a")]) == 0
    recorded = json.loads((tmp_path / "a" / "results.json").read_text())["hyperparameters"]
    assert (recorded["image_size"], recorded["batch_size"], recorded["k"]) == (8, 16, [5])
    assert recorded["config_file"] == "run.yaml"  # as every path in a record: an absolute one by its name
    said = capsys.readouterr()
    printed = _printed_settings(said.err)
    assert yaml.safe_load(printed)["k"] == [5] and "config_file" not in yaml.safe_load(printed)
    (tmp_path / "printed.yaml").write_text(printed)  # what was printed is a config file that reproduces the run
    again_flags = ["--config", str(tmp_path / "printed.yaml"), "--image-size", "8", "--out", str(tmp_path / "b")]
    assert cli.main(["eval", "knn", *again_flags]) == 0
    again = json.loads((tmp_path / "b" / "results.json").read_text())["hyperparameters"]
    where = ("out", "config_file", "image_size_from", "features")
    assert {k: v for k, v in again.items() if k not in where} == {k: v for k, v in recorded.items() if k not in where}
    # Guards: a size the file set was recorded as from --image-size, a flag nobody typed; a flag given still is
    assert (recorded["image_size_from"], again["image_size_from"]) == ("run.yaml", "--image-size")
    assert "images 8 px (from run.yaml)" in said.out and "images 8 px (from --image-size)" in capsys.readouterr().out


def test_pretrain_records_the_config_file_with_its_settings_in_run_json(tmp_path, capsys):
    import json

    config = tmp_path / "pre.yaml"
    config.write_text(
        "data: synthetic:40\nbackbone: resnet18\nsmall_image_stem: true\nimage_size: 8\nprojector: 32-32\n"
        "batch_size: 8\nepochs: 1\nwarmup_epochs: 0\nlr_weights: 1e-2\n"
    )
    assert cli.main(["pretrain", "--config", str(config), "--max-steps", "1", "--out", str(tmp_path / "run")]) == 0
    recorded = json.loads((tmp_path / "run" / "run.json").read_text())["config"]
    assert (recorded["config_file"], recorded["lr_weights"], recorded["max_steps"]) == (str(config), 0.01, 1)
    assert "lr_weights: 0.01" in capsys.readouterr().err
    config.write_text("arch: resnet18\n")  # --arch's setting is backbone: said so, not "unknown"
    assert cli.main(["pretrain", "--config", str(config), "--out", str(tmp_path / "other")]) == 2
    assert f"key arch of {config} is the flag --arch, whose setting is named backbone" in capsys.readouterr().err


@pytest.mark.parametrize(
    "path,command", list(_all_commands()), ids=lambda x: " ".join(x) if isinstance(x, list) else ""
)
def test_every_command_takes_config(path, command):
    """``bt-hub detect --config`` was its detectron2 config (now --detection-config): --config is the YAML file."""
    parser = cli_flags.Parser(prog="bt-hub " + " ".join(path))
    cli_flags.add_dataclass_arguments(parser, getattr(importlib.import_module(command.module), command.config))
    assert [a.dest for a in parser._actions if "--config" in a.option_strings] == ["config_file"]


def test_a_config_files_values_are_read_as_yaml_1_2_and_a_preset_flag_chooses_over_the_files(tmp_path):
    from bt_hub.eval.linear import LinearConfig
    from bt_hub.train.config import PretrainConfig

    config = tmp_path / "pre.yaml"
    config.write_text("compile: off\nlr_weights: 1e-3\nsmall_image_stem: true\nkeep_every: 3\nprojector: 64\n")
    parser = cli_flags.Parser(prog="bt-hub pretrain")
    cli_flags.add_dataclass_arguments(parser, PretrainConfig)
    args = ["--config", str(config), "--out", str(tmp_path / "run")]
    built = cli_flags.build_config(PretrainConfig, parser.parse_args(args))
    assert (built.compile, built.lr_weights, built.small_image_stem) == ("off", 0.001, True)
    # Guards: "key keep_every of pre.yaml must be a string, got 3 (int)" for the --keep-every 3 a flag takes.
    assert (built.keep_every, built.projector) == ("3", "64")
    assert built.config_file == str(config)
    config.write_text("preset: small\nepochs: 3\n")
    parser = cli_flags.Parser(prog="bt-hub eval linear")
    cli_flags.add_dataclass_arguments(parser, LinearConfig)
    flags = ["--weights", "w", "--config", str(config), "--out", str(tmp_path / "ev")]
    from_file = cli_flags.build_config(LinearConfig, parser.parse_args(flags))
    assert (from_file.preset, from_file.epochs) == ("small", 3)
    chosen = cli_flags.build_config(LinearConfig, parser.parse_args([*flags, "--preset", "imagenet"]))
    assert chosen.preset == "imagenet"


def test_python_dash_m_bt_hub_is_the_bt_hub_command(tmp_path, capsys, monkeypatch):
    """Guards: ``python -m bt_hub`` said "No module named bt_hub.__main__" (users of pip, torch.distributed.run)."""
    from bt_hub import __version__

    run = [sys.executable, "-m", "bt_hub"]
    done = subprocess.run([*run, "--version"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert (done.returncode, done.stdout.strip()) == (0, f"bt-hub {__version__}")
    argv = ["eval", "knn", "--weights", "missing.pth", "--out", "out"]
    done = subprocess.run([*run, *argv], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    assert done.returncode == 2 and messages(done.stderr) == messages(capsys.readouterr().err)


def test_ctrl_c_or_sigterm_while_torch_loads_is_answered_in_one_line():
    # Guards: bt-hub imported torch (seconds) before its SIGTERM handler was set, so SIGTERM in the first
    # seconds ended it silently with -15, and Ctrl-C there printed a traceback; the line for a command cut
    # before its flags were read imported torch again, which a half-imported torch crashed (SIGSEGV).
    code = (
        "import sys; import bt_hub.cli as cli; assert 'torch' not in sys.modules, 'the CLI imports torch'; "
        "sys.modules['torch'] = None; print(cli.interrupted(['export'], ['--out', 'x'], None))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "nothing was written; run the command again: bt-hub export --out x"


def test_sigterm_while_the_command_module_loads_waits_for_the_import_and_says_so(monkeypatch, capsys):
    # Guards: SIGTERM or Ctrl-C landing inside ``import torch`` (numpy, torch's C init) came out as an unrelated
    # error ("module 'numpy._core' has no attribute '_multiarray_umath'; this is a bug in bt-hub"), exit code 1.
    real_import = importlib.import_module

    def import_cut_by_sigterm(name):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
        except BaseException:  # as an extension module's C init turns an exception into its own error
            raise AttributeError("partially initialized module") from None
        return real_import(name)

    monkeypatch.setattr(cli.importlib, "import_module", import_cut_by_sigterm)
    assert cli.main(["weights", "list"]) == 143
    assert one_sentence(capsys.readouterr().err).startswith("bt-hub weights list: stopped by SIGTERM; nothing was")


@pytest.mark.parametrize(
    "signum,code", [(signal.SIGUSR1, 138), (signal.SIGUSR2, 140), (signal.SIGHUP, 129)], ids=["USR1", "USR2", "HUP"]
)
def test_a_schedulers_warning_signal_stops_a_command_as_sigterm_does_with_its_own_exit_code(
    signum, code, monkeypatch, capsys
):
    # Guards: SIGUSR1 / SIGUSR2 (Slurm's --signal=USR1@T, submitit, SGE's -notify: sent ahead of a time limit) and
    # SIGHUP (a closed terminal) ended every command on the spot, by their default action: no line, nothing said
    # of what was kept, and pretraining lost every step since its last checkpoint.
    import bt_hub.train.report as plots

    def stopped(config):
        os.kill(os.getpid(), signum)
        time.sleep(30)

    def unhandled(signum, frame):
        raise AssertionError(f"{signal.Signals(signum).name} was not handled by bt-hub")

    monkeypatch.setattr(plots, "report", stopped)
    previous = signal.signal(signum, unhandled)  # instead of its default action, which would end pytest
    try:
        before = {s: signal.getsignal(s) for s in (signal.SIGINT, signum)}
        assert cli.main(["report", "run"]) == code
    finally:
        after = signal.signal(signum, previous)
    line = one_sentence(capsys.readouterr().err)
    assert line.startswith(f"bt-hub report: stopped by {signal.Signals(signum).name}; ")
    assert after is unhandled and signal.getsignal(signal.SIGINT) is before[signal.SIGINT]  # main() puts them back


def test_ctrl_c_in_pretrainings_loop_waits_for_the_step_boundary_and_a_second_one_stops_at_once():
    # Guards: Ctrl-C (LSF's bkill sends SIGINT first; torchrun forwards it) cut pretraining mid-step, keeping only
    # the last checkpoint; the wait it now makes for the step's checkpoint must not trap an impatient user.
    from bt_hub.common.signals import SAME_CTRL_C_S, deferred_stop

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt), deferred_stop(torch.device("cpu")) as requested:
        assert requested() == 0
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # the same Ctrl-C again (torchrun's agent forwards the terminal's)
        time.sleep(0.05)
        assert requested() == signal.SIGINT  # noted, for the loop to checkpoint and stop
        time.sleep(SAME_CTRL_C_S)
        os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C
        time.sleep(5)
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_a_reader_that_went_away_ends_the_command_in_silence_with_sigpipes_exit_code(stream, tmp_path):
    # Guards: `bt-hub weights list | head -1` (or a log reader of stderr that stopped) ended in a BrokenPipeError
    # traceback with exit code 1.
    read, write = os.pipe()
    os.close(read)  # the reader is gone before bt-hub writes a byte
    command = ["weights", "list"] if stream == "stdout" else ["weights", "verify", str(tmp_path / "missing.pth")]
    other = subprocess.PIPE
    streams = {"stdout": write, "stderr": other} if stream == "stdout" else {"stdout": other, "stderr": write}
    try:
        done = subprocess.run([sys.executable, "-m", "bt_hub.cli", *command], **streams, timeout=120)
    finally:
        os.close(write)
    assert done.returncode == 141, (done.stdout or done.stderr)[-2000:]
    assert not (done.stdout or done.stderr)  # the stream still open says nothing either: no traceback


def test_a_signal_ignored_when_bt_hub_starts_stays_ignored():
    # Guards: nohup ignores SIGHUP so that a job outlives its terminal; bt-hub must not undo that.
    from bt_hub.common.signals import restore_signals, stop_on_signals

    previous_hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        previous = stop_on_signals()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN and callable(signal.getsignal(signal.SIGUSR1))
        restore_signals(previous, ignore=False)
    finally:
        signal.signal(signal.SIGHUP, previous_hup)


def test_a_loader_worker_forked_before_it_ignores_group_signals_does_not_act_on_its_parents_handler():
    # Guards: a group SIGTERM landing in a DataLoader worker between its fork and its worker_init_fn ran the
    # inherited handler there, and the worker's "Terminated: 15" traceback was printed above the command's one line.
    from bt_hub.common.signals import restore_signals, stop_on_signals

    previous = stop_on_signals()
    try:
        pid = os.fork()
        if pid == 0:  # the child: the handlers it inherited must do nothing in it
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)
            except BaseException:
                os._exit(1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        restore_signals(previous, ignore=False)


def test_a_second_signal_while_the_command_says_what_it_kept_does_not_cut_that_line_into_a_traceback(
    monkeypatch, capsys
):
    # Guards: a scheduler that signals twice (the job's processes, then the group; torchrun forwarding a SIGTERM its
    # workers got already) landed the second one while bt-hub was writing its line: a Terminated traceback, exit 1.
    import bt_hub.train.report as plots

    def sigterm(config):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)

    def kept_then_signalled(*args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        return "nothing was written; run the command again: bt-hub report run"

    monkeypatch.setattr(plots, "report", sigterm)
    monkeypatch.setattr(cli, "interrupted", kept_then_signalled)
    assert cli.main(["report", "run"]) == 143
    assert one_sentence(capsys.readouterr().err) == (
        "bt-hub report: stopped by SIGTERM; nothing was written; run the command again: bt-hub report run"
    )


def test_sigterm_or_ctrl_c_after_the_work_is_done_does_not_cut_the_exit_short():
    # Guards: SIGTERM in the moment after a command's work (its last line, the interpreter's exit) ended it with
    # -15 and no line though every file was written; Ctrl-C there printed a traceback.
    code = (
        "import os, signal, sys; from bt_hub import cli; sys.argv = ['bt-hub', 'weights', 'list']; rc = cli.main(); "
        "os.kill(os.getpid(), signal.SIGTERM); os.kill(os.getpid(), signal.SIGINT); sys.exit(rc)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_ctrl_c_says_what_was_kept_and_the_command_that_continues(tmp_path, monkeypatch, capsys):
    import bt_hub.train.pretrain as pretrain

    out = tmp_path / "run"
    monkeypatch.setattr(pretrain, "pretrain", _interrupt)
    argv = ["pretrain", "--preset", "digits", "--out", str(out)]
    assert cli.main(argv) == 130
    assert one_sentence(capsys.readouterr().err) == (
        f"bt-hub pretrain: interrupted; nothing was written to {out}; continue with: bt-hub pretrain --preset digits "
        f"--out {out} --resume auto"
    )
    out.mkdir()
    torch.save({"step": 7}, out / "checkpoint.pth")
    assert cli.main([*argv, "--resume", str(tmp_path / "elsewhere.pth")]) == 130
    assert one_sentence(capsys.readouterr().err) == (
        f"bt-hub pretrain: interrupted; the last checkpoint {out / 'checkpoint.pth'} (step 7) is kept; continue with: "
        f"bt-hub pretrain --preset digits --out {out} --resume auto"
    )
    import bt_hub.eval.runner as runner

    monkeypatch.setattr(runner, "run_protocol", lambda _, config: _interrupt(config))
    ev = tmp_path / "ev"
    assert cli.main(["eval", "knn", "--weights", "w w.pth", "--out", str(ev), "--cache-dir", "c"]) == 130
    assert one_sentence(capsys.readouterr().err) == (
        f"bt-hub eval knn: interrupted; nothing was written to {ev}, and no features were kept in c yet (an "
        "extraction keeps a part every 8192 rows or 30 s), so running it again starts the extraction over: "
        f"bt-hub eval knn --weights 'w w.pth' --out {ev} --cache-dir c"
    )
    # Guards: a cut hf export said to run it again, which then refused without --force
    export = importlib.import_module("bt_hub.weights.export")

    def cut_after_the_first_file(config):
        (tmp_path / "hf").mkdir()
        (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
        _interrupt(config)

    monkeypatch.setattr(export, "export", cut_after_the_first_file)
    assert cli.main(["export", "--weights", "w.pth", "--format", "hf", "--out", str(tmp_path / "hf")]) == 130
    assert one_sentence(capsys.readouterr().err).endswith(f"--format hf --out {tmp_path / 'hf'} --force")
    assert cli.main(["eval", "knn", "--weights", "w w.pth", "--out", str(tmp_path / "ev2")]) == 130
    assert one_sentence(capsys.readouterr().err).endswith(
        "without --cache-dir nothing of the features is kept, so running it again starts over: "
        f"bt-hub eval knn --weights 'w w.pth' --out {tmp_path / 'ev2'}"
    )


def test_sigint_stops_a_real_pretraining_run_in_one_line_keeping_its_checkpoint(tmp_path):
    # Guards: Ctrl-C in bt-hub pretrain printed a KeyboardInterrupt traceback and did not say how to continue.
    out = tmp_path / "run"
    flags = ["--data", "synthetic:40", "--arch", "resnet18", "--small-image-stem", "--image-size", "8"]
    flags += ["--projector", "32-32", "--batch-size", "8", "--epochs", "100", "--warmup-epochs", "1"]
    flags += ["--checkpoint-every", "1", "--probe-max-dim", "0", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "bt_hub.cli", "pretrain", *flags], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 240
        while not (out / "checkpoint.pth").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    line = messages(err)[-1]  # the last line: a warning printed on the way is not this test's concern
    step = int(torch.load(out / "checkpoint.pth", weights_only=True, mmap=True)["step"])
    assert line.startswith(f"bt-hub pretrain: interrupted; the last checkpoint {out / 'checkpoint.pth'} (step {step})")
    assert line.endswith(f"continue with: bt-hub pretrain {' '.join(flags)} --resume auto")
    assert not list(out.glob(".*.tmp"))


@pytest.mark.parametrize(
    "signum,code,said",
    [(signal.SIGTERM, 143, "stopped by SIGTERM"), (signal.SIGINT, 130, "interrupted")],
    ids=["SIGTERM", "SIGINT"],
)
def test_a_signal_to_the_process_group_of_an_eval_with_loader_workers_is_one_line(
    signum, code, said, tmp_path, image_folder, resnet18_weights
):
    # Guards: timeout, SLURM's scancel and Ctrl-C signal the whole process group; the DataLoader workers died of it
    # and the command's one line was followed by a DataLoader traceback (or replaced by "DataLoader worker (pid ...)
    # is killed by signal: Terminated", exit 2).
    data = image_folder(tmp_path / "data", per_class=200, size=32)
    cmd = ["eval", "knn", "--weights", str(resnet18_weights), "--arch", "resnet18", "--data", str(data)]
    cmd += ["--test-split", "val", "--image-size", "32", "--batch-size", "2", "--num-workers", "2"]
    cmd += ["--out", str(tmp_path / "ev"), "--cache-dir", str(tmp_path / "c")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "BT_HUB_PROGRESS_EVERY": "1"}
    log = tmp_path / "stderr.txt"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bt_hub.cli", *cmd], env=env, stderr=stderr, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 240
        while "features train: " not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.02)
        os.killpg(proc.pid, signum)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = log.read_text()
    assert proc.returncode == code, err[-2000:]
    assert "Traceback" not in err and "DataLoader" not in err
    assert one_sentence(err).startswith(f"bt-hub eval knn: {said}; ")


def test_every_dataloader_bt_hub_builds_leaves_group_signals_to_its_main_process():
    # Guards: a DataLoader built without worker_init_fn=ignore_group_signals has workers that die of a group
    # SIGTERM / Ctrl-C before their main process checkpoints or answers.
    import ast

    from test_layers import package_modules

    bare = []
    for name, path in package_modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "DataLoader":
                init = {k.arg: k.value for k in node.keywords}.get("worker_init_fn")
                if getattr(init, "id", None) != "ignore_group_signals":
                    bare.append(f"{name} line {node.lineno}")
    assert not bare, f"DataLoader(...) without worker_init_fn=ignore_group_signals: {bare}"
    assert len(list(package_modules())) > 20  # the walk saw the package


@pytest.mark.parametrize(
    "signum", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP], ids=lambda s: s.name
)
def test_loader_workers_outlive_a_signal_meant_for_their_main_process(signum):
    # Guards: a loader worker died of a SIGTERM (or SIGINT) that another process (timeout, scancel, the terminal)
    # sent to the whole group, and the main process failed with "DataLoader worker (pid ...) exited unexpectedly".
    from bt_hub.eval.classifier import make_loader

    data = torch.utils.data.TensorDataset(torch.arange(64.0))
    loader = make_loader(data, 4, shuffle=False, seed=0, num_workers=2, device=torch.device("cpu"))
    batches = iter(loader)
    seen = [next(batches)[0], next(batches)[0]]  # a batch from each worker: both have run their worker_init_fn
    workers = [str(w.pid) for w in batches._workers]
    subprocess.run(["kill", f"-{signum.name[3:]}", *workers], check=True)  # sent by another process than their parent
    time.sleep(0.5)
    assert all(w.is_alive() for w in batches._workers)
    seen += [b[0] for b in batches]
    assert torch.equal(torch.cat(seen), torch.arange(64.0))


def _cut_after_batches(monkeypatch, batches: int) -> None:
    """Ctrl-C once ``batches`` batches of features (over every split) were extracted in the next command."""
    from bt_hub.eval.feature_cache import Extraction

    extend, seen = getattr(Extraction.extend, "real", Extraction.extend), [0]

    def counted(chunks):
        for chunk in chunks:
            if seen[0] == batches:
                raise KeyboardInterrupt
            seen[0] += 1
            yield chunk

    def cut(self, chunks):
        return extend(self, counted(chunks))

    cut.real = extend
    monkeypatch.setattr(Extraction, "extend", cut)


def test_ctrl_c_in_an_extraction_says_exactly_which_features_were_kept_and_the_rerun_continues_there(
    tmp_path, small_stem_weights, monkeypatch, capsys
):
    # Guards: Ctrl-C after 24 of 235 batches said the features in --cache-dir "are kept" though none were (a
    # part held 8192 rows, and the cache folder did not exist); parts now close every 30 s too.
    import json

    import bt_hub.eval.feature_cache as feature_cache

    cache, out = tmp_path / "c", tmp_path / "ev"
    argv = ["eval", "knn", "--weights", str(small_stem_weights), "--data", "synthetic:40", "--image-size", "8"]
    argv += ["--batch-size", "4", "--k", "5", "--cache-dir", str(cache), "--out", str(out)]
    said = f"bt-hub eval knn: interrupted; nothing was written to {out}, and "
    again = f"(checked before reuse); run the same command again to continue: bt-hub {' '.join(argv)}"
    _cut_after_batches(monkeypatch, 3)  # before a part of 8192 rows or 30 s closed
    assert cli.main(argv) == 130
    assert one_sentence(capsys.readouterr().err) == (
        f"{said}no features were kept in {cache} yet (an extraction keeps a part every 8192 rows or 30 s), so "
        f"running it again starts the extraction over: bt-hub {' '.join(argv)}"
    )
    monkeypatch.setattr(feature_cache, "PART_SECONDS", 0.0)  # as a slow extraction: every batch closes a part
    _cut_after_batches(monkeypatch, 3)
    assert cli.main(argv) == 130
    assert one_sentence(capsys.readouterr().err) == f"{said}12 rows of features are kept in {cache} {again}"
    _cut_after_batches(monkeypatch, 6)  # rows 12 to 32: the training split is whole; then 4 rows of the test split
    assert cli.main(argv) == 130
    assert one_sentence(capsys.readouterr().err) == (
        f"{said}the features of 1 whole split (32 rows) and 4 rows of another are kept in {cache} {again}"
    )
    monkeypatch.undo()
    assert cli.main(argv) == 0
    features = json.loads((out / "results.json").read_text())["hyperparameters"]["features"]
    assert features["train"].startswith("cached ") and features["test"] == "computed, continued at row 4 of a cut run"
