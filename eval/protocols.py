"""The protocol table: every evaluation protocol registered once, and read by the CLI (``bt-hub eval NAME``), the
Python API (``evaluate(..., protocol=NAME)``), ``eval all`` and ``eval compare`` (torchvision's
``register_model`` / ``list_models`` pattern).

An entry names the module that holds the protocol, imported on first use (this module imports no torch, so the
CLI can list the commands without loading a network). The module provides:

- the config class (``Protocol.config``, an ``EvalConfig``): its flags, presets and checks;
- ``score_cell(cell, config, seed) -> Scored``: the pure scoring step. ``cell`` is what is scored, read through
  ``cell.features(split)``, ``cell.network``, ``cell.splits``, ``cell.device`` and ``cell.settings``: an
  ``EvalRun`` when the command runs, or one row of ``eval compare`` (its network on the same splits). It reads
  every knob from ``config``, never from the cell. It does not name itself: a record's ``protocol`` is the name of
  the entry whose config class its config is (:func:`protocol_for`);
- ``score(run) -> Scored``: the command's step (its warnings about the data, then ``score_cell``; a protocol whose
  command does more, such as the linear probe's paper loop, says so there) and ``run(config)``, the subcommand;
- optionally ``suite_settings(suite_config) -> [(folder, {field: value})]``: its runs in ``eval all`` (default:
  one run with the suite's shared flags).

Its config in an ``eval compare`` cell is compare's child of its name (``CompareConfig.knn``) with the cell's own
values replaced; its columns are one per label fraction where its config takes a ``fraction``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class Protocol:
    """One evaluation protocol: its name (the ``bt-hub eval`` subcommand and every record's ``protocol``), the
    module holding it, its config class's name, a one-line help, and where it runs besides its own command."""

    name: str
    module: str
    config: str
    help: str
    suite: bool = True  # eval all runs it (its module's suite_settings may say on which flags)
    column: bool = False  # eval compare's --protocols can make it a column (its module has score_cell)
    contract: str = ""  # the test of tests/test_against_reference.py that holds it to the reference code
    title: str = ""  # its name in a table's heading (default: its name)
    trains_network: bool = False  # it trains the network itself: a frozen compare row (pixels) gets the linear probe
    deterministic: bool = False  # on one network every seed scores the same (equal values are no spread)

    @property
    def heading(self) -> str:
        """Its name in a table's heading: ``kNN``, ``linear``, ``semi``."""
        return self.title or self.name

    def load(self) -> ModuleType:
        """The protocol's module, imported now."""
        return importlib.import_module(self.module)

    @property
    def config_class(self) -> type:
        """The protocol's config dataclass."""
        return getattr(self.load(), self.config)

    def hook(self, name: str) -> Callable[..., Any] | None:
        """The module's function ``name`` (``score``, ``score_cell``, ``suite_settings``), if any."""
        return getattr(self.load(), name, None)


PROTOCOLS: dict[str, Protocol] = {}


def register_protocol(protocol: Protocol) -> Protocol:
    """Add ``protocol`` to the table (the CLI, the API, ``eval all`` and ``eval compare`` read it); returns it."""
    known = PROTOCOLS.get(protocol.name)
    if known is not None and known != protocol:
        raise ValueError(f"protocol {protocol.name!r} is registered already, by {known.module}; choose another name")
    if protocol.name in ("all", "compare"):
        raise ValueError(f"protocol name {protocol.name!r} is a bt-hub eval command of its own; choose another name")
    PROTOCOLS[protocol.name] = protocol
    return protocol


def get_protocol(name: str) -> Protocol:
    """The registered protocol ``name``; a ValueError naming the registered ones otherwise."""
    if name not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {name!r}")
    return PROTOCOLS[name]


def protocol_for(config: Any) -> str:
    """The registered name of the protocol whose config class ``config`` is (what its records say they ran)."""
    kind = type(config)
    for p in PROTOCOLS.values():
        if p.config == kind.__name__ and p.config_class is kind:
            return p.name
    raise ValueError(f"{kind.__name__} is the config of no registered protocol")


def list_protocols(*, suite: bool | None = None, column: bool | None = None) -> list[str]:
    """The registered protocols' names, in table order; ``suite`` / ``column`` keep those that run in ``eval all``
    / can be ``eval compare`` columns (or those that do not, when False)."""
    return [
        p.name
        for p in PROTOCOLS.values()
        if (suite is None or p.suite == suite) and (column is None or p.column == column)
    ]


_CONTRACT = "tests/test_against_reference.py::"
for _protocol in (
    Protocol(
        "knn",
        "bt_hub.eval.knn",
        "KnnConfig",
        "weighted kNN on L2-normalised features (faiss on the CPU, torch on CUDA)",
        column=True,
        contract=_CONTRACT + "test_knn_equals_dinos_knn_classifier_at_k_20_and_200",
        title="kNN",
        deterministic=True,
    ),
    Protocol(
        "linear",
        "bt_hub.eval.linear",
        "LinearConfig",
        "linear probe on a frozen backbone (ImageNet protocol)",
        column=True,
        contract=_CONTRACT + "test_the_linear_probe_loop_trains_evaluate_pys_first_epoch",
    ),
    Protocol(
        "semi",
        "bt_hub.eval.semi_supervised",
        "SemiSupervisedConfig",
        "fine-tune on 1% or 10% of the labels",
        column=True,
        trains_network=True,
    ),
    Protocol(
        "voc07-svm",
        "bt_hub.eval.voc07_svm",
        "Voc07SvmConfig",
        "per-class linear SVMs on VOC2007 (VISSL protocol)",
        contract=_CONTRACT + "test_voc07_svms_choose_vissls_cost_per_class_and_score_its_test_ap",
    ),
    Protocol(
        "transfer",
        "bt_hub.eval.linear",
        "TransferConfig",
        "linear transfer to Places-205 / iNat18 (PIRL settings)",
        suite=False,
    ),
):
    register_protocol(_protocol)
