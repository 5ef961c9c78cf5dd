"""The handle of ``hipferry.offload_layers`` and how an offloaded block runs.

Note [offloaded blocks]
~~~~~~~~~~~~~~~~~~~~~~~
* The user's ``nn.Parameter`` objects stay the parameters: their ``.data``
  becomes a view of the block's pinned host buffer (in ``dtype`` if given).
  Optimizers, ``state_dict`` and ``load_state_dict`` see host tensors.
* Each block's ``forward`` is wrapped (an instance attribute, as accelerate
  does): it acquires the block's ring slot (see Note [layer ring]), puts fresh
  device tensors of the slot in the place of the parameters for the call, and
  puts the parameters back afterwards (also on an exception).
* With grad enabled, each device tensor comes from ``_DeviceWeight``, whose
  backward sends the weight gradient device->host (``hipferry.offload``, on the
  copy stream, into the pool) as soon as backward produces it; at the end of
  backward the copies are waited for and accumulated into the parameters'
  ``.grad`` on the host -- summed in arrival order, then added once, as
  autograd's AccumulateGrad does -- and post-accumulate-grad hooks run
  (grad_sink.py). So an optimizer (OffloadAdamW's CPU step, or any CPU
  optimizer) steps the host weights in place. ``torch.autograd.grad`` with the host parameters as
  inputs is not supported (they get no gradient through it).
* Weights that autograd saves for backward are not kept: a saved-tensor hook
  recognizes views of ring slots -- and autocast's copies of a whole weight in
  another dtype (the cast's grad_fn leads to ``_DeviceWeight``; weights that
  require grad only) -- and saves (block, offset, shape, stride[, dtype]);
  backward brings the block in again, prefetching in reverse order the blocks
  that still have saved weights. Other saved tensors go to the hooks outside
  (activation checkpointing, ``offload_activations``), see saved_hooks.py.
* Resident copies are not reused after a backward has ended (the optimizer
  steps then): the next model call refreshes them. Within a call, parameter
  versions decide (see Note [layer ring]).
* Prediction: the block order of the last complete call of the model (list
  order before one) -- forward continues along it (then wraps around for the
  next call without grad, or turns back for backward with grad).
* Parameters shared between blocks, or between a block and the rest of the
  model, stay on the device (``stats()["resident_shared"]``). Buffers stay on
  the device: forward may update them (BatchNorm statistics).
"""
import weakref
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import nn

from ..pool import PinnedPool
from ..trace import trace_region
from .block_layout import Block, release_host_buffers
from .grad_sink import GradSink
from .layer_ring import LayerRing
from .saved_hooks import Passed, current_hooks

API = "hipferry.offload_layers"


class _Box:
    """Hides a tensor from autograd's input detection."""
    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor):
        self.t = t


class _DeviceWeight(torch.autograd.Function):
    """Device copy of a host parameter; its gradient goes back to the host."""

    @staticmethod
    def forward(ctx, anchor, box, sink, entry, where):
        # `anchor`: a leaf that requires grad, so the output does; not the host
        # parameter, whose AccumulateGrad node would run its post-accumulate-grad
        # hooks with no gradient (the sink delivers it at the end of backward).
        # `where`: (block, entry index), for recognizing casts of it (autocast).
        ctx.sink, ctx.entry, ctx.where = sink, entry, where
        return box.t

    @staticmethod
    def backward(ctx, grad):
        ctx.sink.add(ctx.entry, grad)
        return None, None, None, None, None


class _WeightRef:
    """What autograd keeps of a saved weight view: where it is, not its memory
    (`cast`: it was a copy of it in that dtype, made by autocast; made again)."""
    __slots__ = ("owner", "block", "dtype", "size", "stride", "offset", "versions", "cast", "view", "__weakref__")

    def __init__(self, owner: "LayerOffload", block: int, t: torch.Tensor, versions: Tuple[int, ...],
                 cast: Optional[torch.Tensor] = None):
        self.owner, self.block = owner, block
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()
        self.versions = versions
        # The saved cast (or a view of it, e.g. its transpose): its dtype and geometry.
        self.cast = None if cast is None else cast.dtype
        self.view = None if cast is None else (cast.size(), cast.stride(), cast.storage_offset())
        owner._live[block] += 1

    def __del__(self):
        self.owner._live[self.block] -= 1


