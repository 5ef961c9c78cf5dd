"""OffloadAdamW's input checks, all run before anything is changed (the
constructor, add_param_group, step() and load_state_dict validate first, then
act). Every message names the argument (``params[group 1][2]``,
``param_groups[0]['lr']``) and what was expected."""
import math
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from .state import LOW_PRECISION, local

# Real dtypes the fused kernels step (float64 steps with torch ops: layout.torch_ops_step).
FUSED = (torch.float32,) + LOW_PRECISION
REAL = FUSED + (torch.float64,)
# Complex parameters step as their real view (torch does the same).
COMPLEX = {torch.complex64: torch.float32, torch.complex128: torch.float64}
# torch.optim.AdamW's defaults of the flags it adds to every group, as its
# __setstate__ fills them into state dicts that lack them.
TORCH_FLAG_DEFAULTS = dict(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False,
                           fused=None, decoupled_weight_decay=True)


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def scalar_value(x: Any, what: str, *, low: float = 0.0, high: Optional[float] = None,
                 invalid: Optional[str] = None, key: Optional[str] = None) -> float:
    """A hyperparameter as a float: a number or a 1-element real Tensor, finite, in [low, high).
    torch.optim.AdamW's own words start the message, so code that matches torch's errors keeps
    matching: `invalid` for a value out of range ("Invalid learning rate"), and `key` (its name
    without the group: "lr", "betas[0]") for a Tensor of more elements."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"OffloadAdamW: Tensor {key or what} must be 1-element: {what} is a Tensor of "
                             f"shape {tuple(x.shape)}; expected a number or a 1-element real Tensor")
        if x.is_complex() or x.dtype == torch.bool or x.device.type == "meta":
            raise ValueError(f"OffloadAdamW: {what} must be a number or a 1-element real Tensor, got a Tensor of "
                             f"dtype {x.dtype} on {x.device}")
        value = float(x.detach().reshape(()).item())
    elif is_number(x):
        value = float(x)
    else:
        raise ValueError(f"OffloadAdamW: {what} must be a number or a 1-element Tensor, got {x!r}")
    if not math.isfinite(value) or value < low or (high is not None and value >= high):
        bound = f"in [{low:g}, {high:g})" if high is not None else f">= {low:g}"
        words = f"{invalid}: {x}; " if invalid else ""
        raise ValueError(f"OffloadAdamW: {words}{what} must be a finite number {bound}, got {x!r}")
    return value


def check_hyper(lr: Any, betas: Any, eps: Any, weight_decay: Any, where: str = "") -> None:
    """`where` prefixes the names, e.g. "param_groups[1]" -> "param_groups[1]['lr']". The order
    of the checks and the words of each message are torch.optim.AdamW's (see scalar_value)."""
    def name(key: str) -> str:
        return f"{where}[{key!r}]" if where else key
    scalar_value(lr, name("lr"), invalid="Invalid learning rate", key="lr")
    scalar_value(eps, name("eps"), invalid="Invalid epsilon value", key="eps")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"OffloadAdamW: {name('betas')} must be two numbers in [0, 1), got {betas!r}")
    for i, b in enumerate(betas):
        scalar_value(b, f"{name('betas')}[{i}]", high=1.0, invalid=f"Invalid beta parameter at index {i}",
                     key=f"betas[{i}]")
    scalar_value(weight_decay, name("weight_decay"), invalid="Invalid weight_decay value", key="weight_decay")
    if isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
        raise ValueError(f"OffloadAdamW: betas must be either both floats or both Tensors (as in "
                         f"torch.optim.AdamW): {name('betas')} is {betas!r}")


def squeezed_betas(betas: Any) -> Any:
    """torch.optim.AdamW's defaults hold Tensor betas as 0-dim tensors (its _to_scalar: a
    1-element Tensor of more dimensions is squeezed, a view of the caller's tensor)."""
    return tuple(b.squeeze() if isinstance(b, torch.Tensor) and b.dim() != 0 else b for b in betas)


