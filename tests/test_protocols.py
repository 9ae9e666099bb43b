"""The protocol table (bt_hub.eval.protocols): one registration makes a protocol a ``bt-hub eval`` command, an
``evaluate(protocol=...)`` choice, a run of ``eval all`` and a column of ``eval compare``; the test that holds
each protocol to the field's reference code exists."""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from bt_hub import cli
from bt_hub.eval import evaluate
from bt_hub.eval.config import EvalConfig
from bt_hub.eval.protocols import PROTOCOLS, Protocol, get_protocol, list_protocols, register_protocol
from bt_hub.eval.runner import Cell, Scored

# the test of tests/test_against_reference.py that holds each protocol to the field's reference code
CONTRACTS = {
    "knn": "test_knn_equals_dinos_knn_classifier_at_k_20_and_200",
    "linear": "test_the_linear_probe_loop_trains_evaluate_pys_first_epoch",
    "voc07-svm": "test_voc07_svms_choose_vissls_cost_per_class_and_score_its_test_ap",
    "rankme": "test_rankme_equals_a_float64_numpy_computation_on_the_same_features",
}

SMALL = ["--data", "synthetic:40", "--image-size", "8", "--precision", "fp32"]


@dataclass
class CentroidConfig(EvalConfig):
    """A toy protocol: the test features vote for the nearest class centroid of the training features."""

    normalise: bool = field(default=True, metadata={"help": "L2-normalise the features first"})


def score_cell(cell: Cell, config: CentroidConfig, seed: int) -> Scored:
    """Nearest-centroid accuracy of ``cell``'s test features."""
    (train_x, train_y), (test_x, test_y) = cell.features("train"), cell.features("test")
    train_x, test_x = torch.as_tensor(train_x).float(), torch.as_tensor(test_x).float()
    if config.normalise:
        train_x, test_x = (torch.nn.functional.normalize(x, dim=1) for x in (train_x, test_x))
    centroids = torch.stack([train_x[train_y == c].mean(0) for c in range(len(cell.splits.classes))])
    predicted = torch.cdist(test_x, centroids).argmin(1)
    return Scored({"top1": 100.0 * float((predicted == test_y).float().mean())}, mode="features")


def score(run) -> Scored:
    """The command's step: :func:`score_cell` of the run's weights."""
    return score_cell(run, run.config, run.config.seed)


@pytest.fixture
def centroid():
    """The toy protocol, registered for one test (this module holds it)."""
    yield register_protocol(Protocol("centroid", __name__, "CentroidConfig", "nearest class centroid (a toy)"))
    del PROTOCOLS["centroid"]


def test_a_registered_protocol_is_a_cli_command_an_api_choice_a_suite_run_and_a_compare_column(
    centroid, small_stem_weights, tmp_path, capsys
):
    weights = ["--weights", str(small_stem_weights)]
    assert "centroid" in list_protocols(any_data=True)
    assert cli.main(["eval", "--help"]) == 0 and "centroid" in capsys.readouterr().out
    assert cli.main(["eval", "centroid", *weights, *SMALL, "--no-normalise", "--out", str(tmp_path / "c")]) == 0
    record = json.loads((tmp_path / "c" / "results.json").read_text())
    assert record["protocol"] == "centroid" and record["hyperparameters"]["normalise"] is False
    api = evaluate(small_stem_weights, "synthetic:40", "centroid", image_size=8, precision="fp32", normalise=False)
    assert api.records[0]["metrics"] == record["metrics"]

    suite = ["eval", "all", *weights, *SMALL, "--fractions", "--linear-epochs", "2", "--out", str(tmp_path / "all")]
    assert cli.main(suite) == 0
    records = json.loads((tmp_path / "all" / "results.json").read_text())["results"]
    assert [r["protocol"] for r in records] == ["knn", "linear", "rankme", "centroid"]
    assert (tmp_path / "all" / "centroid" / "results.json").is_file()
    normalised = evaluate(small_stem_weights, "synthetic:40", "centroid", image_size=8, precision="fp32")
    assert records[3]["metrics"] == normalised.records[0]["metrics"]

    compare = ["eval", "compare", *weights, *SMALL, "--protocols", "centroid,knn", "--baselines", "pixels"]
    assert cli.main([*compare, "--seeds", "1", "--out", str(tmp_path / "cmp")]) == 0
    summary = json.loads((tmp_path / "cmp" / "results.json").read_text())
    assert list(summary["table"]["pixels"]) == ["RankMe", "centroid", "kNN"]  # RankMe beside the frozen columns
    assert list(summary["verdicts"][small_stem_weights.name]) == ["centroid", "kNN"]  # a verdict per accuracy column
    cells = [r for r in summary["results"] if r["protocol"] == "centroid"]
    assert [c["notes"]["compare"]["row"] for c in cells] == [small_stem_weights.name, "pixels"]
    assert cells[0]["metrics"] == record["metrics"]  # a compare cell is the protocol's own run


def test_the_table_refuses_a_second_protocol_of_the_same_name_and_the_commands_own_names(centroid):
    with pytest.raises(ValueError, match="'knn' is registered already, by bt_hub.eval.knn"):
        register_protocol(Protocol("knn", __name__, "CentroidConfig", "a second knn"))
    with pytest.raises(ValueError, match="'compare' is a bt-hub eval command of its own"):
        register_protocol(Protocol("compare", __name__, "CentroidConfig", "a protocol named compare"))
    with pytest.raises(
        ValueError, match="protocol must be one of knn, linear, semi, voc07-svm, transfer, rankme, centroid"
    ):
        get_protocol("nope")


def test_every_contract_names_a_test_of_test_against_reference():
    tree = ast.parse((Path(__file__).parent / "test_against_reference.py").read_text())
    tests = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert set(CONTRACTS) <= set(PROTOCOLS)
    for name in CONTRACTS.values():
        assert name in tests, name


def test_every_protocol_module_provides_what_the_table_reads():
    for protocol in PROTOCOLS.values():
        module = protocol.load()
        assert callable(module.score), protocol.name
        assert issubclass(protocol.config_class, EvalConfig), protocol.name
        if not protocol.dataset:  # eval compare's columns
            assert callable(module.score_cell), protocol.name
