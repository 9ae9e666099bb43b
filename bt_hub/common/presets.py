"""One preset mechanism for every config dataclass: named sets of field values (litgpt's named configs), the
values a caller gives checked against each field's type, and YAML config files of such values (``--config``).
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
import os
import re
import reprlib
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml


class SettingError(TypeError, ValueError):
    """A setting of an unknown name or of the wrong type or value: a TypeError to a Python caller, and to the
    ``bt-hub`` command a refused input (exit 2) like every ValueError.
    """


def presets_of(cls: type) -> dict[str, dict[str, Any]]:
    """The ``PRESETS`` of a config class (empty when it has none)."""
    return dict(getattr(cls, "PRESETS", None) or {})


def preset_values(cls: type, name: str, flag: str = "--preset") -> dict[str, Any]:
    """The field values preset ``name`` of ``cls`` sets over the defaults (else a ValueError naming ``flag``)."""
    presets = presets_of(cls)
    if name not in presets:
        raise ValueError(f"{flag} {name!r} is unknown; expected one of {', '.join(presets) or '(none)'}")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(presets[name]) - fields)
    if unknown:
        raise ValueError(f"preset {name!r} of {cls.__name__} sets {unknown}, which are not fields of {cls.__name__}")
    return {k: list(v) if isinstance(v, list) else v for k, v in presets[name].items()}


def required(f: dataclasses.Field) -> bool:
    """A field without a default."""
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader reading scalars as YAML 1.2 does: ``1e-3`` is a number, ``on``/``off``/``yes``/``no``
    are strings (``--compile off``), only ``true``/``false`` are booleans; a key given twice is refused.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        """The mapping of ``node``, refusing a key it gives twice (PyYAML keeps the last value without a word)."""
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = self.construct_object(key_node)
                if key in lines:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key} was already given at line {lines[key]}", key_node.start_mark
                    )
                lines[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def read_config_file(cls: type, path: str | os.PathLike) -> dict[str, Any]:
    """The field values a YAML config file (``--config``) sets: a mapping whose keys are the settings' names
    (``image_size: 32``; a nested config's settings under its name, ``knn: {k: [5]}``; ``preset: NAME`` where the
    command has presets), each value checked as ``check_values`` checks it. The file is read as YAML 1.2 reads
    scalars (``1e-3`` a number, ``off`` a string); an integer is taken for a string setting as its flag takes it
    (``keep_every: 3`` is ``--keep-every 3``).

    Raises:
        ValueError: one sentence naming the file, and the key where one is at fault.
    """
    try:
        data = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_Yaml12Loader)
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--config {path} cannot be read ({getattr(err, 'strerror', None) or err})") from None
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise ValueError(f"--config {path} is not valid YAML{line} ({getattr(err, 'problem', None) or err})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(
            f"--config {path} holds a {type(data).__name__}; expected a mapping of settings to values (image_size: 32)"
        )
    hints = typing.get_type_hints(cls)  # an integer where a string flag is expected reads as on the command line
    values = {k: str(v) if type(v) is int and unwrap_optional(hints.get(k)) is str else v for k, v in data.items()}
    preset = values.pop("preset", None) if presets_of(cls) else None
    if preset is not None and preset not in presets_of(cls):
        raise SettingError(f"key preset of {path} must be one of {_listed(presets_of(cls))}, got {shown(preset)}")
    if "config_file" in values:  # the field that records the file: set by --config, never by a file
        raise SettingError(f"key config_file of {path} is not a setting; a config file names no other one")
    checked = check_values(cls, values, lambda name: f"key {name} of {path}", owner="this command (see its --help)")
    return checked if preset is None else {"preset": preset, **checked}


def check_values(
    cls: type,
    values: Mapping[str, Any],
    named: Callable[[str], str] = str,
    literals: bool | str = True,
    *,
    owner: str = "",
) -> dict[str, Any]:
    """``values`` checked against the fields of ``cls``: known names, each of its field's type and ``choices``; the
    settings of a nested config (a field whose type is a dataclass: a mapping, or a config of that class) against its
    class's.

    A path is taken where a string is expected (as ``str``), a tuple where a list is; a string is never taken
    for a list (``splits="train"`` is not ``["t", "r", ...]``). ``literals``: whether a ``Literal`` field's value
    must be one of its values (False: only of their type, so that ``__post_init__`` says why a value does not
    apply to this command; ``"only"``: check nothing else). ``owner`` names whose settings they are (``cls``).

    Raises:
        SettingError: one sentence naming the setting (``named(name)``), what was expected and what was given.
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and f.name != "origin"}
    checked = {}
    for name, value in values.items():
        if name not in fields:
            raise SettingError(unknown_setting(str(name), fields, named, owner or cls.__name__))
        tp = unwrap_optional(hints[name])
        if dataclasses.is_dataclass(tp):  # a nested config's settings
            if not isinstance(value, (tp, Mapping)):
                raise SettingError(f"{named(name)} must be a mapping of settings of {name}, got {shown(value)}")
            inner = lambda k, n=name: named(f"{n}.{k}")  # noqa: E731
            checked[name] = value if isinstance(value, tp) else check_values(tp, value, inner, literals, owner=name)
        elif literals == "only":
            if typing.get_origin(tp) is typing.Literal and value is not None and value not in typing.get_args(tp):
                raise SettingError(f"{named(name)} must be one of {_listed(typing.get_args(tp))}, got {shown(value)}")
        else:
            checked[name] = _checked(value, hints[name], fields[name].metadata.get("choices"), named(name), literals)
    return checked


