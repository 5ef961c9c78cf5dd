"""OffloadAdamW's step during backward, `overlap="backward"` (issue 26;
docs/offload-adamw-overlap-plan.md): CPU parameters, and GPU parameters the
CPU engine steps from host copies.

Note [speculative step]
~~~~~~~~~~~~~~~~~~~~~~~
* When a parameter's gradient is final (its post-accumulate-grad hook), a
  worker thread copies the gradient (the snapshot) and steps a copy of the
  parameter's state in scratch buffers, with the hyperparameters and step
  count of that moment. Nothing the optimizer or the model owns is written.
* Backward does not return before every snapshot of it is taken (a callback
  queued at the end of backward waits): code between backward and step()
  (clipping, GradScaler, the next micro-batch's accumulation) may write the
  gradients then.
* step() waits for the worker; a speculation is COMMITTED only if the
  gradient step() would use has the snapshot's bits and the hyperparameters,
  step count, amsgrad, the parameter (param_key) and the state tensors
  (identity and version) are those it used. Commit swaps the scratch state
  into the state tensors (Tensor.set_: the same tensor objects, no copy)
  and copies the new values into the parameter.
  Otherwise the parameter steps as without overlap (REDO), from its untouched
  state. Either way the result is bit-identical to overlap=None.
* A skipped step (GradScaler's inf, skip_nonfinite), zero_grad and
  load_state_dict drop every speculation, reload_params those of its
  parameters (a write param_key does not show); a new backward of the same
  parameter replaces its own. `OffloadAdamW.accumulating()` marks
  micro-batches whose backward does not speculate (work saved, not needed
  for correctness: the last micro-batch's speculation sees the sum).
Invariants: state and parameters change only inside step(); the worker reads
them only while no step() or load_state_dict runs (those wait for it first);
a speculation's scratch is written by one job at a time (its step job waits
for its snapshot job, a new start for its last step job). Jobs go through
one `submit` (WorkerThread), so tests run them in adversarial orders
(tests/python/test_offload_adamw_overlap_order.py).
"""
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch

from .. import _C
from ..torch_private import amp_unscale_, current_graph_task_id, queue_end_of_backward, tensor_version
from .checks import FUSED
from .layout import aligned, memory_flat, real
from .slots import param_key
from .state import local


@dataclass
class _Speculation:
    """One parameter's speculative step: its inputs and its scratch results."""
    scratch: Dict[str, torch.Tensor] = field(default_factory=dict)  # grad snapshot, state keys, target, out
    snapshot: Optional[Future] = None     # the job that copies the gradient into scratch["grad"]
    future: Optional[Future] = None       # the job that steps the scratch (after `snapshot`)
    step: int = 0                         # the step count it stepped to
    hyper: Optional[dict] = None          # the group's hyperparameters it used
    key: Optional[tuple] = None           # param_key of the parameter it read
    inv_scale: Optional[torch.Tensor] = None  # the factor it unscaled the snapshot by (GradScaler), or None
    state_key: Optional[tuple] = None     # the state tensors it read: identities and versions (_state_key)
    live: bool = False                    # a job was started since the last step / drop


