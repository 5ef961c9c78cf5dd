"""What a speculative step is checked against at step() (Note [speculative
step] in speculation.py): the content of what it read, and the per-thread
state of torch it ran under.

- fingerprint(): one 64-bit hash (hipferry._C._content_hash: one parallel
  pass, position-dependent) of the tensors a step reads, in order. The worker
  takes it of what the speculative step read; step() takes it of what the
  ordinary step would read now. A write the version counter does not show
  (``p.data.copy_``, ``.data`` or numpy writes to the state, a new tensor at
  the old address after ``p.data = t``) changes it.
- thread_state() / run_under(): torch keeps per thread what changes the bits
  of the fused step: how many intra-op threads a loop is cut into, and the
  denormal mode of each of them (torch.set_flush_denormal sets the calling
  thread's only; intra-op threads keep the mode of the thread that made
  them). The worker runs each job under the state of the thread that steps.
"""
import threading
from typing import Iterable, Optional, Tuple

import torch

from .. import _C
from .layout import memory_flat

ThreadState = Tuple[int, Tuple[int, ...]]  # (torch.get_num_threads(), denormal mode of intra-op thread i)

WORKER_PREFIX = "hipferry-speculate"  # the worker's thread names (WorkerThread)


def fingerprint(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    """The content hash of `tensors` (dense CPU tensors; None entries skipped), each walked in memory order."""
    return _C._content_hash([memory_flat(t) for t in tensors if t is not None])


def thread_state() -> ThreadState:
    """The state the calling thread's parallel loops run under."""
    return torch.get_num_threads(), tuple(_C._thread_fp_modes())


_applied = threading.local()  # the state last applied on a worker thread (only our jobs run there)


def run_under(state: ThreadState) -> ThreadState:
    """On a worker thread: makes its parallel loops run as those of `state`'s
    thread do (as many intra-op threads, each with the denormal mode of its
    counterpart) and returns `state`. Elsewhere (a test's scheduler running a
    job inline) nothing is changed: returns the calling thread's own state."""
    if not threading.current_thread().name.startswith(WORKER_PREFIX):
        return thread_state()
    if getattr(_applied, "state", None) != state:
        threads, modes = state
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        _C._set_thread_fp_modes(list(modes))
        _applied.state = state
    return state
