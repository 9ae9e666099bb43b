"""The one rule for reusing work: nothing finished, cached or measured is reused unless every input it came from is
the same.

bt_hub reuses work in several places: the records ``eval all`` skips, the feature cache, the decoded store, the
download cache, the measured choices of ``--precision auto`` and ``--decode auto``, and a pretraining run resumed
from its checkpoint. Each kind names its inputs once, in :data:`INPUTS`, and asks one of two questions through this
module:

- a cache that files each result under its inputs (features, stores, downloads, measurements) keys it with
  :func:`inputs_key`: a result is found only where every input is the same, and a changed input is a miss;
- a place that keeps one result and must decide whether it still stands (the record in a run folder, a checkpoint)
  asks :func:`changed_input` with the inputs recorded beside the result, and says in one line which one changed.

docs/reliability.md has the table: each reuse, its inputs, the change it sees and the one it cannot see.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from bt_hub.common.artifacts import content_key

# kind -> the inputs a result of that kind is made from, every one of which must be the same for it to be reused
INPUTS: dict[str, tuple[str, ...]] = {
    "record": ("protocol", "weights", "train split", "test split", "held-out split", "settings", "hyper-parameters"),
    "features": ("weights", "dataset", "model", "transform"),
    "decoded store": ("files", "view"),
    "download": ("url", "sha256"),
    "measurement": ("machine",),
    "checkpoint": ("recipe", "data"),  # the recipe first: a changed --seed changes a built-in set's data too
}


def _canonical(value: Any) -> Any:
    """``value`` as JSON reads it back (tuples as lists, keys as strings): a recorded input equals a live one."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def inputs_key(kind: str, inputs: Mapping[str, Any]) -> str:
    """The content key of a result of ``kind`` made from ``inputs`` (each input the kind names, and only those): a
    cache that files results under it finds one only where every input is the same."""
    return content_key(kind, {name: inputs[name] for name in INPUTS[kind]})


def changed_input(kind: str, recorded: Mapping[str, Any] | None, current: Mapping[str, Any]) -> str | None:
    """None when the inputs ``recorded`` with a kept result of ``kind`` are ``current``'s, every one of them; else
    the first that is not, in words: ``train split changed``, ``hyper-parameters changed (k)``, ``train split not
    recorded`` (a result kept by an older bt_hub). ``current`` names every input of the kind."""
    missing = [name for name in INPUTS[kind] if name not in current]
    if missing:
        raise KeyError(f"the inputs of a {kind} lack {', '.join(missing)}")
    if not isinstance(recorded, Mapping):
        return "no inputs recorded"
    for name in INPUTS[kind]:
        if name not in recorded:
            return f"{name} not recorded"
        was, now = _canonical(recorded[name]), _canonical(current[name])
        if was != now:
            both = isinstance(was, dict) and isinstance(now, dict)
            keys = sorted(k for k in {*was, *now} if was.get(k) != now.get(k)) if both else []
            return f"{name} changed" + (f" ({', '.join(keys[:3])}{', ...' * (len(keys) > 3)})" if keys else "")
    return None
