"""The handle of ``hipferry.offload_layers`` and how an offloaded block runs.

Note [offloaded blocks]
~~~~~~~~~~~~~~~~~~~~~~~
* The user's ``nn.Parameter`` objects stay the parameters: their ``.data``
  becomes a view of the block's pinned host buffer (in ``dtype`` if given).
  Optimizers, ``state_dict`` and ``load_state_dict`` see host tensors.
* Forward pre- and post-hooks on each block, as FSDP2 does (not a wrapped
  ``forward``: every call through ``nn.Module.__call__`` passes them): the
  pre-hook acquires the block's ring slot (see Note [layer ring]) and puts
  fresh device tensors of the slot in the block's parameter slots; the
  post-hook (``always_call``: also after an exception) puts the parameters
  back, releases the slot, and registers the block's backward start on its
  outputs (``register_multi_grad_hook``, FSDP2's pre-backward).
* When backward reaches a block, its device tensors go into its parameter
  slots again until the backward of the block before it begins (or the
  backward ends): activation checkpointing of any kind recomputes the block
  from ring weights -- also one that reruns the class ``forward`` without
  calling the module (transformers' ``GradientCheckpointingLayer``). After a
  backward that raised, the host parameters are back at the next model call
  or ``undo()``.
* Model calls: a call of the model, of any module between it and the blocks,
  or of a block alone (see Note [offloaded model integration]) starts from
  fresh copies: host weights may have changed between calls in ways no
  version shows (optimizer steps that bump none, e.g. fused AdamW, writes
  through ``.data`` as PEFT's merge does). Within a call, parameter versions
  decide (see Note [layer ring]); ``invalidate()`` is "I changed the weights".
* With grad enabled, each device tensor comes from ``DeviceWeight`` (block_weights.py), whose
  backward sends the weight gradient device->host (``hipferry.offload``, on the
  copy stream, into the pool) as soon as backward produces it; at the end of
  backward the copies are waited for and accumulated into the parameters'
  ``.grad`` on the host -- summed in arrival order, then added once, as
  autograd's AccumulateGrad does -- and post-accumulate-grad hooks run
  (grad_sink.py). So an optimizer (OffloadAdamW's CPU step, or any CPU
  optimizer) steps the host weights in place. ``torch.autograd.grad`` with the
  host parameters as inputs is not supported (they get no gradient through it).
* Weights that autograd saves for backward are not kept: a saved-tensor hook
  recognizes views of ring slots -- and autocast's copies of a whole weight in
  another dtype (the cast's grad_fn leads to ``DeviceWeight`` (block_weights.py); weights that
  require grad only) -- and saves (block, offset, shape, stride[, dtype]);
  backward brings the block in again, prefetching in reverse order the blocks
  that still have saved weights. Other saved tensors go to the hooks outside
  (activation checkpointing, ``offload_activations``), see saved_hooks.py.
* Prediction: the block order of the last complete model call (list order
  before one) -- forward continues along it (then turns back for backward
  with grad).
* Parameters shared between blocks, or between a block and the rest of the
  model, stay on the device (``stats()["resident_shared"]``). Buffers stay on
  the device: forward may update them (BatchNorm statistics).
* torch.compile: the hooks are ``torch.compiler.disable``d -- they run
  eagerly at the graph breaks around each block call; the blocks' forwards
  compile once for all blocks (their parameters are graph inputs).
* Not covered: calling a block's ``forward`` directly from outside backward
  (not through ``module(...)``) sees the host parameters; on a GPU torch
  then raises its device-mismatch error.
"""
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..pool import PinnedPool
from ..torch_private import current_graph_task_id, in_backward, queue_end_of_backward, tensor_base, tree_flatten
from ..trace import trace_region
from .block_layout import API, Block, release_host_buffers
from .block_weights import BlockRun, WeightRef, cast_source, check_entries, put_back, put_in_place
from .grad_sink import GradSink
from .layer_ring import LayerRing
from .model_integration import ModelIntegration, Offload
from .prediction import backward_future, forward_future, recompute_future
from .saved_hooks import Passed, current_hooks


