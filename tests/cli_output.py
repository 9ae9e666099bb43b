"""Reading what ``bt-hub`` printed on stderr: progress lines (off a terminal) apart from messages."""

from __future__ import annotations

import re

# bt_hub.common.progress.LineProgress: "<desc>: <n>/<total> <unit> (<p>%), <rate> <unit>/s, <t> s[, key=value ...]"
PROGRESS_LINE = re.compile(r"^[\w .-]+: \d+/\d+ \w+( \(\d+%\))?, ")


def messages(err: str) -> list[str]:
    """The non-empty stderr lines that are not progress lines."""
    return [line for line in err.splitlines() if line.strip() and not PROGRESS_LINE.match(line)]


def one_sentence(err: str) -> str:
    """The single message line of ``err``; fails the test when there are more or none."""
    lines = messages(err)
    assert len(lines) == 1, f"expected one sentence, got: {lines}"
    return lines[0]
