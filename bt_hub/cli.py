"""The ``bt-hub`` command: a table from subcommand to (config dataclass, library function).

Each subcommand's flags are the fields of its config dataclass (kebab-case, or
``metadata["flag"]`` with the other spellings in ``metadata["aliases"]`` kept as hidden
aliases), their help text is the field's ``metadata["help"]``, and a ``PRESETS`` class
attribute adds ``--preset`` (bt_hub.common.presets; its help lists what each preset sets). The
module behind a subcommand is imported only when that subcommand runs, so ``--help`` and
the other subcommands work without its optional extras. An evaluation ends with a table of
its metrics and the files it wrote; a function that returns text or a list of files has
it printed; warnings print as one line each.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import types
import typing
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from bt_hub.common.presets import describe_presets, from_preset, presets_of


class Command(NamedTuple):
    """Where a subcommand lives: module, config dataclass name, function name, one-line help."""

    module: str
    config: str
    function: str
    help: str


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
        "bt_hub.train.plots",
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
    },
    "eval": {
        "linear": Command(
            "bt_hub.eval.linear", "LinearConfig", "run", "linear probe on a frozen backbone (ImageNet protocol)"
        ),
        "semi": Command(
            "bt_hub.eval.semi_supervised", "SemiSupervisedConfig", "run", "fine-tune on 1% or 10% of the labels"
        ),
        "knn": Command(
            "bt_hub.eval.knn",
            "KnnConfig",
            "run",
            "weighted kNN on L2-normalised features (faiss on the CPU, torch on CUDA)",
        ),
        "voc07-svm": Command(
            "bt_hub.eval.voc07_svm", "Voc07SvmConfig", "run", "per-class linear SVMs on VOC2007 (VISSL protocol)"
        ),
        "transfer": Command(
            "bt_hub.eval.linear", "TransferConfig", "run", "linear transfer to Places-205 / iNat18 (PIRL settings)"
        ),
        "all": Command("bt_hub.eval.suite", "SuiteConfig", "run", "every classification protocol on one checkpoint"),
        "compare": Command(
            "bt_hub.eval.compare",
            "CompareConfig",
            "run",
            "weights against baselines (pixels, random init, supervised), every cell mean ± std over seeds",
        ),
    },
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


def _unwrap_optional(tp: Any) -> Any:
    """``Optional[X]`` -> ``X``; other types unchanged."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def add_dataclass_arguments(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """Add one flag per dataclass field (``field_name`` -> ``--field-name``)."""
    hints = typing.get_type_hints(config_cls)
    presets = presets_of(config_cls)
    for f in dataclasses.fields(config_cls):
        if not f.init:
            continue
        meta = dict(f.metadata)
        tp = _unwrap_optional(hints[f.name])
        origin = typing.get_origin(tp)
        # help texts are plain prose: escape argparse's %-formatting
        kwargs: dict[str, Any] = {"help": meta.get("help", "").replace("%", "%%"), "default": argparse.SUPPRESS}
        if origin is typing.Literal:
            kwargs["choices"] = list(typing.get_args(tp))
            kwargs["type"] = type(kwargs["choices"][0])
        elif tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif origin in (list, tuple):
            kwargs["nargs"] = meta.get("nargs", "+")
            kwargs["type"] = typing.get_args(tp)[0]
        else:
            kwargs["type"] = tp
        if "choices" in meta:
            kwargs["choices"] = meta["choices"]
        if f.name == "preset" and presets:
            kwargs["choices"] = list(presets)
            kwargs["help"] = f"{kwargs['help']}: {describe_presets(config_cls)}".replace("%", "%%")
        if meta.get("positional"):
            kwargs["nargs"] = meta.get("nargs", "*")
            parser.add_argument(f.name, **kwargs)
            continue
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kwargs["required"] = True
        elif f.default is not dataclasses.MISSING and f.default is not None:
            shown = ("on" if f.default else "off") if tp is bool else f.default
            kwargs["help"] = f"{kwargs['help']} (default: {shown})".strip()
        flag = meta.get("flag", f.name)
        parser.add_argument("--" + flag.replace("_", "-"), dest=f.name, **kwargs)
        for alias in meta.get("aliases", ()):
            parser.add_argument("--" + alias.replace("_", "-"), dest=f.name, **{**kwargs, "help": argparse.SUPPRESS})
    if presets and not any(f.name == "preset" for f in dataclasses.fields(config_cls)):
        preset_help = f"named sets of flag values; flags given override them: {describe_presets(config_cls)}"
        parser.add_argument(
            "--preset", choices=list(presets), default=argparse.SUPPRESS, help=preset_help.replace("%", "%%")
        )


def build_config(config_cls: type, namespace: argparse.Namespace) -> Any:
    """The config dataclass from parsed flags: defaults, then ``--preset``'s values, then the flags given."""
    given = vars(namespace).copy()
    return from_preset(config_cls, given.pop("preset", None), **given)


