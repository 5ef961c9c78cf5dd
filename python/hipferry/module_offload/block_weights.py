"""The device weights an offloaded block runs with, and what autograd keeps
of them (Note [offloaded blocks] in layer_offload.py).

* ``put_in_place`` puts a ring slot's tensors in the block's parameter slots
  (through ``DeviceWeight`` when grad is on), ``put_back`` undoes it.
* ``WeightRef``: a saved weight as (block, offset, shape, stride[, dtype]),
  counted in the handle's live counts while autograd holds it.
"""
from typing import Any, List, Optional, Sequence, Set, Tuple

import torch

from ..torch_private import is_dtype_cast_node, module_parameters
from .block_layout import API, Block


class Box:
    """Hides a tensor from autograd's input detection."""
    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor):
        self.t = t


class DeviceWeight(torch.autograd.Function):
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


class WeightRef:
    """What autograd keeps of a saved weight view: where it is, not its memory
    (`cast`: it was a copy of it in that dtype, made by autocast; made again).
    `live[block]` counts the refs alive (the backward prediction reads it)."""
    __slots__ = ("live", "block", "dtype", "size", "stride", "offset", "versions", "cast", "view", "__weakref__")

    def __init__(self, live: List[int], block: int, t: torch.Tensor, versions: Tuple[int, ...],
                 cast: Optional[torch.Tensor] = None):
        self.live, self.block = live, block
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()
        self.versions = versions
        # The saved cast (or a view of it, e.g. its transpose): its dtype and geometry.
        self.cast = None if cast is None else cast.dtype
        self.view = None if cast is None else (cast.size(), cast.stride(), cast.storage_offset())
        live[block] += 1

    def __del__(self):
        self.live[self.block] -= 1


class BlockRun:
    """One block call in progress: what its pre-hook put in place."""
    __slots__ = ("block", "slot", "saved", "hooks", "pass_owner", "trace")

    def __init__(self, block: int, slot, saved, hooks, pass_owner: bool, trace=None):
        self.block = block            # index of the block
        self.slot = slot              # its pinned ring slot
        self.saved = saved            # (parameter dict, name, what was there) to put back
        self.hooks = hooks            # the saved_tensors_hooks entered for it, or None
        self.pass_owner = pass_owner  # the block was called alone: its call is a model call
        self.trace = trace            # its trace_region, entered


def check_entries(blk: Block, known: Set[int], device: torch.device) -> None:
    """The block's parameters are still the offloaded host views, and it gained
    none off `device` (`known`: id() of its parameters when offloaded)."""
    for e in blk.entries:
        p = e.param
        if p.device.type != "cpu" or p.data_ptr() != e.host_ptr:
            raise RuntimeError(f"{API}: parameter {e.name!r} was moved or replaced after offload_layers "
                               "(e.g. by assigning .data); call handle.undo() first")
    for p in blk.module.parameters():  # (every call: names only for the error)
        if id(p) not in known and p.device != device:
            name = next(n for n, q in blk.module.named_parameters() if q is p)
            raise RuntimeError(
                f"{API}: block {blk.name!r} has a parameter {name!r} on {p.device} that was added after "
                f"offload_layers (e.g. PEFT adapters from get_peft_model on the offloaded model), while the "
                f"block runs on {device}; add adapters first and offload the PEFT model, or call "
                "handle.undo() and offload_layers again")


def put_in_place(blk: Block, tensors: List[torch.Tensor], grad: bool, anchor: torch.Tensor, sink: Any) -> list:
    """`tensors` (the block's weights in a ring slot) in the block's parameter
    slots -- with grad, through DeviceWeight, whose gradient goes to `sink`;
    returns what was there."""
    if grad:
        tensors = [DeviceWeight.apply(anchor, Box(t), sink, e, (blk.index, i))
                   if e.param.requires_grad else t for i, (e, t) in enumerate(zip(blk.entries, tensors))]
    saved = []
    for e, t in zip(blk.entries, tensors):
        for m, attr in e.refs:
            params = module_parameters(m)
            saved.append((params, attr, params[attr]))
            params[attr] = t
    return saved


def put_back(saved: list) -> None:
    for params, attr, old in reversed(saved):
        params[attr] = old


def cast_source(t: torch.Tensor, sink: Any, blocks: Sequence[Block]) -> Optional[Tuple[int, int]]:
    """(block, entry) when `t` is a whole-weight dtype copy of a ring weight whose
    gradient goes to `sink` (autocast's cast before a matmul), else None."""
    fn = t.grad_fn
    if not is_dtype_cast_node(fn) or not fn.next_functions:
        return None
    src = fn.next_functions[0][0]
    if getattr(src, "sink", None) is not sink:
        return None
    b, i = src.where
    if tuple(t.shape) != blocks[b].entries[i].shape or not t.is_contiguous():
        return None
    return b, i
