"""What the planner measures of the model: its parameters and blocks, and forward
and backward passes on the user's batch (time, the memory a pass needs on top of
what the process held: activations, gradients, temporaries, and the saved
activations that offload_activations would take).

The passes leave the model as they found it: gradients, RNG state and mode are put back."""
import contextlib
import gc
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import torch
from torch import nn

from ..module_offload import DEFAULT_MIN_BYTES, default_layers, keep_reason, plan_blocks
from .rss import HighWater


@dataclass(frozen=True)
class BlockSize:
    """One of the model's blocks as offload_layers lays it out (block_layout.plan_blocks)."""
    host_bytes: int       # its own weights, streamed through the ring when offloaded
    slot_bytes: int       # one ring slot holding it
    trainable_bytes: int  # its weights that train: their gradients go to the host when streamed


@dataclass
class ModelProfile:
    device: torch.device
    trainable: List[tuple]          # (numel, dtype) of each parameter that trains
    frozen_bytes: int
    fwd_bwd_seconds: float          # the median of the timed passes
    fwd_bwd_runs: List[float] = field(default_factory=list)
    pass_host_bytes: int = 0        # peak RSS growth over one pass (gradients included)
    pass_device_bytes: int = 0      # on a GPU: peak allocated growth over one pass
    host_measured_by: str = ""
    blocks: List[BlockSize] = field(default_factory=list)  # offload_layers' default blocks, in order
    saved_bytes: int = 0            # saved activations of one forward that offload_activations would take
    device_held: int = 0            # on a GPU: bytes allocated before the passes (the model, and the rest)

    @property
    def numel(self) -> int:
        return sum(n for n, _ in self.trainable)


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """model(**batch).loss for a dict (Hugging Face), else the mean square of the output."""
    out = model(**batch) if isinstance(batch, dict) else model(*batch) if isinstance(batch, (tuple, list)) \
        else model(batch)
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"hipferry.plan: the model returned {type(out).__name__}, neither a tensor nor an output "
                        "with .loss; pass loss_fn=lambda model, batch: ... returning a scalar tensor")
    return out.float().square().mean()


def trainable_parameters(model: nn.Module) -> List[nn.Parameter]:
    seen, out = set(), []
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def block_sizes(model: nn.Module) -> List[BlockSize]:
    """The blocks offload_layers would stream by default (none when the model has no
    list of repeated blocks)."""
    try:
        blocks, _ = plan_blocks(model, default_layers(model), None)
    except ValueError:
        return []
    return [BlockSize(b.host_bytes, b.slot_bytes,
                      sum(e.numel * e.host_dtype.itemsize for e in b.entries if e.param.requires_grad))
            for b in blocks]


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes of the tensors one forward saves for backward that
    offload_activations would move (the same rule: not parameters, min_bytes and up),
    each tensor once."""

    def __init__(self, min_bytes: int = DEFAULT_MIN_BYTES):
        self.total, self._seen = 0, set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in self._seen and keep_reason(t, min_bytes) is None:
                self._seen.add(id(t))
                self.total += t.numel() * t.element_size()
            return t
        super().__init__(pack, lambda t: t)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_model(model: nn.Module, batch: Any, loss_fn: Optional[Callable] = None, runs: int = 5,
                  progress: Callable[[str], None] = lambda s: None) -> ModelProfile:
    params = trainable_parameters(model)
    device = params[0].device
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    loss_fn = loss_fn or default_loss
    saved_grads = [p.grad for p in params]
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    times: List[float] = []
    try:
        for p in params:
            p.grad = None
        gc.collect()
        high = HighWater()
        dev_before = 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            dev_before = torch.cuda.memory_allocated(device)
        saved = SavedBytes()
        for r in range(runs + 1):
            progress(f"forward and backward {r + 1}/{runs + 1} on the batch"
                     f"{' (warm-up)' if r == 0 else ''}")
            _sync(device)
            t0 = time.perf_counter()
            # the warm-up also counts what forward saves (the hooks pass tensors through)
            with saved if r == 0 else contextlib.nullcontext():
                loss = loss_fn(model, batch)
            loss.backward()
            del loss
            _sync(device)
            if r:
                times.append(time.perf_counter() - t0)
            for p in params:
                p.grad = None  # each pass allocates its gradients, as a step after zero_grad() does
        host_bytes, how = high.growth()
        dev_bytes = torch.cuda.max_memory_allocated(device) - dev_before if device.type == "cuda" else 0
    finally:
        for p, g in zip(params, saved_grads):
            p.grad = g
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    times.sort()
    return ModelProfile(device=device, trainable=[(p.numel(), p.dtype) for p in params], frozen_bytes=frozen,
                        fwd_bwd_seconds=times[len(times) // 2], fwd_bwd_runs=times, pass_host_bytes=host_bytes,
                        pass_device_bytes=dev_bytes, host_measured_by=how, blocks=block_sizes(model),
                        saved_bytes=saved.total, device_held=dev_before)
