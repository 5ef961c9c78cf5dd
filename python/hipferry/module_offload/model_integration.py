"""How a model with offloaded blocks keeps behaving like a model to the code
around it: ``model.to()`` (Trainer, accelerate), ``copy.deepcopy``,
``state_dict``, and finding its handle.

Note [offloaded model integration]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
* "Callers": the model given to ``offload_layers`` and every module between
  it and the blocks. A call of any of them, or of a block alone, from outside
  such a call, is a model call: it starts from fresh device copies (see
  Note [offloaded blocks]).
* The conversion ``model.to()``, ``.cuda()``, ``.float()`` and Trainer's /
  accelerate's device placement run (``torch_private.module_apply``) is
  overridden on the callers and blocks (``override_module_apply``). It first
  probes, for every offloaded weight below the module, what ``fn`` makes of a
  0-element tensor of its device dtype on the ring's device. If that keeps
  device and dtype (``model.to(handle.device)``), the offloaded weights stay on
  the host -- they reach the device through the ring -- and everything else is
  converted as usual. Otherwise it raises
  before anything changed: the weights would leave the ring's device/dtype.
* ``copy.deepcopy`` -- ``__deepcopy__`` on the callers and blocks -- copies
  without hipferry's hooks. A copy of the model (or of a caller) is offloaded
  again with the same settings: its own ring and host buffers, from the same
  pool; ``LayerOffload.of(copy)`` is its handle. A copy of a block alone is a
  plain module with its weights where and in the dtype they were.
* ``state_dict`` -- a post hook on each module holding an offloaded weight
  whose host dtype differs: the values come in the parameters' dtype (the one
  forward computes with), so a checkpoint keeps the model's dtype.
* ``module.__dict__["_hipferry_offload"]``: a weak reference to the handle,
  on the callers and blocks (``LayerOffload.of``).
"""
import copy
import weakref
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence

import torch
from torch import nn

from ..pool import PinnedPool
from ..torch_private import MODULE_APPLY, module_apply, module_hook_dicts, module_parameters, override_module_apply
from .block_layout import API, Block, remember_origins

ATTRS = (MODULE_APPLY, "__deepcopy__", "_hipferry_offload")  # instance attributes hipferry sets


class OffloadHandle(Protocol):
    """What this module uses of the handle (layer_offload.LayerOffload), so it
    need not import it: the handle imports this module."""
    model: nn.Module
    blocks: List[Block]
    device: torch.device
    pool: PinnedPool
    prefetch: int
    dtype: Optional[torch.dtype]

    def synchronize(self) -> None: ...


class Offload(Protocol):
    """``offload_layers`` (layers.py), handed down as the factory a deep copy is offloaded again with."""

    def __call__(self, model: nn.Module, *, prefetch: int, layers: Optional[Sequence[nn.Module]],
                 pool: Optional[PinnedPool], dtype: Optional[torch.dtype], device: Any) -> OffloadHandle: ...


