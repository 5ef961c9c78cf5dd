"""Asynchronous host<->device transfers: ``prefetch``, ``offload`` and the ``Transfer`` handle.

The engine is C++ (csrc/torch/transfer_engine.h has the design note); this
module maps the caller's structure (a tensor, or tensors in nested containers:
see Note [transfer structures]) to a flat list and back, resolves devices and
pools, and names the offending argument in errors.

Note [transfer structures]
~~~~~~~~~~~~~~~~~~~~~~~~~~
* The containers walked are torch's pytree containers (tuple, list, dict,
  namedtuple, OrderedDict, defaultdict, deque, and what libraries register
  with it, e.g. transformers' ModelOutput) and any ``collections.abc.Mapping``
  (``collections.UserDict``, a tokenizer's ``transformers.BatchEncoding``, a
  dict subclass): a tokenizer's output goes in as it is.
* ``wait()`` gives the same structure back, with the same container types
  where pytree rebuilds them. A Mapping that pytree does not know comes back
  as ``type(m)(d)``, ``d`` the dict of the results in ``m``'s key order, when
  that builds a Mapping holding exactly those items (UserDict, BatchEncoding
  -- without its ``encodings`` --, dict subclasses); else as ``d`` itself.
"""
import atexit
import operator
import os
from collections.abc import Mapping
from typing import Any, List, Optional, Tuple, Union

import torch

from . import _C
from .pool import PinnedPool, resolve_pool
from .torch_private import register_mapping_node, tree_flatten, tree_is_leaf, tree_leaf_paths, tree_unflatten

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
        results, record = self._native.wait()
        if record:
            # Device results allocated on the stream current at the start and handed to
            # another one: torch's allocator must wait for this stream's work too before
            # reusing their memory (the engine cannot record a stream through torch's
            # stable ABI; see Note [hipferry transfer engine]).
            stream = torch.cuda.current_stream(results[0].device)
            for t in results:
                t.record_stream(stream)
        if self._spec is list or self._spec is tuple:  # a flat list / tuple (_flatten)
            return results if self._spec is list else tuple(results)
        return tree_unflatten(results, self._spec)

    def ready(self) -> bool:
        return self._native.ready()

    @property
    def native(self) -> Any:
        """The engine's handle of this copy (``_C.Transfer``): what hipferry's
        windows of copies in flight poll and wait on."""
        return self._native

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


class _AnyMapping:
    """A Mapping that pytree does not know, as pytree walks it (see Note
    [transfer structures]); hipferry's own class, so registering it changes
    nothing for other users of pytree."""

    __slots__ = ("cls", "keys", "values")

    def __init__(self, cls: type, keys: List[Any], values: List[Any]):
        self.cls, self.keys, self.values = cls, keys, values

    @staticmethod
    def rebuild(values: List[Any], context: Tuple[type, List[Any]]) -> Any:
        cls, keys = context
        d = dict(zip(keys, values))
        try:
            m = cls(d)
        except Exception:  # a constructor that takes no dict: the items as a dict
            return d
        same = isinstance(m, Mapping) and list(m.keys()) == keys and all(m[k] is v for k, v in d.items())
        return m if same else d


register_mapping_node(_AnyMapping, lambda m: (m.keys, m.values, (m.cls, m.keys)), _AnyMapping.rebuild)


def _unknown_mapping(x: Any) -> bool:
    return isinstance(x, Mapping) and tree_is_leaf(x)


def _walkable(tree: Any) -> Any:
    """`tree` with each Mapping that pytree does not know, at any depth, as an
    _AnyMapping; `tree` itself when there is none."""
    if _unknown_mapping(tree):
        keys = list(tree.keys())
        return _AnyMapping(type(tree), keys, [_walkable(tree[k]) for k in keys])
    leaves, spec = tree_flatten(tree, is_leaf=_unknown_mapping)
    if not any(_unknown_mapping(leaf) for leaf in leaves):
        return tree
    return tree_unflatten([_walkable(leaf) if _unknown_mapping(leaf) else leaf for leaf in leaves], spec)


_PLAIN_TENSOR_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))
_is_nested = operator.attrgetter("is_nested")


