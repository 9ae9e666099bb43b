"""The machine a benchmark ran on, printed beside its numbers (the benchmarks import it as ``machine``).

CPUs differ between machines in the vector instructions that decide bf16 and float32 speed
(AVX2 only, AVX-512, avx512_bf16, AMX), so a table without them cannot be compared with another.
"""

from __future__ import annotations

import subprocess


def cpu() -> str:
    """The CPU model and its vector-instruction flags (avx*, amx*, fma, sse4*) from ``lscpu``."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "lscpu unavailable"
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    flags = [f for f in fields.get("Flags", "").split() if f.startswith(("avx", "amx", "fma", "sse4"))]
    return f"{fields.get('Model name', '?').strip()}; flags: {' '.join(flags)}"