class ModelIntegration:
    def __init__(self, handle: OffloadHandle, offload: Offload):
        self.handle_ref = weakref.ref(handle)
        self.offload = offload
        self.model = handle.model
        self.blocks = [b.module for b in handle.blocks]
        self.block_ids = {id(m) for m in self.blocks}
        # Callers: modules (the model included) that contain a block and are not one.
        self.callers = [m for m in self.model.modules()
                        if id(m) not in self.block_ids and any(id(s) in self.block_ids for s in m.modules())]
        self.entries_under: Dict[int, list] = {}
        for m in self.callers + self.blocks:
            inside = {id(s) for s in m.modules()}
            self.entries_under[id(m)] = [e for b in handle.blocks if id(b.module) in inside for e in b.entries]
        self.hooks: List[Any] = []

    @property
    def modules(self) -> List[nn.Module]:
        return self.callers + self.blocks

    def install(self) -> None:
        handle = self.handle_ref()
        ref = weakref.ref(handle)
        for m in self.modules:
            m.__dict__["_hipferry_offload"] = ref
            override_module_apply(m, partial(self.convert, m))
            m.__dict__["__deepcopy__"] = partial(self._deepcopy, m)
        by_module: Dict[int, Any] = {}
        for blk in handle.blocks:
            for e in blk.entries:
                if e.host_dtype == e.device_dtype:
                    continue
                for m, attr in e.refs:
                    by_module.setdefault(id(m), (m, {}))[1][attr] = e.device_dtype
        for m, names in by_module.values():
            self.hooks.append(m.register_state_dict_post_hook(partial(_state_dict_in_device_dtype, names)))

    def uninstall(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
        for m in self.modules:
            for a in ATTRS:
                m.__dict__.pop(a, None)

    # ------------------------------------------------------------ model.to() and friends
    def convert(self, module: nn.Module, fn: Callable, recurse: bool = True) -> nn.Module:
        handle = self.handle_ref()
        entries = self.entries_under[id(module)]
        for e in entries:
            probe = fn(torch.empty(0, dtype=e.device_dtype, device=handle.device))
            if not isinstance(probe, torch.Tensor) or probe.device != handle.device or probe.dtype != e.device_dtype:
                got = (f"{probe.dtype} on {probe.device}" if isinstance(probe, torch.Tensor)
                       else type(probe).__name__)
                raise RuntimeError(
                    f"{API}: this conversion would turn the offloaded weight {e.name!r} "
                    f"({e.device_dtype}, run on {handle.device} from host memory) into {got}; nothing was "
                    "changed. Offloaded weights can only be 'moved' to the ring's device (a no-op). Call "
                    "handle.undo() first, or offload with the device=/dtype= you want")
        if id(module) in self.block_ids:
            return _apply_except(module, fn, {id(e.param) for e in entries})
        return module_apply(module, fn, recurse)

    # ------------------------------------------------------------ copy.deepcopy
    def _deepcopy(self, module: nn.Module, memo: Dict[int, Any]) -> nn.Module:
        handle = self.handle_ref()
        handle.synchronize()
        hook_keys = []
        for m in self.modules:
            for d in module_hook_dicts(m):
                for k, fn in d.items():
                    if _is_ours(fn, handle, self):
                        memo[id(fn)] = None  # copied as None, then dropped below
                        hook_keys.append(k)
        attrs = [(m, {a: m.__dict__.pop(a) for a in ATTRS if a in m.__dict__}) for m in self.modules]
        try:
            new = copy.deepcopy(module, memo)
        finally:
            for m, saved in attrs:
                m.__dict__.update(saved)
        for m in self.modules:
            twin = memo.get(id(m))
            if isinstance(twin, nn.Module):
                for d in module_hook_dicts(twin):
                    for k in hook_keys:
                        d.pop(k, None)
        copied = [blk for blk in handle.blocks if isinstance(memo.get(id(blk.module)), nn.Module)]
        block_alone = id(module) in self.block_ids
        with torch.no_grad():
            for blk in copied:
                for e in blk.entries:
                    twin = memo.get(id(e.param))
                    if isinstance(twin, nn.Parameter):  # on the host until offloaded again, unless a block alone
                        twin.data = twin.data.to(device=e.orig_device if block_alone else "cpu", dtype=e.device_dtype)
        if block_alone:
            return new
        twin_handle = self.offload(new, prefetch=handle.prefetch, layers=[memo[id(b.module)] for b in copied],
                                     pool=handle.pool, dtype=handle.dtype, device=handle.device)
        remember_origins(twin_handle.blocks, {id(memo[id(e.param)]): e.orig_device for b in copied for e in b.entries})
        return new


def _is_ours(fn: Any, handle: OffloadHandle, integration: ModelIntegration) -> bool:
    while hasattr(fn, "__wrapped__"):  # torch.compiler.disable's wrapper (functools.wraps)
        fn = fn.__wrapped__
    target = fn.func if isinstance(fn, partial) else fn
    owner = getattr(target, "__self__", None)
    if owner is handle or owner is integration:
        return True
    return isinstance(fn, partial) and fn.func is _state_dict_in_device_dtype


def _apply_except(block: nn.Module, fn: Callable, skip: set) -> nn.Module:
    """torch's module_apply over the block's submodules, leaving the parameters in
    `skip` (offloaded: on the host) alone -- their slots hold None meanwhile,
    so names and order stay."""
    for sub in block.modules():
        params = module_parameters(sub)
        held = [(k, p) for k, p in params.items() if p is not None and id(p) in skip]
        for k, _ in held:
            params[k] = None
        try:
            module_apply(sub, fn, recurse=False)
        finally:
            for k, p in held:
                params[k] = p
    return block


def _state_dict_in_device_dtype(names: Dict[str, torch.dtype], module, state_dict, prefix, local_metadata) -> None:
    for attr, dtype in names.items():
        v = state_dict.get(prefix + attr)
        if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter) and v.dtype != dtype:
            state_dict[prefix + attr] = v.to(dtype)
