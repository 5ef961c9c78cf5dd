"""OffloadAdamW's state format: which state keys a parameter has, the
param-group keys torch.optim.AdamW writes, DTensor (FSDP2) views of the state.
The checks of its inputs are in checks.py."""
from typing import Any, Dict

import torch

from ..torch_private import dtensor_local

LOW_PRECISION = (torch.float16, torch.bfloat16)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank owns: a DTensor's local shard (FSDP2), else t."""
    inner = dtensor_local(t)
    return t if inner is None else inner


def to_global_state(p: torch.Tensor, st: dict) -> dict:
    """The state of a DTensor parameter as DTensors with the parameter's mesh,
    placements and global shape (what torch.optim.AdamW holds under FSDP2);
    other parameters' state as is."""
    if local(p) is p:
        return st
    from torch.distributed.tensor import DTensor
    out = {}
    for k, t in st.items():
        if k == "step" or local(t) is not t:
            out[k] = t
        else:
            out[k] = DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                        stride=p.stride())
    return out


def torch_group_defaults() -> Dict[str, Any]:
    """The group keys torch.optim.AdamW writes besides ours (foreach, fused,
    capturable, differentiable, decoupled_weight_decay... as this torch has
    them), read from a throwaway AdamW's defaults (some are set inside its
    __init__, not in its signature), so a state dict loads into
    torch.optim.AdamW, or Adam(decoupled_weight_decay=True), with AdamW's meaning."""
    ours = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
    probe = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    return {k: v for k, v in probe.defaults.items() if k not in ours}


def format_bytes(n: Any) -> str:
    if n is None:
        return "unlimited"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit} ({n} bytes)"
    return f"{n} bytes"
