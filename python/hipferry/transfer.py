"""Asynchronous host<->device transfers: ``prefetch``, ``offload`` and the ``Transfer`` handle.

The engine is C++ (csrc/torch/transfer_engine.h has the design note); this
module maps the caller's structure (a tensor, or nested lists / tuples / dicts
of tensors) to a flat list and back, resolves devices and pools, and names the
offending argument in errors.
"""
import atexit
import os
import re
from typing import Any, Optional, Union

import torch
from torch.utils import _pytree as pytree

from . import _C
from .pool import PinnedPool, default_pool

Device = Union[str, int, torch.device]


class Transfer:
    """A copy in flight. Returned at once by :func:`prefetch` and :func:`offload`.

    ``wait()`` hands the results over (once), in the structure of the input:
    for device results the CURRENT stream waits for the copy (the host does
    not); for host results the calling thread waits. ``ready()`` polls without
    blocking; ``synchronize()`` blocks the host until the copy is done. A
    handle dropped without ``wait()`` is safe: what it holds is let go of only
    after the copy has completed.
    """

    __slots__ = ("_native", "_spec", "_api")

    def __init__(self, native: Any, spec: Any, api: str):
        self._native = native
        self._spec = spec
        self._api = api

    def wait(self) -> Any:
        return pytree.tree_unflatten(self._native.wait(), self._spec)

    def ready(self) -> bool:
        return self._native.ready()

    def synchronize(self) -> None:
        self._native.synchronize()

    @property
    def device(self) -> torch.device:
        """Where the results are."""
        return self._native.device

    @property
    def nbytes(self) -> int:
        """Bytes of the results (what the copy writes)."""
        return self._native.nbytes

    @property
    def num_tensors(self) -> int:
        return self._native.num_tensors

    def __repr__(self) -> str:
        state = "ready" if self.ready() else "in flight"
        return (f"hipferry.Transfer({self._api}, {self.num_tensors} tensors, {self.nbytes} bytes -> {self.device}, "
                f"{state})")


def _flatten(tensors: Any, api: str):
    leaves, spec = pytree.tree_flatten(tensors)
    for path, leaf in pytree.tree_flatten_with_path(tensors)[0]:
        if not isinstance(leaf, torch.Tensor):
            where = "tensors" + pytree.keystr(path)
            raise TypeError(f"{api}: {where} is of type {type(leaf).__name__}; expected a tensor, or a list / tuple / "
                            "dict of tensors")
        if leaf.is_nested:  # layout strided (or jagged); the engine would stop at an internal error about sizes
            where = "tensors" + pytree.keystr(path)
            raise ValueError(f"{api}: {where} is a nested tensor; expected plain dense tensors (move its components)")
    return leaves, spec


def _resolve_device(device: Device, api: str) -> torch.device:
    try:
        if isinstance(device, bool):
            raise TypeError
        d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (TypeError, RuntimeError, ValueError):
        raise ValueError(f"{api}: device {device!r} is not a device; expected 'cpu', 'cuda', 'cuda:N', an int N "
                         "or a torch.device") from None
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"{api}: device {d} is not supported; expected 'cpu' or a GPU ('cuda', 'cuda:N')")
    return d


def _resolve_pool(pool: Optional[PinnedPool], api: str) -> int:
    if pool is None:
        pool = default_pool()
    if not isinstance(pool, PinnedPool):
        raise TypeError(f"{api}: pool must be a hipferry.PinnedPool or None, got {type(pool).__name__}")
    return pool._open_id(api.split(".")[-1])


def _check_dtype(dtype: Optional[torch.dtype], api: str) -> None:
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"{api}: dtype must be a torch.dtype or None, got {dtype!r}")


def _start(api: str, start: Any, tensors: Any, *args: Any) -> Transfer:
    _apply_env()
    leaves, spec = _flatten(tensors, api)
    try:
        native = start(leaves, *args)
    except (ValueError, TypeError) as e:
        # The engine names flat positions; say where they are in the caller's structure.
        raise type(e)(_rename_positions(str(e), tensors)) from None
    return Transfer(native, spec, api)


