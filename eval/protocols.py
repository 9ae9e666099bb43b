"""The protocol table: every evaluation protocol registered once, and read by the CLI (``bt-hub eval NAME``), the
Python API (``evaluate(..., protocol=NAME)``), ``eval all`` and ``eval compare`` (torchvision's
``register_model`` / ``list_models`` pattern). An entry states facts about its protocol only; what a command that
runs it needs, it keeps itself (compare's columns and the prose of what a seed varies, eval all's runs).

An entry names the module that holds the protocol, imported on first use (this module imports no torch, so the
CLI can list the commands without loading a network). The module provides:

- the config class (``Protocol.config``, an ``EvalConfig``): its flags, presets and checks;
- ``score_cell(cell, config, seed) -> Scored``: the pure scoring step. ``cell`` is what is scored
  (``bt_hub.eval.runner.Cell``): an ``EvalRun`` when the command runs, or one row of ``eval compare`` (its
  network on the same splits). It reads every knob from ``config``, never from the cell, and does not name
  itself: the runner records the entry's name;
- optionally ``score_cells(cells, config, seed) -> [Scored]``: several cells of one ``eval compare`` column scored
  at once (the linear grids of a curve's rows in one set of heads), each what ``score_cell`` scores it;
- ``score(run) -> Scored``: the command's step (its warnings about the data, then ``score_cell``; a protocol whose
  command does more, such as the linear probe's paper loop, says so there), which
  ``bt_hub.eval.runner.run_protocol(entry, config)`` runs.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Protocol:
    """One evaluation protocol: its name (the ``bt-hub eval`` subcommand and every record's ``protocol``), the
    module holding it, its config class's name, a one-line help, and what the protocol is."""

    name: str
    module: str
    config: str
    help: str
    title: str = ""  # its name in a table's heading (default: its name)
    dataset: str = ""  # the dataset it is defined on, where not any --data (VOC2007's lists, Places-205 / iNat18)
    trains_network: bool = False  # it trains the network itself (a row without one, pixels, cannot run it)
    deterministic: bool = False  # on one network every seed scores the same (equal values are no spread)
    label_free: bool = False  # it reads no label: its value is no accuracy (RankMe)

    @property
    def heading(self) -> str:
        """Its name in a table's heading: ``kNN``, ``linear``, ``semi``."""
        return self.title or self.name

    def load(self) -> ModuleType:
        """The protocol's module (its ``score`` and ``score_cell``), imported now."""
        return importlib.import_module(self.module)

    @property
    def config_class(self) -> type:
        """The protocol's config dataclass."""
        return getattr(self.load(), self.config)


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


def list_protocols(*, any_data: bool | None = None) -> list[str]:
    """The registered protocols' names, in table order; ``any_data``: those scored on any ``--data`` (True) or on a
    dataset of their own (False)."""
    return [p.name for p in PROTOCOLS.values() if any_data is None or any_data != bool(p.dataset)]


for _protocol in (
    Protocol(
        "knn",
        "bt_hub.eval.knn",
        "KnnConfig",
        "weighted kNN on L2-normalised features (faiss on the CPU, torch on CUDA)",
        title="kNN",
        deterministic=True,
    ),
    Protocol("linear", "bt_hub.eval.linear", "LinearConfig", "linear probe on a frozen backbone (ImageNet protocol)"),
    Protocol(
        "semi",
        "bt_hub.eval.semi_supervised",
        "SemiSupervisedConfig",
        "fine-tune on 1% or 10% of the labels",
        trains_network=True,
    ),
    Protocol(
        "voc07-svm",
        "bt_hub.eval.voc07_svm",
        "Voc07SvmConfig",
        "per-class linear SVMs on VOC2007 (VISSL protocol)",
        dataset="VOC2007",
    ),
    Protocol(
        "transfer",
        "bt_hub.eval.linear",
        "TransferConfig",
        "linear transfer to Places-205 / iNat18 (PIRL settings)",
        dataset="Places-205, iNat18",
    ),
    Protocol(
        "rankme",
        "bt_hub.eval.rankme",
        "RankmeConfig",
        "RankMe: the effective rank of the features, read without labels (Garrido et al., ICML 2023)",
        title="RankMe",
        label_free=True,
    ),
):
    register_protocol(_protocol)
