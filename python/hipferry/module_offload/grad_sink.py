"""Weight gradients of offloaded blocks: copied device->host as backward
produces them, accumulated into the host parameters' ``.grad`` at its end.

* One entry per backward (graph task): reentrant activation checkpointing
  runs a nested backward inside the outer one, and each accumulates its own
  gradients when it ends, as autograd's AccumulateGrad would.
* Per parameter the gradients of one backward are summed in arrival order,
  then added to ``.grad`` once -- AccumulateGrad's order, so the result is
  bit-identical to the model without offload.
* Device memory: a copy holds its device gradient until it completes, so
  completed copies are settled as new ones start, and more than
  ``max_in_flight`` bytes in flight makes backward wait for the oldest: the
  copy scheduler's bound (hipferry._C.InFlightWindow, Note [copy scheduler])
  decides when; settling hands the host result over.
* A backward that raised never runs its callback; what it left is dropped
  at the next forward of the model (unwaited transfers are safe to drop).
"""
import threading
from functools import partial
from typing import Any, Callable, Dict, List, Tuple

import torch

from .. import _C
from ..pool import PinnedPool
from ..torch_private import current_graph_task_id, post_accumulate_grad_hooks, queue_end_of_backward
from ..transfer import Transfer, offload


class GradSink:
    def __init__(self, pool: PinnedPool, max_in_flight: int, after_flush: Callable[[], None]):
        self.pool = pool
        self.max_in_flight = max_in_flight
        self.after_flush = after_flush
        # graph task id -> {id(param): (entry, [Transfer or host tensor, ...])}
        self.pending: Dict[int, Dict[int, Tuple[Any, List[Any]]]] = {}
        self.window = _C.InFlightWindow(max_in_flight)  # the copies in flight, oldest first
        self._dropped_peak = 0  # peak of windows dropped with stale backwards
        self.bytes_moved = 0
        self.lock = threading.Lock()  # two GPUs: two autograd device threads

    @property
    def in_flight_bytes(self) -> int:
        return self.window.bytes

    @property
    def peak_in_flight_bytes(self) -> int:
        return max(self._dropped_peak, self.window.peak_bytes)

    def add(self, entry, grad: torch.Tensor) -> None:
        task = current_graph_task_id()
        with self.lock:
            by_param = self.pending.get(task)
            if by_param is None:
                by_param = self.pending[task] = {}
                queue_end_of_backward(partial(self.flush, task))
            dtype = entry.host_dtype if entry.host_dtype != grad.dtype else None
            nbytes = grad.numel() * grad.element_size()
            self.window.admit(nbytes)  # completed copies settled; the oldest waited for while over the bound
            items = by_param.setdefault(id(entry.param), (entry, []))[1]
            t = offload(grad, dtype=dtype, pool=self.pool)
            items.append(t)
            self.window.add(t.native, nbytes, partial(_hand_over, items, len(items) - 1))
            self.bytes_moved += grad.numel() * entry.host_dtype.itemsize

    def flush(self, task: int) -> None:
        with self.lock:
            by_param = self.pending.pop(task, {})
            self.window.drain()  # every copy in flight (nested backwards' too): nothing waited twice
        self.after_flush()
        for entry, grads in by_param.values():  # all host tensors now
            total = grads[0]
            for g in grads[1:]:
                total.add_(g)
            p = entry.param
            with torch.no_grad():
                if p.grad is None:
                    p.grad = total
                else:
                    p.grad.add_(total)
            for hook in post_accumulate_grad_hooks(p):
                hook(p)

    def drop_stale(self) -> None:
        """Outside backward: what is pending belongs to backwards that raised."""
        with self.lock:
            self.pending.clear()
            self._dropped_peak = self.peak_in_flight_bytes
            self.window = _C.InFlightWindow(self.max_in_flight)  # unwaited transfers are safe to drop


def _hand_over(items: List[Any], i: int) -> None:
    """A settled copy: its host result replaces the Transfer (the engine lets go of the device gradient)."""
    t = items[i]
    if isinstance(t, Transfer):
        items[i] = t.wait()
