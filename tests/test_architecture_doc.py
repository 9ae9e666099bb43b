"""docs/architecture.md is the map of the code: every module it names exists, and every module is on it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")


def _modules() -> list[Path]:
    found = [*ROOT.glob("bt_hub/**/*.py"), *ROOT.glob("eval/**/*.py")]
    return sorted(p for p in found if p.name != "__init__.py")


def test_every_module_the_map_names_exists():
    named = set(re.findall(r"`((?:bt_hub|eval)/[\w/]+\.py)", DOC))
    assert named, "the map names no module path"
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_every_module_is_on_the_map():
    words = set(re.findall(r"\w+", DOC))
    absent = [str(p.relative_to(ROOT)) for p in _modules() if p.stem not in words]
    assert not absent, f"modules docs/architecture.md does not mention: {absent}"
