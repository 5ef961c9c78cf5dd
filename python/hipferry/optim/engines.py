"""OffloadAdamW's engines: what runs a step over a list of parameters.

Each engine takes `StepItem`s (a parameter, its state and the step to take)
and steps them with the state store's fused pass; none decides which
parameter goes where (OffloadAdamW.step does) or what the state's format is
(the store does).
- InPlaceEngine: state and gradient where the parameter is (CPU parameters,
  small GPU parameters whose state stays on the device, float64 ones).
- HostForGpuEngine (step_on="cpu", GPU parameters): the host steps a host
  copy of the gradient (started in backward: grad_copies.py) and sends the
  new values back with async copies while it steps the next parameter.
- StreamedEngine (step_on="gpu"): the state (float32 or 8-bit moments) streams
  through a ring of device buffers, one fused kernel per chunk
  (hipferry._C.AdamWStreamer).
"""
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from .. import _C
from . import calibration
from .checks import LOW_PRECISION, param_dtype
from .grad_copies import GradCopies
from .layout import aligned, memory_flat, real, torch_ops_step
from .slots import Slot, param_key
from .state import local
from .tracing import TRACK_COPIES_BACK, TRACK_STEP, span


@dataclass
class StepItem:
    p: torch.Tensor
    st: dict
    slot: Slot
    hyper: dict
    step: int
    committed: Optional[Dict[str, torch.Tensor]] = None  # a speculative step's scratch to take instead
    grad: Optional[torch.Tensor] = None  # HostForGpuEngine: the host gradient, when step() fetched it already


class InPlaceEngine:
    def __init__(self, store):
        self.store = store
        # float32 state: the parameters that step straight from their own memory all go
        # through ONE C++ call (Float32Store.step_many): the Python work between one call
        # per parameter cost more than the gap to torch's fused step (issue 31).
        self.batched = store.format == "float32"

    def step(self, items: List[StepItem]) -> None:
        if not self.batched or len(items) < 2 or _C.trace_active():  # a trace shows each parameter's step
            for it in items:
                with span("step", TRACK_STEP, it.p):
                    self._step_one(it)
            return
        run: List[tuple] = []  # in order: a parameter that cannot join steps after the run before it
        for it in items:
            args = self._direct(it)
            if args is not None:
                run.append(args)
                continue
            self._step_run(run)
            run = []
            self._step_one(it)
        self._step_run(run)

    @staticmethod
    def _direct(it: StepItem) -> Optional[tuple]:
        """Float32Store.step_many's item for `it` (the arguments _step_one passes to
        Float32Store.step), or None where _step_one does more than that call: a
        committed speculation, float64, or a parameter that needs a working copy."""
        lp, st = local(it.p), it.st
        rp = real(lp)
        if it.committed is not None or param_dtype(lp) == torch.float64 or \
                rp.stride() != real(st["exp_avg"]).stride() or memory_flat(rp) is None:
            return None
        grad = real(local(it.p.grad))
        master = st.get("master_param")
        if master is not None:
            return it.hyper, master, grad, st, rp, it.step, True, lp, it.slot
        return it.hyper, rp, grad, st, None, it.step, False, lp, it.slot

    def _step_run(self, run: List[tuple]) -> None:
        if not run:
            return
        self.store.step_many([args[:7] for args in run])
        params = [args[7] for args in run]
        torch.autograd.graph.increment_version(params)  # written through a raw pointer: say so
        for args in run:
            args[8].seen = param_key(args[7])

    def _step_one(self, it: StepItem) -> None:
        lp, st, hyper = local(it.p), it.st, it.hyper
        rp, grad = real(lp), real(local(it.p.grad))
        m = real(st["exp_avg"])
        if it.committed is not None:  # the speculation's values become the parameter's (copy_ bumps its version)
            rp.copy_(it.committed["out"] if "master_param" in st else it.committed["target"])
            it.slot.seen = param_key(lp)
            return
        if param_dtype(lp) == torch.float64:
            torch_ops_step(rp, grad, m, real(st["exp_avg_sq"]),
                           real(st.get("max_exp_avg_sq")) if hyper["amsgrad"] else None, it.step, **hyper)
        else:
            # The parameter is walked in the state's memory order; a parameter that is
            # not dense, or whose strides changed since, goes through a working copy.
            direct = memory_flat(rp) is not None and rp.stride() == m.stride()
            master = st.get("master_param")
            if master is not None:
                out = rp if direct else torch.empty_like(m, dtype=rp.dtype)
                # direct: the fused pass takes a write no version showed (the parameter's bits no
                # longer the rounded master's) as the master first (adamw_update.h adopt_written)
                self.store.step(hyper, master, grad, st, hyper["amsgrad"], out, it.step, adopt=direct)
            else:
                out = rp if direct else torch.empty_like(m, dtype=torch.float32).copy_(rp)
                self.store.step(hyper, out, grad, st, hyper["amsgrad"], None, it.step)
            if out is not rp:
                rp.copy_(out)
        torch.autograd.graph.increment_version(lp)  # written through a raw pointer: say so (offload_layers reads it)
        it.slot.seen = param_key(lp)


