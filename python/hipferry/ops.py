"""Thin Python wrappers over torch.ops.hipferry (the schemas live in csrc/torch/ops.cpp)."""
import torch


def copy_cast_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Write ``src`` converted to ``dst.dtype`` into ``dst`` and return ``dst``.

    ``src`` and ``dst`` may be on different devices: host->device,
    device->host, or the same device. Conversions between float32, float16 and
    bfloat16 (round to nearest even, bit-identical to ``.to(dtype)``) and copies
    between equal dtypes are supported. Both tensors must be contiguous and of
    equal shape.

    On a GPU this is ONE kernel on the current stream that reads the source
    where it lies: host tensors must be pinned (page-locked, mapped), e.g. from
    ``tensor.pin_memory()``. Like a ``non_blocking`` copy it is ordered on the
    current stream: keep both tensors alive until the stream passes it and
    synchronize before reading a host ``dst``. On the CPU it is a vectorized,
    multi-threaded loop that has finished when the call returns.

    Raises ``RuntimeError`` (naming the argument and what was expected) for bad
    input, in which case ``dst`` is left untouched.
    """
    if not isinstance(dst, torch.Tensor):
        raise TypeError(f"hipferry.copy_cast_: dst must be a torch.Tensor, got {type(dst).__name__}")
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"hipferry.copy_cast_: src must be a torch.Tensor, got {type(src).__name__}")
    torch.ops.hipferry.copy_cast_(dst, src)
    return dst
