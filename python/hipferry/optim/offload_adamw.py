"""OffloadAdamW: torch.optim.AdamW whose state lives in pinned host memory.

Design and API: docs/offload-adamw-plan.md. In short, per parameter the state
(`exp_avg`, `exp_avg_sq`, `max_exp_avg_sq` with amsgrad, and a float32
`master_param` for bfloat16/float16 parameters) is float32 in the hipferry
pool, and one of two engines runs the same fused element-wise update
(csrc/core/optim/adamw_update.h):
- "cpu": on the host, vectorized and multi-threaded; for GPU parameters the
  gradients come over during backward (post-accumulate-grad hooks start
  `hipferry.offload`) and the new values go back with async copies while the
  host moves on to the next parameter;
- "gpu": the state streams through a ring of device buffers, one fused kernel
  per chunk (hipferry._C.AdamWStreamer).
Small GPU parameters keep their state on the device and step there.
"""
import contextlib
import copy
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch

from .. import _C
from ..pool import PinnedPool, default_pool
from ..torch_private import amp_unscale_, tensor_version
from ..transfer import Transfer
from . import calibration
from .checks import (LOW_PRECISION, TORCH_FLAG_DEFAULTS, check_flag, check_grad, check_group_options,
                     check_loadable, check_norm_args, check_param, param_dtype, scalar_value, split_params,
                     squeezed_betas, unordered_params_message)
from .device_copies import DeviceCopies
from .layout import aligned, memory_flat, real, shaped, state_strides, torch_ops_step
from .speculation import BackwardSpeculation
from .state import format_bytes, local, state_keys, to_global_state, torch_group_defaults

log = logging.getLogger("hipferry.optim")


@dataclass
class _Slot:
    """Per-parameter bookkeeping that is not part of torch's state format."""
    where: str                                 # "host" (state in the pool) or "device" (small GPU parameter)
    shape: tuple = ()                          # the parameter's shape and dtype when its state was made:
    dtype: Optional[torch.dtype] = None        # a parameter changed to others no longer fits its state
    host_param: Optional[torch.Tensor] = None  # CPU engine, float32 GPU parameter: the host working copy
    host_out: Optional[torch.Tensor] = None    # CPU engine, low-precision GPU parameter: the rounded values to send
    seen: Optional[tuple] = None               # param_key(p) after our last read or write (None: read p again)
    grad_copy: Optional[Transfer] = None       # gradient copy started by the backward hook
    copied_grad: Optional[torch.Tensor] = None  # the gradient tensor that copy read ...
    copied_version: int = -1                   # ... and its version then (a change means: copy again)

    def copy_is_current(self, grad: torch.Tensor) -> bool:
        """A gradient copy was started and `grad` is the same tensor, unchanged since."""
        return self.grad_copy is not None and self.copied_grad is grad and self.copied_version == tensor_version(grad)


def param_key(lp: torch.Tensor) -> tuple:
    """What shows a write to a parameter outside step(): its version counter
    (in-place ops, ``p.copy_`` under no_grad, ``model.load_state_dict``), its
    storage and layout (``p.data = t``, ``vector_to_parameters``). A write
    through ``p.data.copy_`` changes none of them: ``reload_params()``."""
    return tensor_version(lp), lp.data_ptr(), tuple(lp.stride())


