"""Fakes that stand in for OffloadAdamW's two sources of asynchrony, so the
order of overlap="backward" is proven on one thread, without a GPU:

- AdversarialScheduler replaces the speculation's WorkerThread. A job runs
  when its policy says: at once ("now"), only when someone waits for it
  ("last moment"), all waiting jobs newest first whenever one is waited for
  ("reversed"), or a random subset in random order at every submit and wait
  ("random").
- DeferredCopies replaces DeviceCopies. A copy reads its source when it
  lands, not when it starts, as a DMA engine may: a copy to the host lands
  when its `wait()` is called, a copy back when an event marked after it is
  synchronized or when the next forward runs (the device runs queued copies
  before the forward's kernels: stream order), or earlier at random. When a
  copy lands, its source must still hold what it held when the copy started;
  otherwise a violation is recorded (not raised: the optimizer would take an
  exception in a job for a failed speculation and hide it).
"""
import random
from typing import Callable, List, Optional

import torch


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


class LazyFuture:
    """A job of AdversarialScheduler: runs at most once, when its scheduler says."""

    def __init__(self, scheduler: "AdversarialScheduler", fn: Callable, args: tuple):
        self._scheduler, self._fn, self._args = scheduler, fn, args
        self._started = False
        self._error: Optional[BaseException] = None

    def run(self) -> None:
        if self._started:
            return
        self._started = True
        self._scheduler.pending.remove(self)
        self._scheduler.ran += 1
        try:
            self._fn(*self._args)
        except BaseException as e:  # kept for result()/exception(), as a Future does
            self._error = e

    def exception(self) -> Optional[BaseException]:
        if not self._started:
            self._scheduler.waited_for(self)
        return self._error

    def result(self) -> None:
        error = self.exception()
        if error is not None:
            raise error


class AdversarialScheduler:
    POLICIES = ("now", "last moment", "reversed", "random")

    def __init__(self, policy: str, rng: Optional[random.Random] = None,
                 between_jobs: Optional[Callable[[], None]] = None):
        assert policy in self.POLICIES, policy
        self.policy = policy
        self.rng = rng or random.Random(0)
        self.between_jobs = between_jobs  # e.g. DeferredCopies.land_some: copies land at random points
        self.pending: List[LazyFuture] = []
        self.ran = 0

    def submit(self, fn: Callable, *args) -> LazyFuture:
        job = LazyFuture(self, fn, args)
        self.pending.append(job)
        if self.policy == "now":
            self._run(job)
        elif self.policy == "random":
            self._run_some()
        return job

    def waited_for(self, job: LazyFuture) -> None:
        if self.policy == "reversed":
            for other in reversed(list(self.pending)):
                self._run(other)
        elif self.policy == "random":
            self._run_some()
        self._run(job)

    def _run_some(self) -> None:
        waiting = list(self.pending)
        for job in self.rng.sample(waiting, self.rng.randint(0, len(waiting))):
            self._run(job)

    def _run(self, job: LazyFuture) -> None:
        if self.between_jobs is not None:
            self.between_jobs()
        job.run()

    def close(self) -> None:
        pass


class _ToHost:
    """A copy of a gradient to the host that reads the gradient when waited for."""

    def __init__(self, copies: "DeferredCopies", grad: torch.Tensor):
        self._copies, self._grad, self._at_start = copies, grad, _bits(grad).clone()
        self._host: Optional[torch.Tensor] = None

    def wait(self) -> torch.Tensor:
        if self._host is None:
            if not torch.equal(_bits(self._grad), self._at_start):
                self._copies.violations.append("a gradient was written while its copy to the host was in flight")
            self._host = self._grad.detach().clone()
        return self._host


class _Event:
    def __init__(self, copies: "DeferredCopies", entries: list):
        self._copies, self._entries = copies, entries

    def synchronize(self) -> None:
        for entry in self._entries:
            self._copies.land(entry)


class DeferredCopies:
    def __init__(self, rng: Optional[random.Random] = None):
        self.rng = rng
        self.pending: list = []      # copies back started and not landed: [dst, src, src's bits at start]
        self.violations: List[str] = []
        self.landed = 0

    def to_host(self, grad: torch.Tensor, pool) -> _ToHost:
        return _ToHost(self, grad)

    def back(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # The real copy_ bumps the parameter's version when it is queued; the fake lands
        # through .data later, so it bumps it now (the optimizer records param_key after).
        torch.autograd.graph.increment_version(dst)
        self.pending.append([dst, src, _bits(src).clone()])

    def mark(self, params) -> list:
        return [_Event(self, list(self.pending))] if self.pending else []

    def _index(self, entry: list) -> int:
        return next((i for i, e in enumerate(self.pending) if e is entry), -1)

    def land(self, entry: list) -> None:
        i = self._index(entry)
        if i < 0:
            return  # (landed already)
        dst, src, at_start = entry
        if not torch.equal(_bits(src), at_start):
            self.violations.append("a host buffer was written while its copy back was in flight")
        dst.data.copy_(src)
        del self.pending[i]
        self.landed += 1

    def drain(self) -> None:
        """What the device does before the next forward's kernels: every queued copy lands."""
        for entry in list(self.pending):
            self.land(entry)

    def land_some(self) -> None:
        """Copies back land early, at random (each parameter's copies in the order they started)."""
        if self.rng is None:
            return
        for entry in list(self.pending):
            i = self._index(entry)
            same_dst = any(e[0].data_ptr() == entry[0].data_ptr() for e in self.pending[:max(i, 0)])
            if i >= 0 and not same_dst and self.rng.random() < 0.5:
                self.land(entry)
