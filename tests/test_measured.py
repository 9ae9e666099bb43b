"""The cache of measured choices (``--precision auto``, ``--decode auto``): read as untrusted input, written whole
under a lock, and never the source of an absolute path in a record (issue 46, cases 5 and 12)."""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from bt_hub.common.reuse import inputs_key
from bt_hub.data import decode_auto, measured, precision
from bt_hub.data.decode import Decoding
from bt_hub.data.measured import MeasurementWarning

TIMES = {"fp32": 0.5, "bf16": 0.25}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """The measured choices' folder of this test (what ``TORCH_HOME`` moves)."""
    folder = tmp_path / "cache"
    monkeypatch.setattr(measured, "cache_file", lambda name: folder / name)
    return folder


def _entry(machine: str, value: object) -> dict:
    """A cache file's content holding ``value`` as the measurement of ``machine``, filed as bt_hub files it."""
    return {inputs_key("measurement", {"machine": machine}): {"machine": machine, "measured": value}}


def _precision_machine() -> str:
    return f"{measured.cpu_model()} | torch {torch.__version__}"


def test_a_measurement_is_kept_readable_under_its_machine_and_read_back_without_measuring(cache, capsys):
    # guards: the cache was read without a lock and filed under the machine key itself, checked by nothing
    chosen = precision.cpu_choice(lambda: TIMES)
    assert chosen["precision"] == "bf16" and chosen["precision_reason"].endswith("(measured now)")
    said = capsys.readouterr().err
    assert (
        said.startswith("timing bf16 against fp32 on this CPU once (12 steps of a ResNet-18")
        and "precision_auto" in said
    )
    assert json.loads((cache / "precision_auto.json").read_text()) == _entry(_precision_machine(), TIMES)
    assert sorted(p.name for p in cache.iterdir()) == ["precision_auto.json"]  # no lock or temp file left
    again = precision.cpu_choice(lambda: pytest.fail("measured again"))
    assert again["precision_reason"].endswith("(cached in precision_auto.json)") and capsys.readouterr().err == ""


@pytest.mark.parametrize("bad", [0, 0.0, -1, float("nan"), float("inf"), "0.5", True, None, [0.5]])
def test_a_timing_that_is_not_a_positive_finite_number_is_measured_again_with_one_warning(cache, bad):
    # guards: a zero timing divided by zero ("this is a bug"); -1 and NaN went into records as "-1 images/s with pil"
    cache.mkdir()
    (cache / "precision_auto.json").write_text(json.dumps(_entry(_precision_machine(), {"fp32": 0.5, "bf16": bad})))
    with pytest.warns(MeasurementWarning) as warned:
        chosen = precision.cpu_choice(lambda: TIMES)
    assert len(warned) == 1 and str(cache / "precision_auto.json") in str(warned[0].message)
    assert "s for bf16, not a positive finite number" in str(warned[0].message)
    assert (chosen["precision_bf16_s"], chosen["precision_reason"][-14:]) == (0.25, "(measured now)")
    assert json.loads((cache / "precision_auto.json").read_text()) == _entry(_precision_machine(), TIMES)


@pytest.mark.parametrize(
    ("content", "named"),
    [
        ("[" * 100_000 + "]" * 100_000, "nests its JSON deeper"),
        ('{"a": ', "is not JSON"),
        ("[1, 2]", "does not hold a JSON object"),
        (b"\xff\xfe\x00", "cannot be read"),
    ],
)
def test_a_cache_file_that_cannot_be_parsed_is_no_measurement(cache, content, named):
    # guards: a deeply nested precision_auto.json made every run on the machine refuse with "maximum recursion depth
    # exceeded", naming no file
    cache.mkdir()
    path = cache / "precision_auto.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.warns(MeasurementWarning, match=named) as warned:
        assert precision.cpu_choice(lambda: TIMES)["precision"] == "bf16"
    assert len(warned) == 1 and str(path) in str(warned[0].message)
    assert json.loads(path.read_text()) == _entry(_precision_machine(), TIMES)


def test_an_entry_filed_under_this_machine_but_of_another_is_measured_again(cache):
    cache.mkdir()
    found = _entry(_precision_machine(), TIMES)
    next(iter(found.values()))["machine"] = "Another CPU | torch 0.1"
    (cache / "precision_auto.json").write_text(json.dumps(found))
    with pytest.warns(MeasurementWarning, match="not of this machine"):
        assert precision.cpu_choice(lambda: {"fp32": 0.25, "bf16": 0.5})["precision"] == "fp32"


