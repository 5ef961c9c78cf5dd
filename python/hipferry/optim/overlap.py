"""OffloadAdamW(overlap="backward"): which parameters start a speculative step
during backward, and when (the post-accumulate-grad hook, or DDP's comm hook
after the allreduce), micro-batches that should not speculate, and the
counters. The speculative step itself, and when it is committed, is
speculation.py (Note [speculative step])."""
import contextlib
import logging
import weakref
from typing import Any, Dict, List, Optional

import torch

from .checks import group_hyper
from .grad_copies import GradCopies
from .layout import real
from .slots import FinishedCopy, Slot
from .speculation import BackwardSpeculation
from .state import local

log = logging.getLogger("hipferry.optim")


class BackwardOverlap:
    def __init__(self, store, grad_copies: GradCopies):
        self.speculation = BackwardSpeculation(store)
        self.grad_copies = grad_copies
        self.from_ddp = False  # register_ddp_comm_hook: the allreduce starts the steps
        self._group_by_param: Dict[int, dict] = {}

    def start_local(self, p: torch.Tensor, slot: Optional[Slot], st: Optional[dict], param_groups: List[dict],
                    grad: Optional[torch.Tensor] = None) -> None:
        """A parameter stepped in place on the CPU: its step starts now, from `grad` (default: p.grad)."""
        found = self._inputs(p, slot, st, param_groups)
        if found is not None:
            group, hyper = found
            self.speculation.start(p, st, hyper, group["amsgrad"], slot.seen, grad)

    def start_remote(self, p: torch.Tensor, slot: Slot, st: dict, param_groups: List[dict]) -> None:
        """A parameter the CPU engine steps from a host copy of its gradient (a GPU
        parameter): its step starts once that copy is done, on the host working copy
        (the first step makes it: nothing to speculate on before)."""
        found = self._inputs(p, slot, st, param_groups)
        if found is None:
            return
        group, hyper = found
        master, host_param = st.get("master_param"), slot.host_param
        if (master is None and host_param is None) or (master is not None and slot.host_out is None):
            return
        transfer, events = slot.grad_copy, self.grad_copies.back_events()

        def fetch_grad() -> torch.Tensor:  # (on the worker) the copy started by the hook, handed over once
            host = transfer.wait()
            if slot.grad_copy is transfer:
                slot.grad_copy = FinishedCopy(host)
            return host

        def before_write() -> None:  # the last step's copies back read host buffers
            for event in events:
                event.synchronize()

        self.speculation.start(p, st, hyper, group["amsgrad"], slot.seen, fetch_grad=fetch_grad,
                               target=lambda: real(host_param), before_write=before_write)

    def _inputs(self, p: torch.Tensor, slot: Optional[Slot], st: Optional[dict],
                param_groups: List[dict]) -> Optional[tuple]:
        """(group, hyperparameters) of a parameter to speculate on, or None."""
        if slot is None or slot.where != "host" or st is None or not self.speculation.eligible(local(p), st):
            return None  # (eligible: float32 / bf16 / fp16 only; float64 steps with torch ops)
        group = self._group_by_param.get(id(p))
        if group is None or not any(q is p for q in group["params"]):
            self._group_by_param = {id(q): g for g in param_groups for q in g["params"]}
            group = self._group_by_param.get(id(p))
            if group is None:
                return None
        try:
            return group, group_hyper(group)
        except Exception:  # a bad hyperparameter: step() names it; nothing to speculate on
            return None

    def register_ddp_comm_hook(self, opt: Any, ddp_model: Any, process_group: Any = None) -> None:
        """See OffloadAdamW.register_ddp_comm_hook. The hook holds the optimizer weakly."""
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel
        if not isinstance(ddp_model, DistributedDataParallel):
            raise TypeError("OffloadAdamW.register_ddp_comm_hook: ddp_model must be a "
                            f"torch.nn.parallel.DistributedDataParallel, got {type(ddp_model).__name__}")
        ref = weakref.ref(opt)

        # (DDP checks these annotations)
        def allreduce_then_step(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            def start_steps(fut: Any) -> Any:
                reduced = fut.value()
                target = ref()
                if target is not None:
                    try:
                        for p, g in zip(bucket.parameters(), bucket.gradients()):
                            target._on_reduced_grad(p, g)
                    except Exception:  # a speculation is an optimization: step() steps it anyway
                        log.exception("OffloadAdamW: starting a step after the allreduce failed")
                return reduced
            return allreduce_hook(state, bucket).then(start_steps)

        ddp_model.register_comm_hook(process_group, allreduce_then_step)
        self.from_ddp = True

    @contextlib.contextmanager
    def accumulating(self):
        spec = self.speculation
        before, spec.enabled = spec.enabled, False
        try:
            yield
        finally:
            spec.enabled = before

    def stats(self) -> dict:
        spec = self.speculation
        return {"overlap": "backward", "started": spec.started, "committed": spec.committed, "redone": spec.redone}
