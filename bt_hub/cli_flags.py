"""The ``bt-hub`` command's flags: a config dataclass as an argparse parser, and the parsed flags (over a ``--config``
YAML file) as that dataclass.

Each field is a flag (kebab-case, or ``metadata["flag"]`` with the other spellings in ``metadata["aliases"]`` kept as
hidden aliases) whose help text is the field's ``metadata["help"]`` with the default that runs; a ``PRESETS`` class
attribute adds ``--preset`` (bt_hub.common.presets; its help lists what each preset sets). Every subcommand takes
``--config FILE.yaml``: settings keyed by the fields' names, under the flags given; the settings it resolves to are
printed (stderr) and kept in the ``config_file`` field of configs that have one, so the run records the file beside
its settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from bt_hub.common.presets import (
    child_defaults,
    child_flag,
    children,
    config_dict,
    describe_presets,
    flat_aliases,
    from_preset,
    knobs,
    merged,
    presets_of,
    read_config_file,
    required,
    unwrap_optional,
)

CONFIG_HELP = (
    "a YAML file of settings for this command, keyed by the flags' names with '_' for '-' and no '--' "
    "(image_size: 32, k: [20]; preset: NAME where there are presets); flags given override it; the settings "
    "it resolves to are printed, and recorded with the run"
)


def add_dataclass_arguments(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """Add one flag per dataclass field (``field_name`` -> ``--field-name``); a child config's settings as
    ``--child.name`` (``bt_hub.common.config.child``), its flat aliases as hidden flags."""
    presets = presets_of(config_cls)
    parser.add_argument(
        "--config", dest="config_file", metavar="FILE.yaml", default=argparse.SUPPRESS, help=CONFIG_HELP
    )
    for f in dataclasses.fields(config_cls):
        if not f.init or f.name == "config_file":  # set by --config
            continue
        if f.name in children(config_cls):
            _add_child(parser, config_cls, f.name)
            continue
        kwargs = _flag_kwargs(config_cls, f, f.default if f.default_factory is dataclasses.MISSING else None)
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
    """The flags of child ``name``'s settings (``--knn.k``, dest ``knn.k``) and of their flat aliases (``--knn-k``:
    hidden, dest ``knn_k``; one aliasing ``["k"]`` takes one value)."""
    child = children(config_cls)[name][0]
    field = next(f for f in dataclasses.fields(config_cls) if f.name == name)
    group = parser.add_argument_group(f"--{name}.*", field.metadata["help"].replace("%", "%%"))
    defaults = child_defaults(config_cls, name)
    fields = {f.name: f for f in dataclasses.fields(child)}
    aliases = {alias: to for alias, to in flat_aliases(config_cls).items() if to[0] == name}
    for knob in knobs(config_cls, name):
        f, flat = fields[knob], [alias for alias, (_, to, _) in aliases.items() if to == knob]
        kwargs = _flag_kwargs(child, f, defaults.get(knob))
        dest, hides = f"{name}.{knob}", f.metadata.get("aliases", ())  # what the child hides (--backbone) stays hidden
        said = [f"--{a}" + (" for --no-" + dest if aliases[a][2] == "not" else "") for a in flat if a not in hides]
        if said:
            kwargs["help"] += " (or " + ", ".join(said).replace("_", "-") + ")"
        if knob == "preset":
            kwargs["help"] = f"{kwargs['help']}: {describe_presets(child)}".replace("%", "%%")
        if "type" in kwargs and "choices" not in kwargs:
            kwargs["metavar"] = knob.upper()
        group.add_argument(child_flag(child, name, knob), dest=dest, **kwargs)
        hidden = {**kwargs, "help": argparse.SUPPRESS}
        for alias in hides:
            group.add_argument(f"--{name}.{alias.replace('_', '-')}", dest=dest, **hidden)
        for alias in flat:
            one = {"nargs": None} if aliases[alias][2] == "one" else {}
            group.add_argument("--" + alias.replace("_", "-"), dest=alias, **{**hidden, **one})


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


def build_config(config_cls: type, namespace: argparse.Namespace) -> Any:
    """The config dataclass from parsed flags: defaults, then ``--preset``'s values, then the ``--config`` file's,
    then the flags given (a ``--preset`` flag chooses over the file's ``preset``; a child's settings merged key by
    key).
    """
    given = vars(namespace).copy()
    path = given.pop("config_file", None)
    values = read_config_file(config_cls, path) if path else {}
    preset = given.pop("preset", values.pop("preset", None))
    from_file = frozenset(values) - frozenset(given)
    recorded = path and any(f.name == "config_file" for f in dataclasses.fields(config_cls))
    if recorded:
        values["config_file"] = path
    values = merged(config_cls, values, given)
    missing = [_flag(f) for f in dataclasses.fields(config_cls) if _required(f) and f.name not in values]
    if missing:
        where = f"on the command line or in {path}" if path else "on the command line or in a --config file"
        raise ValueError(f"the following arguments are required: {', '.join(missing)} ({where})")
    config = from_preset(config_cls, preset, **values)
    if recorded:  # a record says a value the file set came from it, not from its flag (RunConfig.given_from)
        config.file_settings = from_file
    return config


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
    """argparse whose usage errors are one line: what is wrong and where the flags are listed."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help' for the flags\n")
