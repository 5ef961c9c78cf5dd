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
from .grad_copies import GradCopies, inv_scale
from .layout import real
from .scratch import pool_reserve
from .slots import FinishedCopy, Slot
from .speculation import BackwardSpeculation
from .state import local

log = logging.getLogger("hipferry.optim")

NO_OVERLAP_STATS = {"overlap": None, "started": 0, "committed": 0, "redone": 0, "failed": 0, "no_room": 0,
                    "copied_commits": 0, "scratch_bytes": 0}


class BackwardOverlap:
    def __init__(self, store, grad_copies: GradCopies, owner: Any):
        self.speculation = BackwardSpeculation(store)
        self.grad_copies = grad_copies
        self.from_ddp = False  # register_ddp_comm_hook: the allreduce starts the steps
        self._group_by_param: Dict[int, dict] = {}
        self._store, self._capacity = store, store.pool.capacity
        self._owner = weakref.ref(owner)  # (weakly: the optimizer's death ends the worker at once)
        self._reserve: Optional[tuple] = None  # (when, bytes): scratch.pool_reserve, noted once per step

    def start_local(self, p: torch.Tensor, slot: Optional[Slot], st: Optional[dict], param_groups: List[dict],
                    grad: Optional[torch.Tensor] = None) -> None:
        """A parameter stepped in place on the CPU: its step starts now, from `grad` (default: p.grad)."""
        try:
            found = self._inputs(p, slot, st, param_groups)
            if found is not None:
                group, hyper = found
                self.speculation.start(p, st, hyper, group["amsgrad"], slot.seen, grad,
                                       reserve=self._reserve_bytes(p))
        except Exception:  # (an optimization: step() steps the parameter anyway)
            self._failed_start()

    def start_remote(self, p: torch.Tensor, slot: Slot, st: dict, param_groups: List[dict]) -> None:
        """A parameter the CPU engine steps from a host copy of its gradient (a GPU
        parameter): its step starts once that copy is done, on the host working copy
        (the first step makes it: nothing to speculate on before)."""
        try:
            self._start_remote(p, slot, st, param_groups)
        except Exception:
            self._failed_start()

    def start_reduced(self, p: torch.Tensor, slot: Slot, st: dict, param_groups: List[dict],
                      grad: torch.Tensor) -> None:
        """DDP's comm hook, a GPU parameter: the copy of its reduced gradient to the host
        starts now, and its step once that copy is done."""
        self.grad_copies.start_reduced(slot, grad)
        self.start_remote(p, slot, st, param_groups)

    def _failed_start(self) -> None:
        self.speculation.failed += 1
        log.debug("OffloadAdamW: a speculative step could not start; step() steps the parameter", exc_info=True)

    def _reserve_bytes(self, p: torch.Tensor) -> int:
        """What `p`'s scratch must leave free in the pool (none to compute for a pool without a
        cap; the last figure where `p` has its scratch already: a loop over every parameter once
        per step only where one is made)."""
        if self._capacity is None:
            return 0
        spec = self.speculation
        if self._reserve is not None and spec.has_scratch(p):
            return self._reserve[1]
        when = spec.committed + spec.redone  # (changes at each step that had speculations)
        if self._reserve is None or self._reserve[0] != when:
            opt = self._owner()
            if opt is None:
                return 0
            self._reserve = (when, pool_reserve(self._store, opt._slots, opt.state, opt._is_remote))
        return self._reserve[1]

    def _start_remote(self, p: torch.Tensor, slot: Slot, st: dict, param_groups: List[dict]) -> None:
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
                               target=lambda: real(host_param), before_write=before_write,
                               reserve=self._reserve_bytes(p))

    def _inputs(self, p: torch.Tensor, slot: Optional[Slot], st: Optional[dict],
                param_groups: List[dict]) -> Optional[tuple]:
        """(group, hyperparameters) of a parameter to speculate on, or None."""
        if slot is None or slot.where != "host" or st is None or not self.speculation.eligible(local(p), st):
            return None  # (eligible: float32 / bf16 / fp16 only; float64 steps with torch ops)
        group = self._group_by_param.get(id(p))  # (made again once per step: note_scale empties it)
        if group is None or not any(g is group for g in param_groups):  # (load_state_dict makes new groups)
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
        speculation = weakref.ref(self.speculation)

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
            started = allreduce_hook(state, bucket).then(start_steps)
            waiting = speculation()
            if waiting is not None:  # (on the backward's thread: its end waits for these steps)
                waiting.wait_at_end_of_backward(started)
            return started

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

    def note_scale(self, scaler_driven: bool, scale: Optional[torch.Tensor], params: List[torch.Tensor],
                   state: dict) -> None:
        """step(): the next backward's speculations unscale their gradients as this step's
        were (the scale rarely changes): by GradScaler's factor, learnt from the gradients
        where scaler.unscale_ ran before (step() is given no scale then), else not at all."""
        spec = self.speculation
        self._group_by_param = {}  # (a parameter moved to another group: a commit would compare its old one's)
        if not scaler_driven:
            spec.inv_scale = None
        elif scale is not None:
            spec.inv_scale = inv_scale(scale).cpu()
        else:
            spec.learn_inv_scale(params, state)

    def stats(self) -> dict:
        return {"overlap": "backward", **self.speculation.stats()}
