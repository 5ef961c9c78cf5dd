"""Per-parameter bookkeeping of OffloadAdamW that is not part of torch's state
format: where the state lives, the host buffers of a GPU parameter, the
gradient copy backward started, and what shows a write made outside step()."""
from dataclasses import dataclass
from typing import Optional

import torch

from ..torch_private import tensor_version
from ..transfer import Transfer


@dataclass
class Slot:
    where: str                                 # "host" (state in the pool) or "device" (small GPU parameter)
    shape: tuple = ()                          # the parameter's shape and dtype when its state was made:
    dtype: Optional[torch.dtype] = None        # a parameter changed to others no longer fits its state
    host_param: Optional[torch.Tensor] = None  # CPU engine, float32 GPU parameter: the host working copy
    host_out: Optional[torch.Tensor] = None    # CPU engine, low-precision GPU parameter: the rounded values to send
    seen: Optional[tuple] = None               # param_key(p) after our last read or write (None: read p again)
    grad_copy: Optional[Transfer] = None       # gradient copy started by the backward hook
    copied_grad: Optional[torch.Tensor] = None  # the gradient tensor that copy read ...
    copied_version: int = -1                   # ... and its version then (a change means: copy again)

    def copy_is_current(self, grad: torch.Tensor) -> bool:
        """A gradient copy was started and `grad` is the same tensor, unchanged since."""
        return self.grad_copy is not None and self.copied_grad is grad and self.copied_version == tensor_version(grad)

    def drop_grad_copy(self) -> None:
        self.grad_copy, self.copied_grad = None, None


def param_key(lp: torch.Tensor) -> tuple:
    """What shows a write to a parameter outside step(): its version counter
    (in-place ops, ``p.copy_`` under no_grad, ``model.load_state_dict``), its
    storage and layout (``p.data = t``, ``vector_to_parameters``). A write
    through ``p.data.copy_`` changes none of them: ``reload_params()``, or, for
    bf16/fp16 parameters, the check of the parameter against its master at step()."""
    return tensor_version(lp), lp.data_ptr(), tuple(lp.stride())


def step_dtype() -> torch.dtype:
    """torch keeps ``step`` in float32 (float64 under a float64 default dtype),
    never in a low-precision default dtype, where it would stop counting."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class FinishedCopy:
    """A gradient copy already on the host (after clip_grad_norm_ or GradScaler scaled it there)."""

    def __init__(self, host: torch.Tensor):
        self._host = host

    def wait(self) -> torch.Tensor:
        return self._host