class LayerOffload:
    """Handle returned by :func:`offload_layers`: counters, ``invalidate()``, ``undo()``."""

    def __init__(self, model: nn.Module, blocks: List[Block], shared: List[str], ring: LayerRing,
                 prefetch: int, pool: PinnedPool, moved: List[Callable[[], None]], dtype: Optional[torch.dtype],
                 offload: Offload):
        self.model, self.blocks, self.ring, self.prefetch, self.pool = model, blocks, ring, prefetch, pool
        self.device = ring.device
        self.dtype = dtype                  # host dtype asked for (None: as the parameters)
        self.resident_shared = shared
        self._moved_back = moved
        # Gradients of about two blocks may be in flight to the host at once.
        self._sink = GradSink(pool, 2 * ring.slot_bytes, self._release_unpack_slot)
        self._unpack_slot = None        # slot of the last weight handed to backward (see _unpack)
        self._anchor = torch.zeros((), requires_grad=True)  # see DeviceWeight
        self._saved_casts = 0           # autocast copies of weights saved as references
        self._live = [0] * len(blocks)
        self._order = list(range(len(blocks)))  # blocks in call order of the last complete model call
        self._pass: Optional[List[int]] = None  # of the model call running now
        self._pos = 0
        self._calls: List[int] = []     # id() of the hooked modules whose call is running (outside backward)
        self._runs: List[BlockRun] = []  # block calls in progress, innermost last
        self._backward: Dict[int, BlockRun] = {}  # graph task -> the block its backward is in
        self._passes = 0                # model calls begun (each refreshes the resident copies)
        self._closed = False
        # Parameters of each block when offloaded (its entries and the shared ones on the device).
        self._known = [{id(p) for p in blk.module.parameters()} for blk in blocks]
        self._hooks = []
        self._integration = ModelIntegration(self, offload)  # offload: how a deep copy is offloaded again
        # The hooks run eagerly under torch.compile. Disabled here, not with a
        # decorator: torch.compiler.disable imports dynamo (seconds),
        # which `import hipferry` would otherwise pay on every run.
        eager = torch.compiler.disable
        for m in self._integration.callers:
            self._hooks.append(m.register_forward_pre_hook(eager(self._call_begins)))
            self._hooks.append(m.register_forward_hook(eager(self._call_ends), always_call=True))
        for blk in blocks:
            self._hooks.append(blk.module.register_forward_pre_hook(eager(partial(self._block_begins, blk.index)),
                                                                    prepend=True))
            self._hooks.append(blk.module.register_forward_hook(eager(partial(self._block_ends, blk.index)),
                                                                always_call=True))
        self._integration.install()

    # ------------------------------------------------------------ public
    @classmethod
    def of(cls, module: nn.Module) -> Optional["LayerOffload"]:
        """The offload in effect on ``module`` (the model given to
        :func:`offload_layers`, a module between it and the blocks, or a
        block), or None."""
        ref = module.__dict__.get("_hipferry_offload") if isinstance(module, nn.Module) else None
        handle = ref() if ref is not None else None
        return handle if handle is not None and not handle.closed else None

    def stats(self) -> dict:
        s = self.ring.stats
        return {"blocks": len(self.blocks), "ring_slots": len(self.ring.slots), "prefetch": self.prefetch,
                "device_bytes": self.ring.device_bytes, "slot_bytes": self.ring.slot_bytes,
                "host_bytes": sum(b.host_bytes for b in self.blocks),
                "passes": self._passes,
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
        """Say "I changed the weights": no device copy made before this call is
        used again. Needed only inside a model call (every model call, through
        the model or any module inside it, starts from fresh copies anyway)."""
        self.ring.invalidate()

    def synchronize(self) -> None:
        """Block until the ring's copies in flight are done."""
        if not self._closed:
            self.ring.synchronize()

    def undo(self) -> None:
        """Put every offloaded weight back where and in the dtype it was (with its
        current value and gradient), remove the hooks, restore the rest of the
        model's placement, and free the ring and host buffers."""
        if self._closed:
            return
        if self._runs:
            raise RuntimeError(f"{API}: undo() called while block {self.blocks[self._runs[-1].block].name!r} "
                               "is running; call it between model calls")
        self._release_unpack_slot()
        self._end_backward_runs()
        self.ring.synchronize()
        for h in self._hooks:
            h.remove()
        self._integration.uninstall()
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

    # ------------------------------------------------------------ model calls
    def _call_begins(self, module, args) -> None:
        if not in_backward():
            if not self._calls:
                self._begin_pass()
            self._calls.append(id(module))

    def _call_ends(self, module, args, output) -> None:
        if not in_backward() and self._calls and self._calls[-1] == id(module):
            self._calls.pop()
            if not self._calls:
                self._end_pass()

    def _begin_pass(self) -> None:
        """A model call from outside (through the model, a module inside it, or
        a block alone): the host weights may have changed since the last one
        (optimizer steps of any kind, writes through .data), so no resident copy
        is used again."""
        self._passes += 1
        self._pass, self._pos = [], 0
        self._sink.drop_stale()
        self._release_unpack_slot()  # left by a backward that raised
        self._end_backward_runs()
        self.ring.invalidate()
        # The first blocks start copying while what precedes them (embeddings) runs.
        self.ring.prefetch(self._order[:self.prefetch], self._order)

    def _end_pass(self) -> None:
        if self._pass:
            self._order = self._pass
        self._pass = None

    # ------------------------------------------------------------ prediction
    def _release_unpack_slot(self) -> None:
        if self._unpack_slot is not None:
            self.ring.release(self._unpack_slot)
            self._unpack_slot = None

    def _forward_future(self, b: int) -> List[int]:
        if self._pass is not None:
            self._pass.append(b)
        future, self._pos = forward_future(self._order, self._pos, b, torch.is_grad_enabled())
        return future

    def _backward_future(self, b: int) -> List[int]:
        return backward_future(self._order, self._live, b)

    # ------------------------------------------------------------ a block's forward
    def _block_begins(self, b: int, module, args) -> None:
        if self._closed:
            raise RuntimeError(f"{API}: this offload was undone; the block runs unmodified")
        blk = self.blocks[b]
        check_entries(blk, self._known[blk.index], self.device)
        backward = in_backward()  # recomputation by activation checkpointing
        owner = not backward and not self._calls  # a block called alone is a model call of its own
        if owner:
            self._begin_pass()
            self._calls.append(id(module))
        slot, saved, hooks = None, [], None
        try:
            future = recompute_future(self._order, self._live, b) if backward else self._forward_future(b)
            slot = self.ring.acquire(b, future, self.prefetch, pin=True)
            grad = torch.is_grad_enabled()
            saved = put_in_place(blk, self.ring.tensors(blk.index, slot), grad, self._anchor, self._sink)
            if grad:
                versions = self.ring.versions(b)
                outer = current_hooks()
                hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(outer, versions, t),
                                                                 self._unpack)
                hooks.__enter__()
        except BaseException:
            # The post-hook will find no run of this call: undo here what it began
            # (a model call left open would keep later calls from refreshing copies).
            put_back(saved)
            if slot is not None:
                self.ring.release(slot)
            if owner:
                self._calls.pop()
                self._end_pass()
            raise
        trace = trace_region(blk.name, track="offload_layers blocks")
        trace.__enter__()
        self._runs.append(BlockRun(b, slot, saved, hooks, owner, trace))

    def _block_ends(self, b: int, module, args, output) -> Any:
        if not self._runs or self._runs[-1].block != b:
            return None  # its pre-hook did not run (a hook before it raised)
        run = self._runs.pop()
        run.trace.__exit__(None, None, None)
        try:
            if run.hooks is not None:
                run.hooks.__exit__(None, None, None)
            put_back(run.saved)
        finally:
            self.ring.release(run.slot)
            if run.pass_owner and self._calls and self._calls[-1] == id(module):
                self._calls.pop()
                self._end_pass()
        if output is not None and torch.is_grad_enabled():
            outs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if outs:
                # The block's backward starts when the first gradient of an output arrives (FSDP2's
                # pre-backward): its weights are put in place again for what recomputes it there.
                torch.autograd.graph.register_multi_grad_hook(outs, partial(self._backward_begins, b), mode="any")
        return None

    # ------------------------------------------------------------ a block's backward
    def _backward_begins(self, b: int, grad) -> None:
        """Backward reached block b: its weights go into its parameter slots for
        as long as its backward runs, so activation checkpointing of any kind --
        also one that recomputes the block's class forward without calling the
        module (transformers' GradientCheckpointingLayer) -- reads ring weights."""
        if self._closed:
            raise RuntimeError(f"{API}: backward needs weights of block {self.blocks[b].name!r}, "
                               "but the offload was undone after forward")
        task = current_graph_task_id()
        if task in self._backward:
            self._backward_ends(task)  # the block after it in forward is done
        else:
            queue_end_of_backward(partial(self._backward_ends, task))
        # The node that handed this gradient over has run: the last unpacked weight's pin goes.
        self._release_unpack_slot()
        blk = self.blocks[b]
        slot = self.ring.acquire(b, self._backward_future(b), self.prefetch, pin=True)
        try:
            with torch.enable_grad():  # what recomputes the block must save what its forward saved
                saved = put_in_place(blk, self.ring.tensors(b, slot), True, self._anchor, self._sink)
        except BaseException:
            self.ring.release(slot)
            raise
        self._backward[task] = BlockRun(b, slot, saved, None, False)

    def _end_backward_runs(self) -> None:
        """Every block's backward in progress ends (backward raised or is over)."""
        for task in list(self._backward):
            self._backward_ends(task)

    def _backward_ends(self, task: int) -> None:
        run = self._backward.pop(task, None)
        if run is not None:
            put_back(run.saved)
            self.ring.release(run.slot)

    # ------------------------------------------------------------ saved weights
    def _pack(self, outer, versions: Tuple[int, ...], t: torch.Tensor) -> Any:
        slot = self.ring.slot_of(t)
        if slot is not None and slot.block is not None:
            return WeightRef(self._live, slot.block, t, versions)
        base = tensor_base(t)
        source = cast_source(t if base is None else base, self._sink, self.blocks)
        if source is not None:
            b, i = source
            self._saved_casts += 1
            return WeightRef(self._live, b, self.ring.tensors(b, slot=None, only=i)[0], versions, cast=t)
        return Passed(outer, t)

    def _unpack(self, obj: Any) -> torch.Tensor:
        if isinstance(obj, Passed):
            return obj.get()
        if self._closed:
            raise RuntimeError(f"{API}: backward needs weights of block {self.blocks[obj.block].name!r}, "
                               "but the offload was undone after forward")
        if self.ring.versions(obj.block) != obj.versions:
            self._end_backward_runs()  # this backward ends here: the host parameters go back
            raise RuntimeError(f"{API}: a weight of block {self.blocks[obj.block].name!r} that backward needs "
                               "was modified in place after forward (an optimizer step before backward?)")
        run = self._backward.get(current_graph_task_id())
        if run is not None and run.block == obj.block and self.ring.is_current(run.slot):
            slot = run.slot  # pinned for the block's whole backward
        else:
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