def check_norm_args(max_norm: Any, norm_type: Any) -> None:
    """clip_grad_norm_'s arguments, as torch.nn.utils.clip_grad_norm_ takes them."""
    if isinstance(max_norm, torch.Tensor) and max_norm.numel() == 1 and not max_norm.is_complex():
        max_norm = float(max_norm.detach().reshape(()).item())
    if not is_number(max_norm) or math.isnan(max_norm):
        raise ValueError(f"OffloadAdamW: clip_grad_norm_: max_norm must be a number or a 1-element Tensor, got "
                         f"{max_norm!r}")
    if isinstance(norm_type, str):
        if norm_type not in ("inf", "-inf"):
            raise ValueError(f"OffloadAdamW: clip_grad_norm_: norm_type must be a number or 'inf', got {norm_type!r}")
    elif not (is_number(norm_type) and not math.isnan(norm_type)):
        raise ValueError(f"OffloadAdamW: clip_grad_norm_: norm_type must be a number or 'inf', got {norm_type!r}")


def check_flag(value: Any, what: str, *, allow_none: bool = False) -> None:
    if isinstance(value, bool) or (allow_none and value is None):
        return
    expected = "True, False or None" if allow_none else "True or False"
    raise ValueError(f"OffloadAdamW: {what} must be {expected}, got {value!r}")


def check_group_options(group: Dict[str, Any], where: str) -> None:
    """Hyperparameters and flags of one parameter group (at add_param_group and every step())."""
    for key in ("lr", "betas", "eps", "weight_decay", *TORCH_FLAG_DEFAULTS):
        if key not in group:
            raise ValueError(f"OffloadAdamW: {where} has no {key!r}; expected the keys torch.optim.AdamW uses")
    check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"], where)
    check_flag(group["amsgrad"], f"{where}['amsgrad']")
    check_flag(group["maximize"], f"{where}['maximize']")
    for key in ("foreach", "fused"):
        check_flag(group.get(key), f"{where}[{key!r}]", allow_none=True)
    check_flag(group["capturable"], f"{where}['capturable']", allow_none=True)
    check_flag(group["differentiable"], f"{where}['differentiable']")
    if group["differentiable"]:
        raise ValueError(f"OffloadAdamW: {where}['differentiable'] is True; OffloadAdamW steps outside autograd "
                         "and does not support differentiable=True (use torch.optim.AdamW for that)")
    if group["decoupled_weight_decay"] is not True:
        raise ValueError(f"OffloadAdamW: {where}['decoupled_weight_decay'] must be True (AdamW), got "
                         f"{group['decoupled_weight_decay']!r}")


def unordered_params_message(where: str) -> str:
    """torch.optim only warns (FutureWarning) about a set of parameters; OffloadAdamW refuses it, in
    torch's words: the state's order, and with it state_dict's ids, must not change between runs."""
    return (f"OffloadAdamW: {where} is a set; optimizer parameters need to be organized in ordered collections "
            "(a list): the ordering of tensors in sets changes between runs, and with it which saved state "
            "belongs to which parameter. torch.optim only warns about this; OffloadAdamW refuses it")


def split_params(params: Any, where: str) -> Tuple[List[Any], Optional[List[str]]]:
    """A group's 'params' as a list, and the names when given as (name, tensor) pairs
    (``model.named_parameters()``), as torch.optim.Optimizer accepts them."""
    if isinstance(params, torch.Tensor):
        return [params], None
    if isinstance(params, (set, frozenset)):
        raise TypeError(unordered_params_message(where))
    if isinstance(params, (str, bytes, dict)) or not isinstance(params, Iterable):
        raise TypeError(f"OffloadAdamW: {where} must be a Tensor or an iterable of Tensors or (name, Tensor) "
                        f"pairs, got {type(params).__name__}")
    items = list(params)
    named = [isinstance(x, tuple) for x in items]
    if not any(named):
        return items, None
    if not all(named) or not all(len(x) == 2 and isinstance(x[0], str) for x in items):
        raise ValueError(f"OffloadAdamW: {where} mixes named and unnamed parameters: all optimizer params should "
                         "be with/without names. Some param names are missing; give all as (name, Tensor) pairs "
                         "or none")
    return [x[1] for x in items], [x[0] for x in items]


