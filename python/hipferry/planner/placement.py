"""GPU placements beside the state's home: how many of the model's blocks stream
through offload_layers' ring (and with how many slots), and whether saved
activations go to the host (offload_activations).

What a placement moves is known exactly: the blocks' own bytes as offload_layers
lays them out, and the saved activations the profile counted. What it costs in
time is modelled, not measured: the copies run on their own streams beside the
compute, so a pass takes the longer of its measured compute and the copies of
each direction over the measured link, plus the first block's fetch, which
nothing hides. Streamed blocks come in for forward and again for backward, but
for those still in the ring when backward turns back (the last `slots`), and send
their gradients out once; offloaded activations go out and come back."""
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional

from ..module_offload import DEFAULT_MAX_IN_FLIGHT
from .profile import BlockSize, ModelProfile

PREFETCH_CHOICES = (2, 1)  # blocks copied ahead of the one running: offload_layers' default, then the least
# What offload_activations keeps on the device at most: copies in flight, each direction.
ACTIVATIONS_IN_FLIGHT = 2 * DEFAULT_MAX_IN_FLIGHT


@dataclass(frozen=True)
class Placement:
    stream: int = 0            # the model's last `stream` blocks stream through the ring
    prefetch: int = 0          # blocks copied ahead (ring slots - 1)
    activations: bool = False  # saved activations offloaded to the host

    @property
    def offloads(self) -> int:
        """How many kinds of GPU offload it uses (the choice prefers fewer)."""
        return (self.stream > 0) + self.activations

    def label(self, blocks: int) -> str:
        text = f" +stream {self.stream}/{blocks} ({self.prefetch + 1} slots)" if self.stream else ""
        return text + (" +activations" if self.activations else "")


@dataclass
class PlacementCost:
    device_saved: int    # device bytes it frees at the peak (weights, gradients, activations less its ring)
    host_added: int      # host bytes it adds (the streamed weights and their gradients, the activations)
    resident_share: float  # of the trainable weights' bytes, what stays on the device
    ring_bytes: int      # the ring's device slots
    h2d_bytes: int       # copied in per step
    d2h_bytes: int       # copied out per step
    pass_seconds: float  # forward + backward with its copies
    copy_seconds: float  # the copies alone, the busier direction


def streamed(prof: ModelProfile, placement: Placement) -> List[BlockSize]:
    return prof.blocks[len(prof.blocks) - placement.stream:] if placement.stream else []


def placement_cost(prof: ModelProfile, placement: Placement, h2d_gbps: float, d2h_gbps: float) -> PlacementCost:
    blocks = streamed(prof, placement)
    slots = min(placement.prefetch + 1, len(blocks))
    weights = sum(b.host_bytes for b in blocks)
    grads = sum(b.trainable_bytes for b in blocks)
    slot = max((b.slot_bytes for b in blocks), default=0)
    ring = slots * slot
    acts = prof.saved_bytes if placement.activations else 0
    saved = weights + grads - ring + max(0, acts - ACTIVATIONS_IN_FLIGHT)
    h2d = 2 * weights - sum(b.host_bytes for b in blocks[len(blocks) - slots:]) + acts
    d2h = grads + acts
    copies = max(h2d / (h2d_gbps * 1e9), d2h / (d2h_gbps * 1e9))
    trainable = sum(n * d.itemsize for n, d in prof.trainable)
    return PlacementCost(saved, weights + grads + acts, 1 - grads / max(1, trainable), ring, h2d, d2h,
                         max(prof.fwd_bwd_seconds, copies) + slot / (h2d_gbps * 1e9), copies)


def placements(prof: ModelProfile, home: str, gpu_memory: Optional[int],
               device_need: Callable[[Placement], int]) -> Iterator[Placement]:
    """The placements worth estimating for `home`: none; and when the device budget is
    short, for activations kept and offloaded, the fewest streamed blocks that fit with
    the most prefetch (or, when nothing fits, everything streamed with the least, so a
    refusal names the least the device needs). Streaming pairs with hipferry's homes
    (the blocks' weights live on the host, where they step); activations alone with any."""
    yield Placement()
    if prof.device.type != "cuda" or gpu_memory is None or device_need(Placement()) <= gpu_memory:
        return
    max_stream = len(prof.blocks) if home != "torch" else 0
    for activations in ((False, True) if prof.saved_bytes else (False,)):
        options = [Placement(k, p if k else 0, activations) for k in range(0 if activations else 1, max_stream + 1)
                   for p in (PREFETCH_CHOICES if k else (0,))]
        if not options:
            continue
        yield next((o for o in options if device_need(o) <= gpu_memory), min(options, key=device_need))
