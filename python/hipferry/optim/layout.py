"""How OffloadAdamW lays out the state of any parameter torch.optim.AdamW
takes, and the flat views its fused kernels run over.

- Complex parameters step as their real view (``torch.view_as_real``), as
  torch does; their state is complex like the parameter's.
- A dense parameter (contiguous, channels_last, transposed: no gaps, no
  overlaps) gets state with its own strides, as torch's
  ``zeros_like(p, memory_format=torch.preserve_format)``; then parameter,
  gradient and state are all walked in memory order as flat views, and the
  kernel needs no copy. Anything else (a slice with gaps, or strides that
  changed since the state was made) steps through a contiguous working copy
  written back afterwards.
- float64 parameters step with torch ops (torch_ops_step): the fused kernels
  are float32 with bf16/fp16 in and out.
"""
from typing import Optional, Sequence

import torch


def real(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The real view of a complex tensor, else the tensor."""
    return torch.view_as_real(t) if t is not None and t.is_complex() else t


def memory_flat(t: torch.Tensor) -> Optional[torch.Tensor]:
    """A 1-D view of every element of `t` in memory order, or None when `t` is
    not dense (gaps or overlaps)."""
    if t.is_contiguous():
        return t.view(-1)
    order = sorted(range(t.dim()), key=lambda d: t.stride(d), reverse=True)
    permuted = t.permute(order)
    return permuted.reshape(-1) if permuted.is_contiguous() else None


def state_strides(t: torch.Tensor) -> Optional[Sequence[int]]:
    """The strides state tensors of `t` get: its own when it is dense, else None (contiguous)."""
    return tuple(t.stride()) if memory_flat(t) is not None else None


def shaped(flat: torch.Tensor, shape: Sequence[int], strides: Optional[Sequence[int]]) -> torch.Tensor:
    """`flat` (1-D, numel elements) seen with `shape`, and `strides` if given (dense strides)."""
    return flat.view(shape) if strides is None else flat.as_strided(tuple(shape), tuple(strides))


def aligned(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it with the strides of `like` (same shape), so that
    memory_flat(t) walks the elements in the same order as memory_flat(like)."""
    if t.stride() == like.stride() or t.numel() <= 1:
        return t
    return torch.empty_like(like, dtype=t.dtype, device=t.device).copy_(t)


def torch_ops_step(param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                   max_v: Optional[torch.Tensor], step: int, *, lr: float, beta1: float, beta2: float, eps: float,
                   weight_decay: float, amsgrad: bool, maximize: bool) -> None:
    """The AdamW step of csrc/core/optim/adamw_update.h with torch ops, in
    place, for dtypes the fused kernels do not take (float64)."""
    g = -grad if maximize else grad
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    second = v
    if amsgrad:
        torch.maximum(max_v, v, out=max_v)
        second = max_v
    denom = second.sqrt().div_((1 - beta2 ** step) ** 0.5).add_(eps)
    param.addcdiv_(m, denom, value=-(lr / (1 - beta1 ** step)))
