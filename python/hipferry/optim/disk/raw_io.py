"""The disk's raw sequential speed through the optimizer's own I/O queue
(``_C.DiskIo.raw_pass``: the same depth and request size over a page-aligned
window, no compute). Used by the planner's measurements and by `bench disk`.
A write is timed with its flush, as a step's is."""
import time

import torch

DEPTH, REQUEST = 32, 1 << 20


class RawIo:
    """One file of `nbytes` in a folder, written and read whole."""

    def __init__(self, path: str, nbytes: int, backend: str = "auto"):
        from ... import _C
        from ...pool import default_pool
        self.io = _C.DiskIo(backend, DEPTH, REQUEST)
        self.file = self.io.open(path, True)
        self.io.reserve(self.file, nbytes)
        self.nbytes = nbytes
        self.window = default_pool().empty(DEPTH * REQUEST, dtype=torch.uint8, alignment=4096)
        self.window.fill_(0x5A)
        self.direct = self.io.file_info(self.file)[1]

    def timed(self, op: str) -> float:
        """Seconds to read or write (and flush) the whole file."""
        t0 = time.perf_counter()
        self.io.raw_pass(op, self.file, self.nbytes, self.window)
        if op == "write":
            self.io.sync(self.file)
        return time.perf_counter() - t0

    def flush_seconds(self) -> float:
        """One request written and flushed: what a step's journal and syncs cost at least."""
        t0 = time.perf_counter()
        self.io.raw_pass("write", self.file, REQUEST, self.window)
        self.io.sync(self.file)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.io.close()
