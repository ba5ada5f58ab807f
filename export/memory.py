"""Peak memory of one build stage, measured by the kernel.

Linux keeps a process's high-water mark of resident memory (VmHWM in /proc/self/status) and resets
it when 5 is written to /proc/self/clear_refs, so each stage gets its own exact peak without a
sampling thread. Elsewhere (or where clear_refs is not writable) the process-lifetime peak from
getrusage is reported instead, and the record says so.
"""

from __future__ import annotations

import ctypes
import gc
import resource
import sys
from pathlib import Path

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(key: str) -> int | None:
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_bytes() -> int | None:
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def release_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS, so the next stage starts lean."""
    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass


class PeakRSS:
    """`with PeakRSS() as m: ...` then m.peak_bytes (resident high-water mark inside the block) and m.exact."""

    def __init__(self) -> None:
        self.start_bytes: int | None = None
        self.peak_bytes: int | None = None
        self.exact = False

    def __enter__(self) -> "PeakRSS":
        release_memory()
        try:
            CLEAR_REFS.write_text("5")
            self.exact = _status_kib("VmHWM") is not None
        except OSError:
            self.exact = False
        self.start_bytes = rss_bytes()
        return self

    def __exit__(self, *exc) -> None:
        hwm = _status_kib("VmHWM") if self.exact else None
        if hwm is not None:
            self.peak_bytes = hwm * 1024
        else:  # lifetime peak (ru_maxrss is KiB on Linux, bytes on macOS)
            r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            self.peak_bytes = r if sys.platform == "darwin" else r * 1024
        release_memory()

    def to_dict(self) -> dict:
        return {"peak_rss_bytes": self.peak_bytes, "start_rss_bytes": self.start_bytes,
                "peak_is_per_stage": self.exact}
