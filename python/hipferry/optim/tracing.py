"""The optimizer's work on hipferry.trace()'s timeline: its CPU steps, its
worker's jobs and its copies back, each a span on a track of its own. When
no trace is active a span costs one call (_C.trace_active)."""
from .. import _C

TRACK_STEP = "OffloadAdamW step"
TRACK_WORKER = "OffloadAdamW worker"
TRACK_COPIES_BACK = "OffloadAdamW copies back"


class span:
    """A span named `what` and the shape of `tensor` (or `what` alone), counting `tensor`'s bytes
    (or `nbytes`). The name and the bytes are worked out only while a trace records: a span
    wraps every parameter's step."""
    __slots__ = ("what", "track", "tensor", "nbytes", "start")

    def __init__(self, what: str, track: str, tensor=None, nbytes: int = 0):
        self.what, self.track, self.tensor, self.nbytes, self.start = what, track, tensor, nbytes, None

    def __enter__(self) -> "span":
        if _C.trace_active():
            self.start = _C.trace_now_ns()
        return self

    def __exit__(self, *exc) -> bool:
        if self.start is not None:
            t = self.tensor
            name = self.what if t is None else f"{self.what} {tuple(t.shape)}"
            _C.trace_add(name, "optim", self.track, self.start, _C.trace_now_ns(),
                         self.nbytes if t is None else t.nbytes)
        return False
