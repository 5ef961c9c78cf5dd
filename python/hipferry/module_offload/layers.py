"""``hipferry.offload_layers``: a model's blocks run from a small ring of device
buffers while their weights live in pinned host memory.

This module checks the arguments, lays out and allocates the host buffers and
the ring, moves the rest of the model to the device and repoints the
parameters -- all or nothing. How the blocks then run: layer_offload.py,
Note [offloaded blocks].
"""
from typing import Any, Callable, List, Optional, Sequence

import torch
from torch import nn

from ..pool import PinnedPool, resolve_pool
from ..torch_private import module_buffers, module_parameters
from ..transfer import _resolve_device as resolve_device
from .block_layout import (API, allocate_host_buffers, check_layers, default_layers, move_weights_to_host,
                           plan_blocks, release_host_buffers)
from .layer_offload import LayerOffload
from .layer_ring import LayerRing


def _resolve_device(model: nn.Module, device: Any) -> torch.device:
    from .. import _C
    if device is None:
        for p in model.parameters():
            if p.device.type == "cuda":
                return p.device
        if _C.device_count() > 0:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    d = resolve_device(device, API)  # 'cpu' or 'cuda[:N]', named in the error otherwise
    if d.type == "cuda":
        if _C.device_count() == 0:
            raise ValueError(f"{API}: device {d} requested but this hipferry build or machine has no GPU")
        if d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
    return d


def _move_rest(model: nn.Module, offloaded: set, device: torch.device) -> List[Callable[[], None]]:
    """Moves parameters (keeping the objects) and buffers not offloaded to
    `device`; returns the undo steps."""
    undo: List[Callable[[], None]] = []
    try:
        _move_rest_into(model, offloaded, device, undo)
    except BaseException:
        for step in reversed(undo):  # a failure (device OOM) moves back what had moved
            step()
        raise
    return undo


def _move_rest_into(model: nn.Module, offloaded: set, device: torch.device, undo: List[Callable[[], None]]) -> None:
    seen = set()
    with torch.no_grad():
        for m in model.modules():
            for attr, p in module_parameters(m).items():
                if p is None or id(p) in offloaded or id(p) in seen or p.device == device:
                    continue
                seen.add(id(p))
                old, old_grad = p.data, p.grad
                p.data = p.data.to(device)
                if old_grad is not None:
                    p.grad = old_grad.to(device)

                def back(p=p, old_device=old.device, had_grad=old_grad is not None):
                    g = p.grad
                    p.grad = None
                    p.data = p.data.to(old_device)
                    if had_grad and g is not None:
                        p.grad = g.to(old_device)
                undo.append(back)
            bufs = module_buffers(m)
            for attr, buf in list(bufs.items()):
                if buf is None or buf.device == device:
                    continue
                bufs[attr] = buf.to(device)
                undo.append(lambda bufs=bufs, attr=attr, d=buf.device: bufs.__setitem__(attr, bufs[attr].to(d)))


def _check_materialized(model: nn.Module) -> None:
    """Weights hipferry can copy: real ones, placed by nobody else (before any change)."""
    for name, m in model.named_modules():
        if hasattr(m, "_hf_hook"):
            raise ValueError(
                f"{API}: module {name or type(m).__name__!r} has accelerate hooks ({type(m._hf_hook).__name__}: "
                "device_map / cpu_offload / disk_offload place its weights already); remove them with "
                "accelerate.hooks.remove_hook_from_module(model, recurse=True) -- after loading the weights on "
                "the host, e.g. from_pretrained(..., device_map='cpu') or without device_map -- then call "
                "offload_layers")
    for name, p in model.named_parameters():
        if p.is_meta:
            raise ValueError(
                f"{API}: parameter {name!r} is on the meta device: it has no values to offload (the model was "
                "built under accelerate.init_empty_weights(), or loaded with device_map and offloaded or "
                "skipped weights). Load the real weights on the host first, e.g. from_pretrained(..., "
                "device_map='cpu') or model.to_empty(device='cpu') followed by load_state_dict(...)")
    for name, b in model.named_buffers():
        if b.is_meta:
            raise ValueError(f"{API}: buffer {name!r} is on the meta device; materialize the model on the host "
                             "(model.to_empty(device='cpu') and load its state) before offload_layers")


