"""The one reuse rule (bt_hub.common.reuse): a result is reused only where every input it came from is the same."""

from __future__ import annotations

import pytest

from bt_hub.common.reuse import INPUTS, changed_input, inputs_key

FEATURES = {"weights": "ab12", "dataset": "cd34", "model": "resnet18", "transform": {"size": 8, "pool": "avg"}}


def test_the_same_inputs_are_reused_as_json_reads_them_back():
    recorded = {**FEATURES, "transform": {"pool": "avg", "size": 8}}
    assert changed_input("features", recorded, FEATURES) is None
    assert changed_input("measurement", {"machine": ["cpu", 1]}, {"machine": ("cpu", 1)}) is None


def test_a_refused_reuse_names_the_first_input_that_changed_and_the_keys_inside_it():
    assert changed_input("features", {**FEATURES, "dataset": "ef56"}, FEATURES) == "dataset changed"
    moved = {**FEATURES, "transform": {"size": 16, "pool": "avg"}}
    assert changed_input("features", moved, FEATURES) == "transform changed (size)"


def test_a_result_kept_without_its_inputs_is_not_reused():
    # guards: a record of an older bt_hub without split fingerprints was taken for one of the same data
    assert changed_input("features", None, FEATURES) == "no inputs recorded"
    assert changed_input("features", {k: v for k, v in FEATURES.items() if k != "model"}, FEATURES) == (
        "model not recorded"
    )


def test_every_input_of_the_kind_must_be_named_by_the_asker():
    with pytest.raises(KeyError, match="lack model"):
        changed_input("features", FEATURES, {k: v for k, v in FEATURES.items() if k != "model"})


def test_the_key_of_a_cache_changes_with_each_input_and_with_nothing_else():
    key = inputs_key("features", FEATURES)
    assert inputs_key("features", {**FEATURES, "unrelated": 1}) == key
    assert len({inputs_key("features", {**FEATURES, name: "other"}) for name in INPUTS["features"]} | {key}) == 5
