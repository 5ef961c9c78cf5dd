"""How the CPU engine moves a GPU parameter's data between the device and the
host: the one place its asynchronous copies are started and marked.

OffloadAdamW calls only these three methods for that traffic, so a test can
put a fake in their place that delays every copy to the latest moment the
device would allow and checks that nobody writes a copy's source while it
is in flight (tests/python/optim/overlap_fakes.py, DeferredCopies).
"""
from typing import Iterable, List

import torch

from ..transfer import Transfer, offload


class DeviceCopies:
    """The real copies: hipferry.offload to the host, non_blocking copies back
    on the current stream (ordered before the next forward's kernels), one
    CUDA event per device after a step's copies back."""

    def to_host(self, grad: torch.Tensor, pool) -> Transfer:
        """Starts copying `grad` to the host; `.wait()` gives the host copy.
        The caller must not write `grad` before that wait returns."""
        return offload(grad, pool=pool)

    def back(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Starts copying host `src` into the parameter `dst`. `src` must not be
        written before an event marked after this call has completed."""
        dst.copy_(src, non_blocking=True)

    def mark(self, params: Iterable[torch.Tensor]) -> List:
        """Events (with `.synchronize()`) after every copy back started so far into `params`."""
        events = []
        for device in sorted({p.device.index for p in params if p.device.type == "cuda"}):
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events.append(event)
        return events