def step_dtype() -> torch.dtype:
    """torch keeps ``step`` in float32 (float64 under a float64 default dtype),
    never in a low-precision default dtype, where it would stop counting."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class OffloadAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW with its state in pinned host memory (see module doc).

    ``foreach``, ``fused`` and ``capturable`` are accepted for drop-in use and
    ignored (the step is always one fused pass per parameter);
    ``differentiable=True`` is rejected."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, maximize: bool = False, *,
                 foreach: Optional[bool] = None, capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, step_on: str = "auto", pool: Optional[PinnedPool] = None,
                 min_offload_numel: int = 65536, chunk_numel: int = 1 << 21, ring_slots: int = 3,
                 skip_nonfinite: bool = False, overlap: Optional[str] = None):
        defaults = dict(torch_group_defaults(), lr=lr, betas=tuple(betas) if isinstance(betas, list) else betas,
                        eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize, foreach=foreach,
                        capturable=capturable, differentiable=differentiable, fused=fused)
        check_group_options(defaults, "the default group")
        defaults["betas"] = squeezed_betas(defaults["betas"])
        if fused and foreach:
            raise ValueError("OffloadAdamW: fused=True and foreach=True cannot be given together (as in "
                             "torch.optim.AdamW); both are ignored, pass at most one")
        check_flag(skip_nonfinite, "skip_nonfinite")
        if overlap not in (None, "backward"):
            raise ValueError(f"OffloadAdamW: overlap must be None or 'backward', got {overlap!r}")
        if step_on not in ("auto", "cpu", "gpu"):
            raise ValueError(f"OffloadAdamW: step_on must be 'auto', 'cpu' or 'gpu', got {step_on!r}")
        if pool is not None and not isinstance(pool, PinnedPool):
            raise TypeError(f"OffloadAdamW: pool must be a hipferry.PinnedPool or None, got {type(pool).__name__}")
        for name, value, low in (("min_offload_numel", min_offload_numel, 0), ("chunk_numel", chunk_numel, 1),
                                 ("ring_slots", ring_slots, 2)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"OffloadAdamW: {name} must be an int >= {low}, got {value!r}")
        if isinstance(params, (set, frozenset)):
            raise TypeError(unordered_params_message("params"))
        # Set before super().__init__, which calls add_param_group.
        self._pool = pool or default_pool()
        self._min_offload_numel = min_offload_numel
        self._chunk_numel = chunk_numel
        self._ring_slots = ring_slots
        self._skip_nonfinite = skip_nonfinite
        # overlap="backward": parameters stepped on the CPU are stepped speculatively during
        # backward and committed or redone at step() (Note [speculative step]).
        self._overlap = overlap
        self._speculation = (BackwardSpeculation(self._fused_step, param_key, self._host_tensor_like)
                             if overlap == "backward" else None)
        self._group_by_param: Dict[int, dict] = {}
        self._speculation_from_ddp = False  # register_ddp_comm_hook: the allreduce starts the steps
        # Test seam: run the CPU engine's path for GPU parameters (gradient copies
        # started by backward hooks, host working copies, copies back) on CPU
        # parameters, so machines without a GPU test it too.
        self._slots: Dict[torch.Tensor, _Slot] = {}
        self._hooks: list = []
        self._streamers: Dict[int, Any] = {}     # GPU index -> _C.AdamWStreamer
        self._copies = DeviceCopies()  # CPU engine, GPU parameters: gradient copies in, new values back
        self._copies_back: list = []  # CPU engine: per device, an event after the last step's copies back
        self._requested_step_on = step_on
        self.step_on = "cpu"
        self.step_on_reason = ""
        self.skipped_steps = 0
        self.last_step_skipped = False
        # CPU engine, GPU parameters: gradient copies from backward that step() used,
        # and copies it had to make itself (none, or a changed gradient).
        self.grad_copies_reused = 0
        self.grad_copies_made_at_step = 0
        super().__init__(params, defaults)
        self._choose_engine()

    # ---------------------------------------------------------------- setup
    def add_param_group(self, param_group: dict) -> None:
        g_index = len(self.param_groups)
        where = f"param_groups[{g_index}]"
        if not isinstance(param_group, dict):
            raise TypeError(f"OffloadAdamW: {where} must be a dict, got {type(param_group).__name__}")
        if "params" not in param_group:
            raise ValueError(f"OffloadAdamW: {where} has no 'params' (a dict with the key 'params' and optional "
                             "hyperparameters was expected)")
        params, names = split_params(param_group["params"], f"{where}['params']")
        for i, p in enumerate(params):
            check_param(p, f"params[group {g_index}][{i}]")
        group = dict(param_group, params=params)
        if names is not None:
            group["param_names"] = names
        check_group_options({**self.defaults, **group}, where)
        super().add_param_group(group)
        added = self.param_groups[-1]
        try:
            self._allocate(added["params"], added)
        except BaseException:
            for p in added["params"]:
                self.state.pop(p, None)
                self._slots.pop(p, None)
            self.param_groups.pop()
            raise
        if getattr(self, "step_on_reason", ""):
            self._choose_engine()  # a group added later may bring GPU parameters
        for p in added["params"]:
            if (self._is_remote(p) or self._speculation is not None) and p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(_weak_hook(self)))

    @torch.no_grad()
    def _allocate(self, params: List[torch.Tensor], group: dict) -> None:
        """Allocates (and zeroes) every state tensor of `params` at once, so a
        pool that is too small fails here, before anything is kept."""
        plan = []
        for p in params:
            lp = local(p)
            on_gpu = lp.device.type == "cuda"
            # On the device: small GPU parameters, float64 ones (torch ops, no fused
            # kernel) and non-dense ones (no flat view to stream).
            where = "device" if on_gpu and (lp.numel() < self._min_offload_numel or
                                            param_dtype(lp) == torch.float64 or
                                            memory_flat(real(lp)) is None) else "host"
            plan.append((p, lp, where, state_keys(lp, group["amsgrad"])))
        need = sum(real(lp).numel() * (8 if param_dtype(lp) == torch.float64 else 4) * len(keys)
                   for _, lp, where, keys in plan if where == "host")
        states: List[dict] = []
        st: dict = {}
        try:
            for p, lp, where, keys in plan:
                st = {"step": torch.zeros((), dtype=step_dtype())}
                for k in keys:
                    st[k] = self._new_state(lp, where, master=k == "master_param")
                if "master_param" in st:
                    st["master_param"].copy_(lp)
                states.append(st)
        except torch.OutOfMemoryError as e:
            states.clear()  # gives back what this call took, before the pool's figures are read
            st = {}
            stats = self._pool.stats()
            cap = self._pool.capacity
            short = (f", short by {format_bytes(need - (cap - stats['allocated_bytes']))}"
                     if cap is not None and need > cap - stats["allocated_bytes"] else "")
            raise torch.OutOfMemoryError(
                f"OffloadAdamW: the pool cannot hold the optimizer state: it needs {format_bytes(need)} for "
                f"{len(plan)} parameters; pool capacity {format_bytes(cap)}, "
                f"{format_bytes(stats['allocated_bytes'])} in use{short}. Pass a larger pool "
                f"(pool=hipferry.PinnedPool(capacity=...)). ({e})") from None
        for (p, lp, where, _), st in zip(plan, states):
            self.state[p] = st
            self._slots[p] = _Slot(where=where, shape=tuple(lp.shape), dtype=lp.dtype, seen=param_key(lp))

    def _new_state(self, lp: torch.Tensor, where: str, master: bool = False) -> torch.Tensor:
        """A zeroed state tensor of `lp`: float32 (float64 for float64 / complex128
        parameters), complex like a complex parameter, with the parameter's strides
        when it is dense (layout.py)."""
        rp = real(lp)
        dtype = torch.float32 if master or param_dtype(lp) != torch.float64 else torch.float64
        if where == "device":
            t = torch.zeros_like(rp, dtype=dtype, memory_format=torch.preserve_format)
        else:
            t = shaped(self._pool.empty(rp.numel(), dtype=dtype), rp.shape, state_strides(rp)).zero_()
        return torch.view_as_complex(t) if lp.is_complex() else t

    def _host_tensor_like(self, state: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A pool tensor with the shape and strides of the (real) state tensor `state`."""
        return shaped(self._pool.empty(state.numel(), dtype=dtype), state.shape, state.stride())

    def _choose_engine(self) -> None:
        before = self.step_on if self.step_on_reason else None
        self._resolve_engine()
        if before is not None and before != self.step_on:
            # The other engine updates float32 GPU parameters on the device without a
            # version bump: the CPU engine's host copies would be stale.
            self._sync_streamers()
            for slot in self._slots.values():
                slot.host_param = None

    def _resolve_engine(self) -> None:
        gpu_params = [local(p) for g in self.param_groups for p in g["params"]
                      if p.device.type == "cuda" and self._slots[p].where == "host"]
        requested = self._requested_step_on
        if not gpu_params:
            if requested == "gpu" and not any(p.device.type == "cuda" for g in self.param_groups
                                              for p in g["params"]):
                raise ValueError("OffloadAdamW: step_on='gpu' needs parameters on a GPU; all are on the CPU "
                                 "(use step_on='cpu' or 'auto')")
            self.step_on = "cpu" if requested != "gpu" else "gpu"
            self.step_on_reason = ("all parameters are on the CPU" if requested != "gpu"
                                   else "requested (no parameter is large enough to stream)")
        elif requested != "auto":
            self.step_on, self.step_on_reason = requested, "requested"
        else:
            low = sum(p.numel() for p in gpu_params if p.dtype in LOW_PRECISION)
            share = low / max(1, sum(p.numel() for p in gpu_params))
            cal = calibration.calibrate(gpu_params[0].device)
            amsgrad = any(g["amsgrad"] for g in self.param_groups)
            self.step_on, self.step_on_reason = calibration.choose_engine(cal, share, amsgrad)
        log.info("OffloadAdamW: step_on=%s (%s)", self.step_on, self.step_on_reason)

    def _is_remote(self, p: torch.Tensor) -> bool:
        """Whether the parameter lives elsewhere than its state (a GPU parameter)."""
        return p.device.type == "cuda"

    # ------------------------------------------------------- backward hooks
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        slot = self._slots.get(p)
        if slot is None or slot.where != "host" or p.grad is None or p.grad.is_sparse:
            return
        if not self._is_remote(p):
            if not self._speculation_from_ddp:  # (under DDP the comm hook starts it, after the allreduce)
                self._speculate(p, slot)
            return
        if self.step_on != "cpu":
            return
        grad = local(p.grad)
        slot.grad_copy = self._copies.to_host(grad, self._pool)
        slot.copied_grad, slot.copied_version = grad, tensor_version(grad)
        self._speculate_remote(p, slot)

    def _speculate(self, p: torch.Tensor, slot: Optional[_Slot], grad: Optional[torch.Tensor] = None) -> None:
        """overlap="backward", a parameter stepped in place on the CPU: its step starts now,
        from `grad` (default: p.grad)."""
        found = self._speculation_inputs(p, slot)
        if found is not None and not self._is_remote(p):
            st, group, hyper = found
            self._speculation.start(p, st, hyper, group["amsgrad"], slot.seen, grad)

    def _speculate_remote(self, p: torch.Tensor, slot: _Slot) -> None:
        """overlap="backward", a parameter the CPU engine steps from a host copy of its
        gradient (a GPU parameter): its step starts once that copy is done, on the
        host working copy (the first step makes it: nothing to speculate on before)."""
        found = self._speculation_inputs(p, slot)
        if found is None:
            return
        st, group, hyper = found
        master, host_param = st.get("master_param"), slot.host_param
        if (master is None and host_param is None) or (master is not None and slot.host_out is None):
            return
        transfer, events = slot.grad_copy, list(self._copies_back)

        def fetch_grad() -> torch.Tensor:  # (on the worker) the copy started above, handed over once
            host = transfer.wait()
            if slot.grad_copy is transfer:
                slot.grad_copy = _Done(host)
            return host

        def before_write() -> None:  # the last step's copies back read host buffers
            for event in events:
                event.synchronize()

        self._speculation.start(p, st, hyper, group["amsgrad"], slot.seen, fetch_grad=fetch_grad,
                                target=lambda: real(host_param), before_write=before_write)

    def _speculation_inputs(self, p: torch.Tensor, slot: Optional[_Slot]) -> Optional[tuple]:
        """(state, group, hyperparameters) of a parameter to speculate on, or None."""
        spec, st = self._speculation, self.state.get(p)
        if spec is None or slot is None or slot.where != "host" or st is None or not spec.eligible(local(p), st):
            return None  # (eligible: float32 / bf16 / fp16 only; float64 steps with torch ops)
        group = self._group_by_param.get(id(p))
        if group is None or not any(q is p for q in group["params"]):
            self._group_by_param = {id(q): g for g in self.param_groups for q in g["params"]}
            group = self._group_by_param.get(id(p))
            if group is None:
                return None
        try:
            return st, group, self._hyper(group)
        except Exception:  # a bad hyperparameter: step() names it; nothing to speculate on
            return None

    def register_ddp_comm_hook(self, ddp_model: Any, process_group: Any = None) -> None:
        """overlap="backward" under DistributedDataParallel: a parameter's gradient
        is final only after its bucket's allreduce, which runs after the
        post-accumulate-grad hook. This registers DDP's default allreduce as
        ``ddp_model``'s communication hook, followed by the start of each
        bucket parameter's step from the reduced gradient. (Without it, every
        speculation is redone at step(): correct, no gain.)"""
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel
        if self._speculation is None:
            raise ValueError("OffloadAdamW.register_ddp_comm_hook: this optimizer was built without "
                             "overlap='backward'; expected OffloadAdamW(..., overlap='backward')")
        if not isinstance(ddp_model, DistributedDataParallel):
            raise TypeError("OffloadAdamW.register_ddp_comm_hook: ddp_model must be a "
                            f"torch.nn.parallel.DistributedDataParallel, got {type(ddp_model).__name__}")
        ref = weakref.ref(self)

        # (DDP checks these annotations)
        def allreduce_then_step(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            def start_steps(fut: Any) -> Any:
                reduced = fut.value()
                opt = ref()
                if opt is not None:
                    try:
                        for p, g in zip(bucket.parameters(), bucket.gradients()):
                            opt._speculate(p, opt._slots.get(p), g)
                    except Exception:  # a speculation is an optimization: step() steps it anyway
                        log.exception("OffloadAdamW: starting a step after the allreduce failed")
                return reduced
            return allreduce_hook(state, bucket).then(start_steps)

        ddp_model.register_comm_hook(process_group, allreduce_then_step)
        self._speculation_from_ddp = True

    @contextlib.contextmanager
    def accumulating(self):
        """Micro-batches whose gradients are accumulated, not stepped: with
        ``overlap="backward"`` their backward starts no speculative step (only
        saves work: the last micro-batch's step sees the sum either way)."""
        spec = self._speculation
        if spec is None:
            yield
            return
        before, spec.enabled = spec.enabled, False
        try:
            yield
        finally:
            spec.enabled = before

    def overlap_stats(self) -> dict:
        """overlap="backward": speculative steps started, committed at step(), and redone there
        (the gradient, a hyperparameter or the parameter changed since, e.g. clipping fired)."""
        spec = self._speculation
        if spec is None:
            return {"overlap": None, "started": 0, "committed": 0, "redone": 0}
        return {"overlap": self._overlap, "started": spec.started, "committed": spec.committed,
                "redone": spec.redone}

    def _host_grad(self, p: torch.Tensor, slot: _Slot) -> torch.Tensor:
        grad = local(p.grad)
        if slot.copy_is_current(grad):
            copy = slot.grad_copy
            self.grad_copies_reused += 1
        else:
            copy = self._copies.to_host(grad, self._pool)  # changed since the hook (accumulation, clipping, scaling)
            self.grad_copies_made_at_step += 1
        slot.grad_copy, slot.copied_grad = None, None
        return copy.wait()

    # ----------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work, added = self._validate_step()  # everything is checked before anything changes
        spec = self._speculation
        if spec is not None:
            spec.wait()  # the speculative steps read the state: done before anything changes
        for p, t in added:
            self.state[p]["max_exp_avg_sq"] = t
        self.last_step_skipped = False
        scaler_driven = hasattr(self, "found_inf")  # torch.amp.GradScaler.step (see _step_supports_amp_scaling)
        if (scaler_driven and float(self.found_inf) > 0) or \
                (self._skip_nonfinite and work and not self._grads_finite([p for _, p in work])):
            self.skipped_steps += 1
            self.last_step_skipped = True
            self._drop_grad_copies()
            if spec is not None:
                spec.drop()
            # Writes made before this step (p.data = t, in-place ops) still reach the
            # masters and host copies now: the state read after a skipped step is current.
            self._reread_written()
            return loss
        scale = getattr(self, "grad_scale", None) if scaler_driven else None
        if scaler_driven:
            if scale is None:
                self._drop_grad_copies()  # scaler.unscale_ changed the gradients in place, with no version bump
            else:
                self._unscale([p for _, p in work], scale)
        if spec is not None:  # the next backward's speculations unscale as this step did (the scale rarely changes)
            spec.inv_scale = None if scale is None else _inv_scale(scale).cpu()
        # A parameter without a gradient is not stepped, but a write to it still reaches its
        # master and host copy now, as after a skipped step: the state read after step() is current.
        stepping = {id(p) for _, p in work}
        for p, slot in self._slots.items():
            if id(p) not in stepping:
                self._reread_if_written(p, self.state[p], slot)
        self._wait_copies_back()  # the host buffers the last step sent back are written again below
        streamed: Dict[tuple, list] = {}
        host_gpu = []
        hypers = {id(g): self._hyper(g) for g in self.param_groups}  # once per group, not per parameter
        for group, p in work:
            st, slot = self.state[p], self._slots[p]
            self._reread_if_written(p, st, slot)
            st["step"] += 1
            step = int(st["step"].item())
            committed = spec.try_commit(p, st, hypers[id(group)], step) \
                if spec is not None and not self._is_remote(p) and slot.where == "host" else None
            if committed is not None:
                real(local(p)).copy_(committed["out"] if "master_param" in st else committed["target"])
                slot.seen = param_key(local(p))  # (committed: the parameter holds its new values)
            elif slot.where == "device" or not self._is_remote(p) or param_dtype(local(p)) == torch.float64:
                self._step_in_place(group, hypers[id(group)], p, st, step)
            elif self.step_on == "gpu" and self._streamable(p, st):
                streamed.setdefault((id(group), p.device.index, step), []).append((group, p))
            else:
                host_gpu.append((group, p, step))
        for (_, device, step), items in streamed.items():
            self._step_streamed(device, step, items, hypers[id(items[0][0])])
        # The state is back on the host when step() returns: costs the last chunk's
        # copy out (the next forward is queued behind the step's kernels anyway), and
        # opt.state can be read on the host at once.
        self._sync_streamers()
        for group, p, step in host_gpu:
            self._step_host_for_gpu(group, hypers[id(group)], p, step)
        if spec is not None:
            spec.drop()  # speculations of parameters without a gradient now: stale next step
        self._copies_back.extend(self._copies.mark([p for _, p, _ in host_gpu]))
        return loss

    def _validate_step(self) -> tuple:
        """Checks every group's hyperparameters and flags, every parameter and
        gradient, and allocates what a group switched to amsgrad needs; changes
        nothing. Returns the (group, param) pairs to step and the new
        max_exp_avg_sq tensors to keep."""
        work, added = [], []
        for gi, group in enumerate(self.param_groups):
            check_group_options(group, f"param_groups[{gi}]")
            if not isinstance(group.get("params"), list):
                raise ValueError(f"OffloadAdamW: param_groups[{gi}]['params'] must be a list, got "
                                 f"{type(group.get('params')).__name__}")
            for pi, p in enumerate(group["params"]):
                where = f"params[group {gi}][{pi}]"
                slot = self._slots.get(p) if isinstance(p, torch.Tensor) else None
                if slot is None:
                    raise ValueError(f"OffloadAdamW: {where} was put into param_groups without add_param_group; "
                                     "add parameters with opt.add_param_group({'params': [...]})")
                check_param(p, where)
                lp = local(p)
                if tuple(lp.shape) != slot.shape or lp.dtype != slot.dtype:
                    raise ValueError(f"OffloadAdamW: {where} is now {lp.dtype} {tuple(lp.shape)}, but its state was "
                                     f"made for {slot.dtype} {slot.shape}; the state no longer fits (build a new "
                                     "optimizer, or load a state dict for the new shape)")
                if p.grad is None:
                    continue
                check_grad(p, where)
                work.append((group, p))
                if group["amsgrad"] and "max_exp_avg_sq" not in self.state[p]:
                    added.append((p, self._new_state(lp, slot.where)))
        return work, added

    # torch.amp.GradScaler: hand this optimizer `grad_scale` and `found_inf`
    # instead of unscaling the gradients itself, which it does in place without a
    # version bump, unseen by the CPU engine's gradient copies.
    _step_supports_amp_scaling = True

    def _unscale(self, params: List[torch.Tensor], scale: torch.Tensor) -> None:
        """What GradScaler.unscale_ does (the same op and factor), applied to the
        CPU engine's host copies where they are current, else to p.grad."""
        inv = _inv_scale(scale)
        groups: Dict[tuple, list] = {}
        for p in params:
            slot, grad = self._slots[p], local(p.grad)
            if slot.copy_is_current(grad):
                host = slot.grad_copy.wait()
                slot.grad_copy = _Done(host)
                grad = host
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
        for (device, _), grads in groups.items():
            found = torch.zeros((), dtype=torch.float32, device=device)
            amp_unscale_(grads, found, inv.to(device))

    def _grads_finite(self, params: List[torch.Tensor]) -> bool:
        flags = [torch.isfinite(local(p.grad)).all() for p in params]
        by_device: Dict[torch.device, list] = {}
        for f in flags:
            by_device.setdefault(f.device, []).append(f)
        return all(bool(torch.stack(fs).all()) for fs in by_device.values())

    # ------------------------------------------------- writes outside step()
    @torch.no_grad()
    def reload_params(self, params: Optional[Iterable[torch.Tensor]] = None) -> None:
        """Says "I wrote these parameters" (default: all of them): the float32
        masters of bf16/fp16 parameters and the CPU engine's host copies of GPU
        parameters are read again from the parameters now. Needed only after a
        write that changes neither the parameter's version nor its storage, such
        as ``p.data.copy_(x)``; in-place ops, ``p.copy_`` under no_grad,
        ``p.data = t``, ``model.load_state_dict`` and ``vector_to_parameters``
        are seen without it."""
        chosen = [p for g in self.param_groups for p in g["params"]] if params is None else list(params)
        for i, p in enumerate(chosen):
            if not isinstance(p, torch.Tensor) or p not in self._slots:
                raise ValueError(f"OffloadAdamW.reload_params: params[{i}] is not a parameter of this optimizer")
        if self._speculation is not None:
            self._speculation.forget(chosen)  # (stepped from the values before the write)
        for p in chosen:
            slot = self._slots[p]
            slot.seen = None
            self._reread_if_written(p, self.state[p], slot)

    @torch.no_grad()
    def _reread_written(self) -> None:
        """Every parameter written outside step() (as far as it shows) is read again."""
        for p, slot in self._slots.items():
            self._reread_if_written(p, self.state[p], slot)

    def _reread_if_written(self, p: torch.Tensor, st: dict, slot: _Slot) -> None:
        """Reads the parameter again if it was written outside step()."""
        lp = local(p)
        key = param_key(lp)
        if key == slot.seen:
            return
        self._sync_streamers()  # a streamed step may still be writing the master back
        self._wait_copies_back()
        if "master_param" in st:
            # Only where the write changed the value (the parameter no longer is the rounded
            # master): elsewhere the master keeps its float32 precision (a layout change, a
            # write of equal values).
            master = st["master_param"]
            written = lp.to(master.device)
            master.copy_(torch.where(master.to(lp.dtype) != written, written.float(), master))
        if slot.host_param is not None:
            real(slot.host_param).copy_(real(lp))
        slot.seen = key

    # -------------------------------------------------------------- engines
    def _hyper(self, group: dict) -> dict:
        beta1, beta2 = group["betas"]
        return dict(lr=scalar_value(group["lr"], "lr"), beta1=scalar_value(beta1, "beta1"),
                    beta2=scalar_value(beta2, "beta2"), eps=scalar_value(group["eps"], "eps"),
                    weight_decay=scalar_value(group["weight_decay"], "weight_decay"), amsgrad=group["amsgrad"],
                    maximize=group["maximize"])

    @staticmethod
    def _fused_step(group_hyper: dict, target: torch.Tensor, grad: torch.Tensor, st: dict, amsgrad: bool,
                    out: Optional[torch.Tensor], step: int, source: Optional[dict] = None) -> None:
        """One _C._adamw_step_ over the flat memory-order views of a float32
        `target` (parameter, master or host copy), its gradient (aligned to the
        state's strides here) and its state; `out` gets the rounded values.
        `source` (keys "param" and st's): read from those, write `target` and
        `st` (out of place: the speculative step)."""
        m, v = real(st["exp_avg"]), real(st["exp_avg_sq"])
        mx = real(st.get("max_exp_avg_sq")) if amsgrad else None
        flat = memory_flat
        ins = {}
        if source is not None:
            ins = dict(param_in=flat(real(source["param"])), exp_avg_in=flat(real(source["exp_avg"])),
                       exp_avg_sq_in=flat(real(source["exp_avg_sq"])))
            if amsgrad:
                ins["max_exp_avg_sq_in"] = flat(real(source["max_exp_avg_sq"]))
        _C._adamw_step_(flat(target), flat(aligned(grad, m)), flat(m), flat(v), flat(mx) if mx is not None else None,
                        flat(out) if out is not None else None, step, **group_hyper, **ins)

    def _step_in_place(self, group: dict, hyper: dict, p: torch.Tensor, st: dict, step: int) -> None:
        """State and gradient on the parameter's own device."""
        lp = local(p)
        rp, grad = real(lp), real(local(p.grad))
        m = real(st["exp_avg"])
        if param_dtype(lp) == torch.float64:
            torch_ops_step(rp, grad, m, real(st["exp_avg_sq"]),
                           real(st.get("max_exp_avg_sq")) if group["amsgrad"] else None, step, **hyper)
        else:
            # The parameter is walked in the state's memory order; a parameter that is
            # not dense, or whose strides changed since, goes through a working copy.
            direct = memory_flat(rp) is not None and rp.stride() == m.stride()
            master = st.get("master_param")
            if master is not None:
                out = rp if direct else torch.empty_like(m, dtype=rp.dtype)
                self._fused_step(hyper, master, grad, st, group["amsgrad"], out, step)
            else:
                out = rp if direct else torch.empty_like(m).copy_(rp)
                self._fused_step(hyper, out, grad, st, group["amsgrad"], None, step)
            if out is not rp:
                rp.copy_(out)
        torch.autograd.graph.increment_version(lp)  # written through a raw pointer: say so (offload_layers reads it)
        self._slots[p].seen = param_key(lp)

    def _step_host_for_gpu(self, group: dict, hyper: dict, p: torch.Tensor, step: int) -> None:
        """CPU engine, GPU parameter: host step, then an async copy back."""
        st, slot = self.state[p], self._slots[p]
        lp = local(p)
        grad = real(self._host_grad(p, slot))
        master = st.get("master_param")
        m = real(st["exp_avg"])
        if master is None and slot.host_param is None:
            slot.host_param = self._host_tensor_like(m, torch.float32)
            slot.host_param.copy_(real(lp))
        if master is not None and slot.host_out is None:
            slot.host_out = self._host_tensor_like(m, lp.dtype)
        spec = self._speculation
        committed = spec.try_commit(p, st, hyper, step, grad) if spec is not None else None
        if committed is not None:  # the new values are in the scratch: it becomes the host buffer
            if master is not None:
                slot.host_out, committed["out"] = committed["out"], slot.host_out
            else:
                slot.host_param, committed["target"] = committed["target"], slot.host_param
        else:
            self._fused_step(hyper, master if master is not None else slot.host_param, grad, st,
                             group["amsgrad"], slot.host_out if master is not None else None, step)
        self._copies.back(real(lp), slot.host_out if master is not None else slot.host_param)
        slot.seen = param_key(lp)

    def _streamable(self, p: torch.Tensor, st: dict) -> bool:
        """The streamer walks the parameter and its state as flat views: same strides, dense."""
        rp = real(local(p))
        return memory_flat(rp) is not None and rp.stride() == real(st["exp_avg"]).stride()

    def _step_streamed(self, device: int, step: int, items: list, hyper: dict) -> None:
        streamer = self._streamers.get(device)
        if streamer is None:
            streamer = _C.AdamWStreamer(device, self._chunk_numel, self._ring_slots)
            self._streamers[device] = streamer
        group = items[0][0]
        lists: Dict[str, list] = {k: [] for k in ("params", "grads", "masters", "exp_avgs", "exp_avg_sqs",
                                                  "max_exp_avg_sqs")}
        for _, p in items:
            st, rp = self.state[p], real(local(p))
            m = real(st["exp_avg"])
            lists["params"].append(memory_flat(rp))
            lists["grads"].append(memory_flat(aligned(real(local(p.grad)), m)))
            master = st.get("master_param")
            lists["masters"].append(memory_flat(master) if master is not None else None)
            lists["exp_avgs"].append(memory_flat(m))
            lists["exp_avg_sqs"].append(memory_flat(real(st["exp_avg_sq"])))
            mx = st.get("max_exp_avg_sq") if group["amsgrad"] else None
            lists["max_exp_avg_sqs"].append(memory_flat(real(mx)) if mx is not None else None)
        streamer.step(**lists, step=step, **hyper)
        for _, p in items:
            torch.autograd.graph.increment_version(local(p))  # written by our kernel, unseen by autograd
            self._slots[p].seen = param_key(local(p))

    # ------------------------------------------------------------ utilities
    def __del__(self) -> None:
        spec = getattr(self, "_speculation", None)
        if spec is not None:
            try:
                spec.close()
            except Exception:  # interpreter shutdown
                pass
        for handle in getattr(self, "_hooks", ()):
            try:
                handle.remove()
            except Exception:  # interpreter shutdown
                pass

    def synchronize(self) -> None:
        """Waits until the state on the host is up to date."""
        self._sync_streamers()
        self._wait_copies_back()

    def _sync_streamers(self) -> None:
        for s in self._streamers.values():
            s.synchronize()

    def _wait_copies_back(self) -> None:
        for event in self._copies_back:
            event.synchronize()
        self._copies_back = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._drop_grad_copies()
        if self._speculation is not None:
            self._speculation.drop()  # (waits: a job may still read the gradient)
        super().zero_grad(set_to_none=set_to_none)

    def _drop_grad_copies(self) -> None:
        for slot in self._slots.values():
            slot.grad_copy, slot.copied_grad = None, None

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: Optional[bool] = None) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over this optimizer's parameters (same
        result), keeping the CPU engine's in-flight gradient copies: they are
        scaled on the host by the same factor instead of being copied again."""
        check_norm_args(max_norm, norm_type)
        check_flag(error_if_nonfinite, "clip_grad_norm_: error_if_nonfinite")
        check_flag(foreach, "clip_grad_norm_: foreach", allow_none=True)
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        grads = [p.grad for p in params]
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        # Copies still reading a gradient must finish before it is scaled in place.
        copied = []
        for p in params:
            slot = self._slots.get(p)
            if slot is not None and slot.copy_is_current(local(p.grad)):
                copied.append((p, slot, slot.grad_copy.wait()))
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
        if copied:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0).to("cpu")  # as clip_grads_with_norm_ does
            for p, slot, host in copied:
                host.mul_(coef.to(host.dtype))  # CUDA's foreach mul rounds the factor to the grad dtype
                slot.grad_copy = _Done(host)
                slot.copied_version = tensor_version(local(p.grad))
        return total

    def memory_stats(self) -> dict:
        host = device = grad_buffers = 0
        for p, slot in self._slots.items():
            for k, t in self.state[p].items():
                if k == "step":
                    continue
                if t.device.type == "cpu" and slot.where == "host":
                    host += t.nbytes
                else:
                    device += t.nbytes
            for t in (slot.host_param, slot.host_out):
                grad_buffers += t.nbytes if t is not None else 0
        ring = sum(s.ring_bytes for s in self._streamers.values())
        return {"host_state_bytes": host, "device_state_bytes": device, "ring_bytes": ring,
                "grad_buffer_bytes": grad_buffers}

    # ------------------------------------------------------------ state dict
    def state_dict(self) -> Dict[str, Any]:
        """torch.optim.AdamW's format. Under FSDP2 the state of a DTensor
        parameter is a DTensor like the parameter (as torch.optim.AdamW keeps it),
        wrapping this rank's host tensors without copying them."""
        self.synchronize()
        self._reread_written()  # a master written outside step() is saved as written
        sd = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        sd["state"] = {i: to_global_state(params[i], st) if isinstance(i, int) and i < len(params) else st
                       for i, st in sd["state"].items()}
        return sd

    @torch.no_grad()
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """torch.optim.Optimizer.load_state_dict's protocol: pre-hooks may edit or
        replace the state dict, groups lacking newer keys get torch's defaults
        (__setstate__), post-hooks run after the state is restored. Everything
        is validated before anything changes; the state is copied into the pool
        tensors this optimizer already holds."""
        if not isinstance(state_dict, dict):
            raise ValueError(f"OffloadAdamW.load_state_dict: expected a dict, got {type(state_dict).__name__}")
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self.synchronize()
        by_param = check_loadable(self, state_dict)  # validates everything first
        if self._speculation is not None:
            self._speculation.drop()  # its jobs read the state written below
        self._group_by_param = {}
        groups = []
        for g, saved in zip(self.param_groups, copy.deepcopy(state_dict["param_groups"])):
            saved["params"] = g["params"]
            if "param_names" in g and "param_names" not in saved:
                saved["param_names"] = g["param_names"]
            groups.append(saved)
        added = {p: self._new_state(local(p), self._slots[p].where) for g in groups if g["amsgrad"]
                 for p in g["params"] if "max_exp_avg_sq" not in self.state[p]}
        super().__setstate__({"state": self.state, "param_groups": groups})
        self._fill_group_defaults()
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if p in added:
                    st["max_exp_avg_sq"] = added[p]
                elif not group["amsgrad"]:
                    st.pop("max_exp_avg_sq", None)  # torch's keys exactly; the memory goes back to the pool
                self._restore_state(p, st, by_param.get(p))
        self._drop_grad_copies()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _restore_state(self, p: torch.Tensor, st: dict, saved: Optional[dict]) -> None:
        """Copies a saved state (or zeros, without one) into the state tensors of `p`."""
        for k, t in st.items():
            if k == "step":
                t.fill_(float(saved["step"]) if saved is not None else 0.0)
            elif k == "master_param":
                t.copy_(_as_local(saved[k]) if saved is not None and k in saved else local(p))
            elif saved is not None and k in saved:
                t.copy_(_as_local(saved[k]))
            else:
                t.zero_()
        slot = self._slots[p]
        slot.seen = param_key(local(p))
        if slot.host_param is not None:
            real(slot.host_param).copy_(real(local(p)))

    def _fill_group_defaults(self) -> None:
        """What torch.optim.AdamW's __setstate__ fills into groups of older state dicts."""
        for group in self.param_groups:
            for k, v in TORCH_FLAG_DEFAULTS.items():
                group.setdefault(k, v)

    # ----------------------------------------------------- copy and pickle
    def __getstate__(self) -> Dict[str, Any]:
        """torch's three entries (defaults, state, param_groups: the state as
        plain tensors once pickled) and this optimizer's own settings. The pool
        is not pickled: an unpickled optimizer uses the default pool (a
        deepcopy shares the original's pool)."""
        self.synchronize()
        self._reread_written()
        return {"defaults": self.defaults, "state": self.state, "param_groups": self.param_groups,
                "hipferry": dict(step_on=self._requested_step_on, min_offload_numel=self._min_offload_numel,
                                 chunk_numel=self._chunk_numel, ring_slots=self._ring_slots,
                                 skip_nonfinite=self._skip_nonfinite, overlap=self._overlap),
                "counters": dict(skipped_steps=self.skipped_steps, last_step_skipped=self.last_step_skipped)}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        if "_slots" in self.__dict__:  # torch.optim.Optimizer's protocol inside load_state_dict
            super().__setstate__(state)
            self._fill_group_defaults()
            return
        self._rebuild(state, pool=None)

    def __deepcopy__(self, memo: dict) -> "OffloadAdamW":
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new._rebuild(copy.deepcopy(self.__getstate__(), memo), pool=self._pool)
        return new

    @torch.no_grad()
    def _rebuild(self, state: Dict[str, Any], pool: Optional[PinnedPool]) -> None:
        """Unpickling / deepcopy: a new optimizer over the copied parameters (its
        state in `pool`), then the copied state restored into it."""
        d = state["defaults"]
        own = {k: d[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach",
                                 "capturable", "differentiable", "fused") if k in d}
        groups = [dict(g) for g in state["param_groups"]]
        OffloadAdamW.__init__(self, groups, **own, **state.get("hipferry", {}), pool=pool)
        for p in (p for g in self.param_groups for p in g["params"]):
            self._restore_state(p, self.state[p], state["state"].get(p))
        for k, v in state.get("counters", {}).items():
            setattr(self, k, v)


class _Done:
    """A finished gradient copy (after clip_grad_norm_ scaled it on the host)."""

    def __init__(self, host: torch.Tensor):
        self._host = host

    def wait(self) -> torch.Tensor:
        return self._host


def _inv_scale(scale: torch.Tensor) -> torch.Tensor:
    """The factor GradScaler unscales by (GradScaler.unscale_'s own formula)."""
    return scale.double().reciprocal().float()


def _as_local(t: Any) -> torch.Tensor:
    return local(t) if isinstance(t, torch.Tensor) else torch.as_tensor(t)


def _weak_hook(opt: "OffloadAdamW") -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook that does not keep the optimizer alive (the
    parameter holds its hooks): once the optimizer is gone it does nothing."""
    ref = weakref.ref(opt)

    def hook(p: torch.Tensor) -> None:
        target = ref()
        if target is not None:
            target._on_grad_ready(p)
    return hook
