"""``with hipferry.offload_activations(...)``: tensors saved for backward wait in
pinned host memory instead of device memory.

Note [offloaded activations]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
* Forward (pack hook): a saved tensor worth moving starts ``hipferry.offload``
  at once -- on the engine's device->host stream, after the work queued so
  far on the current stream, into the pool -- and autograd keeps only the
  record. The engine holds the device tensor until its copy is complete. The
  copies in flight are counted by the copy scheduler's bound
  (``hipferry._C.InFlightWindow``, Note [copy scheduler]): each pack settles
  the copies that have completed (their device memory is let go) and, when
  more than ``max_in_flight`` bytes would be in flight, blocks on the oldest
  first. So device memory held by copies in flight stays bounded. A record
  that leaves before its copy settled -- unpacked while still on the device,
  or dropped with its graph -- is withdrawn from the window.
* Backward (unpack hook): the record is brought back with ``hipferry.prefetch``
  (the current stream waits for the copy, not the host), and the records
  packed just before it -- what backward needs next, it runs in reverse --
  are prefetched while their bytes fit in ``max_in_flight``.
* Not moved (kept as autograd keeps them, or passed to hooks outside this
  context): tensors under ``min_bytes``; parameters, leaves that require grad
  and views of parameters (kept anyway); tensor subclasses, sparse and
  non-dense layouts; ring slots of ``offload_layers`` (its own hook handles
  them). A tensor saved twice is moved once.
* Values round-trip exactly and the layout (strides) is restored, so
  gradients are bit-identical to the same step without the context.
* On the CPU (tensors on "cpu") the same schedule runs through the engine's
  worker thread; it saves no memory there and exists so scripts run
  unchanged and the schedule is tested everywhere.
* A graph dropped without backward (or left by a forward that raised) frees
  what it offloaded at once: autograd's saved variables are the only strong
  holders of a record, and nothing a record holds leads back to the graph
  (it keeps a detached alias of its tensor, whose grad_fn would lead to the
  node that holds the record: a cycle through autograd's C++ nodes, which
  Python's GC cannot see or collect). The context holds records weakly.
* A ``with`` block that saved tensors but offloaded none, all being under
  ``min_bytes``, warns (NothingOffloadedWarning) on exit: small models
  otherwise run unchanged with nothing said.
"""
import threading
import warnings
import weakref
from dataclasses import dataclass
from functools import partial
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from .. import _C
from ..pool import PinnedPool, parse_bytes, resolve_pool
from ..torch_private import tensor_base, tensor_version
from ..transfer import offload, prefetch
from .saved_hooks import Passed, current_hooks

API = "hipferry.offload_activations"


DEFAULT_MIN_BYTES, DEFAULT_MAX_IN_FLIGHT = 1 << 20, 256 << 20


def keep_reason(t: torch.Tensor, min_bytes: int) -> Optional[str]:
    """Why a saved tensor stays where it is (the counter it goes to), or None: it is offloaded."""
    if isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad) or isinstance(tensor_base(t), nn.Parameter):
        return "kept_params"
    if type(t) is not torch.Tensor or t.layout != torch.strided or t.device.type not in ("cuda", "cpu"):
        return "kept_other"
    if t.numel() == 0 or t.numel() * t.element_size() < min_bytes:
        return "kept_small"
    return None


class NothingOffloadedWarning(UserWarning):
    """An ``offload_activations`` block saved tensors but offloaded none: all
    were under ``min_bytes``."""


@dataclass
class ActivationStats:
    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    deduplicated: int = 0         # saves of a tensor already offloaded
    kept_small: int = 0           # under min_bytes
    kept_params: int = 0          # parameters, leaves requiring grad, views of parameters
    kept_other: int = 0           # subclasses, sparse, non-dense, other devices
    forward_waits: int = 0        # packs that blocked because max_in_flight was reached
    peak_in_flight_bytes: int = 0
    prefetch_hits: int = 0        # unpacked: prefetched and already copied
    prefetch_late: int = 0        # unpacked: prefetched, copy still running (the stream waits)
    prefetch_misses: int = 0      # unpacked: not prefetched, copied on demand
    peak_prefetched_bytes: int = 0


