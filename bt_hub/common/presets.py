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
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

C = TypeVar("C")


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


def from_preset(cls: type[C], name: str | None = None, /, **given: Any) -> C:
    """A ``cls`` config: dataclass defaults, then preset ``name`` (default: the ``preset`` field's default, else
    none: the plain defaults), then ``given`` (a child's settings nested, ``knn={"k": [5]}``, dotted, ``knn.k``,
    or by a flat alias, ``knn_k``)."""
    return build(cls, given, preset=name)


def build(
    cls: type[C], given: Mapping[str, Any], flag_names: Mapping[str, str] | None = None, *, preset: Any = None
) -> C:
    """:func:`from_preset` of ``given`` (``preset`` among them or apart), whose checks name its settings by
    ``flag_names`` (``RunConfig.flag``: ``--knn-k`` where a command holding it was given that)."""
    given = dict(given)
    name = given.pop("preset", preset)
    if name is not None and not isinstance(name, str):
        raise SettingError(f"preset must be the name of a preset (a string), got {shown(name)}")
    field = next((f for f in dataclasses.fields(cls) if f.name == "preset"), None)
    if name is None and field is not None and field.default is not dataclasses.MISSING:
        name = field.default  # the preset used when none is named
    flag = (flag_names or {}).get("preset", "--preset")
    values = merged(
        cls, preset_values(cls, name, flag) if name is not None else {}, check_values(cls, given, literals=False)
    )
    if name is not None and field is not None:
        values["preset"] = name
    config = cls.__new__(cls)
    if flag_names:
        config.flag_names = dict(flag_names)  # read by the messages of its __post_init__
    config.__init__(**values)  # type: ignore[misc]
    own = [k for k in given if k in {f.name for f in dataclasses.fields(cls)} and k not in children(cls)]
    check_values(cls, {k: getattr(config, k) for k in own}, literals="only")  # what __post_init__ let through
    return config


class Given(dict):
    """The settings given for a child config (``{"k": [5]}``), and the flag each was given by (``--knn-k``)."""

    def __init__(self, values: Mapping[str, Any] | None = None, typed: Mapping[str, str] | None = None) -> None:
        super().__init__(values or {})
        self.typed = dict(typed or {})


def children(cls: type) -> dict[str, tuple[type, Mapping[str, Any]]]:
    """The child fields of a config class (``bt_hub.common.config.child``): name -> (its config class, metadata)."""
    found = [f for f in dataclasses.fields(cls) if "child" in f.metadata]
    hints = typing.get_type_hints(cls) if found else {}
    return {f.name: (hints[f.name], f.metadata["child"]) for f in found}


def knobs(cls: type, name: str) -> list[str]:
    """The settings child ``name`` of ``cls`` takes as its own flags: its fields less ``config_file``, those ``cls``
    sets itself and those named like a field of ``cls`` but ``preset`` (unless they are the child's ``own``)."""
    child, meta = children(cls)[name]
    taken = {f.name for f in dataclasses.fields(cls)} - {"preset", *meta["own"]} | {"config_file", *meta["sets"]}
    return [f.name for f in dataclasses.fields(child) if f.init and f.name not in taken]


def child_flag(cls: type, name: str, knob: str) -> str:
    """The flag of setting ``knob`` of a child ``name`` of config class ``cls``: ``--knn.k``, ``--pretrain.arch``."""
    flag = next(f.metadata.get("flag", knob) for f in dataclasses.fields(cls) if f.name == knob)
    return f"--{name}.{flag.replace('_', '-')}"


def flat_aliases(cls: type) -> dict[str, tuple[str, str, str]]:
    """The flat aliases of ``cls``'s children's settings (``bt_hub.common.config.child``): alias -> (child, setting,
    how the alias's value becomes the setting's: ``""`` as it is; ``"one"``, one value of a list, for ``["k"]``;
    ``"not"``, negated, for ``"not cached"``)."""
    found = {}
    for name, (_, meta) in children(cls).items():
        for alias, to in meta["flat"].items():
            how, _, knob = ("one", "", to[0]) if isinstance(to, list) else to.rpartition(" ")
            found[alias] = (name, knob, how)
    return found