class HostForGpuEngine:
    def __init__(self, store, grad_copies: GradCopies):
        self.store = store
        self.grad_copies = grad_copies

    def step(self, items: List[StepItem]) -> None:
        for it in items:
            with span("host step", TRACK_STEP, it.p):
                self._step_one(it)
        self.grad_copies.mark_back([it.p for it in items])

    def _step_one(self, it: StepItem) -> None:
        st, slot, lp = it.st, it.slot, local(it.p)
        grad = it.grad if it.grad is not None else real(self.grad_copies.host_grad(slot, local(it.p.grad)))
        master = st.get("master_param")
        m = real(st["exp_avg"])
        if master is None and slot.host_param is None:
            slot.host_param = self.store.host_tensor_like(m, torch.float32)
            slot.host_param.copy_(real(lp))
        if master is not None and slot.host_out is None:
            slot.host_out = self.store.host_tensor_like(m, lp.dtype)
        committed = it.committed
        if committed is not None:  # the new values are in the scratch: it becomes the host buffer
            if master is not None:
                slot.host_out, committed["out"] = committed["out"], slot.host_out
            else:
                slot.host_param, committed["target"] = committed["target"], slot.host_param
        else:
            self.store.step(it.hyper, master if master is not None else slot.host_param, grad, st,
                            it.hyper["amsgrad"], slot.host_out if master is not None else None, it.step)
        src = slot.host_out if master is not None else slot.host_param
        with span("copy back", TRACK_COPIES_BACK, src):
            self.grad_copies.send_back(real(lp), src)
        slot.seen = param_key(lp)


class StreamedEngine:
    def __init__(self, chunk_numel: int, ring_slots: int):
        self.chunk_numel, self.ring_slots = chunk_numel, ring_slots
        self._streamers: Dict[int, object] = {}  # GPU index -> _C.AdamWStreamer

    @staticmethod
    def streamable(p: torch.Tensor, st: dict) -> bool:
        """The streamer walks the parameter and its state as flat views: same strides, dense."""
        rp = real(local(p))
        return memory_flat(rp) is not None and rp.stride() == real(st["exp_avg"]).stride()

    def step(self, items: List[StepItem]) -> None:
        """Streams `items`, one streamer call per (device, step count, hyperparameters).
        The state is back on the host when this returns: costs the last chunk's copy
        out (the next forward is queued behind the step's kernels anyway), and
        opt.state can be read on the host at once."""
        runs: Dict[tuple, List[StepItem]] = {}
        for it in items:
            runs.setdefault((it.p.device.index, it.step, tuple(sorted(it.hyper.items()))), []).append(it)
        for (device, step, _), run in runs.items():
            with span(f"streamed step of {len(run)} parameters", TRACK_STEP,
                      nbytes=sum(it.p.nbytes for it in run)):
                self._stream(device, step, run)
        self.synchronize()

    def _stream(self, device: int, step: int, items: List[StepItem]) -> None:
        streamer = self._streamers.get(device)
        if streamer is None:
            streamer = _C.AdamWStreamer(device, self.chunk_numel, self.ring_slots)
            self._streamers[device] = streamer
        lists: Dict[str, list] = {k: [] for k in ("params", "grads", "masters", "exp_avgs", "exp_avg_sqs",
                                                  "max_exp_avg_sqs", "exp_avg_absmaxes", "exp_avg_sq_absmaxes",
                                                  "max_exp_avg_sq_absmaxes")}
        amsgrad = items[0].hyper["amsgrad"]
        for it in items:
            st, rp = it.st, real(local(it.p))
            m = real(st["exp_avg"])
            lists["params"].append(memory_flat(rp))
            lists["grads"].append(memory_flat(aligned(real(local(it.p.grad)), m)))
            master = st.get("master_param")
            lists["masters"].append(memory_flat(master) if master is not None else None)
            lists["exp_avgs"].append(memory_flat(m))
            lists["exp_avg_sqs"].append(memory_flat(real(st["exp_avg_sq"])))
            mx = st.get("max_exp_avg_sq") if amsgrad else None
            lists["max_exp_avg_sqs"].append(memory_flat(real(mx)) if mx is not None else None)
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):  # the scales of 8-bit moments (int8_store.py)
                scales = st.get(f"{key}_absmax") if key != "max_exp_avg_sq" or amsgrad else None
                lists[f"{key}_absmaxes"].append(scales)
        streamer.step(**lists, step=step, **items[0].hyper)
        for it in items:
            torch.autograd.graph.increment_version(local(it.p))  # written by our kernel, unseen by autograd
            it.slot.seen = param_key(local(it.p))

    def synchronize(self) -> None:
        for s in self._streamers.values():
            s.synchronize()

    @property
    def ring_bytes(self) -> int:
        return sum(s.ring_bytes for s in self._streamers.values())


def choose_step_on(requested: str, gpu_params: List[torch.Tensor], any_gpu: bool, amsgrad: bool,
                   eight_bit: bool = False) -> tuple:
    """(step_on, reason): the engine for parameters that live on a GPU with their state on the host."""
    if not gpu_params:
        if requested == "gpu" and not any_gpu:
            raise ValueError("OffloadAdamW: step_on='gpu' needs parameters on a GPU; all are on the CPU "
                             "(use step_on='cpu' or 'auto')")
        return ("cpu", "all parameters are on the CPU") if requested != "gpu" else \
            ("gpu", "requested (no parameter is large enough to stream)")
    if requested != "auto":
        return requested, "requested"
    low = sum(p.numel() for p in gpu_params if p.dtype in LOW_PRECISION)
    share = low / max(1, sum(p.numel() for p in gpu_params))
    cal = calibration.calibrate(gpu_params[0].device)
    return calibration.choose_engine(cal, share, amsgrad, eight_bit)
