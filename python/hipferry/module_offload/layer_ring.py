"""The ring of device buffers that offloaded blocks run from.

Note [layer ring]
~~~~~~~~~~~~~~~~~
* ``prefetch + 1`` slots of ``max(block.slot_bytes)`` device bytes each,
  allocated once: that is all the device memory the offloaded weights use.
* A slot holds one block's weights (or nothing). ``acquire(b)`` makes block b
  resident -- it was prefetched (a hit, or "late" if its copy is still
  running), or it is copied now (a miss) -- pins its slot while the block runs,
  and starts copies of the next predicted blocks into free slots.
* Which slot a prefetch takes: an empty one, else the one whose block is
  needed furthest in the predicted future (never a pinned one, never one
  needed sooner than the block being brought in). A miss may take any
  unpinned slot; if every slot is pinned, the ring is too small: an error.
* Ordering (hipferry._C.LayerCopier, on the copy scheduler: Python keeps the
  policy, C++ runs the copies): on a GPU, copies run on the ring's own
  stream, which first waits for the work queued so far on the current stream
  -- so a copy into a slot is ordered after every kernel that read the slot's
  previous block (they were all queued before). Users wait on the copy's
  event with the current stream, so the host never blocks. On the CPU the
  copies run on a worker thread of the ring's own; compute there is
  synchronous, so a slot's readers are done when it is refilled. Either way
  the copies show on hipferry.trace()'s timeline.
* A resident block is reused without copying only while its host weights are
  unchanged: same parameter versions and no ``invalidate()`` since the copy
  (the offload calls it at the start of every model call; users may call it
  after writing weights through ``.data`` inside one).
* Not thread-safe; used from the thread running forward and the autograd
  thread, one at a time (the GIL and autograd's ordering serialize them).
"""
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Iterable, List, Optional, Tuple

import torch

from .. import _C
from ..torch_private import tensor_version
from .block_layout import API, Block

LOG_LENGTH = 4096  # fetch/use events kept for inspection


