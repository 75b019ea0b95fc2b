"""How much memory this test process takes: the kernel's own figures for it, not Python's.

``PeakRss()`` resets the process's peak resident set (``VmHWM``, by writing 5 to
``/proc/self/clear_refs``) and ``grew`` is how far the peak rose above the resident set at
that moment: what a test measures of memory that is gone again by the time it looks (a
buffer joined and dropped inside one call).
"""

from __future__ import annotations

import gc
from pathlib import Path


def status(field: str) -> int:
    """``VmRSS``, ``VmHWM``...: bytes, from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise LookupError(f"no {field} in /proc/self/status")


class PeakRss:
    def __init__(self) -> None:
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")
        self.start = status("VmRSS")

    @property
    def grew(self) -> int:
        return status("VmHWM") - self.start

    def mib(self) -> str:
        return f"{self.grew / 2**20:.1f} MiB"
