"""Which submodules are offloaded, and where each weight lives on the host and in a ring slot.

A block's weights are packed into one pinned host buffer per (host dtype,
device dtype) pair -- a "segment" -- at the same element offsets they get in
a ring slot, so bringing a block in is one copy per segment (one DMA, or one
fused copy+cast kernel when the host keeps another dtype).

This module owns the Block, Entry and Segment records: it alone writes their
fields (the functions at the end); the other modules read them.
"""
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..torch_private import module_parameters

API = "hipferry.offload_layers"  # how messages of offload_layers and its handle name it
ALIGN_BYTES = 256  # each weight starts on a 256-byte boundary in a slot (vector loads, as torch's allocator)
CONVERTIBLE = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class Entry:
    """One offloaded parameter of a block."""
    param: nn.Parameter
    name: str                                  # qualified name in the model (for messages)
    refs: List[Tuple[nn.Module, str]]          # every (module, attribute) that holds it in the block
    shape: Tuple[int, ...]
    device_dtype: torch.dtype                  # what forward computes with
    host_dtype: torch.dtype                    # what the host keeps
    segment: int = 0                           # index into Block.segments
    offset: int = 0                            # element offset inside the segment (host and slot alike)
    orig_device: torch.device = torch.device("cpu")
    host_ptr: int = 0                          # data_ptr of its host view once offloaded

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class Segment:
    host_dtype: torch.dtype
    device_dtype: torch.dtype
    numel: int = 0                             # elements, padding included
    slot_byte_offset: int = 0                  # where the segment starts in a slot
    host: Optional[torch.Tensor] = None        # 1-D pool tensor of host_dtype


@dataclass
class Block:
    index: int
    module: nn.Module
    name: str
    entries: List[Entry] = field(default_factory=list)
    segments: List[Segment] = field(default_factory=list)
    slot_bytes: int = 0

    @property
    def host_bytes(self) -> int:
        return sum(s.numel * s.host_dtype.itemsize for s in self.segments)


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def default_layers(model: nn.Module) -> List[nn.Module]:
    """The entries of the model's nn.ModuleList (or nn.Sequential) that holds
    the most parameter bytes -- the repeated blocks of a transformer."""
    best, best_bytes = None, 0
    for m in model.modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m) < 2:
            continue
        n = sum(p.numel() * p.element_size() for p in m.parameters())
        if n > best_bytes:
            best, best_bytes = m, n
    if best is None:
        raise ValueError(f"{API}: model has nothing to offload: it has no nn.ModuleList or "
                         "nn.Sequential of at least 2 blocks with parameters; pass layers=[...] to choose the "
                         "submodules whose weights live on the host")
    return list(best)


def check_layers(model: nn.Module, layers: Sequence[nn.Module]) -> List[nn.Module]:
    if isinstance(layers, nn.Module) and not isinstance(layers, (nn.ModuleList, nn.Sequential)):
        raise TypeError(f"{API}: layers must be a list of submodules of model (or an nn.ModuleList), "
                        f"got a single {type(layers).__name__}")
    try:
        layers = list(layers)
    except TypeError:
        raise TypeError(f"{API}: layers must be a list of submodules of model, got {type(layers).__name__}") from None
    if not layers:
        raise ValueError(f"{API}: layers is empty; expected at least one submodule of model")
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    unique, seen = [], set()
    for i, m in enumerate(layers):
        if not isinstance(m, nn.Module):
            raise TypeError(f"{API}: layers[{i}] is a {type(m).__name__}; expected an nn.Module")
        if id(m) not in names:
            raise ValueError(f"{API}: layers[{i}] ({type(m).__name__}) is not a submodule of model")
        if m is model:
            raise ValueError(f"{API}: layers[{i}] is the model itself; expected its blocks (submodules)")
        if id(m) not in seen:  # a block listed twice is one block
            seen.add(id(m))
            unique.append(m)
    for i, a in enumerate(unique):
        for j, b in enumerate(unique):
            if i != j and any(sub is a for sub in b.modules()):
                raise ValueError(f"{API}: layers contains {names[id(a)]!r} inside {names[id(b)]!r}; "
                                 "expected blocks that do not contain each other")
    return unique


