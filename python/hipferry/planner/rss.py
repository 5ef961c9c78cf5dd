"""The process's resident memory and its high-water mark (Linux /proc)."""
import os
from typing import Tuple


def _status(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


def rss_bytes() -> int:
    """Resident bytes now (-1 where /proc is missing)."""
    return _status("VmRSS")


class HighWater:
    """The peak RSS growth from now: the kernel's high-water mark (VmHWM), reset by
    writing 5 to /proc/self/clear_refs, or, where that is refused, RSS sampled at
    growth() (a lower bound, said in its second value)."""

    def __init__(self):
        self.start = rss_bytes()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.by = "VmHWM (reset through /proc/self/clear_refs)"
        except OSError:
            self.by = "VmRSS after the pass (clear_refs refused: a lower bound)"
        self.pid = os.getpid()

    def growth(self) -> Tuple[int, str]:
        peak = _status("VmHWM") if self.by.startswith("VmHWM") else rss_bytes()
        return max(0, peak - self.start), self.by