class LayerOffload:
    """Handle returned by :func:`offload_layers`: counters, and ``undo()``."""

    def __init__(self, model: nn.Module, blocks: List[Block], shared: List[str], ring: LayerRing,
                 prefetch: int, pool: PinnedPool, moved: List[Callable[[], None]]):
        self.model, self.blocks, self.ring, self.prefetch, self.pool = model, blocks, ring, prefetch, pool
        self.device = ring.device
        self.resident_shared = shared
        self._moved_back = moved
        # Gradients of about two blocks may be in flight to the host at once.
        self._sink = GradSink(pool, 2 * ring.slot_bytes, self._weights_may_change)
        self._stale = False             # a backward ended since the last model call (an optimizer may step)
        self._unpack_slot = None        # slot of the last weight handed to backward (see _unpack)
        self._anchor = torch.zeros((), requires_grad=True)  # see _DeviceWeight
        self._saved_casts = 0           # autocast copies of weights saved as references
        self._live = [0] * len(blocks)
        self._order = list(range(len(blocks)))  # blocks in call order of the last complete model call
        self._pass: Optional[List[int]] = None  # of the model call running now
        self._pos = 0
        self._closed = False
        self._hooks = [model.register_forward_pre_hook(self._pass_start),
                       model.register_forward_hook(self._pass_end, always_call=True)]
        self._forwards = []
        for blk in blocks:
            self._forwards.append(blk.module.__dict__.get("forward"))
            blk.module.forward = self._wrap(blk.index, blk.module.forward)
            blk.module._hipferry_offload = weakref.ref(self)

    # ------------------------------------------------------------ public
    def stats(self) -> dict:
        s = self.ring.stats
        return {"blocks": len(self.blocks), "ring_slots": len(self.ring.slots), "prefetch": self.prefetch,
                "device_bytes": self.ring.device_bytes, "slot_bytes": self.ring.slot_bytes,
                "host_bytes": sum(b.host_bytes for b in self.blocks),
                "fetches": s.fetches, "prefetches": s.prefetches, "bytes_moved": s.bytes_moved,
                "hits": s.hits, "late": s.late, "misses": s.misses, "stalls": s.stalls, "reused": s.reused,
                "slot_reuses": s.slot_reuses, "grad_bytes_moved": self._sink.bytes_moved,
                "grad_max_in_flight": self._sink.max_in_flight,
                "grad_peak_in_flight_bytes": self._sink.peak_in_flight_bytes,
                "saved_weight_casts": self._saved_casts,
                "resident_shared": list(self.resident_shared)}

    @property
    def log(self) -> List[Tuple[str, int, int]]:
        """Recent ring events, oldest first: (what, block, slot) with what in
        fetch / prefetch (a copy started) and hit / late / miss / reused (a use)."""
        return list(self.ring.stats.log)

    @property
    def block_names(self) -> List[str]:
        return [b.name for b in self.blocks]

    @property
    def closed(self) -> bool:
        return self._closed

    def invalidate(self) -> None:
        """Say that host weights changed in a way parameter versions do not show
        (writes through ``.data`` or raw pointers): resident copies are refreshed."""
        self.ring.invalidate()

    def synchronize(self) -> None:
        """Block until the ring's copies in flight are done."""
        if not self._closed:
            self.ring.synchronize()

    def undo(self) -> None:
        """Put every offloaded weight back where and in the dtype it was (with its
        current value and gradient), restore the blocks' forward and the rest
        of the model's placement, and free the ring and host buffers."""
        if self._closed:
            return
        self._release_unpack_slot()
        self.ring.synchronize()
        for h in self._hooks:
            h.remove()
        for blk, fwd in zip(self.blocks, self._forwards):
            if fwd is None:
                blk.module.__dict__.pop("forward", None)
            else:
                blk.module.forward = fwd
            blk.module.__dict__.pop("_hipferry_offload", None)
        with torch.no_grad():
            for blk in self.blocks:
                for e in blk.entries:
                    p = e.param
                    grad = p.grad
                    p.grad = None
                    p.data = p.data.to(device=e.orig_device, dtype=e.device_dtype, copy=True)
                    if grad is not None:
                        p.grad = grad.to(device=e.orig_device, dtype=e.device_dtype)
            release_host_buffers(self.blocks)
            for move_back in self._moved_back:
                move_back()
        self.ring.close()
        self._closed = True

    def __repr__(self) -> str:
        if self._closed:
            return "hipferry.LayerOffload(undone)"
        s = self.stats()
        return (f"hipferry.LayerOffload({s['blocks']} blocks on the host ({s['host_bytes']} bytes), ring of "
                f"{s['ring_slots']} x {s['slot_bytes']} bytes on {self.device}; hits {s['hits']}, "
                f"stalls {s['stalls']})")

    # ------------------------------------------------------------ prediction
    def _weights_may_change(self) -> None:
        self._stale = True
        self._release_unpack_slot()

    def _release_unpack_slot(self) -> None:
        if self._unpack_slot is not None:
            self.ring.release(self._unpack_slot)
            self._unpack_slot = None

    def _pass_start(self, module, args) -> None:
        if torch._C._current_graph_task_id() == -1:
            self._pass, self._pos = [], 0
            self._sink.drop_stale()
            self._release_unpack_slot()  # left by a backward that raised
            if self._stale:  # copies made before the optimizer step are not reused
                self._stale = False
                self.ring.invalidate()
            # The first blocks start copying while what precedes them (embeddings) runs.
            self.ring.prefetch(self._order[:self.prefetch], self._order)

    def _pass_end(self, module, args, output) -> None:
        if self._pass:
            self._order = self._pass
        self._pass = None

    def _forward_future(self, b: int) -> List[int]:
        order = self._order
        if self._pass is not None:
            self._pass.append(b)
        j = self._pos if self._pos < len(order) and order[self._pos] == b else None
        if j is None:
            later = [i for i in range(self._pos, len(order)) if order[i] == b]
            anywhere = [i for i, x in enumerate(order) if x == b]
            j = later[0] if later else (anywhere[0] if anywhere else None)
        if j is None:
            return list(order)
        self._pos = j + 1
        then = list(reversed(order)) if torch.is_grad_enabled() else list(order)
        return order[j + 1:] + then

    def _backward_future(self, b: int) -> List[int]:
        rev = list(reversed(self._order))
        k = rev.index(b) if b in rev else 0
        waiting = [x for x in rev[k + 1:] + rev[:k] if self._live[x] > 0 and x != b]
        # No saved weights (reentrant checkpointing ran forward without grad, and
        # recomputes blocks in backward): backward still visits them in reverse.
        return waiting if waiting else [x for x in rev[k + 1:] if x != b]

    def _recompute_future(self, b: int) -> List[int]:
        """Activation checkpointing reruns blocks in forward order inside backward:
        the rest of the rerun (later blocks still waiting for their backward, or,
        before any has saved weights, simply the next ones), then backward."""
        order = self._order
        j = order.index(b) if b in order else len(order)
        waiting = any(self._live)
        rest = [x for x in order[j + 1:] if self._live[x] > 0 or not waiting]
        return rest + self._backward_future(b)

    # ------------------------------------------------------------ running a block
    def _wrap(self, b: int, fwd: Callable) -> Callable:
        def forward(*args, **kwargs):
            return self._run(b, fwd, args, kwargs)
        forward.__wrapped__ = fwd
        return forward

    def _check_entries(self, blk: Block) -> None:
        for e in blk.entries:
            p = e.param
            if p.device.type != "cpu" or p.data_ptr() != e.host_ptr:
                raise RuntimeError(f"{API}: parameter {e.name!r} was moved or replaced after offload_layers "
                                   "(e.g. by model.to() or assigning .data); call handle.undo() first")

    def _run(self, b: int, fwd: Callable, args: tuple, kwargs: dict) -> Any:
        if self._closed:
            raise RuntimeError(f"{API}: this offload was undone; the block runs unmodified")
        blk = self.blocks[b]
        self._check_entries(blk)
        in_backward = torch._C._current_graph_task_id() != -1  # recomputation by activation checkpointing
        future = self._recompute_future(b) if in_backward else self._forward_future(b)
        slot = self.ring.acquire(b, future, self.prefetch, pin=True)
        try:
            tensors = self.ring.tensors(b, slot)
            grad_mode = torch.is_grad_enabled()
            if grad_mode:
                tensors = [_DeviceWeight.apply(self._anchor, _Box(t), self._sink, e, (b, i)) if e.param.requires_grad
                           else t for i, (e, t) in enumerate(zip(blk.entries, tensors))]
            for e, t in zip(blk.entries, tensors):
                for m, attr in e.refs:
                    m._parameters[attr] = t
            try:
                with trace_region(blk.name, track="offload_layers blocks"):
                    if not grad_mode:
                        return fwd(*args, **kwargs)
                    outer = current_hooks()
                    versions = self.ring._versions(b)
                    with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(outer, versions, t),
                                                                  self._unpack):
                        return fwd(*args, **kwargs)
            finally:
                for e in blk.entries:
                    for m, attr in e.refs:
                        m._parameters[attr] = e.param
        finally:
            self.ring.release(slot)

    def _pack(self, outer, versions: Tuple[int, ...], t: torch.Tensor) -> Any:
        slot = self.ring.slot_of(t)
        if slot is not None and slot.block is not None:
            return _WeightRef(self, slot.block, t, versions)
        source = self._cast_source(t if t._base is None else t._base)
        if source is not None:
            b, i = source
            self._saved_casts += 1
            return _WeightRef(self, b, self.ring.tensors(b, slot=None, only=i)[0], versions, cast=t)
        return Passed(outer, t)

    def _cast_source(self, t: torch.Tensor) -> Optional[Tuple[int, int]]:
        """(block, entry) when `t` is a whole-weight dtype copy of a ring weight
        (autocast's cast before a matmul), else None."""
        fn = t.grad_fn
        if fn is None or type(fn).__name__ != "ToCopyBackward0" or not fn.next_functions:
            return None
        src = fn.next_functions[0][0]
        if getattr(src, "sink", None) is not self._sink:
            return None
        b, i = src.where
        if tuple(t.shape) != self.blocks[b].entries[i].shape or not t.is_contiguous():
            return None
        return b, i

    def _unpack(self, obj: Any) -> torch.Tensor:
        if isinstance(obj, Passed):
            return obj.get()
        if self._closed:
            raise RuntimeError(f"{API}: backward needs weights of block {self.blocks[obj.block].name!r}, "
                               "but the offload was undone after forward")
        if self.ring._versions(obj.block) != obj.versions:
            raise RuntimeError(f"{API}: a weight of block {self.blocks[obj.block].name!r} that backward needs "
                               "was modified in place after forward (an optimizer step before backward?)")
        # The slot stays pinned until the next weight is handed out: the node that
        # unpacks this one may first unpack an input whose recomputation (activation
        # checkpointing) runs other blocks through the ring.
        # The previous weight's node has queued its work by now (one node unpacks
        # weights of one block), so its pin goes first: a one-slot ring can train.
        self._release_unpack_slot()
        slot = self.ring.acquire(obj.block, self._backward_future(obj.block), self.prefetch, pin=True)
        self._unpack_slot = slot
        t = torch.empty(0, dtype=obj.dtype, device=self.device)
        t.set_(slot.storage.untyped_storage(), obj.offset, obj.size, obj.stride)
        if obj.cast is None:
            return t
        return t.to(obj.cast).as_strided(*obj.view)  # the cast is contiguous like the weight
