"""``--compile auto``: compile a long run's step where it pays, else stay eager (docs/performance.md)."""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from bt_hub.common.distributed import broadcast_object
from bt_hub.data.measured import cpu_flags

SAVED_FRACTION = 0.25
COMPILE_SECONDS = {"cuda": 120.0, "cpu": 300.0}
TIMED_STEPS = 4  # eager steps timed before deciding; the first step (warming caches) is not among them


def compile_pays(steps_left: int, step_seconds: float, device_type: str) -> tuple[bool, str]:
    """Whether compiling repays itself over ``steps_left`` eager steps of ``step_seconds``; the reason in words."""
    if device_type == "cpu" and "amx_bf16" not in cpu_flags():
        return False, "auto: a CPU without AMX, where the compiled step measured slower than eager"
    cost = COMPILE_SECONDS.get(device_type, COMPILE_SECONDS["cpu"])
    saved = steps_left * step_seconds * SAVED_FRACTION
    verdict = ">" if saved > cost else "<="
    return saved > cost, (
        f"auto: {steps_left} steps left x {step_seconds:.3g} s/step eager, {SAVED_FRACTION:.0%} saved = "
        f"{saved:.0f} s {verdict} ~{cost:.0f} s to compile on {device_type}"
    )


class AutoCompile:
    """Calls the training step eagerly or compiled, per ``--compile auto|on|off``, counting down the planned steps."""

    def __init__(self, step: Callable[..., Any], mode: str, planned_steps: int, device: torch.device) -> None:
        self.step, self.compiled, self.device_type = step, None, device.type
        self.steps_left, self.stamps = planned_steps, []
        self.deciding = False
        if mode in ("on", "off"):
            self._choose(mode == "on", f"--compile {mode}")
        elif planned_steps <= TIMED_STEPS + 2:
            self._choose(False, f"auto: {planned_steps} steps planned")
        else:
            self.deciding = True
            self._choose(False, "auto: the run ended before the decision")

    def __call__(self, *args: Any) -> Any:
        if self.deciding:
            self._time(time.perf_counter())
        self.steps_left -= 1
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except Exception as err:  # Dynamo and Inductor fail with many types; a real error recurs eagerly below
                first_line = (str(err).strip().splitlines() or [""])[0][:200]
                self._choose(False, f"torch.compile failed ({type(err).__name__}: {first_line}); eager instead")
                warnings.warn(self.record["compile_reason"], RuntimeWarning, stacklevel=2)
        return self.step(*args)

    def _time(self, now: float) -> None:
        """Stamp this call; after TIMED_STEPS whole steps past the first, decide (rank 0 for every rank)."""
        self.stamps.append(now)
        if len(self.stamps) == TIMED_STEPS + 2:
            self.deciding = False
            seconds = statistics.median(b - a for a, b in zip(self.stamps[1:], self.stamps[2:]))
            self._choose(*broadcast_object(compile_pays(self.steps_left, seconds, self.device_type)))

    def _choose(self, compiled: bool, reason: str) -> None:
        """Compile the step (``compiled``) or call it eagerly from now on; ``record`` says which and why."""
        self.compiled = torch.compile(self.step) if compiled else None
        self.record = {"compile": "on" if compiled else "off", "compile_reason": reason}