def required(f: dataclasses.Field) -> bool:
    """A field without a default."""
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def merged(cls: type, *layers: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of ``layers`` (as :func:`from_preset` takes them) in one, each over the ones before it; a
    child's settings merged key by key."""
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in nested(cls, layer).items():
            old = out.get(key)
            if isinstance(old, Given) and isinstance(value, Given):
                value = Given({**old, **value}, {**old.typed, **value.typed})
            out[key] = value
    return out


def nested(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with each child's settings in one :class:`Given` under its name, however given: nested (a
    mapping, or a config of the child's class), dotted (``knn.k``) or by a flat alias (``knn_k``; one aliasing
    ``["k"]`` gives one value of the list ``k``)."""
    kids, flat = children(cls), flat_aliases(cls)
    out: dict[str, Any] = {}
    for key, value in values.items():
        name, _, knob = key.partition(".")
        if key in flat:
            name, knob, how = flat[key]
            value = [value] if how == "one" else not value if how == "not" else value
            pairs = [(knob, value, "--" + key.replace("_", "-"))]
        elif knob and name in kids:
            pairs = [(knob, value, None)]
        elif key in kids and dataclasses.is_dataclass(value):
            pairs = [(k, getattr(value, k), value.flag_names.get(k)) for k in knobs(cls, key)]
        elif key in kids:
            pairs = [(k, v, getattr(value, "typed", {}).get(k)) for k, v in value.items()]
        else:
            out[key] = value
            continue
        given = out.setdefault(name, Given())
        for setting, setting_value, typed in pairs:
            given[setting] = setting_value
            if typed:
                given.typed[setting] = typed
    return out


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
    """The field values a YAML config file (``--config``) sets: a mapping whose keys are the flags' dest names
    (``image_size: 32``; ``preset: NAME`` where the command has presets), each value checked as ``check_values``
    checks it. The file is read as YAML 1.2 reads scalars (``1e-3`` a number, ``off`` a string); an integer is taken
    for a string setting as its flag takes it (``keep_every: 3`` is ``--keep-every 3``).

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
    *,
    literals: bool | str = True,
    owner: str = "",
    only: Iterable[str] | None = None,
) -> dict[str, Any]:
    """``values`` checked against the fields of ``cls`` (``only``: those named): known names, each of its field's
    type and ``choices``; a child's settings (:func:`nested`) against its class's.

    A path is taken where a string is expected (as ``str``), a tuple where a list is; a string is never taken
    for a list (``splits="train"`` is not ``["t", "r", ...]``). ``literals``: whether a ``Literal`` field's value
    must be one of its values (False: only of their type, so that ``__post_init__`` says why a value does not
    apply to this command; ``"only"``: check nothing else). ``owner`` names whose settings they are (``cls``).

    Raises:
        SettingError: one sentence naming the setting (``named(name)``), what was expected and what was given.
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and (only is None or f.name in only)}
    kids, flat = children(cls), flat_aliases(cls)
    checked = {}
    for name, value in values.items():
        child, _, knob = name.partition(".")
        if name in flat or (knob and child in kids):
            child, knob, how = flat.get(name, (child, knob, ""))
            kid, only = kids[child][0], knobs(cls, child)
            if how == "one":  # one value of the list
                (tp,) = typing.get_args(unwrap_optional(typing.get_type_hints(kid)[knob]))
                checked[name] = _checked(value, tp, None, named(name), literals)
            else:
                label = lambda _, n=name: named(n)  # noqa: E731
                checked[name] = check_values(kid, {knob: value}, label, literals=literals, owner=child, only=only)[knob]
        elif name in kids and not isinstance(value, kids[name][0]):
            if not isinstance(value, Mapping):
                raise SettingError(f"{named(name)} must be a mapping of settings of {name}, got {shown(value)}")
            inner = check_values(
                kids[name][0],
                value,
                lambda k, n=name: named(f"{n}.{k}"),
                literals=literals,
                owner=name,
                only=knobs(cls, name),
            )
            checked[name] = Given(inner, getattr(value, "typed", None))
        elif name in kids:
            checked[name] = value
        elif name not in fields:
            raise SettingError(_unknown(str(name), fields, named, owner or cls.__name__))
        elif literals == "only":
            tp = unwrap_optional(hints[name])
            if typing.get_origin(tp) is typing.Literal and value is not None and value not in typing.get_args(tp):
                raise SettingError(f"{named(name)} must be one of {_listed(typing.get_args(tp))}, got {shown(value)}")
        else:
            checked[name] = _checked(value, hints[name], fields[name].metadata.get("choices"), named(name), literals)
    return checked


def _unknown(name: str, fields: Mapping[str, dataclasses.Field], named: Callable[[str], str], owner: str) -> str:
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


def baseline(cls: type, name: str | None) -> dict[str, Any]:
    """Every field's value under preset ``name`` alone (fields without a default and child configs are left out)."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            values[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            values[f.name] = f.default_factory()
    if name is not None:
        values.update(preset_values(cls, name))
    return {k: v for k, v in values.items() if k not in children(cls)}


