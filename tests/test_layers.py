"""The import graph of the installed package runs one way down the layers (docs/architecture.md).

Every ``import`` counts, at module level or inside a function or a ``TYPE_CHECKING`` block,
and so do the modules the CLI imports by name (its ``COMMANDS`` table). Run this file as a
script to print the graph's size and any upward edge or cycle.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import bt_hub
import bt_hub.weights as weights
from bt_hub import cli

# Lowest first; a module may import its own layer and those before it.
LAYERS = ["common", "method", "data", "train", "weights", "eval", "detection", "cli"]
PREFIXES = [  # most specific first
    ("bt_hub.eval.detection", "detection"),
    ("bt_hub.detection_configs", "detection"),
    ("bt_hub.common", "common"),
    ("bt_hub.method", "method"),
    ("bt_hub.data", "data"),
    ("bt_hub.train", "train"),
    ("bt_hub.weights", "weights"),
    ("bt_hub.eval", "eval"),
    ("bt_hub.cli", "cli"),
    ("bt_hub.__main__", "cli"),  # python -m bt_hub
    ("bt_hub.cli_interrupted", "cli"),  # what a cut command kept
    ("bt_hub.cli_flags", "cli"),  # a config dataclass as flags
    ("bt_hub", "method"),  # the package's __init__ re-exports the method, and nothing above it
]


def layer_of(module: str) -> str:
    """The layer a module of bt_hub belongs to."""
    return next(layer for prefix, layer in PREFIXES if module == prefix or module.startswith(prefix + "."))


def package_modules() -> dict[str, Path]:
    """Every module of the installed ``bt_hub`` package, by dotted name, with its source file."""
    modules = {}
    # an editable install maps eval/ and detection_configs/ into bt_hub without a folder inside it
    for package in (
        bt_hub,
        importlib.import_module("bt_hub.eval"),
        importlib.import_module("bt_hub.detection_configs"),
    ):
        modules[package.__name__] = Path(package.__file__)
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            spec = importlib.util.find_spec(info.name)
            assert spec is not None and spec.origin is not None, info.name
            modules[info.name] = Path(spec.origin)
    return modules


def _target(name: str, modules: dict[str, Path]) -> str:
    """The longest prefix of ``name`` that is a module of the package."""
    while name not in modules:
        name = name.rpartition(".")[0]
    return name


def import_edges(modules: dict[str, Path]) -> set[tuple[str, str]]:
    """(importer, imported) for every import of a bt_hub module anywhere in a module's source."""
    edges = set()
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{parent}.{base}" if base else parent
                # `from bt_hub.eval import voc07_svm` runs bt_hub.eval's __init__ first: an edge to it as well
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            for target in targets:
                if target == "bt_hub" or target.startswith("bt_hub."):
                    imported = _target(target, modules)
                    if imported != name:
                        edges.add((name, imported))
    for module in weights.HOMES:  # the names bt_hub.weights imports on first use
        edges.add(("bt_hub.weights", module))
    for entry in cli.COMMANDS.values():
        for command in entry.values() if isinstance(entry, dict) else [entry]:
            edges.add(("bt_hub.cli", command.module))
    return edges


def upward_edges(edges: set[tuple[str, str]]) -> list[str]:
    """The edges that import a higher layer."""
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    return sorted(
        f"{a} ({layer_of(a)}) imports {b} ({layer_of(b)})" for a, b in edges if rank[layer_of(b)] > rank[layer_of(a)]
    )


def upper_names_in_strings(modules: dict[str, Path]) -> list[str]:
    """The strings (docstrings and messages included) in which a module names a package of a higher layer."""
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    found = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                # `-m bt_hub.cli` is the command a user types under torchrun, not knowledge of the layer
                for named in re.findall(r"(?<!-m )\bbt_hub(?:\.\w+)+", node.value):
                    named = _target(named, modules)  # "bt_hub.results/3" (a schema) names no module
                    if named != "bt_hub" and rank[layer_of(named)] > rank[layer_of(name)]:
                        found.append(f"{name} ({layer_of(name)}) names {named} ({layer_of(named)})")
    return sorted(set(found))


