"""The scratch of OffloadAdamW's speculative steps (Note [speculative step] in
speculation.py): which pool buffers a parameter's speculation writes, whether
the pool has room for them, and how a committed speculation's state becomes
the optimizer's.

Per element of a parameter (float32 state; pool rounding on top):
- the new state: exp_avg and exp_avg_sq (8 bytes), max_exp_avg_sq with
  amsgrad (4), the master of a bf16/fp16 parameter (4);
- the new parameter values: float32 (4) without a master, else the
  parameter's dtype (2);
- a copy of the gradient (its dtype: 4 or 2) for a CPU parameter, whose
  gradient code after backward may write in place, and under GradScaler
  (the copy is unscaled); a GPU parameter's speculation otherwise reads the
  host copy of its gradient the step would use anyway.
So a float32 CPU parameter takes 16 bytes (twice its 8 bytes of state), a
bf16 one 16 (its state: 12), a float32 GPU parameter 12.
"""
from typing import Callable, Dict, List

import torch

from ..torch_private import same_storage, storage_holders, tensor_base
from .layout import real
from .state import local

# The state keys a fused step writes (max_exp_avg_sq only with amsgrad).
STEPPED = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param")


class NoRoom(Exception):
    """The pool cannot hold a parameter's scratch beside what the optimizer without overlap may still need."""


def wanted(st: dict, amsgrad: bool, lp: torch.Tensor, grad_dtype: torch.dtype,
           snapshot: bool) -> Dict[str, torch.dtype]:
    """The scratch buffers of one speculation, by key, with their dtypes."""
    out = {k: torch.float32 for k in STEPPED if k in st and (k != "max_exp_avg_sq" or amsgrad)}
    if "master_param" in st:
        out["out"] = lp.dtype
    else:
        out["target"] = torch.float32
    if snapshot:
        out["grad"] = grad_dtype
    return out


def ensure(store, scratch: Dict[str, torch.Tensor], want: Dict[str, torch.dtype], like: torch.Tensor,
           reserve: int) -> None:
    """Makes `scratch` hold exactly the buffers of `want` (pool tensors shaped like the state
    tensor `like`). NoRoom, with nothing kept, where the pool cannot hold the missing ones
    and still keep `reserve` bytes free (what the optimizer without overlap may need)."""
    for k in [k for k, t in scratch.items() if want.get(k) != t.dtype]:
        del scratch[k]  # (amsgrad switched off, another gradient dtype: given back)
    missing = [k for k in want if k not in scratch]
    if not missing:
        return
    made = {}
    try:
        for k in missing:
            made[k] = _sole_holder(store.host_tensor_like(like, want[k]))
    except torch.OutOfMemoryError:
        made.clear()
        scratch.clear()
        raise NoRoom() from None
    pool = store.pool
    capacity = pool.capacity
    if capacity is not None and capacity - pool.stats()["allocated_bytes"] < reserve:
        made.clear()
        scratch.clear()
        raise NoRoom()
    scratch.update(made)


def pool_reserve(store, slots: dict, state: dict, is_remote: Callable[[torch.Tensor], bool]) -> int:
    """Pool bytes the optimizer without overlap may still take: max_exp_avg_sq of every
    parameter without one (amsgrad switched on), and for GPU parameters the host copies of
    their gradients and host working buffers not made yet."""
    total = 0
    for p, slot in slots.items():
        st = state.get(p)
        if slot.where != "host" or st is None:
            continue
        lp = local(p)
        if "max_exp_avg_sq" not in st:
            total += store.bytes_needed(lp, ["max_exp_avg_sq"])
        if is_remote(p):
            total += lp.numel() * lp.element_size()  # its gradient's copy to the host
            if "master_param" not in st and slot.host_param is None:
                total += real(lp).numel() * 4
            if "master_param" in st and slot.host_out is None:
                total += lp.numel() * lp.element_size()
    return total


def commit_state(st: dict, scratch: Dict[str, torch.Tensor], keys: List[str]) -> int:
    """The scratch's new state becomes `st`'s, each state tensor keeping its object: its
    storage is exchanged with the scratch's (no copy), unless something else holds that
    storage (a view, a .data alias, a numpy array the user keeps), which would then go
    stale and see the next speculation write there: such a tensor takes a copy.
    Returns how many were copied."""
    copied = 0
    for k in keys:
        t, s = st[k], scratch[k]
        if _held_elsewhere(t):
            t.copy_(s)
            copied += 1
        else:
            _swap_storage(t, s)
    return copied


def _held_elsewhere(t: torch.Tensor) -> bool:
    """Whether anything but `t` (and the pool tensor it is a view of) holds its storage."""
    base = tensor_base(t)
    own = 1 + (base is not None and same_storage(base, t))
    return storage_holders(t) > own


def _sole_holder(t: torch.Tensor) -> torch.Tensor:
    """A tensor like `t` (a view of a pool tensor) that alone holds its storage: after a swap,
    the state tensor holding it is then seen as held by nothing else (_held_elsewhere)."""
    return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


def _swap_storage(a: torch.Tensor, b: torch.Tensor) -> None:
    """`a` and `b` (same shape and strides) exchange their memory; each keeps its tensor object."""
    storage, offset = a.untyped_storage(), a.storage_offset()
    a.set_(b.untyped_storage(), b.storage_offset(), b.size(), b.stride())
    b.set_(storage, offset, b.size(), b.stride())