def offload_layers(model: nn.Module, *, prefetch: int = 2, layers: Optional[Sequence[nn.Module]] = None,
                   pool: Optional[PinnedPool] = None, dtype: Optional[torch.dtype] = None,
                   device: Any = None) -> LayerOffload:
    """Keep the weights of ``model``'s blocks in pinned host memory and run each
    block from a ring of ``prefetch + 1`` device buffers, the next ``prefetch``
    blocks copying in while one runs.

    ``layers``: the blocks (default: the entries of the model's nn.ModuleList
    or nn.Sequential holding the most parameter bytes). ``pool``: host memory
    for the weights (default pool). ``dtype``: keep floating weights on the
    host in this dtype and convert on the way in (fused copy+cast; forward
    computes in the parameters' dtype). ``device``: where the blocks run
    (default: the model's GPU, else the current GPU, else "cpu"); the rest of
    the model (parameters not offloaded, buffers) is moved there.

    Returns a :class:`LayerOffload`: ``stats()``, ``log``, ``invalidate()``,
    ``undo()``. See Note [offloaded blocks] for training, gradients and limits.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"{API}: model must be an nn.Module, got {type(model).__name__}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int):
        raise TypeError(f"{API}: prefetch must be an int >= 0, got {prefetch!r}")
    if prefetch < 0:
        raise ValueError(f"{API}: prefetch must be >= 0 (blocks copied ahead of the one running), got {prefetch}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"{API}: dtype must be a torch.dtype or None, got {dtype!r}")
    pool = resolve_pool(pool, API)
    _check_materialized(model)
    dev = _resolve_device(model, device)
    chosen = default_layers(model) if layers is None else check_layers(model, layers)
    for i, m in enumerate(chosen):
        ref = m.__dict__.get("_hipferry_offload")
        if ref is not None and ref() is not None and not ref().closed:
            raise ValueError(f"{API}: layers[{i}] ({type(m).__name__}) is already offloaded; call undo() on "
                             "its handle first")
    blocks, shared = plan_blocks(model, chosen, dtype)
    if not blocks:
        raise ValueError(f"{API}: model has nothing to offload: the {len(chosen)} chosen blocks hold no "
                         f"parameters of their own (shared with the rest of the model: {shared})")
    # Allocate everything before changing anything: a failure leaves the model as it was.
    need = sum(b.host_bytes for b in blocks)
    try:
        allocate_host_buffers(blocks, pool)
    except torch.OutOfMemoryError as e:
        st = pool.stats()
        raise torch.OutOfMemoryError(
            f"{API}: the pool is too small for the offloaded weights: they need {need} bytes on the host "
            f"({len(blocks)} blocks); pool capacity {st['capacity']} bytes, {st['allocated_bytes']} in use. "
            f"Pass pool=hipferry.PinnedPool(capacity=...) with room for them ({e})") from None
    num_slots = min(prefetch + 1, len(blocks))
    try:
        ring = LayerRing(blocks, num_slots, dev)
    except torch.OutOfMemoryError:
        release_host_buffers(blocks)
        slot = max(b.slot_bytes for b in blocks)
        raise torch.OutOfMemoryError(f"{API}: no device memory for the ring: {num_slots} slots x {slot} bytes on "
                                     f"{dev}; use a smaller prefetch") from None
    offloaded = {id(e.param) for blk in blocks for e in blk.entries}
    try:
        moved = _move_rest(model, offloaded, dev)
    except torch.OutOfMemoryError:
        ring.close()
        release_host_buffers(blocks)
        raise torch.OutOfMemoryError(f"{API}: no device memory on {dev} for the part of the model that is not "
                                     f"offloaded (embeddings, head, norms, buffers) next to the ring of "
                                     f"{ring.device_bytes} bytes; the model was left as it was") from None
    move_weights_to_host(blocks)
    return LayerOffload(model, blocks, shared, ring, prefetch, pool, moved, dtype, offload=offload_layers)