def _rename_positions(message: str, tensors: Any) -> str:
    paths = ["tensors" + pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(tensors)[0]]
    # One pass: a replacement must not be rewritten by a later one.
    return re.sub(r"tensors\[(\d+)\]", lambda m: paths[int(m[1])] if int(m[1]) < len(paths) else m[0], message)


def prefetch(tensors: Any, device: Device, *, dtype: Optional[torch.dtype] = None,
             pool: Optional[PinnedPool] = None) -> Transfer:
    """Start moving host tensors to ``device``; returns a :class:`Transfer` at once.

    ``tensors``: a tensor or (nested) list / tuple / dict of CPU tensors.
    ``device``: ``"cuda"``, ``"cuda:N"``, an int, a ``torch.device`` or ``"cpu"``.
    ``dtype``: convert on the way (float32 / float16 / bfloat16, fused with the
    copy: no temporary in the source dtype on the device); ``None`` keeps it.
    ``pool``: pinned memory for staging pageable sources (default pool if None).

    The copy runs on hipferry's host->device stream, after the work already
    queued on the current stream. Pinned sources (pool, ``pin_memory()``) are
    read directly; pageable ones are staged through pinned blocks by a worker
    thread, so the call never turns into a synchronous copy. Many small
    tensors move with one copy and one scatter kernel. Non-contiguous sources
    are made contiguous first, on the calling thread. On the CPU ("cpu", or a
    CPU-only build) the copy runs on a worker thread.

    Do not modify a source until the transfer is done (as with
    ``non_blocking=True`` copies); hipferry keeps it alive until then.
    """
    api = "hipferry.prefetch"
    d = _resolve_device(device, api)
    _check_dtype(dtype, api)
    return _start(api, _C.start_prefetch, tensors, d, dtype, _resolve_pool(pool, api))


def offload(tensors: Any, *, dtype: Optional[torch.dtype] = None, pool: Optional[PinnedPool] = None) -> Transfer:
    """Start moving device tensors into pinned host memory from ``pool``; returns a :class:`Transfer`.

    All tensors must be on one GPU (CPU tensors are copied on the worker
    thread). Small tensors are written by one kernel; large ones by one copy
    each, on hipferry's device->host stream, after the work already queued on
    the current stream. ``wait()`` blocks the calling thread until the host
    copies are complete and returns pool tensors.
    """
    api = "hipferry.offload"
    _check_dtype(dtype, api)
    return _start(api, _C.start_offload, tensors, dtype, _resolve_pool(pool, api))


def transfer_stats() -> dict:
    """Counters of the transfer engine: transfers, bytes, packed_batches (of
    them runtime_batches: the runtime's batched copy), packed_tensors,
    staged_chunks, direct_copies, worker_tasks, and pending_releases (holdings
    waiting for their copy to complete)."""
    return _C.transfer_stats()


ENV_BATCHED_COPY = "HIPFERRY_BATCHED_COPY"
_env_applied = False


def configure_transfers(*, batched_copy: Optional[str] = None) -> dict:
    """Engine settings; returns those in effect.

    ``batched_copy``: how a batch of small pinned tensors moves -- ``"kernel"``
    (default: hipferry's batched kernel through mapped memory, one launch,
    converts too) or ``"runtime"`` (the runtime's batched copy, one call on the
    copy engines, for byte copies; used where the runtime has a working one --
    CUDA 12.8+ -- else the kernel). Also set by ``HIPFERRY_BATCHED_COPY``.
    """
    _apply_env()
    if batched_copy is not None and batched_copy not in ("kernel", "runtime"):
        raise ValueError(f"hipferry.configure_transfers: batched_copy must be 'kernel' or 'runtime', "
                         f"got {batched_copy!r}")
    return {"batched_copy": _C.transfer_batched_copy(batched_copy or "")}


def _apply_env() -> None:
    global _env_applied
    if _env_applied:
        return
    value = os.environ.get(ENV_BATCHED_COPY)
    if value not in (None, "", "kernel", "runtime"):
        raise ValueError(f"hipferry: ${ENV_BATCHED_COPY}={value!r}; expected 'kernel' or 'runtime'")
    _env_applied = True
    if value:
        _C.transfer_batched_copy(value)


# A copy still queued at exit finishes before the interpreter (and the
# runtime under it) is torn down.
atexit.register(_C.transfer_drain)