def param_dtype(lp: torch.Tensor) -> torch.dtype:
    """The real dtype the state of `lp` is computed in (complex: its real view's)."""
    return COMPLEX.get(lp.dtype, lp.dtype)


def check_param(p: Any, where: str) -> None:
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"OffloadAdamW: {where} is a {type(p).__name__}; expected a torch.Tensor")
    lp = local(p)
    if lp.dtype not in REAL and lp.dtype not in COMPLEX:
        raise ValueError(f"OffloadAdamW: {where} is {lp.dtype}; expected float32, float16, bfloat16, float64, "
                         "complex64 or complex128")
    if lp.device.type not in ("cpu", "cuda"):
        raise ValueError(f"OffloadAdamW: {where} is on {lp.device}; expected the CPU or a GPU")
    if lp.layout != torch.strided or lp.is_nested or lp.is_quantized:
        raise ValueError(f"OffloadAdamW: {where} must be a dense strided tensor, got layout {lp.layout}")
    if not p.is_leaf:
        raise ValueError(f"OffloadAdamW: {where} is not a leaf tensor; expected a parameter (can't optimize a "
                         "non-leaf Tensor)")


def check_grad(p: torch.Tensor, where: str) -> None:
    g = p.grad
    if g.is_sparse or g.layout != torch.strided:
        raise ValueError(f"OffloadAdamW does not support sparse gradients; {where} has a {g.layout} gradient")
    lp, lg = local(p), local(g)
    if lp.is_complex():
        ok = lg.dtype == lp.dtype
    else:
        ok = lg.dtype in REAL and (lg.dtype == lp.dtype or (lg.dtype in FUSED and lp.dtype in FUSED))
    if g.shape != p.shape or g.device != p.device or not ok:
        expected = f"{lp.dtype}" if lp.is_complex() or lp.dtype == torch.float64 else "float32, float16 or bfloat16"
        raise ValueError(f"OffloadAdamW: the gradient of {where} is {g.dtype} {tuple(g.shape)} on {g.device}; "
                         f"expected a {expected} gradient shaped {tuple(p.shape)} on {p.device}")


def check_loadable(opt: Any, state_dict: Any) -> Dict[torch.Tensor, dict]:
    """Validates `state_dict` against `opt` and returns {param: saved state}."""
    name = "OffloadAdamW.load_state_dict"
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError(f"{name}: expected a dict with 'state' and 'param_groups'")
    saved_groups, groups = state_dict["param_groups"], opt.param_groups
    if not isinstance(saved_groups, (list, tuple)) or not isinstance(state_dict["state"], dict):
        raise ValueError(f"{name}: expected 'param_groups' to be a list and 'state' a dict")
    if len(saved_groups) != len(groups):
        raise ValueError(f"{name}: the state dict has {len(saved_groups)} parameter groups; this optimizer has "
                         f"{len(groups)}")
    ids: Dict[Any, torch.Tensor] = {}
    for gi, (sg, g) in enumerate(zip(saved_groups, groups)):
        if not isinstance(sg, dict) or not isinstance(sg.get("params"), (list, tuple)):
            raise ValueError(f"{name}: param_groups[{gi}] must be a dict with a list of parameter ids under 'params'")
        if len(sg["params"]) != len(g["params"]):
            raise ValueError(f"{name}: group {gi} has {len(sg['params'])} parameters in the state dict and "
                             f"{len(g['params'])} here")
        check_group_options({**TORCH_FLAG_DEFAULTS, **sg}, f"state_dict['param_groups'][{gi}]")
        ids.update(zip(sg["params"], g["params"]))
    out = {}
    for key, st in state_dict["state"].items():
        if key not in ids:
            raise ValueError(f"{name}: state for parameter id {key!r}, which no group lists")
        p = ids[key]
        lp = local(p)
        if not isinstance(st, dict) or "step" not in st:
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


