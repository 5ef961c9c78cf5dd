"""What a plan's training steps measure: step times, losses and the peak resident
memory, to set beside the prediction (examples/fit_finetune.py, bench plan)."""
import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch
from torch import nn

from .profile import default_loss
from .rss import HighWater


@dataclass
class StepRecord:
    step_seconds: List[float]
    losses: List[float]
    peak_bytes: int       # the process's peak RSS over the steps
    measured_by: str

    @property
    def median_step(self) -> float:
        """The median step after the first (which allocates the state)."""
        return statistics.median(self.step_seconds[1:] or self.step_seconds)


def run_steps(model: nn.Module, batch: Any, optimizer: torch.optim.Optimizer, steps: int,
              loss_fn: Optional[Callable] = None, on_step: Callable[[int, float, float], None] = lambda *a: None,
              context: Any = None) -> StepRecord:
    """`steps` training steps (forward, backward, step, zero_grad) on `batch`;
    on_step(i, loss, seconds) after each. `context`: a context manager each forward and
    backward runs in (Applied.activations)."""
    loss_fn = loss_fn or default_loss
    high = HighWater()
    times, losses = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        with context if context is not None else contextlib.nullcontext():
            loss = loss_fn(model, batch)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # (synchronizes a GPU)
        times.append(time.perf_counter() - t0)
        on_step(i, losses[-1], times[-1])
    grown, how = high.growth()
    return StepRecord(times, losses, high.start + grown, how)
