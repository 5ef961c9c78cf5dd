"""``hipferry.trace()``: a timeline of hipferry's copies and kernels, and the user's regions.

Stream work is timed by the runtime's timing events, worker and user work by
the steady clock, on one time base. The result is Chrome / Perfetto trace
JSON (open it in ui.perfetto.dev or chrome://tracing);
``hipferry.bench.timeline.write_timeline_png`` draws the same events.
"""
import contextlib
from typing import Iterator, List, Optional

from . import _C


class Trace:
    """What one ``with hipferry.trace():`` block recorded (``events`` after the block)."""

    def __init__(self, path: Optional[str]):
        self.path = path
        self.events: List[dict] = []
        self._json: Optional[str] = None

    def __enter__(self) -> "Trace":
        _C.trace_start()  # raises if a trace is already active
        return self

    def __exit__(self, *exc) -> None:
        self.events, self._json = _C.trace_stop()
        if self.path is not None:
            self.save(self.path)

    def region(self, name: str):
        """Same as :func:`trace_region`."""
        return trace_region(name)

    def save(self, path: str) -> None:
        """Writes the Chrome trace JSON of the finished block."""
        if self._json is None:
            raise RuntimeError("hipferry.trace: nothing to save yet; save() works after the with-block ends")
        with open(path, "w") as f:
            f.write(self._json)


def trace(path: Optional[str] = None) -> Trace:
    """Record every hipferry copy and kernel (stream, bytes, start, end) and the
    regions marked with :func:`trace_region` inside a with-block; writes
    Chrome trace JSON to ``path`` at the end when given. One trace at a time."""
    if path is not None and not isinstance(path, str):
        raise TypeError(f"hipferry.trace: path must be a str or None, got {type(path).__name__}")
    return Trace(path)


@contextlib.contextmanager
def trace_region(name: str, track: str = "user") -> Iterator[None]:
    """Marks a region of the caller's work on the timeline (no-op when no trace is active)."""
    if not isinstance(name, str):
        raise TypeError(f"hipferry.trace_region: name must be a str, got {type(name).__name__}")
    start = _C.trace_now_ns()
    try:
        yield
    finally:
        _C.trace_add(name, "user", track, start, _C.trace_now_ns(), 0)