def unknown_setting(name: str, fields: Mapping[str, dataclasses.Field], named: Callable[[str], str], owner: str) -> str:
    """Why ``name`` is no setting: the field it is the flag of (``arch`` -> ``backbone``), a close name, or the list."""
    for field_name, f in fields.items():
        flags = (f.metadata.get("flag", field_name), *f.metadata.get("aliases", ()))
        if name.replace("-", "_") in {flag.replace("-", "_") for flag in flags} and field_name != name:
            return f"{named(name)} is the flag --{flags[0].replace('_', '-')}, whose setting is named {field_name}"
    names = [n for n in fields if n != "config_file"]
    close = difflib.get_close_matches(name, names, n=1)
    expected = f"did you mean {close[0]}?" if close else f"expected one of {', '.join(names) or '(none)'}"
    return f"{named(name)} is not a setting of {owner}; {expected}"


def unwrap_optional(tp: Any) -> Any:
    """``Optional[X]`` (``X | None``) -> ``X``; other types unchanged."""
    options = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return next(t for t in options if t is not type(None))


def _checked(value: Any, tp: Any, choices: Iterable[Any] | None, label: str, literals: bool | str) -> Any:
    """``value`` as a field of type ``tp`` takes it (path -> str, tuple -> list, numpy number -> int or float), or a
    SettingError.
    """
    options = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    if value is None and type(None) in options:
        return None
    tp = unwrap_optional(tp)
    if typing.get_origin(tp) is list:
        (element,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            given = f"the string {reprlib.repr(value)}" if isinstance(value, str) else shown(value)
            raise SettingError(f"{label} must be a list of {_TYPE_WORDS.get(element, ('', 'values'))[1]}, got {given}")
        return [_checked(v, element, choices, f"each item of {label}", literals) for v in value]
    if typing.get_origin(tp) is typing.Literal:
        choices = typing.get_args(tp) if literals else choices
        tp = type(typing.get_args(tp)[0])
    if tp in _TYPE_WORDS:
        if isinstance(value, os.PathLike) and tp is str:
            value = os.fspath(value)
        accepted = {bool: bool, int: numbers.Integral, float: numbers.Real, str: str}[tp]
        if not isinstance(value, accepted) or (isinstance(value, bool) and tp is not bool):
            raise SettingError(f"{label} must be {_TYPE_WORDS[tp][0]}, got {shown(value)}")
        if tp in (int, float) and not isinstance(value, (int, float)):  # numpy's: records are JSON
            value = int(value) if tp is int else float(value)
    if choices is not None and value not in tuple(choices):
        raise SettingError(f"{label} must be one of {_listed(choices)}, got {shown(value)}")
    return value


_TYPE_WORDS = {  # a type in words: (one, a list of them)
    bool: ("True or False", "True or False values"),
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    str: ("a string", "strings"),
}


def _listed(choices: Iterable[Any]) -> str:
    return ", ".join(map(repr, choices))


def shown(value: Any) -> str:
    """A value short enough for a message, and its type: ``'16' (str)``; a list, tuple, set or dict of more than a
    few items as its first few and their count: ``[0, 1, 2, 3, 4, 5, ...] (list of 200000 items)``."""
    kind = type(value).__name__
    if isinstance(value, (list, tuple, set, frozenset, dict)) and len(value) > reprlib.aRepr.maxlist:
        kind = f"{kind} of {len(value)} items"
    return f"{reprlib.repr(value)} ({kind})"


def first_few(names: Sequence[str], most: int) -> str:
    """The first ``most`` of ``names`` and how many more, for a message: ``a, b, c and 4 more``."""
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def describe_presets(cls: type) -> str:
    """One clause per preset naming the flags it sets, for ``--preset``'s help."""
    # a field may have a flag of another name
    flags = {f.name: f.metadata.get("flag", f.name) for f in dataclasses.fields(cls)}
    settings = {
        name: " ".join(_as_flag(flags.get(k, k), v) for k, v in values.items())
        for name, values in presets_of(cls).items()
    }
    return "; ".join(f"{name}: {text or 'the defaults'}" for name, text in settings.items())


def _as_flag(name: str, value: Any) -> str:
    if isinstance(value, Mapping):  # a nested config's settings
        return " ".join(_as_flag(f"{name}.{k}", v) for k, v in value.items())
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + name.replace("_", "-")
    if isinstance(value, (list, tuple)):
        return f"{flag} " + (" ".join(str(v) for v in value) if value else "(none)")
    return f"{flag} {value}"
