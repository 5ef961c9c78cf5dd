"""Checks and layout of OffloadAdamW's state, shared by the optimizer and its
state-dict loading: what a parameter may be, which state keys it has, the
param-group keys torch.optim.AdamW writes, and state-dict validation (all of
it before anything is changed)."""
from typing import Any, Dict, List

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)
SUPPORTED = (torch.float32,) + LOW_PRECISION


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank owns: a DTensor's local shard (FSDP2), else t."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


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


def state_keys(lp: torch.Tensor, amsgrad: bool) -> List[str]:
    keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
    return keys + (["master_param"] if lp.dtype in LOW_PRECISION else [])


def check_hyper(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:
    lr_value = float(lr) if isinstance(lr, torch.Tensor) else lr
    if not isinstance(lr_value, (int, float)) or not 0.0 <= lr_value:
        raise ValueError(f"OffloadAdamW: lr must be a number >= 0, got {lr!r}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2 or \
            not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"OffloadAdamW: betas must be two numbers in [0, 1), got {betas!r}")
    if not isinstance(eps, (int, float)) or not 0.0 <= eps:
        raise ValueError(f"OffloadAdamW: eps must be a number >= 0, got {eps!r}")
    if not isinstance(weight_decay, (int, float)) or not 0.0 <= weight_decay:
        raise ValueError(f"OffloadAdamW: weight_decay must be a number >= 0, got {weight_decay!r}")


def check_param(p: Any, group: int, index: int) -> None:
    where = f"params[group {group}][{index}]"
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"OffloadAdamW: {where} is a {type(p).__name__}; expected a torch.Tensor")
    lp = local(p)
    if lp.dtype not in SUPPORTED:
        raise ValueError(f"OffloadAdamW: {where} is {lp.dtype}; expected float32, float16 or bfloat16")
    if lp.device.type not in ("cpu", "cuda"):
        raise ValueError(f"OffloadAdamW: {where} is on {lp.device}; expected the CPU or a GPU")
    if lp.layout != torch.strided or not lp.is_contiguous():
        raise ValueError(f"OffloadAdamW: {where} must be a contiguous dense tensor")
    if not p.is_leaf:
        raise ValueError(f"OffloadAdamW: {where} is not a leaf tensor; expected a parameter (can't optimize a "
                         "non-leaf Tensor)")


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


def check_loadable(opt: Any, state_dict: Any) -> Dict[torch.Tensor, dict]:
    """Validates `state_dict` against `opt` and returns {param: saved state}."""
    name = "OffloadAdamW.load_state_dict"
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError(f"{name}: expected a dict with 'state' and 'param_groups'")
    saved_groups, groups = state_dict["param_groups"], opt.param_groups
    if len(saved_groups) != len(groups):
        raise ValueError(f"{name}: the state dict has {len(saved_groups)} parameter groups; this optimizer has "
                         f"{len(groups)}")
    ids: Dict[Any, torch.Tensor] = {}
    for gi, (sg, g) in enumerate(zip(saved_groups, groups)):
        if len(sg["params"]) != len(g["params"]):
            raise ValueError(f"{name}: group {gi} has {len(sg['params'])} parameters in the state dict and "
                             f"{len(g['params'])} here")
        betas = sg.get("betas", g["betas"])
        check_hyper(sg.get("lr", g["lr"]), tuple(betas), sg.get("eps", g["eps"]),
                    sg.get("weight_decay", g["weight_decay"]))
        ids.update(zip(sg["params"], g["params"]))
    out = {}
    for key, st in state_dict["state"].items():
        if key not in ids:
            raise ValueError(f"{name}: state for parameter id {key!r}, which no group lists")
        p = ids[key]
        lp = local(p)
        if "step" not in st:
            raise ValueError(f"{name}: the state of parameter {key} has no 'step'")
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param"):
            if k not in st:
                continue
            t = st[k]
            shape = tuple(local(t).shape) if isinstance(t, torch.Tensor) else None
            if shape != tuple(lp.shape):
                raise ValueError(f"{name}: '{k}' of parameter {key} has shape {shape}; expected "
                                 f"{tuple(lp.shape)} like the parameter")
        for k in ("exp_avg", "exp_avg_sq"):
            if k not in st:
                raise ValueError(f"{name}: the state of parameter {key} has no '{k}'")
        out[p] = st
    return out