class WorkerThread:
    """Where speculative jobs run: one thread, first in first out, made on first
    use. The only scheduler the optimizer uses; the order tests put a fake with
    the same `submit` in its place (tests/python/overlap_fakes.py)."""

    def __init__(self):
        self._pool: Optional[ThreadPoolExecutor] = None

    def submit(self, fn: Callable, *args) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hipferry-speculate")
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class BackwardSpeculation:
    """The speculations of one optimizer (see the Note). `store` is its state
    store: it runs the fused step and makes the scratch tensors (pool tensors
    with a state tensor's shape and strides)."""

    def __init__(self, store):
        self._store = store
        self.scheduler = WorkerThread()  # runs the jobs (a job may wait only for jobs submitted before it)
        self._specs: Dict[torch.Tensor, _Speculation] = {}
        self._waiting_task = None  # the backward whose end waits for its snapshots
        self.enabled = True        # False inside OffloadAdamW.accumulating()
        self.inv_scale: Optional[torch.Tensor] = None  # GradScaler's last factor: snapshots are unscaled by it
        self.committed = 0
        self.redone = 0
        self.started = 0

    @staticmethod
    def eligible(lp: torch.Tensor, st: dict) -> bool:
        """Parameters this slice speculates: float32/bf16/fp16, dense, with the state's strides."""
        rp, m = real(lp), st["exp_avg"]
        return ("exp_avg_absmax" not in st and lp.dtype in FUSED and not lp.is_complex() and memory_flat(rp) is not None
                and rp.stride() == m.stride())

    # ----------------------------------------------------------- backward side
    def start(self, p: torch.Tensor, st: dict, hyper: dict, amsgrad: bool, seen: Optional[tuple],
              grad: Optional[torch.Tensor] = None, *, fetch_grad: Optional[Callable[[], torch.Tensor]] = None,
              target: Optional[Callable[[], torch.Tensor]] = None,
              before_write: Optional[Callable[[], None]] = None) -> None:
        """Step `p` speculatively on the worker. From the post-accumulate-grad hook
        (or DDP's comm hook, with the reduced `grad`). For a parameter that lives
        elsewhere than its state (a GPU parameter): `fetch_grad` returns the host
        copy of its gradient (on the worker: it may wait for the copy), `target`
        the float32 host working copy the step starts from (without a master), and
        `before_write` waits until nothing reads the scratch any more (copies
        back of the last step)."""
        lp = local(p)
        key = param_key(lp)
        if grad is None and fetch_grad is None:
            grad = None if p.grad is None else local(p.grad)
        if not self.enabled or key != seen or (fetch_grad is None and (grad is None or grad.is_sparse)):
            return  # (a write not yet read into the master: step() reads it first, then steps)
        spec = self._specs.get(p)
        if spec is None:
            spec = self._specs[p] = _Speculation()
        elif spec.future is not None:
            spec.future.exception()  # the earlier job of this parameter (another micro-batch) is done first
        spec.step, spec.hyper, spec.key, spec.live = int(st["step"].item()) + 1, dict(hyper), key, True
        spec.inv_scale = self.inv_scale
        spec.state_key = _state_key(st)
        if fetch_grad is None:
            fetch_grad = (lambda g=grad: g)
        if target is None:
            target = (lambda: real(lp))
        spec.snapshot = self.scheduler.submit(self._take_snapshot, spec, lp, st, fetch_grad)
        spec.future = self.scheduler.submit(self._speculate, spec, lp, target, before_write, st, amsgrad)
        self.started += 1
        task = current_graph_task_id()
        if task != -1 and task != self._waiting_task:
            self._waiting_task = task
            queue_end_of_backward(self._wait_for_snapshots)

    @torch.no_grad()
    def _take_snapshot(self, spec: _Speculation, lp: torch.Tensor, st: dict, fetch_grad: Callable) -> None:
        m = real(st["exp_avg"])
        s = spec.scratch
        grad = fetch_grad()
        if "grad" not in s:
            s["grad"] = self._store.host_tensor_like(m, lp.dtype)
            for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param"):
                if k in st:
                    s[k] = self._store.host_tensor_like(m, torch.float32)
            if "master_param" in st:
                s["out"] = self._store.host_tensor_like(m, lp.dtype)
            else:
                s["target"] = self._store.host_tensor_like(m, torch.float32)
        s["grad"].copy_(aligned(real(grad), m))
        if spec.inv_scale is not None:  # the gradient step() will use, if the scale stays (GradScaler's op)
            amp_unscale_([s["grad"]], torch.zeros((), dtype=torch.float32), spec.inv_scale)

    @torch.no_grad()
    def _speculate(self, spec: _Speculation, lp: torch.Tensor, target: Callable,
                   before_write: Optional[Callable], st: dict, amsgrad: bool) -> None:
        spec.snapshot.result()  # (done: submitted before this job; raises what it raised)
        s = spec.scratch
        if before_write is not None:
            before_write()
        # Out of place: reads the state and the parameter (or its master), writes the scratch.
        master = "master_param" in st
        stepped = s["master_param"] if master else s["target"]
        source = {k: st[k] for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if k in st}
        source["param"] = st["master_param"] if master else target()
        state = {k: s[k] for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if k in st}
        if "max_exp_avg_sq" in st and not amsgrad:  # (kept from an amsgrad group; the step leaves it)
            s["max_exp_avg_sq"].copy_(st["max_exp_avg_sq"])
        self._store.step(spec.hyper, stepped, s["grad"], state, amsgrad, s.get("out"), spec.step, source)

    def _wait_for_snapshots(self) -> None:
        self._waiting_task = None
        for spec in list(self._specs.values()):
            if spec.live and spec.snapshot is not None:
                spec.snapshot.exception()  # (waits; a failed snapshot fails its step job: redone at step())

    # --------------------------------------------------------------- step side
    def wait(self) -> None:
        """Every job done (raises what a job raised)."""
        for spec in self._specs.values():
            if spec.future is not None:
                spec.future.result()

    def drop(self) -> None:
        """Forget every speculation (after their jobs finished: they read the state)."""
        for spec in self._specs.values():
            if spec.future is not None:
                try:
                    spec.future.result()
                except Exception:  # a failed speculation is dropped all the same
                    pass
            spec.live = False

    def forget(self, params) -> None:
        """reload_params(): the speculations of `params` read values the user has since
        written unseen (after their jobs finished: they read the master and host copies
        reload_params writes). Their parameters step the ordinary way: counted as redone."""
        for p in params:
            spec = self._specs.get(p)
            if spec is None:
                continue
            if spec.future is not None:
                spec.future.exception()  # (waits)
            if spec.live:
                spec.live = False
                self.redone += 1

    @torch.no_grad()
    def try_commit(self, p: torch.Tensor, st: dict, hyper: dict, step: int,
                   grad: Optional[torch.Tensor] = None) -> Optional[Dict[str, torch.Tensor]]:
        """After step() advanced the count to `step`: commit `p`'s speculation if
        it stepped exactly what step() would step now with `grad` (default
        p.grad; see the Note): the state tensors take the scratch state, and the
        scratch (its "out" or "target": the new parameter values) is returned.
        None: step it the ordinary way (its state is untouched)."""
        spec = self._specs.get(p)
        if spec is None or not spec.live:
            return None
        spec.live = False
        if spec.future is None or spec.future.exception() is not None:
            self.redone += 1
            return None
        lp = local(p)
        m = real(st["exp_avg"])
        now = aligned(real(local(p.grad) if grad is None else grad), m)
        same = (spec.step == step and spec.hyper == hyper and spec.key == param_key(lp)
                and spec.state_key == _state_key(st)
                and now.dtype == spec.scratch["grad"].dtype and _same_bits(now, spec.scratch["grad"]))
        if not same:
            self.redone += 1
            return None
        s = spec.scratch
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param"):
            if k in st:
                _swap_storage(st[k], s[k])
        self.committed += 1
        return s

    def close(self) -> None:
        self.drop()
        self.scheduler.close()


def _state_key(st: dict) -> tuple:
    """What shows a write to a parameter's state outside step() (opt.state[p]["exp_avg"].zero_(),
    a tensor put in its place): each state tensor's identity and version ("step" apart: step()
    counts it before the commit, which compares the count itself)."""
    return tuple((k, id(t), tensor_version(t)) for k, t in st.items() if k != "step" and isinstance(t, torch.Tensor))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether host tensors `a` and `b` (dense, same shape and strides: eligible() and
    aligned() make them so) hold the same bits: one parallel memcmp of their memory."""
    return _C._bits_equal(memory_flat(a), memory_flat(b))


def _swap_storage(a: torch.Tensor, b: torch.Tensor) -> None:
    """`a` and `b` (same shape and strides) exchange their memory; each keeps its tensor object."""
    storage, offset = a.untyped_storage(), a.storage_offset()
    a.set_(b.untyped_storage(), b.storage_offset(), b.size(), b.stride())
    b.set_(storage, offset, b.size(), b.stride())
