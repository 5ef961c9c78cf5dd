"""Writes made to a parameter outside step(): when OffloadAdamW sees one, the
parameter is read again into what it keeps beside it (the float32 master of a
bf16/fp16 parameter, the CPU engine's host copy of a GPU parameter)."""
from typing import Callable

import torch

from .layout import real
from .slots import Slot, param_key


def reread_if_written(lp: torch.Tensor, st: dict, slot: Slot, before: Callable[[], None]) -> None:
    """Reads `lp` again if param_key shows a write since the optimizer last read or
    wrote it. `before` waits for whatever may still write the master or read the
    host copy (streamed steps, copies back)."""
    key = param_key(lp)
    if key == slot.seen:
        return
    before()
    if "master_param" in st:
        # Only where the write changed the value (the parameter no longer is the rounded
        # master): elsewhere the master keeps its float32 precision (a layout change, a
        # write of equal values).
        master = st["master_param"]
        written = lp.to(master.device)
        master.copy_(torch.where(master.to(lp.dtype) != written, written.float(), master))
    if slot.host_param is not None:
        real(slot.host_param).copy_(real(lp))
    slot.seen = key
