"""``--compile auto``: short runs stay eager, long ones compile, a failed compile runs eagerly and says so.

``torch.compile`` is replaced by a stand-in and the clock by a counter: nothing here compiles.
"""

from __future__ import annotations

import pytest
import torch

from bt_hub.train import compile_auto
from bt_hub.train.compile_auto import TIMED_STEPS, AutoCompile, compile_pays

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def amx(monkeypatch):
    """An AMX CPU, where compiling measured faster (the rule's CPU case); a test may set other flags."""
    flags = {"amx_bf16", "avx512_bf16"}
    monkeypatch.setattr(compile_auto, "cpu_flags", lambda: frozenset(flags))
    return flags


@pytest.fixture
def fake_compile(monkeypatch):
    """``torch.compile`` -> a stand-in that tags results ``compiled`` (or raises, when ``fail`` is set)."""
    calls = {"compiled": 0, "fail": False}

    def compile_(fn):
        def compiled(*args):
            if calls["fail"]:
                raise RuntimeError("Inductor could not build a kernel\nmore lines")
            calls["compiled"] += 1
            return ("compiled", fn(*args)[1])

        return compiled

    monkeypatch.setattr(compile_auto.torch, "compile", compile_)
    return calls


def _step(x):
    return ("eager", x)


def _run(wrapper, steps, seconds_per_step, monkeypatch):
    clock = iter(range(0, 10**6, seconds_per_step))
    monkeypatch.setattr(compile_auto.time, "perf_counter", lambda: next(clock))
    return [wrapper(k)[0] for k in range(steps)]


def test_compile_pays_only_when_the_steps_left_save_more_than_compiling_costs():
    assert compile_pays(10_000, 1.0, "cpu")[0] and compile_pays(10_000, 0.1, "cuda")[0]
    assert not compile_pays(100, 1.0, "cpu")[0] and not compile_pays(1000, 0.1, "cuda")[0]
    assert "100 steps left" in compile_pays(100, 1.0, "cpu")[1]


def test_a_cpu_without_amx_stays_eager_however_long_the_run(amx):
    # guards: auto compiled on an AMD EPYC with avx512_bf16, where the compiled step took 6.45 s against 4.68 eager
    amx.discard("amx_bf16")
    pays, reason = compile_pays(10**6, 10.0, "cpu")
    assert not pays and "without AMX" in reason
    assert compile_pays(10_000, 0.1, "cuda")[0]  # GPUs are not affected


def test_a_long_run_compiles_after_timing_its_first_eager_steps(fake_compile, monkeypatch):
    wrapper = AutoCompile(_step, "auto", 5000, CPU)
    paths = _run(wrapper, 20, 2, monkeypatch)  # 2 s per eager step: 4,990 steps left save 2,495 s > 300 s
    assert paths[: TIMED_STEPS + 1] == ["eager"] * (TIMED_STEPS + 1) and set(paths[TIMED_STEPS + 1 :]) == {"compiled"}
    assert wrapper.record["compile"] == "on" and "2 s/step" in wrapper.record["compile_reason"]


@pytest.mark.parametrize(("planned", "seconds"), [(5, 100), (1000, 1)])
def test_a_short_or_fast_run_stays_eager_and_says_why(fake_compile, monkeypatch, planned, seconds):
    wrapper = AutoCompile(_step, "auto", planned, CPU)
    assert set(_run(wrapper, planned, seconds, monkeypatch)) == {"eager"} and fake_compile["compiled"] == 0
    assert wrapper.record["compile"] == "off" and wrapper.record["compile_reason"].startswith("auto: ")


def test_on_and_off_are_obeyed_from_the_first_step(fake_compile, monkeypatch):
    assert set(_run(AutoCompile(_step, "on", 3, CPU), 3, 1, monkeypatch)) == {"compiled"}
    off = AutoCompile(_step, "off", 10**6, CPU)
    assert set(_run(off, 10, 100, monkeypatch)) == {"eager"} and off.record["compile"] == "off"


def test_a_failed_compile_runs_the_step_eagerly_with_one_warning_and_records_it(fake_compile, monkeypatch):
    fake_compile["fail"] = True
    wrapper = AutoCompile(_step, "on", 10, CPU)
    with pytest.warns(RuntimeWarning, match="torch.compile failed") as caught:
        assert _run(wrapper, 3, 1, monkeypatch) == ["eager"] * 3
    assert len(caught) == 1
    assert wrapper.record["compile"] == "off"
    assert "RuntimeError: Inductor could not build a kernel" in wrapper.record["compile_reason"]