def plan_blocks(model: nn.Module, layers: List[nn.Module], host_dtype: Optional[torch.dtype]
                ) -> Tuple[List[Block], List[str]]:
    """Blocks with their entries and layouts (no memory yet), and the names of
    parameters that stay on the device because several blocks (or a block
    and the rest of the model) share them."""
    owner_of_module: Dict[int, int] = {}
    for b, layer in enumerate(layers):
        for m in layer.modules():
            owner_of_module[id(m)] = b
    owners: Dict[int, set] = {}
    refs: Dict[int, List[Tuple[nn.Module, str]]] = {}
    names: Dict[int, str] = {}
    for mod_name, m in model.named_modules(remove_duplicate=False):
        for attr, p in module_parameters(m).items():
            if p is None:
                continue
            owners.setdefault(id(p), set()).add(owner_of_module.get(id(m), -1))
            names.setdefault(id(p), f"{mod_name}.{attr}" if mod_name else attr)
            lst = refs.setdefault(id(p), [])
            if all(not (mm is m and a == attr) for mm, a in lst):
                lst.append((m, attr))
    shared: List[str] = []
    blocks: List[Block] = []
    for b, layer in enumerate(layers):
        block = Block(index=len(blocks), module=layer, name=_name_of(model, layer))
        for p in _unique_params(layer):
            if len(owners[id(p)]) > 1:
                if names[id(p)] not in shared:
                    shared.append(names[id(p)])
                continue
            hd = p.dtype
            if host_dtype is not None and p.dtype.is_floating_point:
                if p.dtype not in CONVERTIBLE or host_dtype not in CONVERTIBLE:
                    raise ValueError(f"{API}: dtype={host_dtype} cannot hold parameter "
                                     f"{names[id(p)]!r} of dtype {p.dtype}; expected float32, float16 or "
                                     "bfloat16 on both sides")
                hd = host_dtype
            block.entries.append(Entry(param=p, name=names[id(p)], refs=refs[id(p)], shape=tuple(p.shape),
                                       device_dtype=p.dtype, host_dtype=hd, orig_device=p.device))
        if block.entries:
            _lay_out(block)
            blocks.append(block)
    return blocks, shared


def allocate_host_buffers(blocks: List[Block], pool) -> None:
    """Each segment's pinned host buffer from `pool` (a PinnedPool); all or none:
    on a failure (torch.OutOfMemoryError) those taken are released and it is re-raised."""
    try:
        for blk in blocks:
            for seg in blk.segments:
                seg.host = pool.empty(seg.numel, dtype=seg.host_dtype)
    except BaseException:
        release_host_buffers(blocks)
        raise


def move_weights_to_host(blocks: List[Block]) -> None:
    """Every weight copied into its place in its segment's host buffer (converted
    to the host dtype), then every parameter repointed at that view, its
    gradient moved along: no parameter changes before every copy is made."""
    with torch.no_grad():
        views = []
        for blk in blocks:
            for e in blk.entries:
                v = blk.segments[e.segment].host[e.offset:e.offset + e.numel].view(e.shape)
                v.copy_(e.param.detach())
                views.append((e, v))
        for e, v in views:
            p = e.param
            grad = p.grad
            p.grad = None
            p.data = v
            e.host_ptr = v.data_ptr()
            if grad is not None:
                p.grad = grad.to(device="cpu", dtype=e.host_dtype)


def remember_origins(blocks: List[Block], origin: Dict[int, torch.device]) -> None:
    """Where ``undo()`` puts weights back: ``origin[id(param)]`` for those listed
    (a deep copy's weights go back where the original's were)."""
    for blk in blocks:
        for e in blk.entries:
            e.orig_device = origin.get(id(e.param), e.orig_device)


def release_host_buffers(blocks: List[Block]) -> None:
    """Drops the blocks' pool buffers (the pool reuses them once nothing views them)."""
    for blk in blocks:
        for seg in blk.segments:
            seg.host = None


def _unique_params(module: nn.Module) -> List[nn.Parameter]:
    seen, out = set(), []
    for m in module.modules():
        for p in module_parameters(m).values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _name_of(model: nn.Module, layer: nn.Module) -> str:
    for n, m in model.named_modules(remove_duplicate=False):
        if m is layer:
            return n
    return type(layer).__name__


def _lay_out(block: Block) -> None:
    by_pair: Dict[Tuple[torch.dtype, torch.dtype], int] = {}
    for e in block.entries:
        key = (e.host_dtype, e.device_dtype)
        if key not in by_pair:
            by_pair[key] = len(block.segments)
            block.segments.append(Segment(host_dtype=e.host_dtype, device_dtype=e.device_dtype))
        seg = block.segments[by_pair[key]]
        # Elements aligned for the wider of the two dtypes, so both sides start on ALIGN_BYTES.
        step = ALIGN_BYTES // min(e.host_dtype.itemsize, e.device_dtype.itemsize)
        e.segment, e.offset = by_pair[key], _round_up(seg.numel, step)
        seg.numel = e.offset + e.numel
    pos = 0
    for seg in block.segments:
        step = ALIGN_BYTES // min(seg.host_dtype.itemsize, seg.device_dtype.itemsize)
        seg.numel = _round_up(max(seg.numel, 1), step)
        seg.slot_byte_offset = pos
        pos = _round_up(pos + seg.numel * seg.device_dtype.itemsize, ALIGN_BYTES)
    block.slot_bytes = pos
