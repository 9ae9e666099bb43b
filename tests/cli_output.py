"""Reading what ``bt-hub`` printed on stderr: progress lines (off a terminal) apart from messages."""

from __future__ import annotations

import re

# bt_hub.common.progress.LineProgress: "<desc>: <n>/<total> <unit> (<p>%), <rate> <unit>/s, <t> s[, key=value ...]"
PROGRESS_LINE = re.compile(r"^[\w .-]+: \d+/\d+ \w+( \(\d+%\))?, ")
# bt_hub.data.store's announcement before it decodes a folder: what a long step is about to do, not a message
STORE_LINE = re.compile(r"^decoding \d+ images once into a store ")
# bt_hub.data.measured's, before a measured choice is timed (the first run on a machine): likewise
MEASURE_LINE = re.compile(r"^timing .+ once\b.*; kept in \w+\.json\)$")


def messages(err: str) -> list[str]:
    """The non-empty stderr lines that are not progress lines (nor the announcement of a decoded store or of a
    measurement)."""
    skipped = (PROGRESS_LINE, STORE_LINE, MEASURE_LINE)
    return [line for line in err.splitlines() if line.strip() and not any(p.match(line) for p in skipped)]


def one_sentence(err: str) -> str:
    """The single message line of ``err``; fails the test when there are more or none."""
    lines = messages(err)
    assert len(lines) == 1, f"expected one sentence, got: {lines}"
    return lines[0]
