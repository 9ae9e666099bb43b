"""bt_hub.common.progress: a bar on a terminal, a log line every N percent elsewhere (CI, Slurm)."""

from __future__ import annotations

import io

from tqdm import tqdm

from bt_hub.common.progress import note, progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_progress_is_a_line_every_ten_percent_and_at_the_end():
    stream = io.StringIO()
    assert list(progress(range(20), "features train", unit="batch", stream=stream)) == list(range(20))
    lines = stream.getvalue().splitlines()
    assert [line.split("(")[1].split("%")[0] for line in lines] == [str(p) for p in range(10, 101, 10)]
    assert lines[0].startswith("features train: 2/20 batch (10%), ") and "ETA" in lines[0] and "ETA" not in lines[-1]


def test_uneven_totals_report_each_crossed_step_once(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setenv("BT_HUB_PROGRESS_EVERY", "25")
    list(progress(range(3), "linear (cached)", unit="epoch", stream=stream))
    assert [line.split("(")[2].split("%")[0] for line in stream.getvalue().splitlines()] == ["33", "67", "100"]


def test_the_interval_comes_from_the_environment_and_zero_silences(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setenv("BT_HUB_PROGRESS_EVERY", "50")
    list(progress(range(4), "x", stream=stream))
    assert len(stream.getvalue().splitlines()) == 2
    monkeypatch.setenv("BT_HUB_PROGRESS_EVERY", "0")
    stream = io.StringIO()
    list(progress(range(4), "x", stream=stream))
    assert stream.getvalue() == ""


def test_without_a_length_lines_come_after_powers_of_two_and_at_the_end():
    stream = io.StringIO()
    list(progress(iter(range(9)), "stream", stream=stream))
    assert [line.split(": ")[1].split(" ")[0] for line in stream.getvalue().splitlines()] == ["1", "2", "4", "8", "9"]


def test_on_a_terminal_it_is_a_tqdm_bar_named_by_desc():
    bar = progress(range(3), "features test", stream=Terminal())
    assert isinstance(bar, tqdm) and bar.desc == "features test"
    assert list(bar) == [0, 1, 2]


def test_a_note_says_what_comes_next_before_a_long_step_and_a_silent_bar_says_nothing(monkeypatch):
    """Guards: compare showed "features train: 1/1 batch (100%)" and then nothing for the minutes its grid took."""
    stream = io.StringIO()
    bar = progress(None, "compare", total=4, unit="cell", stream=stream)
    note(bar, "next: the linear grid probe (18 heads x 100 epochs) of pixels, seed 0")
    assert stream.getvalue() == "compare: next: the linear grid probe (18 heads x 100 epochs) of pixels, seed 0\n"
    monkeypatch.setenv("BT_HUB_PROGRESS_EVERY", "0")
    silent = io.StringIO()
    note(progress(None, "compare", total=4, stream=silent), "next: anything")
    assert silent.getvalue() == ""