class _Record:
    """What autograd keeps of an offloaded tensor."""
    __slots__ = ("index", "device", "size", "stride", "perm", "nbytes", "transfer", "source", "host", "ahead",
                 "saves", "unpacks", "device_copy", "entry", "__weakref__")

    def __init__(self, index: int, t: torch.Tensor, perm: List[int]):
        self.index, self.device, self.size, self.stride, self.perm = index, t.device, t.size(), t.stride(), perm
        self.nbytes = t.numel() * t.element_size()
        self.transfer = None   # the device->host copy until settled
        self.entry = None      # its InFlightWindow entry id and the finalizer that withdraws it (until settled)
        # The tensor's data until settled (the engine holds it anyway); detached, see
        # Note [offloaded activations]: `t` itself would lead back to this record.
        self.source = t.detach()
        self.saves = 1         # times autograd saved it (the same tensor saved again is moved once)
        self.unpacks = 0
        self.device_copy = None  # brought back, kept for the remaining unpacks of a tensor saved twice
        self.host = None       # pool tensor once settled (lives as long as autograd keeps the record)
        self.ahead = None      # Transfer of a prefetch back, until unpacked


@dataclass
class _Entry:
    """One open `with` of an offload_activations: its pack hook and the hooks it passes to."""
    pack: Any
    outer: Any


def _dense_permutation(t: torch.Tensor) -> Optional[List[int]]:
    """Dims ordered so that t.permute(perm) is contiguous, or None if t is not
    dense (has gaps or overlaps)."""
    if t.is_contiguous():
        return list(range(t.dim()))
    perm = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.size(d)))
    return perm if t.permute(perm).is_contiguous() else None


def _inverse(perm: List[int]) -> List[int]:
    inverse = [0] * len(perm)
    for i, d in enumerate(perm):
        inverse[d] = i
    return inverse


