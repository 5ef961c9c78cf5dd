"""DiskEngine: steps the parameters whose state DiskStore keeps on disk.

CPU parameters are written in place by the fused pass (a write the user made
since the last step is taken as the master first: adopt). GPU parameters
(step_on="cpu") step from the host copy of their gradient into a host buffer,
which goes back to the device only once the step is committed."""
from typing import List

import torch

from ..engines import StepItem
from ..grad_copies import GradCopies
from ..layout import aligned, memory_flat, shaped
from ..slots import param_key
from ..state import local
from ..tracing import TRACK_COPIES_BACK, TRACK_STEP, span
from .store import DiskStore


class DiskEngine:
    def __init__(self, store: DiskStore, grad_copies: GradCopies, pool):
        self.store, self.grad_copies, self.pool = store, grad_copies, pool

    def step(self, items: List[StepItem]) -> None:
        plans, back, remote = [], [], []
        try:
            for it in items:
                plan, copy_back = self._plan(it)
                plans.append(plan)
                back.append(copy_back)
            with span(f"disk step of {len(items)} parameters", TRACK_STEP, nbytes=sum(it.p.nbytes for it in items)):
                self.store.step(plans)
        except BaseException:  # nothing was stepped (DiskStore.step undoes a failed one): nor are the counts
            for it in items:
                it.st["step"] -= 1
            raise
        for it, copy_back in zip(items, back):
            lp = local(it.p)
            if lp.device.type == "cpu":
                if copy_back is not None:
                    lp.copy_(copy_back)
                torch.autograd.graph.increment_version(lp)  # written through a raw pointer
            else:
                with span("copy back", TRACK_COPIES_BACK, copy_back):
                    self.grad_copies.send_back(lp, copy_back)
                remote.append(it.p)
            it.slot.seen = param_key(lp)
        if remote:
            self.grad_copies.mark_back(remote)

    def _plan(self, it: StepItem) -> tuple:
        """The store's step item of `it`, and the tensor to copy into the parameter after
        the step (None: the pass wrote the parameter itself)."""
        lp = local(it.p)
        strides = self.store.strides[self.store.index[id(it.p)]]
        like = torch.empty_strided(lp.shape, strides, dtype=lp.dtype, device="meta")
        if lp.device.type == "cpu":
            grad = aligned(local(it.p.grad), like)
            direct = lp.stride() == strides
            out = lp if direct else torch.empty_strided(lp.shape, strides, dtype=lp.dtype).copy_(lp)
            copy_back = None if direct else out
        else:
            grad = aligned(self.grad_copies.host_grad(it.slot, local(it.p.grad)), like)
            if it.slot.host_out is None:
                it.slot.host_out = shaped(self.pool.empty(lp.numel(), dtype=lp.dtype), lp.shape, strides)
                it.slot.seen = None  # its first values come from the parameter
            out = copy_back = it.slot.host_out
            if param_key(lp) != it.slot.seen:
                out.copy_(lp)  # a write to the GPU parameter: the pass adopts it
        return dict(param=it.p, grad=memory_flat(grad), out=memory_flat(out), adopt=True, step=it.step,
                    hyper=it.hyper), copy_back