def cycles(modules: dict[str, Path], edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    graph: dict[str, list[str]] = {m: [] for m in modules}
    for a, b in edges:
        graph[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer_and_the_graph_sees_function_level_imports():
    modules = package_modules()
    assert len(modules) > 60
    for name in modules:
        assert layer_of(name) in LAYERS
    edges = import_edges(modules)
    # a function-level import (inside eval.voc07_svm.voc07_transform) is an edge like any other
    assert ("bt_hub.eval.voc07_svm", "bt_hub.method.transforms") in edges


def test_imports_run_one_way_down_the_layers():
    edges = import_edges(package_modules())
    assert upward_edges(edges) == []


def test_a_function_level_import_from_a_package_is_an_edge_to_its_init(tmp_path):
    # Guards: `from bt_hub.eval import voc07_svm` inside a function of suite.py ran bt_hub.eval's __init__ (whose
    # __getattr__ imports api -> comparison -> suite), yet the graph saw only the edge to voc07_svm: no cycle found.
    modules = package_modules()
    modules["bt_hub.eval.made_here"] = tmp_path / "made_here.py"
    modules["bt_hub.eval.made_here"].write_text("def late():\n    from bt_hub.eval import knn\n", encoding="utf-8")
    edges = import_edges(modules)
    assert {("bt_hub.eval.made_here", "bt_hub.eval"), ("bt_hub.eval.made_here", "bt_hub.eval.knn")} <= edges


def test_the_import_graph_has_no_cycle():
    # Every strongly connected component of more than one module, function-level imports included.
    modules = package_modules()
    assert cycles(modules, import_edges(modules)) == []


def test_no_command_stands_in_the_data_layer():
    # Guards: bt-hub report (a config class, a run-folder claim of kind "report") stood in the data layer as
    # bt_hub/data/plots.py; it is training's report now (bt_hub/train/report.py), save_png in common/files.py.
    commands = [c for entry in cli.COMMANDS.values() for c in (entry.values() if isinstance(entry, dict) else [entry])]
    assert [c.module for c in commands if layer_of(c.module) == "data"] == []
    assert cli.COMMANDS["report"].module == "bt_hub.train.report"


def test_no_layer_names_a_layer_above_it_even_in_a_string():
    # Guards: common/runs.py mapped "bt_hub.train", "bt_hub.eval", ... to run-folder kinds, an import in all but name.
    assert upper_names_in_strings(package_modules()) == []


def test_the_library_never_inspects_the_call_stack():
    # Guards: run-folder permissions came from the calling module (sys._getframe), so a move changed them.
    for name, path in package_modules().items():
        source = path.read_text(encoding="utf-8")
        assert "_getframe" not in source and "inspect.stack" not in source and "currentframe" not in source, name


def test_importing_the_method_loads_neither_training_nor_weights_nor_evaluation():
    code = (
        "import sys, bt_hub.method.loss, bt_hub.method.model, bt_hub.method.views, bt_hub.method.optim, "
        "bt_hub.method.transforms; "
        "print(sorted(m for m in sys.modules if m.startswith(('bt_hub.train', 'bt_hub.weights', 'bt_hub.eval'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_evaluation_stands_on_the_data_layer_and_loads_no_training_module():
    # Guards: eval imported its pipeline (datasets, decode, prefetch, precision) from bt_hub.train.
    code = "import sys, bt_hub.eval.knn; print(sorted(m for m in sys.modules if m.startswith('bt_hub.train')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_no_evaluation_module_but_the_demo_imports_training():
    # Guards: eval compare's curve rows (and the reading of a run's kept steps) lived in bt_hub.train.kept; reading
    # kept weights is a weights source (bt_hub.weights.sources) and the rows are eval's. The demo pretrains.
    importers = {
        a for a, b in import_edges(package_modules()) if a.startswith("bt_hub.eval") and b.startswith("bt_hub.train")
    }
    assert importers == {"bt_hub.eval.demo"}


def test_importing_knn_loads_no_card_export_hub_or_download_module():
    # Guards: eval/report.py imported the weights registry for the paper's numbers and bt_hub/weights/__init__.py
    # imported the whole wing, so import bt_hub.eval.knn loaded 42 bt_hub modules, the model card and Hub upload too.
    # What a protocol may not load is named (the publishing wing, training, libraries kNN does not use), not counted.
    code = "import sys, bt_hub.eval.knn; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    heavy = [f"bt_hub.weights.{name}" for name in ("card", "export", "hf", "download", "registry")]
    heavy += [
        "bt_hub.train",
        "bt_hub.cli",
        "sklearn",
        "huggingface_hub",
        "matplotlib",
        "pandas",
        "detectron2",
        "nvidia",
    ]
    assert "bt_hub.eval.knn" in loaded
    assert [m for m in loaded if any(m == h or m.startswith(h + ".") for h in heavy)] == []


@pytest.mark.parametrize("generic_name", ["eval", "detection_configs"])
def test_the_installed_package_exposes_bt_hub_only_and_no_generic_top_level_name(tmp_path, generic_name):
    run = subprocess.run([sys.executable, "-c", f"import {generic_name}"], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode != 0 and f"No module named '{generic_name}'" in run.stderr
    nested = subprocess.run(
        [sys.executable, "-c", f"import bt_hub.{generic_name}"], capture_output=True, text=True, cwd=tmp_path
    )
    assert nested.returncode == 0, nested.stderr


def test_the_eval_folder_of_a_checkout_refuses_to_import_as_a_top_level_package():
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", "import eval"], capture_output=True, text=True, cwd=root)
    assert run.returncode != 0 and "import bt_hub.eval" in run.stderr


def test_the_records_know_no_protocol_preset_or_subset_file():
    # Guards: records.py held each protocol's name, the paper's rows keyed by protocol and preset, and the
    # names of SimCLR's subset files; the protocols declare them now and the records carry them.
    source = Path(importlib.util.find_spec("bt_hub.common.records").origin).read_text(encoding="utf-8").lower()
    for protocol in ("linear", "transfer", "semi", "knn", "voc07", "detect", "compare", "embed"):
        assert re.search(rf"['\"]{protocol}", source) is None, protocol
    for name in ("imagenet", "places205", "inat18", "coco", "percent.txt", "1percent", "paper_task"):
        assert name not in source, name


def test_every_record_is_built_by_the_runner():
    # Guards: records were built in three places (EvalRun.record, detect._write, embedding._write, which repeated
    # the runner's settings line); eval/runner.py's build_record builds them all, so a field changes in one place.
    callers = sorted(
        name
        for name, path in package_modules().items()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "make_record"
    )
    assert callers == ["bt_hub.eval.runner"]


if __name__ == "__main__":
    found = package_modules()
    all_edges = import_edges(found)
    print(f"{len(found)} modules, {len(all_edges)} import edges (function-level and CLI table included)")
    print(f"upward edges: {upward_edges(all_edges) or 'none'}")
    print(f"cycles: {cycles(found, all_edges) or 'none'}")
    print(f"upper packages named in strings: {upper_names_in_strings(found) or 'none'}")