class offload_activations(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: saved activations of at least ``min_bytes`` go to the
    pool during forward and come back ahead of use during backward.

    ``min_bytes``: smaller saved tensors stay (default 1 MiB; a block that
    offloaded nothing because of it warns NothingOffloadedWarning).
    ``max_in_flight``: device bytes that copies in flight may hold, in each
    direction (default 256 MiB). ``pool``: host memory (default pool). See Note
    [offloaded activations]. ``stats()`` gives the counters of everything run
    under it.
    """

    def __init__(self, *, min_bytes: Any = DEFAULT_MIN_BYTES, max_in_flight: Any = DEFAULT_MAX_IN_FLIGHT,
                 pool: Optional[PinnedPool] = None):
        for name, v in (("min_bytes", min_bytes), ("max_in_flight", max_in_flight)):
            if isinstance(v, bool) or not isinstance(v, (int, str)):
                raise TypeError(f"{API}: {name} must be a byte count (int or a string like '64MiB'), got {v!r}")
        self.min_bytes = parse_bytes(min_bytes, "offload_activations: min_bytes")
        self.max_in_flight = parse_bytes(max_in_flight, "offload_activations: max_in_flight")
        if self.max_in_flight <= 0:
            raise ValueError(f"{API}: max_in_flight must be > 0 bytes, got {max_in_flight!r}")
        self.pool = resolve_pool(pool, API)
        self._stats = ActivationStats()
        self._open: List[_Entry] = []                   # per open `with`, innermost last
        self._entered: List[Tuple[int, int, int]] = []  # per open `with`: counters at entry (the warning)
        self._largest_small = 0                        # bytes of the largest saved tensor under min_bytes
        # The copies out not settled yet, oldest first. Its callbacks hold their records weakly:
        # a record of a graph dropped without backward dies with it, and withdraws itself
        # (its unwaited copy is safe to drop: the engine holds what the copy uses).
        self._window = _C.InFlightWindow(self.max_in_flight)
        self._records: List[weakref.ref] = []         # in pack order (records die with their graph)
        self._compact_at = 1024                       # list length that triggers dropping dead entries
        self._by_tensor: Dict[int, Tuple[weakref.ref, weakref.ref, int]] = {}  # id -> (tensor, record, version)
        self._ahead: "weakref.WeakSet[_Record]" = weakref.WeakSet()             # records prefetched back
        self._lock = threading.RLock()  # a model on two GPUs: two autograd device threads unpack at once
        super().__init__(self._locked(partial(self._pack, None)), self._locked(self._unpack))
        self._first_pack = self.pack_hook

    def __enter__(self):
        # Each `with` pushes a pack hook of its own that passes what it keeps to the hooks
        # in effect before it. Entering this context again inside itself nests like a
        # counter: it passes to what the outer entry passes to, never to itself.
        outer = current_hooks()
        ours = next((e for e in self._open if outer is not None and outer[0] is e.pack), None)
        if ours is not None:
            outer = ours.outer
        entry = _Entry(self._locked(partial(self._pack, outer)), outer)
        self._open.append(entry)
        s = self._stats
        self._entered.append((s.offloaded_tensors + s.deduplicated, s.kept_small, self._largest_small))
        self._largest_small = 0
        self.pack_hook = entry.pack  # what saved_tensors_hooks.__enter__ pushes
        super().__enter__()
        return self

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._open.pop()
            self.pack_hook = self._open[-1].pack if self._open else self._first_pack
            moved, small, largest_before = self._entered.pop()
            largest, self._largest_small = self._largest_small, max(largest_before, self._largest_small)
            s = self._stats
            small = s.kept_small - small
            if exc[0] is None and s.offloaded_tensors + s.deduplicated == moved and small and largest:
                warnings.warn(NothingOffloadedWarning(
                    f"{API}: nothing was offloaded in this block: the {small} saved tensors that could move were "
                    f"all under min_bytes={self.min_bytes} bytes (the largest: {largest} bytes); pass a smaller "
                    f"min_bytes, e.g. offload_activations(min_bytes={largest}), to offload them"), stacklevel=2)

    def stats(self) -> dict:
        with self._lock:
            return dict(vars(self._stats), in_flight_bytes=self._window.bytes)

    def _locked(self, fn):
        def call(arg):
            with self._lock:
                return fn(arg)
        return call

    # ------------------------------------------------------------ forward
    def _keep_reason(self, t: torch.Tensor) -> Optional[str]:
        return keep_reason(t, self.min_bytes)

    def _pack(self, outer: Any, t: torch.Tensor) -> Any:
        """`outer`: the hooks in effect when this pack hook's `with` began."""
        why = self._keep_reason(t)
        perm = None if why else _dense_permutation(t)
        if why is None and perm is None:
            why = "kept_other"
        if why is not None:
            setattr(self._stats, why, getattr(self._stats, why) + 1)
            if why == "kept_small":
                self._largest_small = max(self._largest_small, t.numel() * t.element_size())
            return Passed(outer, t)
        # The same tensor object saved again (unchanged) is moved once. Identity, not
        # address: freed device memory is reused by new tensors at once.
        seen = self._by_tensor.get(id(t))
        if seen is not None and seen[0]() is t and seen[1]() is not None and seen[2] == tensor_version(t):
            self._stats.deduplicated += 1
            seen[1]().saves += 1
            return seen[1]()
        self._trim()
        if len(self._records) >= self._compact_at:
            self._compact()
        rec = _Record(len(self._records), t, perm)
        window = self._window
        waits = window.waits
        window.admit(rec.nbytes)  # completed copies settled; the oldest waited for while over the bound
        self._stats.forward_waits += window.waits - waits
        rec.transfer = offload(rec.source.permute(perm), pool=self.pool)  # (detached: the engine holds no graph)
        entry = window.add(rec.transfer.native, rec.nbytes, partial(_settled, weakref.ref(rec)))
        finalizer = weakref.finalize(rec, window.withdraw, entry)
        finalizer.atexit = False  # (at exit nothing needs withdrawing)
        rec.entry = (entry, finalizer)
        s = self._stats
        s.peak_in_flight_bytes = max(s.peak_in_flight_bytes, window.bytes)
        s.offloaded_tensors += 1
        s.offloaded_bytes += rec.nbytes
        self._records.append(weakref.ref(rec))
        self._by_tensor[id(t)] = (weakref.ref(t), weakref.ref(rec), tensor_version(t))
        return rec

    def _compact(self) -> None:
        alive = [r for r in (w() for w in self._records) if r is not None]
        for i, r in enumerate(alive):
            r.index = i
        self._records = [weakref.ref(r) for r in alive]
        self._by_tensor = {k: v for k, v in self._by_tensor.items() if v[0]() is not None and v[1]() is not None}
        self._compact_at = max(1024, 2 * len(self._records))

    def _settle(self, rec: _Record) -> None:
        """Host copy of `rec` in hand (out of the window's order: backward needs it now)."""
        if rec.transfer is None:
            return
        self._withdraw(rec)
        _take_host_copy(rec)

    def _withdraw(self, rec: _Record) -> None:
        entry, finalizer = rec.entry
        finalizer.detach()
        self._window.withdraw(entry)

    # ------------------------------------------------------------ backward
    def _unpack(self, obj: Any) -> torch.Tensor:
        if isinstance(obj, Passed):
            return obj.get()
        rec: _Record = obj
        s = self._stats
        rec.unpacks += 1
        if rec.device_copy is not None or rec.source is not None:
            # Still on the device: saved twice and brought back already, or
            # unpacked before its copy out was settled (the last ones of forward).
            t = rec.device_copy if rec.device_copy is not None else rec.source
            s.prefetch_hits += 1
            if rec.transfer is not None:  # keep the tensor instead of the copy out (dropped unwaited: safe)
                self._withdraw(rec)
                rec.transfer, rec.entry = None, None
            if rec.unpacks >= rec.saves:
                rec.device_copy = None
            self._prefetch_before(rec.index)
            return t if t is rec.source else t.permute(_inverse(rec.perm))
        if rec.ahead is not None:
            late = not rec.ahead.ready()
            s.prefetch_late += int(late)
            s.prefetch_hits += int(not late)
            t = rec.ahead.wait()
            rec.ahead = None
        else:
            s.prefetch_misses += 1
            self._settle(rec)
            t = prefetch(rec.host, rec.device, pool=self.pool).wait()
        if rec.unpacks < rec.saves:
            rec.device_copy = t
        self._prefetch_before(rec.index)
        return t.permute(_inverse(rec.perm))

    def _prefetch_before(self, index: int) -> None:
        """Start bringing back what backward needs next: records packed before `index`."""
        s = self._stats
        ahead = sum(r.nbytes for r in list(self._ahead) if r.ahead is not None)
        i = index - 1
        while i >= 0:
            rec = self._records[i]()
            i -= 1
            if rec is None or rec.ahead is not None or rec.source is not None:
                continue  # (a record whose copy out is not settled is still on the device: used as it is)
            if ahead > 0 and ahead + rec.nbytes > self.max_in_flight:
                break  # (one tensor larger than the budget still goes ahead alone, as in forward)
            self._settle(rec)
            rec.ahead = prefetch(rec.host, rec.device, pool=self.pool)
            self._ahead.add(rec)
            ahead += rec.nbytes
            s.peak_prefetched_bytes = max(s.peak_prefetched_bytes, ahead)
        self._trim()

    def _trim(self) -> None:
        """Records that autograd has let go of need no place at the end of the list."""
        while self._records and self._records[-1]() is None:
            self._records.pop()
        if not self._records:
            self._by_tensor.clear()


def _take_host_copy(rec: _Record) -> None:
    rec.host = rec.transfer.wait()
    rec.transfer, rec.source, rec.entry = None, None, None


def _settled(ref: "weakref.ref[_Record]") -> None:
    """The window settled a record's copy out (in order): keep the host copy. Holds the
    record weakly, and nothing else: the window lives in the context, the record in the graph."""
    rec = ref()
    if rec is None or rec.transfer is None:
        return
    rec.entry[1].detach()
    _take_host_copy(rec)
