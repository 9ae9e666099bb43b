"""The ``bt-hub`` command's flags: a config dataclass as an argparse parser, and the parsed flags (over a ``--config``
YAML file) as that dataclass.

Each field is a flag (kebab-case, or ``metadata["flag"]`` with the other spellings in ``metadata["aliases"]`` kept as
hidden aliases) whose help text is the field's ``metadata["help"]`` with the default that runs; a child config's
settings (``bt_hub.common.config.child``) are flags under its name (``--knn.k``); a ``PRESETS`` class attribute adds
``--preset`` (bt_hub.common.presets; its help lists what each preset sets). Every subcommand takes ``--config
FILE.yaml``: settings keyed by the fields' names (a child's under its name), under the flags given; the settings it
resolves to are printed (stderr) and kept in the ``config_file`` field of configs that have one, so the run records
the file beside its settings. The flat spellings composites took before their children's flags were nested live in
one table, :data:`LEGACY_FLAGS`, and nowhere else.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from bt_hub.common.config import Origin, build, child_defaults, children, config_dict, knobs, merged
from bt_hub.common.presets import describe_presets, presets_of, read_config_file, required, unwrap_optional

CONFIG_HELP = (
    "a YAML file of settings for this command, keyed by the flags' names with '_' for '-' and no '--' "
    "(image_size: 32, k: [20]; preset: NAME where there are presets); flags given override it; the settings "
    "it resolves to are printed, and recorded with the run"
)
# The flat spellings of the composites' child settings (eval compare, eval all, demo) before those were nested: each
# is rewritten to its nested flag where a command has that and not the flat one (torchvision's
# _utils.handle_legacy_interface: old interfaces in one place, the library never sees them). docs/evaluation.md
# lists them; --help shows the nested flags only.
LEGACY_FLAGS = {
    "--knn-k": "--knn.k",
    "--linear-preset": "--linear.preset",
    "--linear-epochs": "--linear.epochs",
    "--full-linear": "--no-linear.cached",
    "--no-full-linear": "--linear.cached",
    "--lr-grid": "--linear.lr-grid",
    "--weight-decay-grid": "--linear.weight-decay-grid",
    "--val-fraction": "--linear.val-fraction",
    "--semi-preset": "--semi.preset",
    "--semi-epochs": "--semi.epochs",
    "--semi-batch-size": "--semi.batch-size",
    "--finetune-steps": "--semi.min-steps",
    **{f"--{flag}": f"--pretrain.{flag}" for flag in ("epochs", "max-steps", "batch-size", "lr-weights")},
    **{f"--{flag}": f"--pretrain.{flag}" for flag in ("crop-scale-min", "image-size", "projector", "lambd")},
    **{f"--{flag}": f"--pretrain.{flag}" for flag in ("warmup-epochs", "small-image-stem")},
    "--no-small-image-stem": "--no-pretrain.small-image-stem",
    "--arch": "--pretrain.arch",
    "--backbone": "--pretrain.arch",
}


def add_dataclass_arguments(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """Add one flag per dataclass field (``field_name`` -> ``--field-name``); a child config's settings as
    ``--child.name`` (``bt_hub.common.config.child``)."""
    presets = presets_of(config_cls)
    parser.add_argument(
        "--config", dest="config_file", metavar="FILE.yaml", default=argparse.SUPPRESS, help=CONFIG_HELP
    )
    for f in dataclasses.fields(config_cls):
        if not f.init or f.name in ("config_file", "origin"):  # set by --config; not a setting
            continue
        if f.name in children(config_cls):
            _add_child(parser, config_cls, f.name)
            continue
        kwargs = _flag_kwargs(
            config_cls, f, f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        )
        if f.name == "preset" and presets:
            kwargs["choices"] = list(presets)
            kwargs["help"] = f"{kwargs['help']}: {describe_presets(config_cls)}".replace("%", "%%")
        if f.metadata.get("positional"):
            kwargs["nargs"] = f.metadata.get("nargs", "*")
            parser.add_argument(f.name, **kwargs)
            continue
        if _required(f):  # on the command line or in the --config file (build_config checks)
            kwargs["help"] = f"{kwargs['help']} (required)".strip()
        if _flag(f) != "--" + f.name.replace("_", "-"):  # a --config file names the setting, not the flag
            kwargs["help"] = f"{kwargs['help']} (key in a --config file: {f.name})"
        parser.add_argument(_flag(f), dest=f.name, **kwargs)
        for alias in f.metadata.get("aliases", ()):
            parser.add_argument("--" + alias.replace("_", "-"), dest=f.name, **{**kwargs, "help": argparse.SUPPRESS})
    if presets and not any(f.name == "preset" for f in dataclasses.fields(config_cls)):
        preset_help = f"named sets of flag values; flags given override them: {describe_presets(config_cls)}"
        parser.add_argument(
            "--preset", choices=list(presets), default=argparse.SUPPRESS, help=preset_help.replace("%", "%%")
        )


def _add_child(parser: argparse.ArgumentParser, config_cls: type, name: str) -> None:
    """The flags of child ``name``'s settings (``--knn.k``, dest ``knn.k``), with this command's defaults for it."""
    child = children(config_cls)[name][0]
    field = next(f for f in dataclasses.fields(config_cls) if f.name == name)
    group = parser.add_argument_group(f"--{name}.*", field.metadata["help"].replace("%", "%%"))
    defaults = child_defaults(config_cls, name)
    fields = {f.name: f for f in dataclasses.fields(child)}
    for knob in knobs(config_cls, name):
        f, dest = fields[knob], f"{name}.{knob}"
        kwargs = _flag_kwargs(child, f, defaults.get(knob))
        if knob == "preset":
            kwargs["help"] = f"{kwargs['help']}: {describe_presets(child)}".replace("%", "%%")
        if "type" in kwargs and "choices" not in kwargs:
            kwargs["metavar"] = knob.upper()
        group.add_argument(f"--{name}.{f.metadata.get('flag', knob).replace('_', '-')}", dest=dest, **kwargs)
        for alias in f.metadata.get("aliases", ()):  # what the child hides (--backbone) stays hidden
            group.add_argument(
                f"--{name}.{alias.replace('_', '-')}", dest=dest, **{**kwargs, "help": argparse.SUPPRESS}
            )


def _flag_kwargs(config_cls: type, f: dataclasses.Field, default: Any) -> dict[str, Any]:
    """argparse's keywords for the flag of field ``f``: its type, choices and help with ``default``."""
    meta = dict(f.metadata)
    tp = unwrap_optional(typing.get_type_hints(config_cls)[f.name])
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
    if default is not None and default is not dataclasses.MISSING and not meta.get("positional"):
        shown = " ".join(map(str, default)) or "none" if isinstance(default, list) else default
        shown = ("on" if default else "off") if tp is bool else shown
        kwargs["help"] = f"{kwargs['help']} (default: {shown})".strip()
    return kwargs


