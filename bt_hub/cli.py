"""The ``bt-hub`` command: a table from subcommand to (config dataclass, library function).

Each subcommand's flags are the fields of its config dataclass (bt_hub.cli_flags turns one into a parser and the
parsed flags back into it). The module behind a subcommand is imported only when that subcommand runs, so ``--help``
and the other subcommands work without its optional extras. An evaluation ends with a table of its metrics and the
files it wrote; a function that returns text or a list of files has it printed; warnings print as one line each.
"""

from __future__ import annotations

import importlib
import os
import select
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from bt_hub.cli_interrupted import interrupted
from bt_hub.eval.protocols import get_protocol, list_protocols

# a refused input (a flag, a file, a missing extra): exit 2; any other exception is a failure, exit 1
REFUSED = (ValueError, OSError, ImportError, RuntimeError)


class Command(NamedTuple):
    """Where a subcommand lives: module, config dataclass name, function name, one-line help; a protocol of the
    table (``bt-hub eval NAME``) runs through the runner (``run_protocol``) instead of a function."""

    module: str
    config: str
    function: str
    help: str
    protocol: str = ""


def _eval_commands() -> dict[str, Command]:
    """``bt-hub eval``'s subcommands: every protocol of the table (bt_hub.eval.protocols), then ``all`` and
    ``compare``, which run the table's protocols."""
    protocols = (get_protocol(name) for name in list_protocols())
    return {p.name: Command(p.module, p.config, "", p.help, p.name) for p in protocols} | {
        "all": Command(
            "bt_hub.eval.suite", "SuiteConfig", "run_suite", "every classification protocol on one checkpoint"
        ),
        "compare": Command(
            "bt_hub.eval.comparison",
            "CompareConfig",
            "run",
            "weights against baselines (pixels, random init, supervised), every cell mean ± std over seeds",
        ),
    }


COMMANDS: dict[str, Command | dict[str, Command]] = {
    "demo": Command(
        "bt_hub.eval.demo",
        "DemoConfig",
        "run_demo",
        "pretrain on the embedded digits set and score it (the README's first command)",
    ),
    "pretrain": Command(
        "bt_hub.train.pretrain", "PretrainConfig", "pretrain", "pretrain a backbone with the Barlow Twins loss"
    ),
    "report": Command(
        "bt_hub.train.report",
        "ReportConfig",
        "report",
        "draw a pretraining run's loss, cross-correlation matrices and kNN curve as PNG files",
    ),
    "export": Command(
        "bt_hub.weights.export",
        "ExportConfig",
        "export",
        "convert weights to torchvision, safetensors, detectron2 or a Hugging Face folder",
    ),
    "push": Command(
        "bt_hub.weights.hf", "PushConfig", "push", "upload weights to the Hugging Face Hub with a model card"
    ),
    "weights": {
        "list": Command(
            "bt_hub.weights.registry",
            "ListWeightsConfig",
            "weights_table",
            "the registered weights: name, architecture, cached?, URL, cache path",
        ),
        "download": Command(
            "bt_hub.weights.registry",
            "DownloadWeightsConfig",
            "download_weights",
            "fetch registered weights (or a URL) into the verified download cache, as loading them would",
        ),
        "verify": Command(
            "bt_hub.weights.registry",
            "VerifyWeightsConfig",
            "verify_weights",
            "which registered weights a file is, by its sha256 (published, or recorded at first download)",
        ),
    },
    "eval": _eval_commands(),  # the protocol table's, as it was at import (commands(): as it is now)
    "embed": Command(
        "bt_hub.eval.embedding",
        "EmbedConfig",
        "run",
        "features of any weights on any data, with the file, label and split of every row (.npy + index, or Parquet)",
    ),
    "detect": Command(
        "bt_hub.eval.detection.detect",
        "DetectConfig",
        "main",
        "Faster/Mask R-CNN C4 transfer (detectron2 or torchvision engine)",
    ),
    "make-detection-data": Command(
        "bt_hub.eval.detection.synthetic",
        "DetectionDataConfig",
        "make_detection_data",
        "write the generated shapes detection set (VOC + COCO layouts) that checks an installation",
    ),
}


def commands() -> dict[str, Command | dict[str, Command]]:
    """The command table, with ``bt-hub eval``'s subcommands as the protocol table holds them now (a protocol
    registered after bt_hub.cli was imported included)."""
    return COMMANDS | {"eval": _eval_commands()}


