"""One preset mechanism for every config dataclass: named sets of field values (litgpt's named configs)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, TypeVar

C = TypeVar("C")


def presets_of(cls: type) -> dict[str, dict[str, Any]]:
    """The ``PRESETS`` of a config class (empty when it has none)."""
    return dict(getattr(cls, "PRESETS", None) or {})


def default_preset(cls: type) -> str | None:
    """The preset used when none is named: the ``preset`` field's default, else None (the plain defaults)."""
    for f in dataclasses.fields(cls):
        if f.name == "preset" and f.default is not dataclasses.MISSING:
            return f.default
    return None


def preset_values(cls: type, name: str) -> dict[str, Any]:
    """The field values preset ``name`` of ``cls`` sets over the defaults (else ValueError)."""
    presets = presets_of(cls)
    if name not in presets:
        raise ValueError(f"--preset {name!r} is unknown; expected one of {', '.join(presets) or '(none)'}")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(presets[name]) - fields)
    if unknown:
        raise ValueError(f"preset {name!r} of {cls.__name__} sets {unknown}, which are not fields of {cls.__name__}")
    return {k: list(v) if isinstance(v, list) else v for k, v in presets[name].items()}


def from_preset(cls: type[C], name: str | None = None, /, **given: Any) -> C:
    """A ``cls`` config: dataclass defaults, then preset ``name`` (default: ``default_preset(cls)``), then ``given``."""
    name = name if name is not None else default_preset(cls)
    values = preset_values(cls, name) if name is not None else {}
    values.update(given)
    if name is not None and any(f.name == "preset" for f in dataclasses.fields(cls)):
        values["preset"] = name
    return cls(**values)


def baseline(cls: type, name: str | None) -> dict[str, Any]:
    """Every field's value under preset ``name`` alone (fields without a default are left out)."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            values[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            values[f.name] = f.default_factory()
    if name is not None:
        values.update(preset_values(cls, name))
    return values


def overrides(config: Any, ignore: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
    """``{field: {"value": run's value, "preset": the preset's value}}`` for every field that differs.

    The preset is ``config.preset`` when the config has one, else the defaults; ``ignore`` names fields
    that say where or how a run executes rather than what it computes.
    """
    cls = type(config)
    name = getattr(config, "preset", None)
    reference = baseline(cls, name if name in presets_of(cls) else None)
    skipped = set(ignore) | {"preset"}
    changed = {}
    for f in dataclasses.fields(cls):
        if f.name in skipped or f.name not in reference:
            continue
        value = getattr(config, f.name)
        if not _same(value, reference[f.name]):
            changed[f.name] = {"value": value, "preset": reference[f.name]}
    return changed


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return a == b


def describe_presets(cls: type) -> str:
    """One clause per preset naming the flags it sets, for ``--preset``'s help."""
    flags = {
        f.name: f.metadata.get("flag", f.name) for f in dataclasses.fields(cls)
    }  # a field may have a flag of another name
    parts = []
    for name, values in presets_of(cls).items():
        settings = " ".join(_as_flag(flags.get(k, k), v) for k, v in values.items()) or "the defaults"
        parts.append(f"{name}: {settings}")
    return "; ".join(parts)


def _as_flag(name: str, value: Any) -> str:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + name.replace("_", "-")
    if isinstance(value, (list, tuple)):
        return f"{flag} " + (" ".join(str(v) for v in value) if value else "(none)")
    return f"{flag} {value}"