def _print_warning(prefix: str) -> Any:
    """A ``warnings.showwarning`` that prints one line: ``<prefix>: warning: <message>``."""

    def show(message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        print(f"{prefix}: warning: {message}", file=sys.stderr)

    return show


def _summary(result: Any, out: Any) -> str | None:
    """The metrics table and files written of an evaluation's return value; None for other commands."""
    from bt_hub.common.records import RESULT_FILES, records_in, summary_text

    if (
        not isinstance(result, dict)
        or not ("metrics" in result or "results" in result)
        or os.environ.get("RANK", "0") != "0"
    ):
        return None
    written = [Path(out) / name for name in RESULT_FILES if out is not None and (Path(out) / name).exists()]
    return summary_text(records_in(result), written)


def _resolve(argv: Sequence[str]) -> tuple[list[str], Command | None, list[str]]:
    """Split argv into the command path, the Command found (or None) and the rest."""
    table: Any = COMMANDS
    path: list[str] = []
    rest = list(argv)
    while rest and isinstance(table, dict) and rest[0] in table:
        path.append(rest.pop(0))
        table = table[path[-1]]
    return path, table if isinstance(table, Command) else None, rest


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
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``bt-hub`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        from bt_hub import __version__

        print(f"bt-hub {__version__}")
        return 0
    path, command, rest = _resolve(argv)
    if command is None:
        table: Any = COMMANDS
        for p in path:
            table = table[p]
        if rest and rest[0] not in ("-h", "--help"):
            print(
                f"bt-hub: error: unknown command {' '.join(path + rest[:1])!r}\n\n{_overview(path, table)}",
                file=sys.stderr,
            )
            return 2
        print(_overview(path, table))
        return 0 if rest else 2
    from bt_hub.common.config import torch_threads  # torch loads with the command's module, not for --help

    module = importlib.import_module(command.module)
    config_cls = getattr(module, command.config)
    parser = argparse.ArgumentParser(prog="bt-hub " + " ".join(path), description=command.help)
    add_dataclass_arguments(parser, config_cls)
    namespace = parser.parse_args(rest)
    prefix = f"bt-hub {' '.join(path)}"
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _print_warning(prefix)
            config = build_config(config_cls, namespace)
            with torch_threads(getattr(config, "threads", 0)):
                result = getattr(module, command.function)(config)
    except (ValueError, OSError, ImportError, RuntimeError) as err:
        if os.environ.get("BT_HUB_DEBUG"):
            raise
        print(f"{prefix}: error: {err}", file=sys.stderr)
        return 2
    summary = _summary(result, getattr(config, "out", None))
    if summary:
        print(summary)
    elif os.environ.get("RANK", "0") == "0" and (described := _describe(result, config)) is not None:
        print(described)
    return 0


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

        return f"wrote {result} (sha256 {file_sha256(result)})"
    if hasattr(result, "commit_url"):  # huggingface_hub's CommitInfo (bt-hub push)
        return f"pushed {config.weights} to {result.commit_url}"
    return None  # a command that writes its own report (bt-hub demo) returns data for Python callers


if __name__ == "__main__":
    raise SystemExit(main())
