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
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch

from .. import _C
from ..pool import PinnedPool, default_pool
from ..transfer import Transfer, offload
from . import calibration
from .state import (LOW_PRECISION, SUPPORTED, check_hyper, check_param, format_bytes, local, state_keys,
                    to_global_state, torch_group_defaults)

log = logging.getLogger("hipferry.optim")


@dataclass
class _Slot:
    """Per-parameter bookkeeping that is not part of torch's state format."""
    where: str                                 # "host" (state in the pool) or "device" (small GPU parameter)
    host_param: Optional[torch.Tensor] = None  # CPU engine, float32 GPU parameter: the host working copy
    host_out: Optional[torch.Tensor] = None    # CPU engine, low-precision GPU parameter: the rounded values to send
    param_version: int = -1                    # local(p)._version after our last write (-1: read p again)
    grad_copy: Optional[Transfer] = None       # gradient copy started by the backward hook
    copied_grad: Optional[torch.Tensor] = None  # the gradient tensor that copy read ...
    copied_version: int = -1                   # ... and its version then (a change means: copy again)

    def copy_is_current(self, grad: torch.Tensor) -> bool:
        """A gradient copy was started and `grad` is the same tensor, unchanged since."""
        return self.grad_copy is not None and self.copied_grad is grad and self.copied_version == grad._version


class OffloadAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW with its state in pinned host memory (see module doc)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, maximize: bool = False, *,
                 step_on: str = "auto", pool: Optional[PinnedPool] = None, min_offload_numel: int = 65536,
                 chunk_numel: int = 1 << 21, ring_slots: int = 3, skip_nonfinite: bool = False,
                 _cpu_params_as_remote: bool = False):
        check_hyper(lr, betas, eps, weight_decay)
        if step_on not in ("auto", "cpu", "gpu"):
            raise ValueError(f"OffloadAdamW: step_on must be 'auto', 'cpu' or 'gpu', got {step_on!r}")
        if pool is not None and not isinstance(pool, PinnedPool):
            raise TypeError(f"OffloadAdamW: pool must be a hipferry.PinnedPool or None, got {type(pool).__name__}")
        for name, value, low in (("min_offload_numel", min_offload_numel, 0), ("chunk_numel", chunk_numel, 1),
                                 ("ring_slots", ring_slots, 2)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"OffloadAdamW: {name} must be an int >= {low}, got {value!r}")
        # Set before super().__init__, which calls add_param_group.
        self._pool = pool or default_pool()
        self._min_offload_numel = min_offload_numel
        self._chunk_numel = chunk_numel
        self._ring_slots = ring_slots
        self._skip_nonfinite = bool(skip_nonfinite)
        # Test seam: run the CPU engine's path for GPU parameters (gradient copies
        # started by backward hooks, host working copies, copies back) on CPU
        # parameters, so machines without a GPU test it too.
        self._cpu_params_as_remote = bool(_cpu_params_as_remote)
        self._slots: Dict[torch.Tensor, _Slot] = {}
        self._hooks: list = []
        self._streamers: Dict[int, Any] = {}     # GPU index -> _C.AdamWStreamer
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
        defaults = dict(torch_group_defaults(), lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize)
        super().__init__(params, defaults)
        self._choose_engine()

    # ---------------------------------------------------------------- setup
    def add_param_group(self, param_group: dict) -> None:
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        g_index = len(self.param_groups)
        for i, p in enumerate(params):
            check_param(p, g_index, i)
        group["params"] = params
        super().add_param_group(group)
        added = self.param_groups[-1]
        try:
            check_hyper(added["lr"], added["betas"], added["eps"], added["weight_decay"])
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
            if self._is_remote(p) and p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(_weak_hook(self)))

    def _allocate(self, params: List[torch.Tensor], group: dict) -> None:
        """Allocates (and zeroes) every state tensor of `params` at once, so a
        pool that is too small fails here, before anything is kept."""
        plan = []
        for p in params:
            lp = local(p)
            where = "device" if lp.device.type == "cuda" and lp.numel() < self._min_offload_numel else "host"
            plan.append((p, lp, where, state_keys(lp, group["amsgrad"])))
        need = sum(lp.numel() * 4 * len(keys) for _, lp, where, keys in plan if where == "host")
        states: List[dict] = []
        st: dict = {}
        try:
            for p, lp, where, keys in plan:
                st = {"step": torch.tensor(0.0)}
                for k in keys:
                    st[k] = self._new_state(lp, where)
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
            self._slots[p] = _Slot(where=where, param_version=lp._version)

    def _new_state(self, lp: torch.Tensor, where: str) -> torch.Tensor:
        if where == "device":
            return torch.zeros(lp.shape, dtype=torch.float32, device=lp.device)
        return self._pool.empty(*lp.shape, dtype=torch.float32).zero_()

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
        return p.device.type == "cuda" or self._cpu_params_as_remote

    # ------------------------------------------------------- backward hooks
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        slot = self._slots.get(p)
        if slot is None or slot.where != "host" or self.step_on != "cpu" or p.grad is None or p.grad.is_sparse:
            return
        grad = local(p.grad)
        slot.grad_copy = offload(grad, pool=self._pool)
        slot.copied_grad, slot.copied_version = grad, grad._version

    def _host_grad(self, p: torch.Tensor, slot: _Slot) -> torch.Tensor:
        grad = local(p.grad)
        if slot.copy_is_current(grad):
            copy = slot.grad_copy
            self.grad_copies_reused += 1
        else:
            copy = offload(grad, pool=self._pool)  # changed since the hook (accumulation, clipping, scaling)
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
        work = []
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is not None:
                    self._check_grad(p, gi, pi)
                    work.append((group, p))
        self.last_step_skipped = False
        scaler_driven = hasattr(self, "found_inf")  # torch.amp.GradScaler.step (see _step_supports_amp_scaling)
        if (scaler_driven and float(self.found_inf) > 0) or \
                (self._skip_nonfinite and work and not self._grads_finite([p for _, p in work])):
            self.skipped_steps += 1
            self.last_step_skipped = True
            self._drop_grad_copies()
            return loss
        if scaler_driven:
            if getattr(self, "grad_scale", None) is None:
                self._drop_grad_copies()  # scaler.unscale_ changed the gradients in place, with no version bump
            else:
                self._unscale([p for _, p in work], self.grad_scale)
        self._wait_copies_back()  # the host buffers the last step sent back are written again below
        streamed: Dict[tuple, list] = {}
        host_gpu = []
        for group, p in work:
            st, slot = self.state[p], self._slots[p]
            self._refresh_master(p, st, slot)
            st["step"] += 1
            step = int(st["step"].item())
            if slot.where == "device" or not self._is_remote(p):
                self._step_in_place(group, p, st, step)
            elif self.step_on == "gpu":
                streamed.setdefault((id(group), p.device.index, step), []).append((group, p))
            else:
                host_gpu.append((group, p, step))
        for (_, device, step), items in streamed.items():
            self._step_streamed(device, step, items)
        # The state is back on the host when step() returns: costs the last chunk's
        # copy out (the next forward is queued behind the step's kernels anyway), and
        # opt.state can be read on the host at once.
        self._sync_streamers()
        for group, p, step in host_gpu:
            self._step_host_for_gpu(group, p, step)
        for device in sorted({p.device.index for _, p, _ in host_gpu if p.device.type == "cuda"}):
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._copies_back.append(event)
        return loss

    # torch.amp.GradScaler: hand this optimizer `grad_scale` and `found_inf`
    # instead of unscaling the gradients itself, which it does in place without a
    # version bump, unseen by the CPU engine's gradient copies.
    _step_supports_amp_scaling = True

    def _unscale(self, params: List[torch.Tensor], scale: torch.Tensor) -> None:
        """What GradScaler.unscale_ does (the same op and factor), applied to the
        CPU engine's host copies where they are current, else to p.grad."""
        inv = scale.double().reciprocal().float()
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
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv.to(device))

    def _check_grad(self, p: torch.Tensor, gi: int, pi: int) -> None:
        g = p.grad
        where = f"params[group {gi}][{pi}]"
        if g.is_sparse or g.layout != torch.strided:
            raise ValueError(f"OffloadAdamW does not support sparse gradients; {where} has a {g.layout} gradient")
        if g.shape != p.shape or g.device != p.device or local(g).dtype not in SUPPORTED:
            raise ValueError(f"OffloadAdamW: the gradient of {where} is {g.dtype} {tuple(g.shape)} on {g.device}; "
                             f"expected a float32, float16 or bfloat16 gradient shaped {tuple(p.shape)} on "
                             f"{p.device}")

    def _grads_finite(self, params: List[torch.Tensor]) -> bool:
        flags = [torch.isfinite(local(p.grad)).all() for p in params]
        by_device: Dict[torch.device, list] = {}
        for f in flags:
            by_device.setdefault(f.device, []).append(f)
        return all(bool(torch.stack(fs).all()) for fs in by_device.values())

    def _refresh_master(self, p: torch.Tensor, st: dict, slot: _Slot) -> None:
        """Reads the parameter again if it was changed outside step()."""
        lp = local(p)
        if lp._version == slot.param_version:
            return
        self._sync_streamers()  # a streamed step may still be writing the master back
        if "master_param" in st:
            st["master_param"].copy_(lp)
        if slot.host_param is not None:
            slot.host_param.copy_(lp)
        slot.param_version = lp._version

    def _hyper(self, group: dict) -> dict:
        beta1, beta2 = group["betas"]
        return dict(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]), amsgrad=bool(group["amsgrad"]),
                    maximize=bool(group["maximize"]))

    def _step_in_place(self, group: dict, p: torch.Tensor, st: dict, step: int) -> None:
        """State and gradient on the parameter's own device: one fused call."""
        lp = local(p)
        grad = local(p.grad).contiguous()
        master = st.get("master_param")
        _C._adamw_step_(master if master is not None else lp, grad, st["exp_avg"], st["exp_avg_sq"],
                        st.get("max_exp_avg_sq") if group["amsgrad"] else None,
                        lp if master is not None else None, step, **self._hyper(group))
        torch.autograd.graph.increment_version(lp)  # written through a raw pointer: say so (offload_layers reads it)
        self._slots[p].param_version = lp._version

    def _step_host_for_gpu(self, group: dict, p: torch.Tensor, step: int) -> None:
        """CPU engine, GPU parameter: host step, then an async copy back."""
        st, slot = self.state[p], self._slots[p]
        lp = local(p)
        grad = self._host_grad(p, slot)
        master = st.get("master_param")
        if master is None and slot.host_param is None:
            slot.host_param = self._pool.empty(*lp.shape, dtype=torch.float32)
            slot.host_param.copy_(lp)
        if master is not None and slot.host_out is None:
            slot.host_out = self._pool.empty(*lp.shape, dtype=lp.dtype)
        _C._adamw_step_(master if master is not None else slot.host_param, grad, st["exp_avg"], st["exp_avg_sq"],
                        st.get("max_exp_avg_sq") if group["amsgrad"] else None,
                        slot.host_out if master is not None else None, step, **self._hyper(group))
        lp.copy_(slot.host_out if master is not None else slot.host_param, non_blocking=True)
        slot.param_version = lp._version

    def _step_streamed(self, device: int, step: int, items: list) -> None:
        streamer = self._streamers.get(device)
        if streamer is None:
            streamer = _C.AdamWStreamer(device, self._chunk_numel, self._ring_slots)
            self._streamers[device] = streamer
        group = items[0][0]
        lists: Dict[str, list] = {k: [] for k in ("params", "grads", "masters", "exp_avgs", "exp_avg_sqs",
                                                  "max_exp_avg_sqs")}
        for _, p in items:
            st, lp = self.state[p], local(p)
            lists["params"].append(lp)
            lists["grads"].append(local(p.grad).contiguous())
            lists["masters"].append(st.get("master_param"))
            lists["exp_avgs"].append(st["exp_avg"])
            lists["exp_avg_sqs"].append(st["exp_avg_sq"])
            lists["max_exp_avg_sqs"].append(st.get("max_exp_avg_sq") if group["amsgrad"] else None)
        streamer.step(**lists, step=step, **self._hyper(group))
        for _, p in items:
            torch.autograd.graph.increment_version(local(p))  # written by our kernel, unseen by autograd
            self._slots[p].param_version = local(p)._version

    # ------------------------------------------------------------ utilities
    def __del__(self) -> None:
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
                slot.copied_version = local(p.grad)._version
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
        sd = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        sd["state"] = {i: to_global_state(params[i], st) if isinstance(i, int) and i < len(params) else st
                       for i, st in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        from .state import check_loadable
        self.synchronize()
        by_param = check_loadable(self, state_dict)  # validates everything first
        groups = [{k: v for k, v in g.items()} for g in state_dict["param_groups"]]
        kept = {p: self.state[p] for p in self._slots}
        super().load_state_dict({"state": {}, "param_groups": groups})
        for group in self.param_groups:
            for p in group["params"]:
                st = kept[p]
                if group["amsgrad"] and "max_exp_avg_sq" not in st:
                    st["max_exp_avg_sq"] = self._new_state(local(p), self._slots[p].where)
                elif not group["amsgrad"]:
                    st.pop("max_exp_avg_sq", None)  # torch's keys exactly; the memory goes back to the pool
                saved = by_param.get(p)
                for k, t in st.items():
                    if k == "step":
                        t.fill_(float(saved["step"]) if saved is not None else 0.0)
                    elif k == "master_param":
                        t.copy_(_as_local(saved[k]) if saved is not None and k in saved else local(p))
                    elif saved is not None and k in saved:
                        t.copy_(_as_local(saved[k]))
                    else:
                        t.zero_()
                self.state[p] = st
                slot = self._slots[p]
                slot.param_version = local(p)._version
                if slot.host_param is not None:
                    slot.host_param.copy_(local(p))
        self._drop_grad_copies()


class _Done:
    """A finished gradient copy (after clip_grad_norm_ scaled it on the host)."""

    def __init__(self, host: torch.Tensor):
        self._host = host

    def wait(self) -> torch.Tensor:
        return self._host


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