def child_defaults(cls: type, name: str, preset: str | None = None, child_preset: str | None = None) -> dict[str, Any]:
    """What ``cls`` (under its preset ``preset``) gives its child ``name`` where nothing is given: its defaults for
    the child and its preset's (the child's ``preset`` among them), over the child class's defaults under that
    preset (or ``child_preset``, the one the child was given)."""
    child, meta = children(cls)[name]
    given = {**meta["defaults"], **(preset_values(cls, preset).get(name, {}) if preset in presets_of(cls) else {})}
    expected = given.pop("preset", baseline(child, None).get("preset"))
    return {**baseline(child, child_preset or expected), **given, "preset": expected}


def overrides(config: Any, ignore: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
    """``{field: {"value": run's value, "preset": the preset's value}}`` for every field that differs; a child's
    settings under ``child.name`` (against this config's defaults for it, its own preset apart).

    The preset is ``config.preset`` when the config has one, else the defaults; ``ignore`` names fields
    that say where or how a run executes rather than what it computes.
    """
    cls = type(config)
    name = getattr(config, "preset", None)
    name = name if name in presets_of(cls) else None
    reference = baseline(cls, name)
    compared = set(reference) - set(ignore) - {"preset"}
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(cls) if f.name in compared}
    for child in (c for c in children(cls) if dataclasses.is_dataclass(getattr(config, c))):
        settings = getattr(config, child)  # its settings against its own preset's, its preset against the expected
        expected = child_defaults(cls, child, name, getattr(settings, "preset", None))
        for knob in knobs(cls, child):
            values[f"{child}.{knob}"], reference[f"{child}.{knob}"] = getattr(settings, knob), expected.get(knob)
    return {k: {"value": v, "preset": reference[k]} for k, v in values.items() if not _same(v, reference[k])}


def config_dict(config: Any) -> dict[str, Any]:
    """A dataclass config as a plain dict, a child config as the mapping of its own settings (what ``--config``
    reads back); a mapping or a namespace as a dict."""
    if not dataclasses.is_dataclass(config):
        return dict(config) if hasattr(config, "keys") else dict(vars(config))
    cls, kids = type(config), children(type(config))
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(cls)}
    return {k: {n: getattr(v, n) for n in knobs(cls, k)} if k in kids else v for k, v in values.items()}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return a == b


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
    if isinstance(value, Mapping):  # a child's settings
        return " ".join(_as_flag(f"{name}.{k}", v) for k, v in value.items())
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + name.replace("_", "-")
    if isinstance(value, (list, tuple)):
        return f"{flag} " + (" ".join(str(v) for v in value) if value else "(none)")
    return f"{flag} {value}"
