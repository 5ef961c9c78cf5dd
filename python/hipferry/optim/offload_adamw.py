"""OffloadAdamW: torch.optim.AdamW whose state lives in pinned host memory.

Design and API: docs/optimizer.md. The optimizer is cut by role:
- this class: construction, the checks of step(), which engine steps which
  parameter, zero_grad, clipping and writes made outside step();
- the state store (state_store.py): where master, m and v live and in what
  format, and the fused step over them (csrc/core/optim/adamw_update.h);
- the engines (engines.py): in place, host-for-GPU (step_on="cpu": gradients
  come over during backward, new values go back with async copies while the
  host steps the next parameter; grad_copies.py) and GPU-streamed
  (step_on="gpu": the state streams through a ring of device buffers);
- overlap="backward" (overlap.py, speculation.py): steps during backward;
- persistence (persistence.py): state_dict, load_state_dict, pickling;
- state_dir=...: the state in files (disk/, docs/disk-state.md).
Small GPU parameters keep their state on the device and step there.
"""
import contextlib
import logging
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch

from ..pool import PinnedPool, resolve_pool
from ..torch_private import supports_amp_scaling
from .checks import (check_flag, check_group_options, check_norm_args, check_options, check_param, grads_finite,
                     group_hyper, param_dtype, split_params, squeezed_betas, unordered_params_message, validate_step)
from .engines import HostForGpuEngine, InPlaceEngine, StepItem, StreamedEngine, choose_step_on
from .grad_copies import GradCopies
from .layout import memory_flat, real
from .overlap import NO_OVERLAP_STATS, BackwardOverlap
from .persistence import StatePersistence
from .slots import Slot, param_key
from .stats import memory_stats
from .state import local, torch_group_defaults
from .disk.engine import DiskEngine
from .disk.options import DiskOptions, check_disk_options
from .disk.store import DiskStore
from .int8_store import Int8Store
from .state_store import Float32Store
from .write_tracking import reread_if_written

log = logging.getLogger("hipferry.optim")


