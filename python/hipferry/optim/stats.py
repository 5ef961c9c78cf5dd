"""OffloadAdamW.memory_stats(): where the optimizer's bytes are."""
from typing import Dict

import torch

from .layout import real
from .state import local


def memory_stats(slots: Dict[torch.Tensor, object], state: Dict[torch.Tensor, dict], store, ring_bytes: int) -> dict:
    host = device = grad_buffers = 0
    for p, slot in slots.items():
        tensors = [t for k, t in state[p].items() if k != "step" and isinstance(t, torch.Tensor)]
        nbytes = store.state_bytes(state[p])
        on_host = slot.where == "host" and all(t.device.type == "cpu" for t in tensors)
        host, device = (host + nbytes, device) if on_host else (host, device + nbytes)
        for t in (slot.host_param, slot.host_out):
            grad_buffers += t.nbytes if t is not None else 0
    disk = store.stats() if hasattr(store, "stats") else {}
    host += disk.get("disk_window_bytes", 0)  # state on disk: the host holds the window
    numel = sum(real(local(p)).numel() for p, slot in slots.items() if slot.where == "host")
    return {"host_state_bytes": host, "device_state_bytes": device, "ring_bytes": ring_bytes,
            "grad_buffer_bytes": grad_buffers, "state_format": store.format,
            "host_bytes_per_param": host / numel if numel else 0.0, **disk}