def parse(parser: Parser, argv: Sequence[str]) -> tuple[argparse.Namespace, dict[str, str]]:
    """The flags of ``argv``, each old flat spelling (:data:`LEGACY_FLAGS`) first rewritten to the nested flag the
    parser has (its errors name the old one); and each setting (dest) given -> its flag as typed, the last one typed.
    A setting given by an old spelling and another one (``--knn.k 5 --knn-k 7``) is refused, in one line, exit 2."""
    actions = parser._option_string_actions  # every flag the parser takes, hidden aliases included
    words, spelled, legacy = [], {}, set()
    for word in argv:
        flag, equals, value = word.partition("=")
        nested = LEGACY_FLAGS.get(flag, "")
        if nested in actions and flag not in actions:
            word, parser.typed[nested] = nested + equals + value, flag
            legacy.add(actions[nested].dest)
        if (action := actions.get(word.partition("=")[0])) is not None:
            flags = spelled.setdefault(action.dest, {})
            flags.pop(flag, None)
            flags[flag] = None  # in the order last typed
        words.append(word)
    for dest in legacy:
        if len(spelled[dest]) > 1:
            parser.error(f"{' and '.join(spelled[dest])} are two spellings of the setting {dest}: give it once")
    return parser.parse_args(words), {dest: list(flags)[-1] for dest, flags in spelled.items()}


def build_config(config_cls: type, namespace: argparse.Namespace, typed: Mapping[str, str] | None = None) -> Any:
    """The config dataclass from parsed flags: defaults, then ``--preset``'s values, then the ``--config`` file's,
    then the flags given (a ``--preset`` flag chooses over the file's ``preset``; a child's settings, ``--knn.k``,
    under its name and merged key by key). It keeps where each setting came from (``Origin``): the file, or the flag
    as ``typed`` (:func:`parse`); a flag given overrides the file's value and its credit.
    """
    given = vars(namespace).copy()
    path = given.pop("config_file", None)
    values = read_config_file(config_cls, path) if path else {}
    preset = given.pop("preset", values.pop("preset", None))
    flags: dict[str, Any] = {}
    for key, value in given.items():  # a child's settings (dest knn.k) under its name
        name, _, knob = key.partition(".")
        if knob:
            flags.setdefault(name, {})[knob] = value
        else:
            flags[key] = value
    keys = [key for k, v in values.items() for key in ([f"{k}.{n}" for n in v] if isinstance(v, Mapping) else [k])]
    origin = {k: os.path.basename(path) for k in keys if k not in given} | dict(typed or {})
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    if path and "config_file" in fields:  # a record says a value the file set came from it (RunConfig.given_from)
        values["config_file"] = path
    values = merged(values, flags)
    missing = [_flag(f) for f in fields.values() if _required(f) and f.name not in values]
    if missing:
        where = f"on the command line or in {path}" if path else "on the command line or in a --config file"
        raise ValueError(f"the following arguments are required: {', '.join(missing)} ({where})")
    return build(config_cls, values, preset=preset, origin=Origin(given=origin) if "origin" in fields else None)


def _required(f: dataclasses.Field) -> bool:
    """A flag without a default (not a positional argument, which argparse requires itself)."""
    return f.init and required(f) and not f.metadata.get("positional")


def _flag(f: dataclasses.Field) -> str:
    return "--" + f.metadata.get("flag", f.name).replace("_", "-")


def resolved_settings(config: Any) -> str:
    """A config's settings as the YAML file ``--config`` reads back (every field a flag sets)."""
    import json

    import yaml

    names = [f.name for f in dataclasses.fields(config) if f.init and f.name != "config_file"]
    values = json.loads(json.dumps({k: v for k, v in config_dict(config).items() if k in names}, default=str))
    return yaml.safe_dump(values, sort_keys=False, allow_unicode=True, default_flow_style=None).rstrip()


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line: what is wrong (naming a flag as typed) and where the flags are
    listed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.typed: dict[str, str] = {}  # a nested flag -> the old spelling typed for it (:func:`parse`)

    def error(self, message: str) -> typing.NoReturn:
        for flag, typed in self.typed.items():
            message = message.replace(f"argument {flag}:", f"argument {typed}:")
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help' for the flags\n")