def _print_warning(prefix: str) -> Any:
    """A ``warnings.showwarning`` that prints one line: ``<prefix>: warning: <message>``, each message once (eval
    compare's cells are protocol runs: a kNN cell of every row and seed would say the same k was cut)."""
    said: set[str] = set()

    def show(message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if str(message) not in said:
            said.add(str(message))
            print(f"{prefix}: warning: {message}", file=sys.stderr)

    return show


def _summary(result: Any, out: Any) -> str | None:
    """The metrics table and files written of an evaluation's return value; None for other commands."""
    from bt_hub.common.records import RESULT_FILES, records_in, summary_text

    if not isinstance(result, dict) or not ("metrics" in result or "results" in result):
        return None
    written = [Path(out) / name for name in RESULT_FILES if out is not None and (Path(out) / name).exists()]
    return summary_text(records_in(result), written)


def _resolve(argv: Sequence[str]) -> tuple[list[str], Any, list[str]]:
    """Split argv into the command path, what it leads to (a Command, or a group's table) and the rest."""
    table: Any = commands()
    path: list[str] = []
    rest = list(argv)
    while rest and isinstance(table, dict) and rest[0] in table:
        path.append(rest.pop(0))
        table = table[path[-1]]
    return path, table, rest


def _overview(path: list[str], table: dict[str, Any]) -> str:
    width = max(len(k) for k in table) + 2
    lines = [
        f"usage: bt-hub {' '.join(path + ['<command>'])} [flags]" + ("  |  bt-hub --version" if not path else ""),
        "",
        "commands:",
    ]
    for name, entry in table.items():
        text = entry.help if isinstance(entry, Command) else "subcommands: " + ", ".join(entry)
        lines.append(f"  {name:<{width}}{text}")
    lines += ["", "Run 'bt-hub " + " ".join(path + ["<command>"]) + " --help' for its flags."]
    if not path:
        lines.append(
            "Exit codes: 0 done, 1 failure, 2 refused input, 130 Ctrl-C, 143 SIGTERM (138 SIGUSR1, 140 SIGUSR2, "
            "129 SIGHUP; pretrain checkpoints first)."
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``bt-hub`` console script.

    Exit codes: 0 done, 2 a usage error or a refused input (one line naming the flag or file),
    1 a failure that is not the input's (one line; ``BT_HUB_DEBUG=1`` shows the traceback),
    130 interrupted (Ctrl-C: one line saying what was kept and the command that continues),
    143 stopped by SIGTERM (the same line; ``bt-hub pretrain`` first checkpoints the step it is on), and likewise
    128 + the signal's number for SIGUSR1, SIGUSR2 and SIGHUP (``bt_hub.common.signals.STOP_SIGNALS``),
    141 (128 + SIGPIPE) in silence when the reader of its output went away (``bt-hub weights list | head -1``), as
    any program that SIGPIPE ends: before, a BrokenPipeError traceback.
    """
    try:
        return _main(argv)
    except BrokenPipeError:
        if not _reader_gone():
            raise
        return 141


def _reader_gone() -> bool:
    """Whether the reader of stdout or stderr has gone: then both are pointed at /dev/null, so that nothing more
    (Python's own flush at exit included) fails on them."""
    poll = select.poll()
    for fd in (1, 2):
        poll.register(fd, select.POLLOUT)
    if not any(event & select.POLLERR for _, event in poll.poll(0)):
        return False
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    return True


def _main(argv: Sequence[str] | None) -> int:
    console = argv is None  # the bt-hub script: once its work is done, a signal would only cut its exit short
    started = time.time()  # an interruption names what the command itself kept
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        from bt_hub import __version__

        print(f"bt-hub {__version__}")
        return 0
    path, command, rest = _resolve(argv)
    if not isinstance(command, Command):
        return _no_command(path, command, rest)
    prefix = f"bt-hub {' '.join(path)}"
    config = None
    from bt_hub.common.signals import Terminated, held_signals, restore_signals, stop_on_signals

    main_thread = threading.current_thread() is threading.main_thread()  # only it may set signal handlers
    previous = stop_on_signals() if main_thread else {}  # Ctrl-C's path
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _print_warning(prefix)
            with held_signals():  # torch loads with the command's module, not for --help
                from bt_hub.cli_flags import Parser, add_dataclass_arguments, build_config, parse, resolved_settings
                from bt_hub.common.config import keep_freed_memory, torch_threads

                module = importlib.import_module(command.module)
            config_cls = getattr(module, command.config)
            parser = Parser(prog=prefix, description=command.help)
            add_dataclass_arguments(parser, config_cls)
            args, typed = parse(parser, rest)
            if os.environ.get("BT_HUB_PARSE_ONLY"):  # the CPU suite's check of GPU scripts' command lines
                print(f"{prefix}: parsed (BT_HUB_PARSE_ONLY is set: nothing run)")
                return 0
            config = build_config(config_cls, args, typed)
            if getattr(args, "config_file", None) and os.environ.get("RANK", "0") == "0":
                print(f"{prefix}: settings from {args.config_file} and the flags given:", file=sys.stderr)
                print(resolved_settings(config), file=sys.stderr)
            keep_freed_memory()
            with torch_threads(getattr(config, "threads", 0)):
                if command.protocol:
                    from bt_hub.eval.runner import run_protocol  # loaded with the protocol's module

                    result = run_protocol(get_protocol(command.protocol), config)
                else:
                    result = getattr(module, command.function)(config)
    except KeyboardInterrupt as err:
        if main_thread:  # the command is ending: a second signal must not cut its one line into a traceback
            restore_signals(previous, ignore=True)
        stopped = isinstance(err, Terminated)
        if os.environ.get("RANK", "0") == "0":
            how = f"stopped by {err.signum.name}" if stopped else "interrupted"
            print(f"{prefix}: {how}; {interrupted(path, rest, config, started)}", file=sys.stderr)
        return err.exit_code if stopped else 130
    except Exception as err:
        if os.environ.get("BT_HUB_DEBUG"):
            raise
        print(f"{prefix}: error: {_error_text(err)}", file=sys.stderr)
        return 2 if isinstance(err, REFUSED) else 1
    finally:
        if main_thread:
            restore_signals(previous, ignore=console)
    if os.environ.get("RANK", "0") == "0":  # the main process speaks for every rank
        described = _summary(result, getattr(config, "out", None)) or _describe(result, config)
        if described is not None:
            print(described)
    return 0


def _error_text(err: Exception) -> str:
    """A failed command's error in words: a refused input's own sentence (exit 2), else out of memory or a bug in
    bt-hub, each with what to do (exit 1)."""
    if isinstance(err, REFUSED):
        return str(err)
    if isinstance(err, MemoryError):
        return (
            f"out of memory ({err or 'no detail'}); ask for less (a smaller --batch-size or --image-size) or use a "
            "machine with more memory"
        )
    # a bug, not the input's fault: one line, and the way to the traceback
    return (
        f"{type(err).__name__}: {err}; this is a bug in bt-hub: rerun with BT_HUB_DEBUG=1 for the traceback and "
        "report it"
    )


def _no_command(path: list[str], table: dict[str, Any], rest: list[str]) -> int:
    """A group named without a command: its overview (exit 0 for ``--help``, 2 when bare), or an unknown command (2)."""
    if rest and rest[0] not in ("-h", "--help"):
        name = " ".join(["bt-hub", *path])
        print(
            f"{name}: error: unknown command {' '.join(path + rest[:1])!r}; expected one of "
            f"{', '.join(table)} (see '{name} --help')",
            file=sys.stderr,
        )
        return 2
    print(_overview(path, table))
    return 0 if rest else 2


def _describe(result: Any, config: Any) -> str | None:
    """What a command returned, in words: text as it is, files written (with their sha256), a Hub commit."""
    if isinstance(result, str):
        return result
    if isinstance(result, list):  # files written (bt-hub report)
        return "\n".join(str(item) for item in result)
    if isinstance(result, Path) and result.is_dir():
        files = sorted(p.name for p in result.iterdir() if p.is_file() and not p.name.startswith("."))
        return f"wrote {result} ({', '.join(files)})"
    if isinstance(result, Path):
        from bt_hub.common.files import file_sha256

        wrote = f"wrote {result} (sha256 {file_sha256(result)})"
        if getattr(config, "format", None) in ("torchvision", "safetensors"):  # bt-hub export of a backbone
            return f"{wrote}; it holds no fc: set model.fc = nn.Identity() before load_state_dict, or pass strict=False"
        return wrote
    if hasattr(result, "commit_url"):  # huggingface_hub's CommitInfo (bt-hub push)
        return f"pushed {config.weights} to {result.commit_url}"
    if isinstance(result, dict) and isinstance(result.get("summary"), str):  # bt-hub demo: its headline and report
        return result["summary"]
    return None


if __name__ == "__main__":
    raise SystemExit(main())