def test_an_unwritable_cache_measures_without_keeping_and_no_absolute_path_reaches_the_reason(tmp_path, monkeypatch):
    # guards: where the cache could not be written, decode_from and precision_from carried its absolute path
    (tmp_path / "torch").write_text("a file where the cache's folder would be")
    monkeypatch.setattr(measured, "cache_file", lambda name: tmp_path / "torch" / "hub" / name)
    with pytest.warns(MeasurementWarning, match="cannot be written") as warned:
        chosen = precision.cpu_choice(lambda: TIMES)
    assert len(warned) == 1 and str(tmp_path) in str(warned[0].message)  # the warning names it; the record does not
    assert chosen["precision_reason"].endswith("(measured now, not cached (precision_auto.json is not writable))")
    assert str(tmp_path) not in json.dumps(chosen)


def test_two_processes_measuring_at_once_measure_once(cache):
    # guards: the cache took no lock: two runs starting together both measured and the last writer won
    calls, started, results = [], threading.Event(), []

    def slow():
        calls.append(1)
        started.set()
        time.sleep(0.5)  # lets the second caller reach the cache while this one measures (no assert on time)
        return TIMES

    first = threading.Thread(target=lambda: results.append(precision.cpu_choice(slow)))
    first.start()
    started.wait()
    results.append(precision.cpu_choice(slow))
    first.join()
    assert len(calls) == 1
    assert sorted(r["precision_reason"].rsplit("(", 1)[1] for r in results) == [
        "cached in precision_auto.json)",
        "measured now)",
    ]


def _jpeg_data(root: Path) -> Path:
    from conftest import make_image_folder

    return make_image_folder(root, per_class=3, size=24, jpeg=True, suffix=".jpg", splits=("train",))


def _decode_cache(cache: Path, data: Path, value: object) -> None:
    """``decode_auto.json`` holding ``value`` as this machine's measurement for ``data``'s JPEGs."""
    key = decode_auto._machine(torch.device("cpu"), decode_auto.jpeg_sample(data))[0]
    cache.mkdir(exist_ok=True)
    (cache / "decode_auto.json").write_text(json.dumps(_entry(key, value)))


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ({"seconds": {"pil": 0}, "agreement": {}}, "0 s for pil"),
        ({"seconds": {"pil": -1.0}, "agreement": {}}, "-1.0 s for pil"),
        ({"seconds": {"pil": float("nan")}, "agreement": {}}, "nan s for pil"),
        (
            {"seconds": {"pil": 1e-3, "torchvision": 1e-4}, "agreement": {"torchvision": {"max": 0, "mean": 0}}},
            "torchvision",
        ),
        ({"seconds": {"pil": 1e-3, "nvimgcodec": 1e-4}, "agreement": {}}, "pixel check"),
        ({"seconds": {"pil": 1e-3, "nvimgcodec": 1e-4}, "agreement": {"nvimgcodec": {"max": -3, "mean": 0}}}, "levels"),
        ({"pil": 1e-3}, "no timings"),
    ],
)
def test_a_hostile_decode_cache_never_stops_a_run_nor_reaches_the_record(cache, tmp_path, value, named):
    # guards: a zero timing in decode_auto.json ended in ZeroDivisionError; a negative or NaN one was recorded
    data = _jpeg_data(tmp_path / "data")
    _decode_cache(cache, data, value)
    with pytest.warns(MeasurementWarning, match=named):
        chosen = decode_auto.decode_choice("auto", "cpu", data, 2)
    assert chosen.decode in ("pil", "nvimgcodec") and chosen.decoding.device is None
    speeds = r"[\d,]+ images/s with \w+"
    assert re.fullmatch(
        rf"auto: a loader worker decoded ~24x24 JPEGs at {speeds}(, {speeds})* on .+ \(measured now\)", chosen.reason
    )


def test_a_cache_claiming_a_decoder_that_is_not_installed_is_measured_again(cache, tmp_path, monkeypatch):
    # guards: such a cache ended in an error about --decode nvimgcodec, a flag that was not given
    data = _jpeg_data(tmp_path / "data")
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", None)  # as if it were not installed
    claim = {"seconds": {"pil": 1e-3, "nvimgcodec": 1e-5}, "agreement": {"nvimgcodec": {"max": 0, "mean": 0.0}}}
    _decode_cache(cache, data, claim)
    with pytest.warns(MeasurementWarning, match="holds a timing of nvimgcodec, which is not installed"):
        chosen = decode_auto.decode_choice("auto", "cpu", data, 2)
    assert (chosen.decode, chosen.decoding, chosen.agreement) == ("pil", Decoding(), {})


def test_pretrain_refuses_a_batch_past_the_data_before_measuring_anything(tmp_path, monkeypatch):
    # guards (case 12): on an empty cache, --precision auto timed the CPU for 48 s before --batch-size was refused
    from bt_hub import cli

    monkeypatch.setattr(measured, "cache_file", lambda name: tmp_path / "cache" / name)
    monkeypatch.setattr(precision, "measure_cpu", lambda: pytest.fail("measured before the input was checked"))
    argv = ["pretrain", "--preset", "digits", "--batch-size", "100000", "--out", str(tmp_path / "run")]
    assert cli.main(argv) == 2
    assert not (tmp_path / "cache").exists()
