"""The optimizer's work on hipferry.trace()'s timeline: its CPU steps, its
worker's jobs and its copies back, each a span on a track of its own. When
no trace is active a span costs one call (_C.trace_active)."""
from .. import _C

TRACK_STEP = "OffloadAdamW step"
TRACK_WORKER = "OffloadAdamW worker"
TRACK_COPIES_BACK = "OffloadAdamW copies back"


class span:
    __slots__ = ("name", "track", "nbytes", "start")

    def __init__(self, name: str, track: str, nbytes: int = 0):
        self.name, self.track, self.nbytes, self.start = name, track, nbytes, None

    def __enter__(self) -> "span":
        if _C.trace_active():
            self.start = _C.trace_now_ns()
        return self

    def __exit__(self, *exc) -> bool:
        if self.start is not None:
            _C.trace_add(self.name, "optim", self.track, self.start, _C.trace_now_ns(), self.nbytes)
        return False