def group_hyper(group: dict) -> dict:
    """A group's hyperparameters as the fused step takes them (floats; checked by check_group_options)."""
    beta1, beta2 = group["betas"]
    return dict(lr=scalar_value(group["lr"], "lr"), beta1=scalar_value(beta1, "beta1"),
                beta2=scalar_value(beta2, "beta2"), eps=scalar_value(group["eps"], "eps"),
                weight_decay=scalar_value(group["weight_decay"], "weight_decay"), amsgrad=group["amsgrad"],
                maximize=group["maximize"])


def validate_step(param_groups: List[dict], slots: Dict[torch.Tensor, Any], state: Dict[torch.Tensor, dict],
                  store: Any) -> tuple:
    """step()'s checks: every group's hyperparameters and flags, every parameter
    and gradient; allocates what a group switched to amsgrad needs and changes
    nothing. Returns the (group, param) pairs to step and the new
    max_exp_avg_sq tensors to keep."""
    work, added = [], []
    for gi, group in enumerate(param_groups):
        check_group_options(group, f"param_groups[{gi}]")
        if not isinstance(group.get("params"), list):
            raise ValueError(f"OffloadAdamW: param_groups[{gi}]['params'] must be a list, got "
                             f"{type(group.get('params')).__name__}")
        for pi, p in enumerate(group["params"]):
            where = f"params[group {gi}][{pi}]"
            slot = slots.get(p) if isinstance(p, torch.Tensor) else None
            if slot is None:
                raise ValueError(f"OffloadAdamW: {where} was put into param_groups without add_param_group; "
                                 "add parameters with opt.add_param_group({'params': [...]})")
            check_param(p, where)
            lp = local(p)
            if tuple(lp.shape) != slot.shape or lp.dtype != slot.dtype:
                raise ValueError(f"OffloadAdamW: {where} is now {lp.dtype} {tuple(lp.shape)}, but its state was "
                                 f"made for {slot.dtype} {slot.shape}; the state no longer fits (build a new "
                                 "optimizer, or load a state dict for the new shape)")
            if p.grad is None:
                continue
            check_grad(p, where)
            work.append((group, p))
            if group["amsgrad"] and "max_exp_avg_sq" not in state[p]:
                added.append((p, store.amsgrad_state(lp, slot.where, state[p])))
    return work, added


def check_options(*, skip_nonfinite: Any, overlap: Any, step_on: Any, state_dtype: Any,
                  min_offload_numel: Any, chunk_numel: Any, ring_slots: Any, min_8bit_numel: Any) -> None:
    """OffloadAdamW's own constructor arguments (torch's are checked with the
    groups, the pool by resolve_pool)."""
    check_flag(skip_nonfinite, "skip_nonfinite")
    if overlap not in (None, "backward"):
        raise ValueError(f"OffloadAdamW: overlap must be None or 'backward', got {overlap!r}")
    if step_on not in ("auto", "cpu", "gpu"):
        raise ValueError(f"OffloadAdamW: step_on must be 'auto', 'cpu' or 'gpu', got {step_on!r}")
    if state_dtype not in (torch.float32, torch.uint8):
        raise ValueError("OffloadAdamW: state_dtype must be torch.float32 (exact AdamW) or torch.uint8 (m and v "
                         f"in 8 bits, blockwise, with a float32 master), got {state_dtype!r}")
    for name, value, low in (("min_offload_numel", min_offload_numel, 0), ("chunk_numel", chunk_numel, 1),
                             ("ring_slots", ring_slots, 2), ("min_8bit_numel", min_8bit_numel, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"OffloadAdamW: {name} must be an int >= {low}, got {value!r}")
    if state_dtype == torch.uint8 and chunk_numel % 256:
        raise ValueError(f"OffloadAdamW: chunk_numel must be a multiple of 256 with state_dtype=torch.uint8 (8-bit "
                         f"state streams in whole blocks of 256), got {chunk_numel}")


def grads_finite(params: List[torch.Tensor]) -> bool:
    """Whether every gradient of `params` is finite (one sync per device)."""
    flags = [torch.isfinite(local(p.grad)).all() for p in params]
    by_device: Dict[torch.device, list] = {}
    for f in flags:
        by_device.setdefault(f.device, []).append(f)
    return all(bool(torch.stack(fs).all()) for fs in by_device.values())