class _Copier:
    """The ring's copies, run by hipferry._C.LayerCopier on a copy scheduler
    stream (Note [copy scheduler]): on a GPU a stream of its own that first
    waits for the current stream; on the CPU a worker thread. Traced."""

    def __init__(self, device: torch.device):
        index = -1 if device.type == "cpu" else (device.index if device.index is not None
                                                 else torch.cuda.current_device())
        self.native = _C.LayerCopier(index)

    def start(self, pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> Any:
        return self.native.start([d for d, _ in pairs], [s for _, s in pairs])

    def done(self, ticket: Any) -> bool:
        return self.native.done(ticket)

    def wait(self, ticket: Any) -> None:
        self.native.wait(ticket)  # GPU: the current stream waits, the host does not

    def drain(self) -> None:
        self.native.drain()

    close = drain


@dataclass
class Slot:
    index: int
    storage: torch.Tensor                 # uint8 device buffer, slot_bytes long
    block: Optional[int] = None           # whose weights it holds (or is receiving)
    copy: Any = None                      # event / future of the copy in flight, None when waited on
    prefetched: bool = False              # brought in ahead of use and not used yet
    pins: int = 0                         # blocks running from it now
    versions: Tuple[int, ...] = ()        # host parameter versions when copied
    generation: int = -1                  # ring generation when copied
    last_use: int = 0                     # acquire counter at last use (LRU tie-break)


@dataclass
class RingStats:
    fetches: int = 0          # copies started
    prefetches: int = 0       # of them ahead of use
    bytes_moved: int = 0      # host->device bytes of those copies
    hits: int = 0             # block needed, its prefetch had completed
    late: int = 0             # block needed, its prefetch was still running (compute waited for it)
    misses: int = 0           # block needed and not resident: copied on demand (compute waited)
    reused: int = 0           # block needed and still resident from an earlier use: no copy
    slot_reuses: int = 0      # copies into a slot that held another block
    log: Deque[Tuple[str, int, int]] = field(default_factory=lambda: deque(maxlen=LOG_LENGTH))

    @property
    def stalls(self) -> int:
        return self.late + self.misses


class LayerRing:
    def __init__(self, blocks: List[Block], num_slots: int, device: torch.device):
        self.blocks = blocks
        self.device = device
        self.slot_bytes = max(b.slot_bytes for b in blocks)
        self.slots = [Slot(i, torch.empty(self.slot_bytes, dtype=torch.uint8, device=device))
                      for i in range(num_slots)]
        self.copier = _Copier(device)
        self.resident: Dict[int, Slot] = {}
        self.by_storage = {s.storage.untyped_storage().data_ptr(): s for s in self.slots}
        self.stats = RingStats()
        self.generation = 0
        self._clock = 0

    @property
    def device_bytes(self) -> int:
        return self.slot_bytes * len(self.slots)

    # ------------------------------------------------------------ use
    def acquire(self, b: int, future: Iterable[int], prefetch: int, pin: bool) -> Slot:
        """Block b resident (its copy ordered before what the caller queues
        next); pinned if `pin`; then copies of the next `prefetch` predicted
        blocks are started."""
        self._clock += 1
        future = [x for x in future if x != b]
        slot = self.resident.get(b)
        if slot is not None and not self.is_current(slot):
            self._drop(slot)  # host weights changed since the copy
            slot = None
        if slot is None:
            slot = self._victim(b, [b] + future, demand=True)
            self._fetch(b, slot, ahead=False)
            self.stats.misses += 1
            outcome = "miss"
        elif slot.prefetched:
            outcome = "hit" if self.copier.done(slot.copy) else "late"
            if outcome == "hit":
                self.stats.hits += 1
            else:
                self.stats.late += 1
        else:
            self.stats.reused += 1
            outcome = "reused"
        if slot.copy is not None:
            self.copier.wait(slot.copy)
            slot.copy = None
        slot.prefetched = False
        slot.last_use = self._clock
        self.stats.log.append((outcome, b, slot.index))
        # b ranks first: its slot is not refilled before the caller has queued the work that reads it.
        slot.pins += 1
        try:
            self._prefetch(future[:prefetch], [b] + future)
        finally:
            if not pin:
                slot.pins -= 1
        return slot

    def prefetch(self, wanted: List[int], future: List[int]) -> None:
        """Start copies of `wanted` (in that order) where slots allow."""
        self._prefetch(wanted, future)

    def release(self, slot: Slot) -> None:
        slot.pins -= 1

    def slot_of(self, t: torch.Tensor) -> Optional[Slot]:
        """The slot whose memory `t` views, if any."""
        if t.device != self.device:
            return None
        return self.by_storage.get(t.untyped_storage().data_ptr())

    def invalidate(self) -> None:
        """Host weights may have changed: resident copies are not reused."""
        self.generation += 1

    def synchronize(self) -> None:
        """Every copy started so far has completed (also those already waited on
        by a stream: the host may free their sources after this)."""
        self.copier.drain()

    def versions(self, b: int) -> Tuple[int, ...]:
        """Block b's host parameter versions now (in-place writes bump them)."""
        return tuple(tensor_version(e.param) for e in self.blocks[b].entries)

    def is_current(self, slot: Slot) -> bool:
        """Whether `slot`'s copy still matches its block's host weights: no
        ``invalidate()`` and no in-place write since it was copied."""
        return (slot.block is not None and slot.generation == self.generation
                and slot.versions == self.versions(slot.block))

    def close(self) -> None:
        self.copier.close()  # waits for every copy started
        self.resident.clear()
        self.slots, self.by_storage = [], {}

    # ------------------------------------------------------------ inside
    def _drop(self, slot: Slot) -> None:
        if slot.block is not None and self.resident.get(slot.block) is slot:
            del self.resident[slot.block]
        slot.block, slot.prefetched = None, False

    def _prefetch(self, wanted: List[int], future: List[int]) -> None:
        for b in wanted:
            slot = self.resident.get(b)
            if slot is not None and self.is_current(slot):
                continue
            if slot is not None:
                self._drop(slot)
            slot = self._victim(b, future, demand=False)
            if slot is None:
                return  # every other slot holds something needed sooner
            self._fetch(b, slot, ahead=True)

    def _victim(self, b: int, future: List[int], demand: bool) -> Optional[Slot]:
        free = [s for s in self.slots if s.pins == 0]
        if not free:
            if demand:
                raise RuntimeError(
                    f"{API}: block {self.blocks[b].name!r} is needed while all "
                    f"{len(self.slots)} ring slots hold blocks that are in use (blocks called from inside "
                    "each other, or activation checkpointing recomputing blocks while backward holds a "
                    "weight); use a larger prefetch= so the ring has more slots")
            return None
        empty = [s for s in free if s.block is None]
        if empty:
            return empty[0]
        rank = {x: i for i, x in reversed(list(enumerate(future)))}
        never = len(future) + 1

        def next_use(s: Slot) -> int:
            if s.block in rank:
                return rank[s.block]
            return never

        best = max(free, key=lambda s: (next_use(s), -s.last_use))
        if not demand and b in rank and next_use(best) <= rank[b]:
            return None  # would evict a block needed before b
        return best

    def _fetch(self, b: int, slot: Slot, ahead: bool) -> None:
        # A copy still in flight into this slot needs no wait: the copier runs copies in order.
        if slot.block is not None and slot.block != b:
            self.stats.slot_reuses += 1
        self._drop(slot)
        block = self.blocks[b]
        pairs = []
        with torch.inference_mode(False):  # views made under inference_mode could not be written elsewhere
            for seg in block.segments:
                nbytes = seg.numel * seg.device_dtype.itemsize
                dst = slot.storage[seg.slot_byte_offset:seg.slot_byte_offset + nbytes].view(seg.device_dtype)
                pairs.append((dst, seg.host))
                self.stats.bytes_moved += seg.numel * seg.host_dtype.itemsize
            slot.copy = self.copier.start(pairs)
        slot.block, slot.prefetched = b, ahead
        slot.versions, slot.generation = self.versions(b), self.generation
        self.resident[b] = slot
        self.stats.fetches += 1
        self.stats.prefetches += int(ahead)
        self.stats.log.append(("prefetch" if ahead else "fetch", b, slot.index))

    def tensors(self, b: int, slot: Optional[Slot], only: Optional[int] = None) -> List[torch.Tensor]:
        """Fresh device tensors (not views autograd tracks) of block b's weights in
        `slot` (None: a placeholder storage, for their layout only); `only`: one entry."""
        out = []
        storage = (slot or self.slots[0]).storage.untyped_storage()
        entries = self.blocks[b].entries
        for e in entries if only is None else [entries[only]]:
            seg = self.blocks[b].segments[e.segment]
            off = seg.slot_byte_offset // e.device_dtype.itemsize + e.offset
            t = torch.empty(0, dtype=e.device_dtype, device=self.device)
            t.set_(storage, off, e.shape, _contiguous_strides(e.shape))
            out.append(t)
        return out


def _contiguous_strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))