def _flatten(tensors: Any, api: str) -> Tuple[List[torch.Tensor], Any, Any]:
    """Leaves, structure and the tree pytree walked (for the leaves' places,
    "tensors['w'][1]"); raises naming the first leaf that is not a plain tensor.
    A list or tuple of plain tensors (the common case) skips pytree: its
    structure is its type."""
    kind = type(tensors)
    if (kind is list or kind is tuple) and _PLAIN_TENSOR_TYPES.issuperset(map(type, tensors)) and \
            not any(map(_is_nested, tensors)):
        return tensors, kind, tensors
    tree = tensors
    leaves, spec = tree_flatten(tree, is_leaf=_unknown_mapping)
    if any(_unknown_mapping(leaf) for leaf in leaves):  # (else one walk is all it takes)
        tree = _walkable(tensors)
        leaves, spec = tree_flatten(tree)
    bad = [i for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor) or leaf.is_nested]
    paths = ["tensors" + p for p in tree_leaf_paths(tree)] if bad else None  # (paths only when needed: cost)
    for i in bad:
        leaf = leaves[i]
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"{api}: {paths[i]} is of type {type(leaf).__name__}; expected a tensor, or tensors in "
                            "(nested) lists / tuples / dicts / Mappings")
        # layout strided (or jagged); the engine would stop at an internal error about sizes
        raise ValueError(f"{api}: {paths[i]} is a nested tensor; expected plain dense tensors (move its components)")
    return leaves, spec, tree


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


def _check_dtype(dtype: Optional[torch.dtype], api: str) -> None:
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"{api}: dtype must be a torch.dtype or None, got {dtype!r}")


def _start(api: str, start: Any, tensors: Any, *args: Any) -> Transfer:
    _apply_env()
    leaves, spec, tree = _flatten(tensors, api)
    # The stable ABI cannot read torch's negative bit: the engine resolves it
    # with one dispatcher call per source unless told that no source has it.
    try:
        negative_views = any(map(torch.Tensor.is_neg, leaves))
    except TypeError:  # a leaf that is not a tensor: the engine rejects it, naming its position
        negative_views = True
    # The engine's errors name each source where it sits in the caller's structure.
    names = None if spec is list or spec is tuple else _LeafNames(tree)
    return Transfer(start(leaves, *args, negative_views=negative_views, source_names=names), spec, api)


class _LeafNames:
    """i -> "tensors['w'][1]", the place of leaf i of `tree`; the paths are made
    on the first call only (the engine asks only when a check fails)."""

    __slots__ = ("tree", "paths")

    def __init__(self, tree: Any):
        self.tree, self.paths = tree, None

    def __call__(self, i: int) -> str:
        if self.paths is None:
            self.paths = ["tensors" + p for p in tree_leaf_paths(self.tree)]
        return self.paths[i]


def prefetch(tensors: Any, device: Device, *, dtype: Optional[torch.dtype] = None,
             pool: Optional[PinnedPool] = None) -> Transfer:
    """Start moving host tensors to ``device``; returns a :class:`Transfer` at once.

    ``tensors``: a tensor, or CPU tensors in (nested) lists, tuples, dicts,
    any Mapping (a tokenizer's output) and what torch's pytree walks; ``wait()``
    returns the same structure (Note [transfer structures]).
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
    return _start(api, _C.start_prefetch, tensors, d, dtype, resolve_pool(pool, api).native_id)


def offload(tensors: Any, *, dtype: Optional[torch.dtype] = None, pool: Optional[PinnedPool] = None) -> Transfer:
    """Start moving device tensors into pinned host memory from ``pool``; returns a :class:`Transfer`.

    ``tensors``: as for :func:`prefetch`. All tensors must be on one GPU (CPU
    tensors are copied on the worker thread). Small tensors are written by one
    kernel; large ones by one copy each, on hipferry's device->host stream,
    after the work already queued on the current stream. ``wait()`` blocks the calling thread until the host
    copies are complete and returns pool tensors.
    """
    api = "hipferry.offload"
    _check_dtype(dtype, api)
    return _start(api, _C.start_offload, tensors, dtype, resolve_pool(pool, api).native_id)


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
