"""What the planner measures of the model: its parameters, and one forward and
backward on the user's batch (time, and the memory that pass needs on top of
what the process held: activations, gradients, temporaries).

The pass leaves the model as it was: gradients, RNG state and mode are put back."""
import gc
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import torch
from torch import nn

from .rss import HighWater


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
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            dev_before = torch.cuda.memory_allocated(device)
        for r in range(runs + 1):
            progress(f"forward and backward {r + 1}/{runs + 1} on the batch"
                     f"{' (warm-up)' if r == 0 else ''}")
            _sync(device)
            t0 = time.perf_counter()
            loss_fn(model, batch).backward()
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
                        pass_device_bytes=dev_bytes, host_measured_by=how)