@supports_amp_scaling  # GradScaler hands step() grad_scale and found_inf (see scaler_driven in step)
class OffloadAdamW(StatePersistence, torch.optim.Optimizer):
    """torch.optim.AdamW with its state in pinned host memory (see module doc).

    ``foreach``, ``fused`` and ``capturable`` are accepted for drop-in use and
    ignored (the step is always one fused pass per parameter);
    ``differentiable=True`` is rejected."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, maximize: bool = False, *,
                 foreach: Optional[bool] = None, capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, step_on: str = "auto", pool: Optional[PinnedPool] = None,
                 min_offload_numel: int = 65536, chunk_numel: int = 1 << 21, ring_slots: int = 3,
                 skip_nonfinite: bool = False, overlap: Optional[str] = None,
                 state_dtype: torch.dtype = torch.float32, min_8bit_numel: int = 4096,
                 state_dir: Optional[str] = None, disk: Optional[DiskOptions] = None):
        defaults = dict(torch_group_defaults(), lr=lr, betas=tuple(betas) if isinstance(betas, list) else betas,
                        eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize, foreach=foreach,
                        capturable=capturable, differentiable=differentiable, fused=fused)
        check_group_options(defaults, "the default group")
        defaults["betas"] = squeezed_betas(defaults["betas"])
        if fused and foreach:
            raise ValueError("OffloadAdamW: fused=True and foreach=True cannot be given together (as in "
                             "torch.optim.AdamW); both are ignored, pass at most one")
        check_options(skip_nonfinite=skip_nonfinite, overlap=overlap, step_on=step_on, state_dtype=state_dtype,
                      min_offload_numel=min_offload_numel, chunk_numel=chunk_numel, ring_slots=ring_slots,
                      min_8bit_numel=min_8bit_numel)
        check_disk_options(state_dir, disk, overlap, step_on)
        if isinstance(params, (set, frozenset)):
            raise TypeError(unordered_params_message("params"))
        # Set before super().__init__, which calls add_param_group.
        self._settings = dict(step_on=step_on, min_offload_numel=min_offload_numel, chunk_numel=chunk_numel,
                              ring_slots=ring_slots, skip_nonfinite=skip_nonfinite, overlap=overlap,
                              state_dtype=state_dtype, min_8bit_numel=min_8bit_numel)
        self._pool = resolve_pool(pool, "OffloadAdamW")
        ram = Int8Store(self._pool, min_8bit_numel) if state_dtype == torch.uint8 else Float32Store(self._pool)
        self._grad_copies = GradCopies(self._pool)
        self._in_place = InPlaceEngine(ram)
        self._host_for_gpu = HostForGpuEngine(ram, self._grad_copies)
        # state_dir: parameters the disk store can hold keep their state in files (disk/).
        self._store = ram if state_dir is None else DiskStore(state_dir, disk or DiskOptions(), ram,
                                                              state_dtype == torch.uint8, min_8bit_numel, self._pool)
        self._disk = None if state_dir is None else DiskEngine(self._store, self._grad_copies, self._pool)
        self._streamed = StreamedEngine(chunk_numel, ring_slots)
        # overlap="backward": parameters stepped on the CPU are stepped speculatively during
        # backward and committed or redone at step() (Note [speculative step]).
        self._overlap = BackwardOverlap(self._store, self._grad_copies, self) if overlap == "backward" else None
        self._slots: Dict[torch.Tensor, Slot] = {}
        self._hooks: list = []
        self.step_on = "cpu"
        self.step_on_reason = ""
        self.skipped_steps = 0
        self.last_step_skipped = False
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
        if self.step_on_reason:
            self._choose_engine()  # a group added later may bring GPU parameters
        for p in added["params"]:
            if (self._is_remote(p) or self._overlap is not None) and p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(_weak_hook(self)))

    def _allocate(self, params: List[torch.Tensor], group: dict) -> None:
        """Every state tensor of `params` at once, so a pool that is too small fails
        here, before anything is kept. On the device: small GPU parameters, float64
        ones (torch ops, no fused kernel) and non-dense ones (no flat view to stream)."""
        plan, wheres = [], []
        for p in params:
            lp = local(p)
            where = "device" if lp.device.type == "cuda" and (lp.numel() < self._settings["min_offload_numel"] or
                                                              param_dtype(lp) == torch.float64 or
                                                              memory_flat(real(lp)) is None) else "host"
            plan.append((lp, where, self._store.plan_keys(lp, where, group["amsgrad"])))
            wheres.append(where)
        for p, where, st in zip(params, wheres, self._store.allocate(plan)):
            lp = local(p)
            self.state[p] = st
            self._slots[p] = Slot(where=where, shape=tuple(lp.shape), dtype=lp.dtype, seen=param_key(lp))

    def _choose_engine(self) -> None:
        before = self.step_on if self.step_on_reason else None
        gpu_params = [local(p) for g in self.param_groups for p in g["params"]
                      if p.device.type == "cuda" and self._slots[p].where == "host"]
        any_gpu = any(p.device.type == "cuda" for g in self.param_groups for p in g["params"])
        on_disk = self._store.format.startswith("disk")
        requested = "cpu" if on_disk and gpu_params else self._settings["step_on"]
        self.step_on, self.step_on_reason = choose_step_on(requested, gpu_params, any_gpu,
                                                           any(g["amsgrad"] for g in self.param_groups),
                                                           eight_bit=self._store.format == "uint8")
        if requested != self._settings["step_on"]:
            self.step_on_reason = f"{self._store.format} state steps on the CPU (the GPU-streamed engine moves " \
                                  "host state in RAM, not in files)"
        log.info("OffloadAdamW: step_on=%s (%s)", self.step_on, self.step_on_reason)
        if before is not None and before != self.step_on:
            # The other engine updates float32 GPU parameters on the device without a
            # version bump: the CPU engine's host copies would be stale.
            self._streamed.synchronize()
            for slot in self._slots.values():
                slot.host_param = None

    def _is_remote(self, p: torch.Tensor) -> bool:
        """Whether the parameter lives elsewhere than its state (a GPU parameter)."""
        return p.device.type == "cuda"

    # ------------------------------------------------------- backward hooks
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        slot = self._slots.get(p)
        if slot is None or slot.where != "host" or p.grad is None or p.grad.is_sparse:
            return
        if not self._is_remote(p):
            if self._overlap is not None and not self._overlap.from_ddp:  # (DDP: after the allreduce)
                self._overlap.start_local(p, slot, self.state.get(p), self.param_groups)
            return
        if self.step_on != "cpu" or (self._overlap is not None and self._overlap.from_ddp):
            return  # (DDP: the comm hook copies the reduced gradient)
        self._grad_copies.start(slot, local(p.grad))
        if self._overlap is not None:
            self._overlap.start_remote(p, slot, self.state[p], self.param_groups)

    def _on_reduced_grad(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """DDP's comm hook (register_ddp_comm_hook): `p`'s gradient after the allreduce."""
        slot = self._slots.get(p)
        if not self._is_remote(p):
            self._overlap.start_local(p, slot, self.state.get(p), self.param_groups, grad)
        elif slot is not None and slot.where == "host" and self.step_on == "cpu":
            self._overlap.start_reduced(p, slot, self.state[p], self.param_groups, local(grad))

    def register_ddp_comm_hook(self, ddp_model: Any, process_group: Any = None) -> None:
        """overlap="backward" under DistributedDataParallel: a parameter's gradient
        is final only after its bucket's allreduce, which runs after the
        post-accumulate-grad hook. This registers DDP's default allreduce as
        ``ddp_model``'s communication hook, followed by the start of each
        bucket parameter's step from the reduced gradient. (Without it, every
        speculation is redone at step(): correct, no gain.)"""
        if self._overlap is None:
            raise ValueError("OffloadAdamW.register_ddp_comm_hook: this optimizer was built without "
                             "overlap='backward'; expected OffloadAdamW(..., overlap='backward')")
        self._overlap.register_ddp_comm_hook(self, ddp_model, process_group)

    def accumulating(self):
        """Micro-batches whose gradients are accumulated, not stepped: with
        ``overlap="backward"`` their backward starts no speculative step (only
        saves work: the last micro-batch's step sees the sum either way)."""
        return self._overlap.accumulating() if self._overlap is not None else contextlib.nullcontext()

    def overlap_stats(self) -> dict:
        """overlap="backward": speculative steps started, committed and redone at step(), failed
        jobs, parameters without pool room, commits that copied the state, scratch bytes (docs/optimizer.md)."""
        return dict(NO_OVERLAP_STATS) if self._overlap is None else self._overlap.stats()

    # CPU engine, GPU parameters: gradient copies from backward that step() used, and copies
    # step() had to make itself (none, or a changed gradient).
    grad_copies_reused = property(lambda self: self._grad_copies.reused)
    grad_copies_made_at_step = property(lambda self: self._grad_copies.made_at_step)

    # ----------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work, added = validate_step(self.param_groups, self._slots, self.state, self._store)  # changes nothing
        spec = self._overlap.speculation if self._overlap is not None else None
        if spec is not None:
            spec.wait()  # the speculative steps read the state: done before anything changes
        for p, tensors in added:
            self.state[p].update(tensors)
        self.last_step_skipped = False
        scaler_driven = hasattr(self, "found_inf")  # torch.amp.GradScaler.step (see supports_amp_scaling)
        if (scaler_driven and float(self.found_inf) > 0) or \
                (self._settings["skip_nonfinite"] and work and not grads_finite([p for _, p in work])):
            self.skipped_steps += 1
            self.last_step_skipped = True
            self._grad_copies.drop(self._slots.values())
            if spec is not None:
                spec.drop()
            # Writes made before this step (p.data = t, in-place ops) still reach the
            # masters and host copies now: the state read after a skipped step is current.
            self._reread_written()
            return loss
        scale = getattr(self, "grad_scale", None) if scaler_driven else None
        if scaler_driven:
            if scale is None:  # scaler.unscale_ changed the gradients in place, with no version bump
                self._grad_copies.drop(self._slots.values())
            else:
                self._grad_copies.unscale([(self._slots[p], local(p.grad)) for _, p in work], scale)
        if spec is not None:  # how the next backward's speculations unscale their gradients
            self._overlap.note_scale(scaler_driven, scale, [p for _, p in work], self.state)
        # A parameter without a gradient is not stepped, but a write to it still reaches its
        # master and host copy now, as after a skipped step: the state read after step() is current.
        stepping = {id(p) for _, p in work}
        for p, slot in self._slots.items():
            if id(p) not in stepping:
                self._reread_if_written(p, slot)
        self._grad_copies.wait_back()  # the host buffers the last step sent back are written again below
        self._run_engines(work, spec)
        for _, p in work:  # after all writes: parameters that are views of one buffer share a version counter
            self._slots[p].seen = param_key(local(p))
        if spec is not None:
            spec.drop()  # speculations of parameters without a gradient now: stale next step
        return loss

    def _run_engines(self, work: list, spec) -> None:
        """Counts the step of every parameter in `work`, commits its speculation where it
        holds, and hands it to its engine."""
        in_place, streamed, host_gpu, on_disk = [], [], [], []
        hypers = {id(g): group_hyper(g) for g in self.param_groups}  # once per group, not per parameter
        for group, p in work:
            st, slot = self.state[p], self._slots[p]
            self._reread_if_written(p, slot)
            st["step"] += 1
            it = StepItem(p, st, slot, hypers[id(group)], int(st["step"].item()))
            if "disk" in st:
                on_disk.append(it)
                continue
            remote_host = slot.where == "host" and self._is_remote(p) and param_dtype(local(p)) != torch.float64
            if not remote_host:
                in_place.append(it)
            elif self.step_on == "gpu" and self._streamed.streamable(p, st):
                streamed.append(it)
                continue
            else:
                host_gpu.append(it)
                if spec is not None:  # the commit compares the host copy of the gradient
                    it.grad = real(self._grad_copies.host_grad(slot, local(p.grad)))
            if spec is not None and slot.where == "host":
                it.committed = spec.try_commit(p, st, it.hyper, it.step, it.grad)
        if on_disk:  # first: the step most likely to fail (I/O), and it changes nothing when it does
            self._disk.step(on_disk)
        self._in_place.step(in_place)
        if streamed:
            self._streamed.step(streamed)
        if host_gpu:
            self._host_for_gpu.step(host_gpu)

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
        if self._overlap is not None:
            self._overlap.speculation.forget(chosen)  # (stepped from the values before the write)
        for p in chosen:
            slot = self._slots[p]
            slot.seen = None
            self._reread_if_written(p, slot)

    @torch.no_grad()
    def _reread_written(self) -> None:
        """Every parameter written outside step() (as far as it shows) is read again."""
        for p, slot in self._slots.items():
            self._reread_if_written(p, slot)

    def _reread_if_written(self, p: torch.Tensor, slot: Slot) -> None:
        if "disk" in self.state[p]:
            return  # the disk step takes a write as it steps (DiskEngine: adopt)
        reread_if_written(local(p), self.state[p], slot, before=self.synchronize)

    # ------------------------------------------------------------ utilities
    def __del__(self) -> None:
        overlap = getattr(self, "_overlap", None)
        if overlap is not None:
            try:
                overlap.speculation.close()
            except Exception:  # interpreter shutdown
                pass
        if getattr(self, "_disk", None) is not None:
            self._store.close()
        for handle in getattr(self, "_hooks", ()):
            try:
                handle.remove()
            except Exception:  # interpreter shutdown
                pass

    def synchronize(self) -> None:
        """Waits until the state on the host is up to date."""
        self._streamed.synchronize()
        self._grad_copies.wait_back()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._grad_copies.drop(self._slots.values())
        if self._overlap is not None:
            self._overlap.speculation.drop()  # (waits: a job may still read the gradient)
        super().zero_grad(set_to_none=set_to_none)

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
        return self._grad_copies.clip(params, [self._slots.get(p) for p in params], max_norm, norm_type,
                                      error_if_nonfinite, foreach)

    def memory_stats(self) -> dict:
        """Host and device bytes of the state, buffers, format (stats.py); with state_dir, the disk's too."""
        return memory_stats(self._slots, self.state, self._store, self._streamed.ring_bytes)


def _weak_hook(opt: "OffloadAdamW") -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook that does not keep the optimizer alive (the
    parameter holds its hooks): once the optimizer is gone it does nothing."""
    ref = weakref.ref(opt)

    def hook(p: torch.Tensor) -> None:
        target = ref()
        if target is not None:
            target._on_grad_ready(p)
    return hook
