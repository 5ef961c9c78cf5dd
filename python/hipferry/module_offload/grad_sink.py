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
  ``max_in_flight`` bytes in flight makes backward wait for the oldest.
* A backward that raised never runs its callback; what it left is dropped
  at the next forward of the model (unwaited transfers are safe to drop).
"""
import threading
from collections import deque
from functools import partial
from typing import Any, Callable, Deque, Dict, List, Tuple

import torch

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
        self.in_flight: Deque[Tuple[List[Any], int, int]] = deque()  # (list, index, bytes), oldest first
        self.in_flight_bytes = 0
        self.peak_in_flight_bytes = 0
        self.bytes_moved = 0
        self.lock = threading.Lock()  # two GPUs: two autograd device threads

    def add(self, entry, grad: torch.Tensor) -> None:
        task = current_graph_task_id()
        with self.lock:
            by_param = self.pending.get(task)
            if by_param is None:
                by_param = self.pending[task] = {}
                queue_end_of_backward(partial(self.flush, task))
            dtype = entry.host_dtype if entry.host_dtype != grad.dtype else None
            nbytes = grad.numel() * grad.element_size()
            self._settle(lambda: self.in_flight and self.in_flight_bytes + nbytes > self.max_in_flight)
            items = by_param.setdefault(id(entry.param), (entry, []))[1]
            items.append(offload(grad, dtype=dtype, pool=self.pool))
            self.in_flight.append((items, len(items) - 1, nbytes))
            self.in_flight_bytes += nbytes
            self.peak_in_flight_bytes = max(self.peak_in_flight_bytes, self.in_flight_bytes)
            self.bytes_moved += grad.numel() * entry.host_dtype.itemsize

    def _settle(self, must_wait: Callable[[], bool]) -> None:
        """Hands completed copies' host results over (the engine lets go of the
        device gradients); blocks on the oldest while `must_wait()`."""
        while self.in_flight:
            items, i, nbytes = self.in_flight[0]
            t = items[i]
            if isinstance(t, Transfer) and not t.ready() and not must_wait():
                return
            if isinstance(t, Transfer):
                items[i] = t.wait()
            self.in_flight.popleft()
            self.in_flight_bytes -= nbytes

    def flush(self, task: int) -> None:
        with self.lock:
            by_param = self.pending.pop(task, {})
            self._settle(lambda: True)  # every copy in flight (nested backwards' too): nothing waited twice
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
            self.in_flight.clear()
            self.in_flight_bytes = 0
